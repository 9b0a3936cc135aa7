"""The bench harness: a tiny budget grid and max-size scan, its outputs, the trace cache, bad input, the CLI."""

from __future__ import annotations

import doctest
import json
import logging
import math
import os

import pytest

import dynn_runtime.bench as bench
from dynn_runtime.bench import (
    BenchConfig,
    TraceCache,
    render_markdown,
    run_bench,
    scaled_overrides,
    write_outputs,
)
from dynn_runtime.bench.harness import available_policies
from dynn_runtime.cli import main
from dynn_runtime.errors import ConfigError
from dynn_runtime.policies import POLICIES
from dynn_runtime.policies.base import Policy

FAMILIES = ["moe", "varlen"]
POLS = ["none", "lru", "oracle"]
BUDGETS = [1.0, 0.25]
REQUIRED = ("family", "preset", "policy", "budget_fraction", "feasible", "iter_time_s", "compute_time_s",
            "stall_time_s", "bytes_offloaded", "bytes_fetched", "recompute_time_s", "peak_bytes")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cfg(tmp, **kw) -> BenchConfig:
    base = dict(families=FAMILIES, policies=POLS, budgets=BUDGETS, preset="tiny", max_scale=2,
                cache_dir=str(tmp / "cache"), out_dir=str(tmp / "out"))
    base.update(kw)
    return BenchConfig(**base)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    report = run_bench(_cfg(tmp), progress=False)
    paths = write_outputs(report)
    return tmp, report, paths


def _strict_load(path):
    def bad(c):
        raise ValueError(f"non-strict JSON constant {c}")

    return json.loads(path.read_text(), parse_constant=bad)


def test_results_json(run):
    tmp, report, paths = run
    data = _strict_load(paths["json"])
    assert data["config"]["families"] == FAMILIES and data["config"]["policies"] == POLS
    assert data["config"]["budgets"] == BUDGETS and data["config"]["preset"] == "tiny"
    assert data["torch"] and data["date"] and data["profile"]["name"] == "h100"
    assert paths["json"].name.startswith("bench-h100-tiny-") and paths["json"].parent == tmp / "out"
    res = data["results"]
    assert len(res) == len(FAMILIES) * len(POLS) * len(BUDGETS)
    for r in res:
        for k in REQUIRED:
            assert k in r, k
        if r["feasible"]:
            assert r["iter_time_s"] > 0 and r["overhead"] >= 1.0 - 1e-9
        else:
            assert r["iter_time_s"] is None and r["overhead"] is None and r["reason"]
    none1 = [r for r in res if r["policy"] == "none" and r["budget_fraction"] == 1.0]
    assert len(none1) == len(FAMILIES) and all(r["overhead"] == 1.0 for r in none1)
    # none cannot run below its own peak; the offloading policies can at 1/4 on these families
    assert all(not r["feasible"] for r in res if r["policy"] == "none" and r["budget_fraction"] < 1)
    assert any(r["feasible"] for r in res if r["policy"] == "oracle" and r["budget_fraction"] < 1)


def test_max_size(run):
    _, report, paths = run
    ms = _strict_load(paths["json"])["max_size"]
    assert {(r["family"], r["policy"]) for r in ms} == {(f, p) for f in FAMILIES for p in POLS}
    for r in ms:
        for k in ("family", "policy", "knob", "scale", "ratio_vs_none"):
            assert k in r
        # a policy charged the manager's host cost (the simulator's host cost) may pass no scale within the overhead limit
        assert r["scale"] in ((1, 2) if r["policy"] == "none" else (0, 1, 2)) and r["capacity_bytes"] > 0
        assert r["knob"] == "batch"
    assert all(r["ratio_vs_none"] == 1.0 for r in ms if r["policy"] == "none")


def test_markdown_and_plots(run):
    tmp, report, paths = run
    md = paths["markdown"].read_text()
    assert paths["markdown"] == paths["json"].with_suffix(".md")
    assert md == render_markdown(report)
    for f in FAMILIES:
        assert f"## {f}" in md
    assert "OOM" in md and "1.00x" in md and "Max trainable size" in md
    names = sorted(p.name for p in paths["plots"])
    assert names == sorted([f"overhead_{f}.png" for f in FAMILIES] + ["max_size.png"])
    for p in paths["plots"]:
        assert p.parent == tmp / "out" and p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000


def test_cache_reuse(run):
    tmp, report, _ = run
    assert report.meta["traces_recorded"] >= len(FAMILIES)
    files = sorted((tmp / "cache").glob("*.jsonl.gz"))
    assert files and not list((tmp / "cache").glob(".*tmp*"))
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    again = run_bench(_cfg(tmp), progress=False)
    assert again.meta["traces_recorded"] == 0
    assert again.meta["traces_reused"] == report.meta["traces_recorded"] + report.meta["traces_reused"]
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes
    assert [r["iter_time_s"] for r in again.results] == [r["iter_time_s"] for r in report.results]


