"""``dynn bench --scale`` on tiny shape-only traces: the max-size metric and its outputs."""

from __future__ import annotations

import json

from dynn_runtime.bench.scale import ScaleConfig, knob_values, run_scale, write_scale_outputs
from dynn_runtime.sim import unmanaged_peak
from dynn_runtime.trace.cache import TraceCache


def test_knob_values_move_a_range_as_a_whole():
    vals = knob_values("evoformer", "tiny", [0.5, 1, 2])
    assert [s for s, _ in vals] == [0.5, 1, 2]
    for _, ov in vals:
        assert 2 <= ov["residues_min"] <= ov["residues_max"]
    assert vals[2][1]["residues_max"] == 2 * vals[1][1]["residues_max"]
    # scales that round to the same batch are one size
    assert len(knob_values("varlen", "tiny", [1, 1.01])) == 1


def test_scale_finds_the_largest_size_on_a_fixed_capacity(tmp_path):
    cache = tmp_path / "cache"
    x1 = TraceCache(cache, fake=True).get("varlen", "tiny", 0, 2, knob_values("varlen", "tiny", [1])[0][1])
    capacity = unmanaged_peak(x1)  # none trains x1 and nothing larger
    cfg = ScaleConfig(families=["varlen"], policies=["none", "dtr"], preset="tiny", knob_scales=[1, 2],
                      budgets=[0.5], capacity_bytes=capacity, host_cost="none", cache_dir=str(cache),
                      out_dir=str(tmp_path / "out"))
    report = run_scale(cfg)
    x1_value = knob_values("varlen", "tiny", [1])[0][1]["batch"]
    assert report.meta["traces_reused"] >= 1 and report.meta["capacity_bytes"] == capacity
    runs = {(r["policy"], r["scale"]): r for r in report.runs}
    assert runs[("none", 1)]["feasible"] and runs[("none", 1)]["overhead"] == 1.0
    assert not runs[("none", 2)]["feasible"]
    best = {(r["policy"], r["limit"]): r for r in report.max_size}
    assert best[("none", 1.5)]["largest"] == x1_value and best[("none", 1.5)]["ratio_vs_none"] == 1.0
    dtr = best[("dtr", 2.0)]
    passed = [r for r in report.runs if r["policy"] == "dtr" and r["feasible"] and r["overhead"] <= 2.0]
    assert dtr["largest"] == max(r["knob_value"] for r in passed)
    assert dtr["ratio_vs_none"] == dtr["largest"] / x1_value
    assert {(g["policy"], g["budget_fraction"]) for g in report.grid} == {("none", 0.5), ("dtr", 0.5)}
    paths = write_scale_outputs(report)
    data = json.loads(paths["json"].read_text())
    assert data["kind"] == "dynn-bench-scale" and data["config"]["capacity_bytes"] == capacity
    assert "| varlen | batch |" in paths["markdown"].read_text()
    assert [p.name for p in paths["plots"]] == ["scale_varlen.png"]
