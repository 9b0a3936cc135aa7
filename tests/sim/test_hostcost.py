"""The simulator's host cost: the live manager's host cost on the simulator's host clock, and its calibration file."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from builder import TB, UNIT  # noqa: E402
from test_sim import chain_trace  # noqa: E402

from dynn_runtime.errors import ConfigError  # noqa: E402
from dynn_runtime.sim import simulate  # noqa: E402
from dynn_runtime.sim.hostcost import (  # noqa: E402
    CALIBRATION_PATH,
    HostCost,
    host_cost_for,
    load_calibration,
    parse_host_cost,
    policy_options_for,
)

ZERO = HostCost(per_op_s=0.0, per_decision_s=0.0, source="model")


def cheap_ops_trace(n: int) -> object:
    """``n`` operators at the floor (1 s each on UNIT), one small temporary each."""
    b = TB()
    b.storage("P", 100, "param", persistent_from=0)
    b.iteration([(f"op{j}", "forward", "", ["P"], [(f"T{j}", 10, "temp", False)], [f"T{j}"]) for j in range(n)])
    return b.trace()


def _without_source(res) -> dict:
    d = res.as_dict()
    d.pop("host_cost_source")
    return d


@pytest.mark.parametrize("policy", ["none", "lru", "oracle", "save_on_cpu", "dtr", "replay"])
@pytest.mark.parametrize("budget", [400, 300])
def test_zero_charge_reproduces_the_uncharged_run_exactly(policy, budget):
    tr = chain_trace()
    base = simulate(tr, policy, budget, UNIT, iteration=0)
    zero = simulate(tr, policy, budget, UNIT, iteration=0, host_cost=ZERO)
    assert _without_source(zero) == _without_source(base)
    assert zero.host_cost_source == "model" and base.host_cost_source == ""


def test_per_op_charge_grows_a_host_bound_iteration_by_ops_times_per_op():
    n = 50
    tr = cheap_ops_trace(n)
    base = simulate(tr, "lru", 1 << 20, UNIT, iteration=0)
    assert base.iter_time_s == pytest.approx(n * 1.0)
    for per_op in (0.25, 3.0):
        r = simulate(tr, "lru", 1 << 20, UNIT, iteration=0, host_cost=HostCost(per_op_s=per_op, per_decision_s=0.0,
                                                                                 source="model"))
        assert r.iter_time_s == pytest.approx(base.iter_time_s + n * per_op)
        assert r.host_cost_s == pytest.approx(n * per_op) and r.host_wait_s == pytest.approx(n * per_op)
        # below the peak nothing moves, yet the manager sees every operator and is charged
        assert not r.managed and r.decision_points == 0


def test_per_op_charge_hides_behind_long_operators():
    # op0 takes 11 s on the device (1 s floor + 10 s of arithmetic): the 2 s per operator the host
    # spends on ops 1-4 is issued while it runs, so only op0's own charge reaches the device
    tr = cheap_ops_trace(5)
    prof = dataclasses.replace(UNIT, name="slowflops", peak_flops={"float32": 1.0}, compute_efficiency=1.0)
    it = tr.iterations[0]
    it.ops[0] = dataclasses.replace(it.ops[0], flops=10)
    base = simulate(tr, "lru", 1 << 20, prof, iteration=0)
    r = simulate(tr, "lru", 1 << 20, prof, iteration=0, host_cost=HostCost(per_op_s=2.0, per_decision_s=0.0,
                                                                             source="model"))
    assert base.iter_time_s == pytest.approx(15.0)
    assert r.iter_time_s == pytest.approx(base.iter_time_s + 2.0) and r.host_cost_s == pytest.approx(10.0)


def test_decision_points_are_counted_and_charged():
    # lru at 300 B: op2 asks for victims (P leaves, a clean copy), op3 asks again (A leaves, P comes
    # back): two decision points. At 0.5 s each: the first is exposed (the host issues op2 0.5 s
    # after the device ran dry), the second hides behind op3's 2 s stall.
    tr = chain_trace()
    base = simulate(tr, "lru", 300, UNIT, iteration=0)
    r = simulate(tr, "lru", 300, UNIT, iteration=0, host_cost=HostCost(per_op_s=0.0, per_decision_s=0.5,
                                                                       source="model"))
    assert r.decision_points == 2 and r.host_cost_s == pytest.approx(1.0)
    assert r.iter_time_s == pytest.approx(base.iter_time_s + 0.5) and r.host_wait_s == pytest.approx(0.5)
    assert r.moves == 3  # P out, A out, P back on demand
    m = simulate(tr, "lru", 300, UNIT, iteration=0, host_cost=HostCost(per_op_s=0.0, per_decision_s=0.0,
                                                                       per_move_s=0.5, source="model"))
    # P's eviction before op2 is exposed (0.5 s); A out and P back (1 s) hide behind op3's stall
    assert m.moves == 3 and m.host_cost_s == pytest.approx(1.5) and m.iter_time_s == pytest.approx(base.iter_time_s + 0.5)
    # the oracle's proactive moves (after_op with actions) are decision points too
    o = simulate(tr, "oracle", 300, UNIT, iteration=0, host_cost=ZERO)
    assert o.decision_points >= 1


def test_host_cost_is_validated():
    with pytest.raises(ConfigError, match="per_op_s"):
        HostCost(per_op_s=-1.0, per_decision_s=0.0, source="model")
    with pytest.raises(ConfigError, match="host_cost"):
        simulate(chain_trace(), "lru", 300, UNIT, iteration=0, host_cost=1e-6)


def test_shipped_calibration_charges_the_manager_policies_only():
    data = load_calibration()
    assert "python" in data["sources"] and CALIBRATION_PATH.is_file()
    for name in ("none", "save_on_cpu", "checkpoint", "uvm", "dtr"):
        assert host_cost_for(name, calibration=data) is None and policy_options_for(name, calibration=data) == {}
    for name in ("lru", "oracle", "replay", "pilot"):
        c = host_cost_for(name, source="python", calibration=data)
        assert c.source == "python" and c.per_op_s > 0 and c.per_decision_s >= 0
    auto = host_cost_for("lru", source="auto", calibration=data)
    assert auto.source == ("native" if "native" in data["sources"] else "python")
    pilot = host_cost_for("pilot", source="python", calibration=data)
    extra = data["sources"]["python"].get("policy_per_op_s", {}).get("pilot", 0.0)
    assert pilot.per_op_s == pytest.approx(host_cost_for("lru", source="python", calibration=data).per_op_s + extra)
    opts = policy_options_for("pilot", source="python", calibration=data)
    assert len(opts["host_cost"]) == 3 and all(x >= 0 for x in opts["host_cost"])


def test_calibration_errors_name_the_fix(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"schema": 99, "sources": {}}))
    with pytest.raises(ConfigError, match="write-calibration"):
        load_calibration(bad)
    only_python = {"schema": 1, "uncharged": {}, "sources": {"python": {"per_op_s": 1e-5, "per_decision_s": 0}}}
    with pytest.raises(ConfigError, match="native"):
        host_cost_for("lru", source="native", calibration=only_python)
    assert host_cost_for("lru", calibration=only_python).source == "python"
    # a policy's own per-operator work is added to its per_op_s (charged even where the simulator runs none below the peak)
    only_python["sources"]["python"]["policy_per_op_s"] = {"pilot": 2e-5}
    assert host_cost_for("pilot", calibration=only_python).per_op_s == pytest.approx(3e-5)
    assert host_cost_for("lru", calibration=only_python).per_op_s == pytest.approx(1e-5)


def test_parse_host_cost():
    assert parse_host_cost("calibrated") == "calibrated" and parse_host_cost("none") is None
    assert parse_host_cost("40e-6") == HostCost(per_op_s=40e-6, per_decision_s=0.0, source="model")
    assert parse_host_cost("40e-6,25e-6").per_decision_s == 25e-6
    assert parse_host_cost("40e-6,25e-6,5e-6").per_move_s == 5e-6
    with pytest.raises(ConfigError, match="--host-cost"):
        parse_host_cost("fast")


def test_doctest():
    import doctest

    import dynn_runtime.sim.hostcost as mod

    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