def test_corrupt_cache_is_rerecorded(tmp_path, caplog):
    cache = TraceCache(tmp_path)
    first = cache.get("varlen", "tiny", 0, 2)
    path = cache.path("varlen", "tiny", 0, 2)
    path.write_bytes(path.read_bytes()[:200])  # cut short mid-stream
    with caplog.at_level(logging.WARNING, logger="dynn_runtime"):
        again = cache.get("varlen", "tiny", 0, 2)
    assert cache.recorded == 2 and cache.reused == 0
    assert "recording it again" in caplog.text
    assert len(again.iterations) == len(first.iterations) == 2
    cache.get("varlen", "tiny", 0, 2)
    assert cache.reused == 1


def test_cache_key():
    c = TraceCache("x")
    a = c.path("moe", "tiny", 0, 2, {"batch": 16})
    assert a != c.path("moe", "tiny", 0, 2, {"batch": 32})
    assert a != c.path("moe", "tiny", 1, 2, {"batch": 16}) != c.path("moe", "tiny", 0, 3, {"batch": 16})
    assert c.path("moe", "tiny", 0, 2) == c.path("moe", "tiny", 0, 2, {})
    assert a.name.startswith("moe-tiny-seed0-steps2-") and a.name.endswith(".jsonl.gz")


def test_scaled_overrides():
    assert scaled_overrides("moe", "tiny", 1) == {}
    assert scaled_overrides("moe", "tiny", 4) == {"batch": 32}
    ev = scaled_overrides("evoformer", "tiny", 2)
    assert ev == {"residues_max": 32, "residues_min": 16}
    # the depth scan multiplies layers / blocks; the Tree-LSTM's depth comes from its data
    assert scaled_overrides("moe", "tiny", 4, "depth") == {"layers": 8}
    assert scaled_overrides("evoformer", "tiny", 2, "depth") == {"blocks": 4}
    with pytest.raises(ConfigError, match="tree_lstm has no depth knob"):
        scaled_overrides("tree_lstm", "tiny", 2, "depth")


def test_grid_depth_simulates_deeper_models(tmp_path):
    # the budget grid on depth-scaled traces: a deeper model has a larger peak at the same batch, and
    # a family without a depth knob is left out rather than run at its usual depth
    base = run_bench(_cfg(tmp_path, families=["moe"], policies=["none"], budgets=[1.0], max_scale=0),
                     progress=False)
    deep = run_bench(_cfg(tmp_path, families=["moe", "tree_lstm"], policies=["none"], budgets=[1.0], max_scale=0,
                          grid_depth=2), progress=False)
    assert [r["family"] for r in deep.results] == ["moe"]
    assert deep.results[0]["unmanaged_peak_bytes"] > base.results[0]["unmanaged_peak_bytes"]
    assert deep.results[0]["ops"] > base.results[0]["ops"]
    assert "depth x2" in render_markdown(deep)


def test_depth_scan_builds_deeper_models():
    from dynn_runtime import models

    fam = models.family("skipnet")
    base = fam.build_model(fam.config("tiny"))
    deeper = fam.build_model(fam.config("tiny", **scaled_overrides("skipnet", "tiny", 2, "depth")))
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(deeper) > 1.5 * n(base)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(families=["nope"]), "choices: moe"),
        (dict(policies=["nope"]), "registered: none"),
        (dict(device_profile="b200"), "choices: h100"),
        (dict(budgets=[0.0]), "(0, 1]"),
        (dict(budgets=[1.5]), "(0, 1]"),
        (dict(budgets=[]), "at least one"),
        (dict(preset="huge"), "choices: tiny"),
        (dict(steps=1), ">= 2"),
        (dict(max_size_knob="width"), "'size' (batch, residues) or 'depth'"),
        (dict(grid_depth=0), "grid_depth must be an integer >= 1"),
    ],
)
def test_bad_input(tmp_path, kw, needle):
    with pytest.raises(ConfigError, match=r"^bench: ") as exc:
        run_bench(_cfg(tmp_path, **kw), progress=False)
    assert needle in str(exc.value)
    assert not (tmp_path / "cache").exists()  # rejected before any recording


def test_policies_come_from_the_registry(monkeypatch):
    class Fresh(Policy):
        name = "fresh_test_policy"

    class NeedsPilot(Policy):  # the simulator serves history, future and pilot, never a GPU
        name = "needs_pilot_test"
        requires = frozenset({"pilot", "gpu"})

    monkeypatch.setitem(POLICIES, Fresh.name, Fresh)
    monkeypatch.setitem(POLICIES, NeedsPilot.name, NeedsPilot)
    ok, skipped = available_policies()
    assert Fresh.name in ok and NeedsPilot.name in skipped
    cfg = BenchConfig(quick=True).resolved()
    assert cfg.policies == ok and cfg.preset == "tiny" and cfg.budgets == [1.0, 0.5, 0.25, 0.125]
    assert cfg.max_scale == 8 and cfg.scales() == [1, 2, 4, 8]
    with pytest.raises(ConfigError, match="cannot run in the simulator"):
        BenchConfig(policies=[NeedsPilot.name]).resolved()


