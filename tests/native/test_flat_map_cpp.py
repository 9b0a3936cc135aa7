"""Compile and run the check of the native observer's hash map and pool (dynn_runtime/csrc/flat_map.h)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) on PATH")
def test_flat_map_agrees_with_unordered_map(tmp_path):
    exe = tmp_path / "flat_map_test"
    cmd = [CXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", f"-I{ROOT / 'dynn_runtime' / 'csrc'}",
           str(Path(__file__).parent / "cpp" / "flat_map_test.cpp"), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
