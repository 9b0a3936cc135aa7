"""Tooling that builds the patched PyTorch wheel (see patches/README.md)."""
