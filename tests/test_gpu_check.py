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
    assert all(sec[k]["rc"] == "skipped" and "CUDA" in sec[k]["why"]
               for k in ("events", "real", "racecheck", "overhead", "pair", "soc", "thirdparty"))
    assert bench.read_text() == "# before\n"


def _gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_report_renders_the_overhead_and_thirdparty_sections():
    gc = _gpu_check()
    method = {"prefetch_hits": 3, "prefetch_misses": 1, "hit_rate": 0.75, "stall_seconds": 0.002, "bytes_moved": 3 << 20,
              "bit_identical": True, "step_ratio": 2.5, "steps_to_recover": 1, "steps_to_recover_with_stalls": None}
    live = {"alone_step_s": 0.012, "methods": {"pilot (shipped)": method, "lru": {**method, "step_ratio": 1.75}}}
    report = {"device": "NVIDIA H200", "torch": "2.11", "date": "d", "wall_s": 1.0, "sections": {
        "overhead": {"rc": 0, "seconds": 100.0, "calibration": "out/host_cost.json",
                     "markdown": "# dynn bench --overhead (d): manager on cuda\n\n## Operators: host us\n"},
        "thirdparty": {"rc": 0, "seconds": 90.0, "results": {"moe_lm": {"trace": None, "live": live}}}}}
    md = gc.render(report)
    assert "### dynn bench --overhead (d): manager on cuda" in md and "#### Operators" in md
    assert "calibration written to `out/host_cost.json`" in md
    assert "PyTorch alone per step: moe_lm 12.0 ms." in md
    assert "| moe_lm | pilot (shipped) | - | 3 / 1 | 75.0% | 2.000 ms | 3.0 MiB | 1 / not reached | 2.50x | yes |" in md
    assert "| moe_lm | lru | - | 3 / 1 | 75.0% | 2.000 ms | 3.0 MiB |  | 1.75x | yes |" in md


def test_report_renders_the_paired_and_save_on_cpu_sections():
    gc = _gpu_check()
    pair_tail = ("noise before\ntree_lstm none round 0: ratio 1.020 (range 0.9-1.1; ...)\n"
                 "tree_lstm lru@0.5 round 0: ratio 2.500 (range 2.1-2.9; ...)\n")
    soc_tail = ("tree_lstm r0 lru: 40.0 ms, ...\n\nfamily | method | x PyTorch alone (median of rounds) | x save_on_cpu"
                " | peak MiB\ntree_lstm | lru | 1.50x | 0.80x | 12.0\n")
    report = {"device": "NVIDIA H100", "torch": "2.11", "date": "d", "wall_s": 1.0, "sections": {
        "pair": {"rc": 0, "seconds": 30.0, "tail": pair_tail},
        "soc": {"rc": "timeout", "seconds": 150.0, "tail": soc_tail}}}
    md = gc.render(report)
    assert "tree_lstm none round 0: ratio 1.020" in md and "tree_lstm lru@0.5 round 0: ratio 2.500" in md
    assert "noise before" not in md
    assert "tree_lstm | lru | 1.50x | 0.80x | 12.0" in md and "tree_lstm r0 lru" not in md
    assert "rc timeout, 150.0 s" in md
