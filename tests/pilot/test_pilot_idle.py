"""The pilot's idle decision points (``defer_idle``, dynn_runtime/pilot/scheduling.py): deferred while
nothing would read them, caught up by a full rescoring before the first victim of an iteration, and
from the iteration after a victim search on the decisions of ``defer_idle=False`` (the reference)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_pilot_operator import _plain_losses, _run  # noqa: E402

from dynn_runtime.pilot.policy import PilotPolicy  # noqa: E402
from dynn_runtime.runtime.events import native_module  # noqa: E402
from dynn_runtime.sim import Simulator, unmanaged_peak  # noqa: E402

live = pytest.mark.skipif(native_module() is None, reason="the native event source is not built")


class _PerIteration(PilotPolicy):
    """The pilot with its moves, decision points and rows scored kept per iteration, and whether the
    iteration searched for victims."""

    name = "pilot-per-iteration"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.iterations: list[dict[str, object]] = []

    def begin_iteration(self, index: int, context: object = None) -> None:
        super().begin_iteration(index, context)
        self.iterations.append({"moves": [], "start": (self.decisions, self.candidates, self.deferred_idle),
                                "catch_ups": self.catch_ups})

    def counts(self) -> list[tuple[int, int, int]]:
        """Per iteration: (decision points run, rows scored, decision points deferred)."""
        marks = [it["start"] for it in self.iterations] + [(self.decisions, self.candidates, self.deferred_idle)]
        return [tuple(b - a for a, b in zip(m0, m1)) for m0, m1 in zip(marks, marks[1:])]

    def victims(self, need_bytes: int, exclude: set[int]):  # noqa: ANN201
        it = self.iterations[-1]
        it["searched"] = True
        for sid in super().victims(need_bytes, exclude):
            # at the iteration's first victim: the catch-ups run so far, and whether any point is still deferred
            it.setdefault("first_victim", (self.catch_ups - it["catch_ups"], self._stale, self.deferred_idle))
            it["moves"].append((self.view.position, "evict", sid))
            yield sid

    def after_op(self, position: int) -> list:
        actions = super().after_op(position)
        self.iterations[-1]["moves"].extend((position, a.kind, a.sid) for a in actions)
        return actions


@live
@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_with_nothing_moved_the_pilot_sits_every_step_out(backend):
    """Above the peak memory is never short. The first step is told (the pilot has no iteration to
    index yet: its decision points deferred); every later one starts idle (``Policy.idle_step``), the
    runtime reads its log light and tells the pilot no operator, so no decision point is even due,
    and its history entry keeps no operators, while the pilot keeps the first step as the iteration
    to index. With ``defer_idle=False`` every step is told and its decision points run. Training is
    PyTorch alone's either way."""
    shipped, stats = PilotPolicy(backend=backend), []
    losses, moves = _run("tree_lstm", shipped, 1 << 40, steps=4, stats=stats)
    every, every_stats = PilotPolicy(backend=backend, defer_idle=False), []
    every_losses, every_moves = _run("tree_lstm", every, 1 << 40, steps=4, stats=every_stats)
    assert moves == every_moves == []
    assert [s.idle for s in stats] == [False, True, True, True]
    # the runtime's periodic turns: every 32 operators of the told step, none in a step sat out
    assert stats[0].decision_points > 3 and all(s.decision_points == 0 for s in stats[1:])
    first_ops = shipped.ops
    assert first_ops == stats[0].ops > 100  # the first step's operators only
    assert shipped.decisions == shipped.catch_ups == 0 and shipped.deferred_idle > 3
    assert shipped._walked is not None and shipped._walked.index == 0 and len(shipped._walked.ops) == first_ops
    assert not any(s.idle for s in every_stats)
    assert every.ops > 3 * first_ops and every.decisions > 3 and every.deferred_idle == 0
    assert losses == every_losses == _plain_losses("tree_lstm", steps=4)


class _Budgets(_PerIteration):
    """Per iteration also the previous iteration the feature state indexed, and at the iteration's
    first victim the operators told in it so far and the runtime's position."""

    name = "pilot-budgets"

    def begin_iteration(self, index: int, context: object = None) -> None:
        super().begin_iteration(index, context)
        self.iterations[-1].update(history=list(context.history), ops=self.ops)

    def victims(self, need_bytes: int, exclude: set[int]):  # noqa: ANN201
        it = self.iterations[-1]
        it.setdefault("told_at_search", (self.ops - it["ops"], self._state.position, self.view.position))
        it.setdefault("prev", self._state._prev_iter)  # (the state's start waits for the first notification)
        yield from super().victims(need_bytes, exclude)


