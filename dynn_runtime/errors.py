"""Error types of dynn-runtime.

Every message starts with the subsystem that raised it, says what was expected
and what was found, and how to fix it. Internal invariants go through
:func:`internal_assert`, whose failure asks for a bug report instead of
blaming the user.
"""

from __future__ import annotations

__all__ = [
    "DynnError",
    "WorkloadError",
    "ConfigError",
    "TraceError",
    "BudgetError",
    "PolicyError",
    "PilotError",
    "NativeError",
    "HostMemoryError",
    "internal_assert",
]


class DynnError(RuntimeError):
    """Base class of every error dynn-runtime raises on purpose."""


class WorkloadError(DynnError):
    """A workload could not be found, loaded or run (unknown name, bad ``file.py:function``)."""


class ConfigError(DynnError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class TraceError(DynnError):
    """A trace file is missing, truncated, corrupt, or of an unsupported schema."""


class BudgetError(DynnError):
    """A memory budget is malformed or too small for the workload."""


class PolicyError(DynnError):
    """A policy is unknown or its requirements are not met."""


class PilotError(DynnError):
    """A pilot-model weights file is corrupt or does not match this version."""


class NativeError(DynnError):
    """The patched-PyTorch build or its native hooks misbehaved."""


class HostMemoryError(DynnError, MemoryError):
    """The host (CPU) memory budget for offloaded tensors is exhausted."""


def internal_assert(cond: bool, msg: str) -> None:
    """Check an internal invariant; a failure is a bug in dynn-runtime, not in the caller's code."""
    if not cond:
        raise AssertionError(
            f"dynn-runtime internal error: {msg}. This is a bug; please report it with the command that "
            "triggered it and the output of `dynn doctor`."
        )


