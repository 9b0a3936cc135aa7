"""``hybrid`` and ``hybrid_oracle``: per victim, recompute when that costs the compute stream less
than the copy, else offload. Known answers on hand-built traces where one choice is clearly right,
so a test fails if the choice were inverted; the simulator's invariants on random traces are
``tests/sim/test_sim.py``'s property tests, which run every registered policy."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from builder import TB, UNIT  # noqa: E402

import dynn_runtime as dr  # noqa: E402
from dynn_runtime.policies import POLICIES  # noqa: E402
from dynn_runtime.sim import simulate  # noqa: E402
from dynn_runtime.sim.hostcost import host_cost_for, policy_options_for  # noqa: E402

# UNIT, but an operator's FLOPs count as seconds: op time = 1 s + flops (copies: bytes / 100 s)
SLOW = dataclasses.replace(UNIT, name="slow", peak_flops={"float32": 1.0}, compute_efficiency=1.0)


def _trace(a_bytes: int, a_flops: int, big_first: bool = False):
    """X (a saved input) -> f0 -> A (saved activation, ``a_bytes``, ``a_flops`` to produce); f1..f3
    run on a persistent W; f4 allocates a temporary T that only fits once A has left (Belady's first
    victim: read last, at b1). With ``big_first``, a non-recomputable input G (1000 B) read after A
    leaves first and T is large enough that A must follow: G's offload queues 10 s on the
    device-to-host link ahead of A's."""
    b = TB()
    b.storage("X", 10, "input", saved=True, persistent_from=0)
    b.storage("W", 10, "param", persistent_from=0)
    if big_first:
        b.storage("G", 1000, "input", persistent_from=0)
    ops = [
        ("f0", "forward", "", ["X"], [("A", a_bytes, "activation", True)], []),
        ("f1", "forward", "", ["W"], [], []),
        ("f2", "forward", "", ["W"], [], []),
        ("f3", "forward", "", ["W"], [], []),
        ("f4", "forward", "", ["W"], [("T", 1000 + a_bytes if big_first else a_bytes, "temp", False)], ["T"]),
        ("b0", "backward", "", ["W", "X"], [], []),
        ("b1", "backward", "", ["A"], [], ["A"]),
    ]
    if big_first:
        ops.append(("b2", "backward", "", ["G"], [], []))
    it = b.iteration(ops)
    it.ops[0] = dataclasses.replace(it.ops[0], flops=a_flops)
    return b.trace()


def _run(policy: str, tr, budget: int):
    pol = POLICIES[policy]() if policy == "hybrid_oracle" else dr.policies.make_policy(policy)
    r = simulate(tr, pol, budget, SLOW, iteration=0)
    assert r.feasible, r.reason
    assert r.peak_bytes <= budget
    return r, pol


@pytest.mark.parametrize("policy", ["hybrid_oracle", "hybrid"])
def test_recompute_when_the_copy_is_dear(policy):
    # A: 1000 B (a 10 s copy each way) made by a 1 s operator: dropped, rebuilt once, nothing copied
    tr = _trace(a_bytes=1000, a_flops=0)
    r, pol = _run(policy, tr, 10 + 10 + 1000)  # X, W and A fit; T does not beside A
    assert pol.choices["drop"] == 1 and (r.recomputed_ops, r.recompute_time_s) == (1, 1.0)
    assert r.bytes_offloaded < 1000  # A was not copied (the pilot may move a 10 B storage too)
    if policy == "hybrid_oracle":
        assert pol.choices == {"drop": 1, "offload": 0} and r.bytes_offloaded == 0
    oracle = simulate(tr, "oracle", 1020, SLOW, iteration=0)  # the swapping policy copies it and waits
    assert oracle.bytes_offloaded == 1000 and r.iter_time_s < oracle.iter_time_s


@pytest.mark.parametrize("policy", ["hybrid_oracle", "hybrid"])
def test_copy_when_the_recompute_is_dear(policy):
    # A: 300 B (a 3 s copy each way, the fetch hidden by the prefetch) made by a 51 s operator: offloaded
    tr = _trace(a_bytes=300, a_flops=50)
    r, pol = _run(policy, tr, 10 + 10 + 300)
    assert pol.choices["drop"] == 0 and (r.recomputed_ops, r.recompute_time_s) == (0, 0.0)
    assert r.bytes_offloaded >= 300  # A was copied
    if policy == "hybrid_oracle":
        assert pol.choices == {"drop": 0, "offload": 1} and r.bytes_offloaded == 300
    dtr = simulate(tr, "dtr", 320, SLOW, iteration=0)  # the rematerialising policy re-runs 51 s
    assert dtr.recompute_time_s == 51.0 and r.iter_time_s < dtr.iter_time_s


def test_a_busy_link_turns_a_copy_into_a_recompute():
    # A alone: a 3 s copy out (the fetch back hidden by the prefetch) against a 5 s rebuild:
    # offloaded. Behind G's 10 s offload the link is the bottleneck and A's round trip costs its
    # 6 s of link time: dropped instead.
    alone = _run("hybrid_oracle", _trace(a_bytes=300, a_flops=4), 10 + 10 + 300)[1]
    assert alone.choices == {"drop": 0, "offload": 1}
    r, busy = _run("hybrid_oracle", _trace(a_bytes=300, a_flops=4, big_first=True), 10 + 10 + 1000 + 300)
    assert busy.choices == {"drop": 1, "offload": 1}
    assert r.bytes_offloaded == 1000 and r.recomputed_ops == 1


def test_no_drop_whose_rebuild_input_may_be_freed_first():
    # A's producer reads Y, a temporary still alive when A must leave (f2) but read for the last
    # time, and freed, before A is read again: a drop would make the rebuild a chain through a
    # storage the policy cannot see coming back, so A is offloaded although its rebuild is 1 s
    # against a 10 s copy. With Y read after A instead, A is dropped.
    def trace(y_last: str):
        b = TB()
        b.storage("W", 10, "param", persistent_from=0)
        b.iteration([
            ("f0", "forward", "", ["W"], [("Y", 10, "temp", False)], []),
            ("f1", "forward", "", ["Y"], [("A", 1000, "activation", True)], []),
            ("f2", "forward", "", ["W"], [("T", 1000, "temp", False)], ["T"]),
            ("f3", "forward", "", ["W", "Y"] if y_last == "forward" else ["W"], [], ["Y"] if y_last == "forward" else []),
            ("b0", "backward", "", ["A"], [], ["A"]),
            ("b1", "backward", "", ["W", "Y"] if y_last == "backward" else ["W"], [], ["Y"] if y_last == "backward" else []),
        ])
        return b.trace()

    r, pol = _run("hybrid_oracle", trace("forward"), 10 + 10 + 1000)
    assert pol.choices == {"drop": 0, "offload": 1} and r.recomputed_ops == 0 and r.bytes_offloaded == 1000
    r, pol = _run("hybrid_oracle", trace("backward"), 10 + 10 + 1000)
    # (Y, read last, leaves first: a 0.1 s copy; then A is dropped and its rebuild fetches Y)
    assert pol.choices == {"drop": 1, "offload": 1} and r.recomputed_ops == 1 and r.bytes_offloaded == 10


def test_simulator_only_and_charged_as_the_pilot():
    with pytest.raises(dr.PolicyError, match="hybrid is available in the simulator only"):
        dr.MemoryManager(1 << 20, policy="hybrid", device="cpu")
    assert host_cost_for("hybrid") == host_cost_for("pilot")
    assert policy_options_for("hybrid") == policy_options_for("pilot") != {}
    assert host_cost_for("hybrid_oracle") == host_cost_for("oracle")