def _run_budgets(policy: PilotPolicy, budgets: list[int]) -> tuple[list[float], list]:
    """moe (tiny) under ``policy``, one step per budget (bytes, set before the step); losses, stats."""
    import dynn_runtime as dr
    from dynn_runtime.workload import load_workload, make_optimizer, train_step

    wl = load_workload("moe", preset="tiny", seed=0)
    import torch

    torch.manual_seed(0)
    opt = make_optimizer(wl, wl.model.parameters())
    mm = dr.MemoryManager(budgets[0], policy=policy, device="cpu", events="native").attach(wl.model, opt)
    losses = []
    try:
        for step, budget in enumerate(budgets):
            mm.budget = budget
            with mm.step():
                losses.append(train_step(wl, wl.model, opt, wl.make_batch(step)).item())
        return losses, list(mm.steps)
    finally:
        mm.detach()


@live
def test_a_step_that_becomes_short_is_told_everything_before_its_first_victim():
    """Budgets that bind, fit, fit, bind: the step after one that searched is told as it runs; the one
    after a step without a search sits out (idle, its history entry without operators); a step that
    then runs short is told every operator so far before its first victim (the same count at the
    same position as a pilot that never sits out) and indexes the last iteration that was told as
    its previous one. Training is PyTorch alone's bit for bit."""
    _, peak_stats = _run_budgets(PilotPolicy(backend="native"), [1 << 40])
    short = int(peak_stats[0].peak_device_bytes * 0.75)
    budgets = [short, 1 << 40, 1 << 40, short, short]
    pol, ref = _Budgets(backend="native"), _Budgets(backend="native", defer_idle=False)
    losses, stats = _run_budgets(pol, budgets)
    ref_losses, ref_stats = _run_budgets(ref, budgets)
    assert [s.idle for s in stats] == [False, False, True, False, False]
    assert not any(s.idle for s in ref_stats)
    its = pol.iterations[-5:]
    assert its[0].get("searched") and not its[1].get("searched") and its[3].get("searched")
    # step 2 sat out: no operator told, its history entry has none; step 3 indexed step 1 instead
    assert its[3]["ops"] == its[2]["ops"] and not its[3]["history"][-1].ops
    assert its[3]["prev"] is its[3]["history"][-2] and its[3]["prev"].ops
    assert ref.iterations[-2]["prev"] is ref.iterations[-2]["history"][-1]  # the reference: step 2
    assert all(it.get("searched") for it in ref.iterations[-2:])
    # step 3 was told every operator before its first victim, as the reference at the same point
    told, state_pos, view_pos = its[3]["told_at_search"]
    assert told > 50 and told == ref.iterations[-2]["told_at_search"][0]
    assert state_pos == ref.iterations[-2]["told_at_search"][1]
    assert view_pos == ref.iterations[-2]["told_at_search"][2]
    assert any(kind == "evict" for _, kind, _ in its[3]["moves"])
    assert losses == ref_losses
    assert losses == _plain_losses("moe", steps=5)


@live
@pytest.mark.parametrize(("family", "budget", "native_pack"), [("moe", "3/4", True), ("moe", "1/2", False)])
def test_under_a_binding_budget_the_decisions_are_the_references_from_the_iteration_after_a_search(
        family, budget, native_pack):
    """Under a budget that binds, an iteration after one that searched for victims runs every decision
    point: its moves (evictions and prefetches, in order, at the same positions), decision points and
    rows scored are those of ``defer_idle=False``; training is PyTorch alone's bit for bit. Before the
    first search of an iteration after one without, the shipped policy defers and catches up."""
    ref = _PerIteration(backend="native", defer_idle=False)
    ref.native_pack = native_pack
    ref_losses, _ = _run(family, ref, budget, steps=4)
    pol = _PerIteration(backend="native")
    pol.native_pack = native_pack
    losses, _ = _run(family, pol, budget, steps=4)
    assert len(pol.iterations) == len(ref.iterations) >= 4
    after = [i for i in range(1, len(pol.iterations)) if pol.iterations[i - 1].get("searched")]
    assert any(pol.iterations[i]["moves"] for i in after)
    for i in after:
        assert pol.iterations[i]["moves"] == ref.iterations[i]["moves"], f"iteration {i}"
        assert pol.counts()[i] == ref.counts()[i], f"iteration {i}"
        assert pol.counts()[i][2] == 0  # nothing deferred
    assert pol.deferred_idle > 0 and pol.catch_ups >= 1 and ref.deferred_idle == ref.catch_ups == 0
    # an iteration that deferred and then searched caught up once, before its first victim, and deferred
    # nothing after it
    caught = 0
    for i, it in enumerate(pol.iterations):
        if "first_victim" in it and pol.counts()[i][2]:
            n, stale, deferred = it["first_victim"]
            assert n == 1 and not stale, f"iteration {i}"
            assert deferred == it["start"][2] + pol.counts()[i][2], f"iteration {i}"
            caught += 1
    assert caught >= 1
    assert losses == ref_losses == _plain_losses(family, steps=4)


