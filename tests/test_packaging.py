"""The wheel carries the zoo at dynn_runtime/models and installs no torch of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("cmake") is None and shutil.which("ninja") is None, reason="no cmake")
def test_wheel_ships_the_zoo(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(tmp_path.glob("dynn_runtime-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for fam in ("moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen"):
        assert f"dynn_runtime/models/{fam}.py" in names
    assert "dynn_runtime/cli.py" in names
    # the pilot's shipped weights and their provenance record are package data
    assert "dynn_runtime/pilot/weights/zoo.npz" in names and "dynn_runtime/pilot/weights/zoo.json" in names
    # the pilot's native kernel can be compiled from source where the built one is missing or stale
    from dynn_runtime.pilot import kernel

    for src in (*kernel.SOURCES, kernel.INTERNAL_HEADER, "pilot_kernel.h"):
        assert f"dynn_runtime/pilot/kernel/{Path(src).name}" in names, src
    # the pilot's per-operator packing (pack.c), built by CMake as a Python extension
    assert any(n.startswith("dynn_runtime/pilot/kernel/_pack.") and n.endswith(".so") for n in names)
    assert not any(n.startswith("models/") for n in names), "zoo must not install as a top-level package"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: torch<2.14,>=2.11" in meta or "Requires-Dist: torch>=2.11,<2.14" in meta
    assert "Provides-Extra: vision" in meta