def test_cli(tmp_path, run, capsys):
    cache = run[0] / "cache"  # moe tiny is cached there already
    out = tmp_path / "o"
    rc = main(["bench", "--quick", "--families", "moe", "--policies", "none", "lru", "--out", str(out),
               "--max-scale", "1", "--cache-dir", str(cache), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "## moe" in text and "| lru |" in text and "1/8" in text
    assert len(list(out.glob("bench-h100-tiny-*.json"))) == 1
    assert (out / "overhead_moe.png").exists() and (out / "max_size.png").exists()
    js = tmp_path / "r.json"
    assert main(["bench", "--families", "moe", "--policies", "none", "--preset", "tiny", "--budgets", "1,1/2",
                 "--max-scale", "0", "--json", str(js), "--out", str(out), "--cache-dir", str(cache), "-q"]) == 0
    assert [r["budget_fraction"] for r in _strict_load(js)["results"]] == [1.0, 0.5]
    assert js.with_suffix(".md").exists()
    assert main(["bench", "--families", "nope", "--out", str(out)]) == 2
    assert "choices:" in capsys.readouterr().err


def test_doctest():
    res = doctest.testmod(bench, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


def test_inf_is_null_in_json(run):
    _, report, _ = run
    data = report.to_json()
    json.dumps(data, allow_nan=False)
    assert not any(isinstance(v, float) and not math.isfinite(v) for r in data["results"] for v in r.values())
    assert os.path.basename(report.results[0]["trace"]).endswith(".jsonl.gz")


def test_accounting_invariants(run):
    _, report, _ = run
    for r in report.results:
        if r["feasible"]:
            assert r["peak_bytes"] <= r["budget_bytes"]
            assert r["iter_time_s"] == pytest.approx(r["compute_time_s"] + r["stall_time_s"] + r["recompute_time_s"]
                                                     + r["host_wait_s"])
            assert r["iter_time_s"] >= r["compute_time_s"] - 1e-12
        if r["budget_fraction"] == 1.0:  # nothing moves; the manager's host cost is charged (the simulator's host cost)
            assert r["feasible"] and not r["managed"] and r["overhead"] >= 1.0 - 1e-12
            assert r["overhead"] == pytest.approx(1.0) if not r["host_cost_source"] else r["overhead"] > 1.0


def test_the_grid_charges_the_manager_host_cost_and_says_so(run, tmp_path):
    from dynn_runtime.sim import simulate
    from dynn_runtime.sim.hostcost import host_cost_for
    from dynn_runtime.trace import read_trace

    tmp, report, paths = run
    hc = report.meta["host_cost"]
    assert hc["mode"] == "calibrated" and hc["policies"]["none"] is None
    assert hc["policies"]["lru"]["per_op_s"] > 0 and hc["measured"]
    assert "Manager host cost charged: calibrated" in paths["markdown"].read_text()
    cache = tmp / "cache"
    off = run_bench(_cfg(tmp, host_cost="none", max_scale=0), progress=False)
    model = run_bench(_cfg(tmp, host_cost="1e-5", max_scale=0), progress=False)
    assert off.meta["host_cost"]["mode"] == "none" and model.meta["host_cost"]["mode"] == "model"
    by = {k: {(r["family"], r["policy"], r["budget_fraction"]): r for r in rep.results}
          for k, rep in (("cal", report), ("off", off), ("model", model))}
    for key, r in by["off"].items():
        assert r["host_cost_s"] == 0 and r["host_cost_source"] == ""
        if key[2] == 1.0:
            assert r["overhead"] == 1.0  # uncharged: the grid as it was
        cal, mod = by["cal"][key], by["model"][key]
        if key[1] == "none":  # PyTorch alone is never charged: the reference stays the reference
            assert cal["host_cost_s"] == mod["host_cost_s"] == 0 and cal["iter_time_s"] == r["iter_time_s"]
            continue
        if not r["feasible"]:
            continue
        assert mod["host_cost_s"] == pytest.approx(mod["ops"] * 1e-5) and mod["host_cost_source"] == "model"
        assert cal["host_cost_source"] in ("python", "native") and cal["iter_time_s"] >= r["iter_time_s"]
        if key[2] == 1.0:  # the record is the simulation with the calibrated charge, nothing else
            trace = read_trace(cache / cal["trace"])
            again = simulate(trace, key[1], 1.0, "h100", host_cost=host_cost_for(key[1], "auto"))
            assert cal["iter_time_s"] == pytest.approx(again.iter_time_s) and cal["overhead"] > 1.0
