"""The `dynn` command line: listing, training, errors without tracebacks, the README's example."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dynn_runtime.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_models_lists_six_families(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    for fam in ("moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen"):
        assert re.search(rf"^{fam}\s+tiny, small, large", out, re.M), fam


def test_train_prints_loss_and_peak(capsys):
    assert main(["train", "skipnet", "--preset", "tiny", "--steps", "2", "-q"]) == 0
    out = capsys.readouterr().out
    steps = re.findall(r"step\s+(\d+)\s+loss (\S+)\s+peak (\S+ \S+)", out)
    assert [s[0] for s in steps] == ["0", "1"]
    assert all(float(s[1]) > 0 for s in steps)


def test_train_set_override(capsys):
    assert main(["train", "moe", "--steps", "1", "-q", "--set", "top_k=1", "--set", "experts=2"]) == 0
    assert main(["train", "moe", "--steps", "1", "-q", "--set", "top_k=5"]) == 2
    assert "'top_k' must be 1 or 2, got 5" in capsys.readouterr().err


def test_errors_are_one_line_no_traceback():
    r = subprocess.run([sys.executable, "-m", "dynn_runtime.cli", "train", "resnet"], capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "unknown workload 'resnet'" in r.stderr and "moe" in r.stderr


def test_cuda_requested_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert main(["train", "moe", "--steps", "1", "--device", "cuda", "-q"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_every_subcommand_has_help():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert {"models", "train", "demo"} <= set(sub.choices)
    for name, p in sub.choices.items():
        assert p.format_help().strip(), name


def test_readme_example_is_the_shipped_file_and_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "my_workload.py").read_text()
    assert example in readme, "README's example drifted from examples/my_workload.py"
    spec = f"{ROOT / 'examples' / 'my_workload.py'}:build"
    assert main(["train", spec, "--steps", "3", "-q"]) == 0
    assert len(re.findall(r"^step", capsys.readouterr().out, re.M)) == 3


def test_readme_example_trains_to_finite_losses_at_small():
    """The benches measure the example at ``small``; a loss that overflows there times NaN arithmetic."""
    import math

    from dynn_runtime.workload import load_workload, make_optimizer, train_step

    wl = load_workload(f"{ROOT / 'examples' / 'my_workload.py'}:build", preset="small", seed=0)
    opt = make_optimizer(wl, wl.model.parameters())
    losses = [train_step(wl, wl.model, opt, wl.make_batch(i)).item() for i in range(12)]
    assert all(math.isfinite(x) for x in losses), losses


def test_demo_reports_every_family(capsys):
    assert main(["demo", "--steps", "2", "--families", "moe", "varlen"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^moe\s+\d+", out, re.M) and re.search(r"^varlen\s+\d+", out, re.M)
    assert "tokens_per_expert" in out and "padded_len" in out
