"""The user-facing side of the memory manager: `dynn train --budget`, the demo's managed run, `dynn bench --real`."""

from __future__ import annotations

import json

import pytest

from dynn_runtime.cli import main
from dynn_runtime.memory import format_bytes
from dynn_runtime.runtime.train import (
    compare_unmanaged,
    parse_budget,
    train_managed,
    train_unmanaged,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy machine OpenMP's spinning
    threads make every step many times slower; restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_parse_budget():
    assert parse_budget("1/8") == "1/8"
    assert parse_budget("0.25") == 0.25 and parse_budget("1") == 1.0
    assert parse_budget("4096") == 4096 and parse_budget("6GiB") == "6GiB"
    with pytest.raises(Exception, match="runtime: the budget must be"):
        parse_budget("0")


def test_train_budget_lru_is_bit_identical_and_within_budget(tmp_path, capsys):
    out_json = tmp_path / "run.json"
    rc = main(["train", "moe", "--preset", "tiny", "--steps", "3", "--budget", "1/2", "--policy", "lru",
               "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "(measuring the peak for budget 1/2)" in out
    assert "within the budget" in out
    assert "bit-identical        yes" in out
    data = json.loads(out_json.read_text())
    res, cmp = data["result"], data["comparison"]
    assert res["managed_steps"] == [False, True, True]
    assert 0 < res["max_managed_peak"] <= res["budget_bytes"]
    # 1/2 of the measured peak: step 0's peak plus the optimizer state it created after that peak
    assert int(res["peak_bytes"][0] * 0.5) < res["budget_bytes"] < res["peak_bytes"][0]
    # the budget forced the manager to move tensors, and the result is still PyTorch's, bit for bit
    assert res["stats"]["bytes_offloaded"] > 0 and res["stats"]["bytes_fetched_on_demand"] > 0
    assert cmp["losses_identical"] and cmp["params_identical"] and cmp["differing"] == []
    assert res["losses"] == cmp["unmanaged"]["losses"]


def test_train_measures_a_fraction_over_the_steps_it_is_told(tmp_path, capsys):
    out_json = tmp_path / "run.json"
    rc = main(["train", "examples/my_workload.py:build", "--preset", "tiny", "--steps", "4", "--budget", "1/2",
               "--measure-steps", "3", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.count("(measuring the peak for budget 1/2)") == 3
    res = json.loads(out_json.read_text())["result"]
    assert res["managed_steps"] == [False, False, False, True]
    measured = res["stats"]["measured_peak_bytes"]
    assert measured >= max(res["peak_bytes"][:3])  # the largest of the three (and the state they made)
    assert f"1/2 of the measured peak {format_bytes(measured)}" in out
    assert res["budget_bytes"] == int(measured * 0.5)


_BAD_BUDGET = ("runtime: the budget must be a positive number of bytes, a size like '6GiB', or a fraction of the "
               "unmanaged peak in (0, 1] like 0.25 or '1/4'; got {!r}.")


@pytest.mark.parametrize("budget, expect", [
    ("lots", _BAD_BUDGET.format("lots")),
    ("0", _BAD_BUDGET.format("0")),
    ("1/0", _BAD_BUDGET.format("1/0")),
])
def test_train_bad_budget_exits_2_with_one_line(budget, expect, capsys):
    assert main(["train", "moe", "--steps", "1", "--budget", budget]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynn: error: ") and expect in err
    assert err.count("\n") == 1


def test_train_budget_below_largest_operator_names_it(capsys):
    assert main(["train", "tree_lstm", "--steps", "2", "--budget", "1/8", "--no-compare"]) == 2
    err = capsys.readouterr().err
    assert "smaller than what one operator needs" in err and "operator aten::" in err and "Raise the budget" in err


def test_train_unknown_policy_exits_2(capsys):
    assert main(["train", "moe", "--steps", "1", "--budget", "1/2", "--policy", "magic"]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err


def test_compare_detects_a_difference():
    """compare_unmanaged must not call two different runs identical (a different seed stands in for a bug)."""
    run = train_unmanaged("tree_lstm", steps=1, seed=0)
    run.policy = "lru"
    cmp = compare_unmanaged(run)
    assert cmp.params_identical and cmp.losses_identical
    run.seed = 1
    cmp = compare_unmanaged(run)
    assert not cmp.params_identical and cmp.differing and not cmp.losses_identical


def test_oracle_records_its_trace_and_prefetches():
    run = train_managed("moe", "1/2", "oracle", steps=2)
    st = run.stats
    assert run.managed_steps == [False, True]
    assert st["bytes_prefetched"] > 0 and st["prefetch_hits"] > 0
    assert compare_unmanaged(run).params_identical


def test_demo_managed_run_writes_the_timeline(tmp_path, capsys):
    from dynn_runtime.demo import managed_demo, print_managed_demo

    png = tmp_path / "timeline.png"
    res = managed_demo("moe", budget="1/8", policy="lru", steps=3, timeline=png)
    assert res["bit_identical"]
    run = res["managed"]
    assert run.stats["evictions"] > 0 and run.stats["bytes_offloaded"] > 0
    assert run.max_managed_peak() < max(res["accounting"].peak_bytes) / 4  # the budget held it far below
    assert len(res["accounting"].timeline) == len(run.timeline)  # same operators, so the curves line up
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    print_managed_demo(res)
    out = capsys.readouterr().out
    for line in ("peak device bytes", "bytes offloaded", "bytes prefetched", "fetched on demand",
                 "bit-identical to PyTorch alone", f"memory timeline: {png}"):
        assert line in out


def test_bench_real_on_cpu_writes_json_and_markdown(tmp_path, capsys):
    out_json = tmp_path / "real.json"
    rc = main(["bench", "--real", "--device", "cpu", "--families", "moe", "--preset", "tiny", "--steps", "2",
               "--max-scale", "2", "--policies", "lru", "--out", str(tmp_path), "--json", str(out_json), "-q"])
    assert rc == 0
    data = json.loads(out_json.read_text())
    assert data["kind"] == "dynn-bench-real" and data["config"]["fraction"] == 0.125
    rows = {r["method"]: r for r in data["results"]}
    assert set(rows) == {"unlimited", "save_on_cpu (torch)", "checkpoint (torch)", "lru"}
    cap = rows["unlimited"]["cap_bytes"]
    assert cap == int(rows["unlimited"]["peak_bytes"] * 0.125)
    lru = rows["lru"]
    assert lru["feasible"] and lru["bit_identical"] and 0 < lru["peak_bytes"] <= cap + lru["budget_overshoot_bytes"]
    assert lru["iter_time_s"] > 0 and lru["bytes_offloaded"] > 0
    assert rows["save_on_cpu (torch)"]["feasible"] is False  # on the CPU it saves nothing: over the cap
    assert "predicted_overhead" in rows["lru"] and rows["unlimited"]["predicted_overhead"] == 1.0
    scan = {r["method"]: r for r in data["max_size"]}
    assert scan["pytorch"]["scale"] == 1 and scan["lru"]["scale"] == 2
    md = out_json.with_suffix(".md").read_text()
    assert "## moe:" in md and "| lru | yes |" in md and "Max trainable size" in md


def test_checkpoint_blocks_wraps_outermost_lists_and_keeps_the_result():
    import torch

    from dynn_runtime import models
    from dynn_runtime.bench.real import checkpoint_blocks

    assert checkpoint_blocks(models.build("tree_lstm", preset="tiny").model) == []
    wl = models.build("moe", preset="tiny")
    batch = wl.make_batch(0)
    torch.manual_seed(0)
    ref = wl.loss(wl.model, batch)
    assert checkpoint_blocks(wl.model) == ["blocks"]  # experts inside blocks are not wrapped twice
    torch.manual_seed(0)
    assert torch.equal(wl.loss(wl.model, batch), ref)


def test_readme_memory_manager_example_runs(capsys):
    """The README's MemoryManager snippet, on the CPU, around a zoo workload."""
    import re
    from pathlib import Path

    import torch

    from dynn_runtime import models

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "dr.MemoryManager(" in b)
    assert 'device="cuda"' in block
    wl = models.build("moe", preset="tiny")
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(wl.model.parameters(), lr=1e-3)
    ns = {"model": wl.model, "optimizer": optimizer, "loss_fn": wl.loss,
          "batches": [wl.make_batch(i) for i in range(3)]}
    exec(compile(block.replace('device="cuda"', 'device="cpu"'), "README.md", "exec"), ns)
    stats = ns["mm"].stats()
    assert stats["steps"] == 3 and stats["bytes_offloaded"] > 0
    # detach() brought every parameter back (an offloaded storage is resized to zero)
    assert all(p.untyped_storage().nbytes() >= p.numel() * p.element_size() for p in wl.model.parameters())
    assert "peak_device_bytes" in capsys.readouterr().out


def test_bench_real_trains_a_model_that_does_not_fit_alone(tmp_path, monkeypatch):
    """Where PyTorch alone runs out of device memory, `bench --real` gives each policy the fraction as
    its budget: the manager measures the peak in a first step run under the device's free memory.
    Here the device is played by a PyTorch alone that raises OutOfMemoryError and a free memory of a
    third of the model's peak."""
    import torch

    from dynn_runtime.runtime import train as train_mod
    from dynn_runtime.runtime.train import train_managed

    ref = train_managed("moe", 0.25, "lru", steps=2, preset="tiny", device="cpu").stats  # measured unmanaged
    peak = ref["measured_peak_bytes"]

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(train_mod, "train_unmanaged", oom)
    from dynn_runtime.runtime.manager import MemoryManager

    monkeypatch.setattr(MemoryManager, "_first_step_budget", lambda self: peak // 3)
    out_json = tmp_path / "real.json"
    rc = main(["bench", "--real", "--device", "cpu", "--families", "moe", "--preset", "tiny", "--steps", "2",
               "--max-scale", "0", "--policies", "lru", "--cap", "0.25", "--out", str(tmp_path), "--json",
               str(out_json), "-q"])
    assert rc == 0
    rows = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}
    assert rows["unlimited"]["feasible"] is False and rows["unlimited"]["beyond_device"]
    lru = rows["lru"]
    assert lru["feasible"] and lru["evictions"] > 0
    assert lru["cap_bytes"] == int(lru["measured_peak_bytes"] * 0.25)
    assert lru["measured_peak_bytes"] == peak  # what PyTorch alone would hold, measured though it did not fit
    md = out_json.with_suffix(".md").read_text()
    assert "PyTorch alone does not fit the device" in md and "| lru | yes |" in md


def test_bench_real_keeps_where_a_failure_was_raised(tmp_path, failing_allocations):
    """A run that fails keeps, besides its error, where it was raised: the innermost frames (here
    the manager's first fetch, whose allocation runs out, and again when retried) and the errors it
    was raised from or during, in the JSON row (``where``) and in the report's list of failures."""

    failing_allocations[0] = 2
    out_json = tmp_path / "real.json"
    rc = main(["bench", "--real", "--device", "cpu", "--families", "moe", "--preset", "tiny", "--steps", "2",
               "--max-scale", "0", "--policies", "lru", "--no-predict", "--out", str(tmp_path), "--json",
               str(out_json), "-q"])
    assert rc == 0
    lru = {r["method"]: r for r in json.loads(out_json.read_text())["results"]}["lru"]
    assert lru["feasible"] is False and lru["reason"].startswith("BudgetError: runtime: operator aten::")
    assert "ran out of device memory" in lru["reason"] and "again when retried" in lru["reason"]
    assert "dynn_runtime/runtime/moves.py" in lru["where"] and "_start_fetch" in lru["where"]
    md = out_json.with_suffix(".md").read_text()
    assert "Failures (the error, then where it was raised):" in md and "- lru: BudgetError" in md
