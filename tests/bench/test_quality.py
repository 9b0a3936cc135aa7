"""Prefetch quality beside window recall: the simulator's report, ``dynn bench --real``, the shared helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynn_runtime.bench import BenchConfig, run_bench
from dynn_runtime.bench.quality import hit_rate, live_quality, sim_quality, window_recall
from dynn_runtime.bench.report import render_markdown
from dynn_runtime.cli import main
from dynn_runtime.sim.hostcost import host_cost_for

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "my_workload.py") + ":build"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quality")
    cfg = BenchConfig(families=["moe"], policies=["none", "lru", "replay", "pilot"], budgets=[1.0, 0.25],
                      preset="tiny", max_scale=0, cache_dir=str(tmp / "cache"), out_dir=str(tmp / "out"))
    return run_bench(cfg, progress=False)


def test_window_recall_ranks_the_predictors(grid):
    recall = grid.meta["window_recall"]["moe"]
    assert set(recall) == {"pilot", "replay", "lru"}
    # the zoo's moe is in distribution: the pilot ranks the next uses far better than replaying or recency
    assert recall["pilot"] > 0.9 and recall["pilot"] > recall["replay"] > recall["lru"]


def test_window_recall_of_a_given_model_differs_from_the_shipped_one(grid, tmp_path):
    from dynn_runtime.pilot.config import cached_model, default_weights_path
    from dynn_runtime.trace import read_trace

    trace = read_trace(next((Path(grid.config.cache_dir)).glob("moe-*.jsonl.gz")))
    shipped = cached_model(default_weights_path())
    broken = shipped.copy()
    for k in ("W1", "W2", "W3"):
        if k in broken.arrays:
            broken.arrays[k] = broken.arrays[k] * 0.0
    assert window_recall(trace, shipped)["pilot"] == grid.meta["window_recall"]["moe"]["pilot"]
    assert window_recall(trace, broken)["pilot"] < 0.5 * grid.meta["window_recall"]["moe"]["pilot"]


def test_the_simulated_report_lists_hits_misses_stalls_and_bytes_beside_recall(grid):
    md = render_markdown(grid)
    assert "Prefetch quality (simulated)" in md
    recall = grid.meta["window_recall"]["moe"]
    for r in grid.results:
        if r["budget_fraction"] == 0.25 and r["feasible"] and r["managed"]:
            q = sim_quality(r)
            assert q["bytes_moved"] == r["bytes_offloaded"] + r["bytes_fetched"] > 0
            line = (f"| {r['policy']} | 1/4 | {100 * recall[r['policy']]:.1f}% | {r['prefetch_hits']} / "
                    f"{r['prefetch_misses']} |")
            assert line in md, line
    assert "| none | 1/4 |" not in md  # infeasible rows and unmanaged runs have no prefetch quality


def test_hit_rate_and_live_quality():
    assert hit_rate(3, 1) == 0.75 and hit_rate(0, 0) is None and hit_rate(None, 2) is None
    q = live_quality({"prefetch_hits": 2, "prefetch_misses": 6, "stall_seconds": 0.5, "bytes_offloaded": 10,
                      "bytes_prefetched": 4, "bytes_fetched_on_demand": 6})
    assert q == {"prefetch_hits": 2, "prefetch_misses": 6, "hit_rate": 0.25, "stall_seconds": 0.5, "bytes_moved": 20}


def test_bench_real_takes_a_users_workload_and_reports_prefetch_quality(tmp_path):
    out_json = tmp_path / "real.json"
    rc = main(["bench", "--real", "--device", "cpu", "--families", EXAMPLE, "--preset", "tiny", "--steps", "3",
               "--cap", "1/2", "--policies", "lru", "replay", "--out", str(tmp_path), "--json", str(out_json), "-q"])
    assert rc == 0
    data = json.loads(out_json.read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert data["max_size"] == []  # a file workload has no size knob to scan
    for p in ("lru", "replay"):
        r = rows[p]
        assert r["feasible"] and r["bit_identical"]
        assert r["bytes_moved"] == r["bytes_offloaded"] + r["bytes_prefetched"] + r["bytes_fetched_on_demand"]
        assert r["hit_rate"] == hit_rate(r["prefetch_hits"], r["prefetch_misses"])
        assert 0 <= r["window_recall"] <= 1 and "predicted_prefetch_hits" in r
        # the prediction charges the manager's calibrated host cost, and says which figures
        hc = host_cost_for(p)
        assert r["predicted_host_cost"] == hc.as_dict() and hc.per_op_s > 0
    assert rows["unlimited"]["predicted_host_cost"] is None
    md = out_json.with_suffix(".md").read_text()
    assert "Prefetch quality: live" in md
    assert f"| replay | {100 * rows['replay']['window_recall']:.1f}% | {rows['replay']['prefetch_hits']} / " in md


def test_bench_real_names_the_choices_for_an_unknown_workload():
    from dynn_runtime.bench.real import RealBenchConfig
    from dynn_runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="path/to/file.py:function"):
        RealBenchConfig(families=["nope"], device="cpu").resolved()


def test_the_simulated_grid_takes_a_users_workload(tmp_path):
    from dynn_runtime.bench import write_outputs

    cfg = BenchConfig(families=[EXAMPLE], policies=["none", "replay"], budgets=[1.0, 0.5], preset="tiny",
                      max_scale=2, cache_dir=str(tmp_path / "cache"), out_dir=str(tmp_path / "out"))
    report = run_bench(cfg, progress=False)
    assert {r["family"] for r in report.results} == {EXAMPLE} and report.max_size == []  # no size knob
    assert set(report.meta["window_recall"][EXAMPLE]) == {"pilot", "replay", "lru"}
    cached = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(cached) == 1 and cached[0].startswith("my_workload.build-")  # a file name, not a path
    paths = write_outputs(report)
    assert [p.name for p in paths["plots"]] == ["overhead_my_workload.build.png"]
    assert f"## {EXAMPLE} (tiny)" in paths["markdown"].read_text()


def test_the_simulated_grid_takes_a_recorded_trace_file(tmp_path):
    from dynn_runtime.bench import write_outputs
    from dynn_runtime.bench.scale import ScaleConfig
    from dynn_runtime.errors import ConfigError
    from dynn_runtime.sim import simulate
    from dynn_runtime.trace import read_trace, record

    path = tmp_path / "mine.jsonl.gz"
    record(EXAMPLE, path, steps=2, preset="tiny", seed=3)
    cfg = BenchConfig(families=[str(path)], policies=["none", "lru"], budgets=[1.0, 0.5], preset="tiny", host_cost="none",
                      max_scale=2, cache_dir=str(tmp_path / "cache"), out_dir=str(tmp_path / "out"))
    report = run_bench(cfg, progress=False)
    assert {r["family"] for r in report.results} == {str(path)} and report.max_size == []  # no size knob
    half = next(r for r in report.results if r["policy"] == "lru" and r["budget_fraction"] == 0.5)
    assert half["iter_time_s"] == simulate(read_trace(path), "lru", 0.5, "h100").iter_time_s  # that file, as recorded
    assert report.meta["traces_recorded"] == 0 and not (tmp_path / "cache").exists()  # nothing recorded again
    assert [p.name for p in write_outputs(report)["plots"]] == ["overhead_mine.png"]
    with pytest.raises(ConfigError, match="does not exist; record one"):
        BenchConfig(families=[str(tmp_path / "nope.jsonl.gz")]).validate()
    with pytest.raises(ConfigError, match="is not a zoo family"):
        ScaleConfig(families=[str(path)]).validate()
