"""`make gpu-check` without CUDA: the gpu tests skip, the GPU sections say why, nothing is appended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, make gpu-check is the real run")
def test_gpu_check_runs_cleanly_without_cuda(tmp_path):
    bench = tmp_path / "benchmarks.md"
    bench.write_text("# before\n")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path / "out"),
                        "--append", str(bench)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    (report,) = (tmp_path / "out").glob("gpu-check-*.json")
    sec = json.loads(report.read_text())["sections"]
    assert sec["tests"]["rc"] == 0 and "skipped" in sec["tests"]["tail"]
    assert all(sec[k]["rc"] == "skipped" and "CUDA" in sec[k]["why"] for k in ("events", "real", "racecheck"))
    assert bench.read_text() == "# before\n"
