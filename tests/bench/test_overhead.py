"""``dynn bench --overhead``: the measurement's records, the calibration it writes and the simulator reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynn_runtime.bench.overhead import (
    EVERY_POINT,
    OverheadConfig,
    render_overhead_markdown,
    run_overhead,
    write_calibration,
    write_overhead,
)
from dynn_runtime.cli import main
from dynn_runtime.errors import ConfigError
from dynn_runtime.sim.hostcost import host_cost_for, load_calibration, policy_options_for

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "my_workload.py") + ":build"


@pytest.fixture(scope="module")
def report():
    cfg = OverheadConfig(workloads=["tree_lstm", EXAMPLE], policies=["none", "lru", "pilot"], sources=["python"],
                         preset="tiny", steps=1, reps=2)
    return run_overhead(cfg, progress=False)


def test_records_cover_every_policy_source_and_workload(report):
    assert {(r["source"], r["policy"]) for r in report.micro} == {("python", p) for p in ("none", "lru", "pilot")}
    for r in report.micro:
        assert r["source_used"] == "python" and r["ops"] > 50 and r["plain_us_per_op"] > 0
    keys = {(r["workload"], r["policy"], r["budget"]) for r in report.workloads}
    for w in ("tree_lstm", "my_workload.build"):
        assert {(w, p, "above peak") for p in ("none", "lru", "pilot")} | {(w, "lru", 0.5)} <= keys
    for r in report.workloads:
        assert r["ops"] > 0 and r["managed_s"] > 0 and r["plain_s"] > 0 and r["ratio"] > 0
        assert r["steps"] == 2 and r["cpu_ratio"] > 0  # one measured pair in each of the two rounds
        if str(r["budget"]).startswith("above peak"):
            assert r["evictions"] == 0 and r["decision_points"] == 0  # nothing moves above the peak
        else:  # half the peak: lru is consulted and moves storages
            assert r["decision_points"] > 0 and r["evictions"] >= r["decision_points"] and r["stall_s"] > 0
            assert r["moves"] >= r["evictions"] and r["extra_over_above_s"] is not None
    for r in report.workloads:  # the collector's clock ran on both sides of every step
        assert r["gc_s"] >= r["gc_full_s"] >= 0 and r["gc_full"] >= 0 and r["plain_gc_s"] >= 0
    # as shipped the pilot defers its decision points above the peak (nothing reads them); the run with
    # every one taken measures their cost
    shipped = [r for r in report.workloads if r["policy"] == "pilot" and r["budget"] == "above peak"]
    assert shipped and all(r["pilot_decisions"] == 0 < r["pilot_deferred_idle"] and "pilot" not in r
                           for r in shipped)
    every = [r for r in report.workloads if r["policy"] == "pilot" and r["budget"] == EVERY_POINT]
    assert len(every) == len(shipped) and all(
        r["pilot"]["decisions_per_step"] > 0 and r["pilot_deferred_idle"] == 0 and 0 < r["pilot"]["share_of_step"] < 1
        for r in every)


def test_calibration_round_trip(report, tmp_path):
    cal = report.calibration["python"]
    assert cal["per_op_s"] > 0 and cal["per_decision_s"] >= 0 and cal["per_move_s"] >= 0
    assert len(cal["policy_options"]["pilot"]["host_cost"]) == 3 and cal["policy_per_op_s"]["pilot"] >= 0
    assert cal["measured"]["cores"] and cal["measured"]["torch"]
    path = tmp_path / "host_cost.json"
    path.write_text(json.dumps({"schema": 1, "sources": {"native": {"per_op_s": 1e-6, "per_decision_s": 0.0}}}))
    write_calibration(report, path)
    data = load_calibration(path)
    assert set(data["sources"]) == {"python", "native"}  # a source not measured now is kept
    c = host_cost_for("lru", "python", data)
    assert c.per_op_s == cal["per_op_s"] and c.per_decision_s == cal["per_decision_s"]
    assert c.per_move_s == cal["per_move_s"] >= 0
    assert host_cost_for("lru", "auto", data).source == "native" and host_cost_for("none", "python", data) is None
    assert policy_options_for("pilot", "python", data)["host_cost"] == tuple(cal["policy_options"]["pilot"]["host_cost"])


def test_outputs(report, tmp_path):
    paths = write_overhead(report, tmp_path / "o.json")
    data = json.loads(paths["json"].read_text())
    assert data["kind"] == "dynn-bench-overhead" and data["config"]["preset"] == "tiny" and data["machine"]["cores"]
    md = paths["markdown"].read_text()
    assert md == render_overhead_markdown(report)
    for needle in ("## Operators", "| python | lru |", "| tree_lstm |", "my_workload.build", "lru at 0.5",
                   "## The pilot", "## Calibration", "## Python's cyclic collector (python"):
        assert needle in md


def test_the_collector_clock_times_full_and_young_collections():
    import gc

    from dynn_runtime.bench.overhead import _Collector

    with _Collector() as clock:
        snap = clock.snapshot()
        gc.collect(0)
        young = clock.since(snap)
        gc.collect()
        both = clock.since(snap)
    assert young["gc_full"] == 0 and young["gc_s"] > 0 and young["gc_full_s"] == 0
    assert both["gc_full"] == 1 and both["gc_full_s"] > 0 and both["gc_s"] > young["gc_s"]
    n = clock.full
    gc.collect()  # unregistered on exit
    assert clock.full == n and clock._callback not in gc.callbacks


def test_bad_input_and_cli(tmp_path, capsys):
    with pytest.raises(ConfigError, match="event source"):
        OverheadConfig(sources=["cuda"]).resolved()
    with pytest.raises(ConfigError, match="path/to/file.py:function"):
        OverheadConfig(workloads=["nope"]).resolved()
    with pytest.raises(ConfigError, match="unknown policies"):
        OverheadConfig(policies=["nope"]).resolved()
    out = tmp_path / "ov.json"
    assert main(["bench", "--overhead", "--quick", "--families", EXAMPLE, "--policies", "lru", "--reps", "1",
                 "--steps", "1", "--json", str(out), "-q"]) == 0
    text = capsys.readouterr().out
    assert "## Operators" in text and "my_workload.build" in text and out.exists()
    assert main(["bench", "--overhead", "--quick", "--families", EXAMPLE, "--policies", "lru", "--reps", "1",
                 "--steps", "1", "--out", str(tmp_path / "dir"), "-q"]) == 0
    assert (tmp_path / "dir" / "overhead.json").exists() and (tmp_path / "dir" / "overhead.md").exists()



def test_counting_wrapper_keeps_a_lazy_policy_lazy():
    """The bench's counting wrapper must not make the native source call Python every few operators for a
    policy that never acts ahead of need (it did: the bench then measured a manager no user runs)."""
    import torch

    from dynn_runtime.bench.overhead import _BIG, _counting, _manager, available_sources
    from dynn_runtime.policies import Policy

    assert type(_counting("lru")).after_op is Policy.after_op
    assert type(_counting("none")).after_op is Policy.after_op
    pilot = _counting("pilot")
    assert type(pilot).after_op is not Policy.after_op
    # counted on the instance: the class keeps the pilot's own after_op, so its batches are still told in
    # bulk (operators_in_bulk and stops_in_bulk check the class) and the bench measures the shipped path
    from dynn_runtime.pilot.policy import PilotPolicy

    assert type(pilot).after_op is PilotPolicy.after_op and pilot.after_op.__func__ is not PilotPolicy.after_op
    if "native" not in available_sources():
        pytest.skip("the native event source is not built here")
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])
    mm = _manager(_BIG, _counting("lru"), "native")
    mm.attach(model)
    try:
        for _ in range(2):
            with mm.step():
                model(torch.randn(4, 8)).sum().backward()
        assert mm.steps[-1].ops > 64  # more than two periodic turns' worth of operators
        assert mm.stats()["decision_points"] == 0  # Python never entered: nothing to decide
    finally:
        mm.detach()


@pytest.mark.parametrize("source", ["python", "native"])
def test_micro_runs_pytorch_alone_unobserved(source):
    """The operator microbenchmark's PyTorch-alone runs happen with the manager paused (an attached manager
    observes every operator on its thread, in a step or not), its managed runs inside a step, the two
    in alternating order."""
    import torch

    from dynn_runtime.bench.overhead import _micro, available_sources
    from dynn_runtime.runtime.events import QUIET

    if source not in available_sources():
        pytest.skip(f"the {source} event source is not usable here")
    seen: list[bool] = []

    def observed() -> bool:  # whether an operator run now reaches a manager
        obs = QUIET[-1] if QUIET else None
        before = obs.position if obs is not None else None
        torch.ones(2).add_(1)
        return torch._C._len_torch_dispatch_stack() > 0 or (obs is not None and obs.position != before)

    class Bar:
        def update(self, n: int) -> None:
            pass

    cfg = OverheadConfig(workloads=["tree_lstm"], sources=[source], reps=3).resolved()
    rec = _micro(cfg, source, "lru", Bar(), probe=lambda: seen.append(observed()))
    assert rec["source_used"] == source
    # warm-up alone, one unmeasured managed step; then the pairs, alone first in every other one
    assert seen == [False, True] + [False, True] + [True, False] + [False, True]
    assert not observed()  # detached


def test_calibration_is_kept_per_device(report, tmp_path):
    """A GPU's figures go under devices.cuda beside the CPU's (kept), and the simulator's GPU profiles
    charge them where they were measured (device auto); a file of the first layout still reads."""
    import dataclasses

    path = tmp_path / "host_cost.json"
    legacy = {"schema": 1, "sources": {"native": {"per_op_s": 1e-6, "per_decision_s": 0.0}}}
    path.write_text(json.dumps(legacy))
    assert host_cost_for("lru", "auto", load_calibration(path)).device == "cpu"  # no GPU figures: the CPU's
    with pytest.raises(ConfigError, match="--device cuda"):
        host_cost_for("lru", "native", load_calibration(path), device="cuda")
    write_calibration(report, path)  # measured on the CPU: under sources
    on_gpu = dataclasses.replace(report, config=dataclasses.replace(report.config, device="cuda"),
                                 calibration={"python": {**report.calibration["python"], "per_op_s": 7e-6}})
    write_calibration(on_gpu, path)
    data = load_calibration(path)
    assert set(data["sources"]) == {"python", "native"} and set(data["devices"]) == {"cuda"}
    assert data["sources"]["python"]["per_op_s"] == report.calibration["python"]["per_op_s"] != 7e-6
    gpu = host_cost_for("lru", "python", data)
    assert (gpu.device, gpu.source, gpu.per_op_s) == ("cuda", "python", 7e-6)
    cpu = host_cost_for("lru", "python", data, device="cpu")
    assert (cpu.device, cpu.per_op_s) == ("cpu", report.calibration["python"]["per_op_s"])
    # the GPU has no native figures: auto charges the CPU's native ones rather than fail
    assert host_cost_for("lru", "native", data).device == "cpu"
    assert policy_options_for("pilot", "python", data) == {
        "host_cost": tuple(on_gpu.calibration["python"]["policy_options"]["pilot"]["host_cost"])}
    write_calibration(report, path)  # measuring the CPU again keeps the GPU's figures
    assert load_calibration(path)["devices"]["cuda"]["python"]["per_op_s"] == 7e-6
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**legacy, "devices": {"tpu": {}}}))
    with pytest.raises(ConfigError, match="unknown device"):
        load_calibration(bad)


def test_device_is_checked(monkeypatch, capsys):
    with pytest.raises(ConfigError, match="cpu or cuda"):
        OverheadConfig(device="tpu").resolved()
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA is not available"):
        OverheadConfig(device="cuda").resolved()
    assert main(["bench", "--overhead", "--device", "cuda", "--families", "tree_lstm", "-q"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_every_timed_run_ends_synchronized(monkeypatch):
    """The device's synchronization ends every timed run of the operator loop and every timed step, managed
    or alone (on a GPU the time then includes the kernels it launched); on the CPU it is the same code."""
    from dynn_runtime.bench import overhead

    calls = []
    monkeypatch.setattr(overhead, "_synchronizer", lambda device: lambda: calls.append(device))

    class Bar:
        def update(self, n: int) -> None:
            pass

    cfg = OverheadConfig(workloads=["tree_lstm"], policies=["lru"], sources=["python"], preset="tiny", steps=1,
                         reps=3).resolved()
    overhead._micro(cfg, "python", "lru", Bar())
    assert calls == ["cpu"] * (1 + 1 + 2 * 3)  # warm-up, the unmeasured managed step, the pairs
    calls.clear()
    overhead._workload(cfg, "tree_lstm", "python", Bar())
    # (lru above the peak, lru at half) x 2 rounds x (alone + managed) x (steps + 1)
    assert calls == ["cpu"] * (2 * 2 * 2 * 2)


def test_a_failing_workload_is_reported_and_the_others_still_calibrate(report, monkeypatch):
    from dynn_runtime.bench import overhead

    assert report.meta["failed"] == []
    real = overhead._workload

    def workload(cfg, spec, source, bar, collector=None):
        if spec == "skipnet":
            raise RuntimeError("CUDA error: an illegal memory access")
        return real(cfg, spec, source, bar, collector)

    monkeypatch.setattr(overhead, "_workload", workload)
    cfg = OverheadConfig(workloads=["skipnet", "tree_lstm"], policies=["lru"], sources=["python"], preset="tiny",
                         steps=1, reps=1)
    rep = run_overhead(cfg, progress=False)
    assert rep.meta["failed"] == [{"workload": "skipnet", "source": "python",
                                   "error": "RuntimeError: CUDA error: an illegal memory access"}]
    assert {r["workload"] for r in rep.workloads} == {"tree_lstm"} and rep.calibration["python"]["per_op_s"] >= 0
    assert "**skipnet (python) failed**" in render_overhead_markdown(rep)