class _CaughtUp(PilotPolicy):
    """At its first victim, the predictions and due times of every slot, the eviction heap's next
    entries, and the counters; with ``force``, a full rescoring is run first by hand (the reference of
    the catch-up on a policy that never defers)."""

    name = "pilot-caught-up"

    def __init__(self, force: bool = False, **kw: object) -> None:
        super().__init__(**kw)
        self.force = force
        self.first: dict[str, object] | None = None

    def victims(self, need_bytes: int, exclude: set[int]):  # noqa: ANN201
        if self.force and self.first is None:
            self._full_due = True
            self._decision(self._state.position)
        before = (self.decisions, self.catch_ups, self.candidates)
        first = self.first is None
        for sid in super().victims(need_bytes, exclude):
            if self.first is None:
                st = self._state
                live = st.active_slots()
                self.first = {"position": st.position, "before": before, "catch_ups": self.catch_ups,
                              "live": live.copy(), "pred": st.pred[live].copy(), "due": self._due[live].copy(),
                              "touched": st.touched[live].copy(), "skip": self._skip[live].copy(),
                              "offered": []}
            if first:
                self.first["offered"].append(sid)  # the first search's victims
            yield sid


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from dynn_runtime.trace import read_trace, record

    path = tmp_path_factory.mktemp("pilot-idle") / "moe.jsonl.gz"
    record("moe", path, steps=2, preset="tiny", seed=5)
    return read_trace(path)


@pytest.mark.parametrize("backend", ["native", "numpy"])
def test_the_first_victim_comes_after_a_full_rescoring(trace, backend):
    """The simulator (deterministic): at the first victim of the run the deferred decision points are
    caught up by one full rescoring, before the victim is yielded, and it leaves every live storage's
    prediction and due time as a full rescoring at that point leaves them in a policy that never
    deferred (the features do not depend on earlier decision points): the same first victims."""
    budget = int(unmanaged_peak(trace, 0) * 0.5)
    pol = _CaughtUp(backend=backend)
    Simulator(trace, pol, budget, iteration=0).run()  # no previous iteration: the policy's first
    ref = _CaughtUp(force=True, backend=backend, defer_idle=False)
    Simulator(trace, ref, budget, iteration=0).run()
    a, b = pol.first, ref.first
    assert a is not None and b is not None
    assert pol.deferred_idle > 0 and pol.catch_ups == 1
    assert a["before"][1] == 0 and a["catch_ups"] == 1  # caught up inside the search, before its first victim
    assert a["before"][0] == 0  # no decision point ran before it
    assert a["position"] == b["position"]
    np.testing.assert_array_equal(a["live"], b["live"])
    np.testing.assert_array_equal(a["pred"], b["pred"])
    scored = a["skip"] == 0  # small storages keep their provisional predictions in both
    np.testing.assert_array_equal(a["due"][scored], b["due"][scored])
    assert not a["touched"][scored].any()
    assert a["offered"] == b["offered"]


@pytest.mark.parametrize("frac", [0.5, 0.25])
def test_simulated_runs_defer_only_before_the_first_search(trace, frac):
    """A simulated iteration without a previous one is the policy's first: it defers only until its
    first victim search, and the run is deterministic. Its decisions after the catch-up follow fresher
    predictions than the reference's incremental ones, so they may differ: the result is held to the
    reference's within 1% of the iteration time and the bytes moved within 10% (measured on the zoo:
    docs/benchmarks.md, "the pilot's decision points deferred while nothing reads them")."""
    budget = int(unmanaged_peak(trace, 0) * frac)
    runs = []
    for defer in (True, True, False):
        pol = PilotPolicy(defer_idle=defer, worker=False)
        runs.append((pol, Simulator(trace, pol, budget, iteration=0).run()))
    (pol, res), (_, again), (ref, ref_res) = runs
    assert res.as_dict() == again.as_dict()
    assert res.feasible and ref_res.feasible
    assert pol.catch_ups == 1 and pol.deferred_idle > 0
    assert pol.decisions == ref.decisions - pol.deferred_idle + pol.catch_ups
    assert res.iter_time_s <= ref_res.iter_time_s * 1.01
    moved, ref_moved = res.bytes_offloaded + res.bytes_fetched, ref_res.bytes_offloaded + ref_res.bytes_fetched
    assert moved <= ref_moved * 1.1


def test_the_modes_that_read_every_decision_point_never_defer(trace):
    """The fallback's judge and the online refit read every decision point's rows: with them nothing is
    deferred, even above the peak (the simulator runs the policy only under a budget: half the peak)."""
    budget = int(unmanaged_peak(trace) * 0.5)
    for opts in ({"fallback": True}, {"online": True, "refit_background": False}):
        pol = PilotPolicy(**opts)
        Simulator(trace, pol, budget).run()
        assert pol.deferred_idle == 0 and pol.catch_ups == 0 and pol.decisions > 3, opts


@pytest.mark.parametrize("frac", [0.5, 0.25, 2.0])
def test_a_simulated_iteration_after_one_the_budget_bound_is_the_references(trace, frac):
    """The simulator's iteration stands for one of a run under the same budget: where the previous
    iteration's peak was over the budget, that iteration searched for victims, so nothing is deferred
    and the run is the reference's (``defer_idle=False``) exactly; above every peak the policy is not
    run at all."""
    budget = int(unmanaged_peak(trace, 0) * frac)
    pol, ref = PilotPolicy(worker=False), PilotPolicy(defer_idle=False, worker=False)
    res, ref_res = Simulator(trace, pol, budget).run(), Simulator(trace, ref, budget).run()
    assert res.as_dict() == ref_res.as_dict()
    assert pol.deferred_idle == 0 and pol.catch_ups == 0
    assert pol.decisions == ref.decisions and (pol.decisions > 0) == (frac < 1)


@pytest.mark.parametrize("frac", [2.0, 0.5])
def test_a_simulated_iteration_the_pilot_sits_out_is_not_charged_its_share(trace, frac):
    """The simulator charges the pilot's own per-operator cost (``HostCost.policy_per_op_s``) as the
    live runtime spends it: not in an iteration whose peak fits (the pilot sits it out), and in the
    first iteration under a budget for every operator, those before the first victim search at it;
    ``defer_idle=False`` pays it everywhere."""
    from dynn_runtime.sim.hostcost import HostCost

    hc = HostCost(per_op_s=10e-6, per_decision_s=3e-6, per_move_s=1e-6, policy_per_op_s=8e-6, source="model")
    budget = int(unmanaged_peak(trace, 0) * frac)
    for defer in (True, False):
        pol = PilotPolicy(defer_idle=defer, worker=False)
        res = Simulator(trace, pol, budget, iteration=0, host_cost=hc).run()
        full = hc.charge(res.ops, res.decision_points, res.moves)
        assert res.managed == (frac < 1)
        if defer and frac > 1:
            assert res.host_cost_s == pytest.approx(full - res.ops * hc.policy_per_op_s)
        else:
            assert res.decision_points > 0 or frac > 1
            assert res.host_cost_s == pytest.approx(full)
    # the share of the operators before the first search lands there, not before them: the host
    # clock is nowhere ahead of the flat charge's, so neither is the device (the pilot's own time
    # charged by a model, so that both runs decide alike)
    flat = HostCost(per_op_s=10e-6, per_decision_s=3e-6, per_move_s=1e-6, source="model")
    if frac < 1:
        a, b = (Simulator(trace, PilotPolicy(worker=False, host_cost=(0.0, 0.0, 0.0)), budget, iteration=0,
                          host_cost=c).run() for c in (hc, flat))
        assert a.host_cost_s == pytest.approx(b.host_cost_s) and a.iter_time_s <= b.iter_time_s
        assert (a.decision_points, a.moves) == (b.decision_points, b.moves)


def test_a_victim_the_runtime_refuses_is_not_left_away_in_the_pilots_books():
    """The parameters pinned (refused by the runtime for now, so still offered): by the time the
    search offers its next victim, a refused one is not marked away in the pilot's books (a feature
    of its model, and what decides whether it may sit a step out)."""
    import dynn_runtime as dr
    from dynn_runtime.workload import load_workload, make_optimizer, train_step

    wl = load_workload("moe", preset="tiny", seed=0)
    opt = make_optimizer(wl, wl.model.parameters())
    pol = PilotPolicy()
    mm = dr.MemoryManager(0.5, policy=pol, device="cpu")
    mm.attach(wl.model, opt)
    mm.pin(wl.model)
    refused: list[int] = []
    left_away: list[int] = []
    offered = [0]
    original = mm._evict

    def counting(s):
        slot = pol._state._slot
        left_away.extend(r for r in refused if r in slot and pol._away[slot[r]])
        refused.clear()
        ok = original(s)
        if not ok and s.sid in mm._pinned:
            refused.append(s.sid)
            offered[0] += 1
        return ok

    mm._evict = counting
    try:
        for step in range(4):
            with mm.step():
                train_step(wl, wl.model, opt, wl.make_batch(step))
    finally:
        mm.detach()
    assert mm.stats()["evictions"] > 0
    assert offered[0] > 0, "pinned parameters must have been offered and refused, or this checks nothing"
    assert not left_away
