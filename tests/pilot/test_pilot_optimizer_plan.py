"""The optimizer phase, planned by parameter: an optimizer updates the parameters that have a
gradient, in one fixed order, so when which parameters have one changes from step to step
(LayerDrop, skipped blocks, unused experts) the previous iteration's optimizer, replayed operator
by operator, is shifted; the plan (:class:`~dynn_runtime.pilot.replay.OptimizerMemory`) keeps the
blocks of the parameters used in this step, in their order, each from its latest update.

Checked on a recorded network whose layers are skipped per step (``layerdrop_workload.py``): the
plan is the optimizer that runs, and the features' replayed distances in the optimizer are the
true next uses (they are shifted without the plan)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest

from dynn_runtime.pilot import kernel as native
from dynn_runtime.pilot.features import CAND_FEATURES, FeatureState
from dynn_runtime.pilot.replay import OptimizerMemory, plan_scores
from dynn_runtime.pilot.training import data
from dynn_runtime.trace import read_trace, record

C = {n: i for i, n in enumerate(CAND_FEATURES)}
BACKENDS = ["numpy"] + (["native"] if native.available() else [])
WORKLOAD = f"{Path(__file__).resolve().parent / 'layerdrop_workload.py'}:build"
#: from this step on every layer has run in an earlier step (layerdrop_workload.PLAN)
SEEN_ALL = 3
#: the steps in which a layer runs for the first time (layers 2 and 4)
FIRST_RUN = (1, 2)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("ld") / "ld.jsonl.gz"
    record(WORKLOAD, path, steps=7)
    return read_trace(path)


def _accessed(op):
    return {*op.inputs, *op.outputs, *op.writes}


def _optimizer(it):
    start = next(j for j, op in enumerate(it.ops) if op.phase == "optimizer")
    return start, it.ops[start:]


def test_the_plan_is_the_optimizer_that_runs(trace):
    its = trace.iterations
    shifted = 0
    for i in range(1, len(its)):
        it, prev = its[i], its[i - 1]
        start, ops = _optimizer(it)
        before = set().union(*(_accessed(op) for op in it.ops[:start]))
        memory = OptimizerMemory()
        memory.ingest(its[:i])
        # a layer that runs for the first time: its parameters' state is created and updated too
        fresh = sorted(sid for sid in before if trace.storages[sid].kind == "param"
                       and sid not in memory.params and sid not in set().union(*map(_accessed, prev.ops)))
        assert bool(fresh) == (i in FIRST_RUN)
        plan = memory.plan(prev, before.__contains__, fresh, rank=lambda sid: sid,
                           size=lambda sid: trace.storages[sid].nbytes)
        assert plan is not None
        prev_start, planned, _ = plan
        assert prev_start == _optimizer(prev)[0]
        # storages alive at the start that an earlier step used (not the step counters that a
        # first update makes without an operator: those the plan cannot name)
        alive = set(it.live_at_start(trace)) & set().union(*(_accessed(op) for j in range(i) for op in its[j].ops))
        # the same operators, touching the same parameters and optimizer state in the same order
        assert [op.name for op in planned] == [op.name for op in ops]
        assert [_accessed(op) & alive for op in planned] == [_accessed(op) & alive for op in ops]
        _, prev_ops = _optimizer(prev)
        shifted += [_accessed(op) & alive for op in prev_ops] != [_accessed(op) & alive for op in ops]
    assert shifted  # the previous iteration's optimizer alone would not have been right


def test_no_plan_where_the_rule_does_not_hold(trace):
    """An optimizer that also updated a parameter the step did not use (gradients kept as zeros,
    say) breaks "the parameters used before the optimizer are those it updates": no plan."""
    its = trace.iterations
    memory = OptimizerMemory()
    memory.ingest(its[:SEEN_ALL])
    assert memory.ok
    it = its[SEEN_ALL]
    start, _ = _optimizer(it)
    used = set().union(*(_accessed(op) for op in it.ops[:start]))
    unused = [k for k in memory.order if not k & used]
    assert unused  # some layer is skipped in this step
    forged = dataclasses.replace(it, ops=[*it.ops, *memory.blocks[unused[0]]])
    assert memory.plan(its[SEEN_ALL - 1], used.__contains__) is not None
    memory.ingest([forged])
    assert not memory.ok
    assert memory.plan(forged, used.__contains__) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_distances_in_the_optimizer_are_the_true_ones(trace, backend, monkeypatch):
    monkeypatch.setattr(data, "FeatureState", functools.partial(FeatureState, backend=backend))
    its = trace.iterations
    checked = 0
    for i in range(SEEN_ALL + 1, len(its)):
        alive = set(its[i].live_at_start(trace))
        for d in data.walk(trace, i, group=16, baselines=False):
            if its[i].ops[d.position].phase != "optimizer":
                continue
            for sid, x, true in zip(d.sids.tolist(), d.X, d.dist):
                # parameters, optimizer state, and the gradients (of layers the previous step skipped too)
                if (sid in alive or trace.storages[sid].kind == "grad") and true <= 64:
                    assert x[C["prev_used_again"]] == 1.0
                    assert np.expm1(x[C["log_prev_dist"]] * 8.0) == pytest.approx(true, abs=1e-3)
                    checked += 1
    assert checked > 100


def test_the_live_runtime_plans_the_optimizer(monkeypatch):
    """Live, the history the runtime records (a profiler mark after the optimizer included) gives
    a plan from the second step on, and training stays PyTorch's own."""
    from dynn_runtime.runtime.train import train_managed, train_unmanaged

    plans = []
    plan = OptimizerMemory.plan

    def spy(self, *args):
        out = plan(self, *args)
        plans.append(out is not None)
        return out

    monkeypatch.setattr(OptimizerMemory, "plan", spy)
    ref = train_unmanaged(WORKLOAD, steps=5)
    r = train_managed(WORKLOAD, max(ref.peak_bytes) // 2, "pilot", steps=5)
    assert r.losses == ref.losses and r.digest == ref.digest
    assert plans == [True] * 4


def test_a_parameter_the_previous_step_skipped_replays_its_latest_use(trace):
    """A layer the previous step skipped and this one runs: its parameters are their own
    counterparts, with the accesses of the latest step that used them placed among the previous
    step's operators, so from the start of the step they are expected again (without it they have
    no counterpart, or the batch's)."""
    its = trace.iterations
    checked = 0
    for i in range(SEEN_ALL + 1, len(its)):
        used_prev = set().union(*(_accessed(op) for op in its[i - 1].ops))
        n_fwd = sum(op.phase == "forward" for op in its[i - 1].ops)
        d = next(data.walk(trace, i, group=16, baselines=False))
        assert d.position == 0
        for sid, x, true in zip(d.sids.tolist(), d.X, d.dist):
            if trace.storages[sid].kind == "param" and sid not in used_prev and np.isfinite(true):
                assert x[C["matched"]] == 1.0 and x[C["prev_used_again"]] == 1.0
                # again in the previous step's forward, where the layer would have run
                assert np.expm1(x[C["log_prev_dist"]] * 8.0) < n_fwd
                checked += 1
    assert checked >= 4


def test_a_first_time_parameter_is_expected_in_the_optimizer(trace):
    """A layer that runs for the first time: in the optimizer its parameters' planned update is
    their next access, by occurrence too (after its k accesses so far, a (k+1)-th)."""
    its = trace.iterations
    checked = 0
    for i in FIRST_RUN:
        seen = set().union(*(_accessed(op) for j in range(i) for op in its[j].ops))
        for d in data.walk(trace, i, group=16, baselines=False):
            if its[i].ops[d.position].phase != "optimizer":
                continue
            for sid, x, true in zip(d.sids.tolist(), d.X, d.dist):
                if trace.storages[sid].kind == "param" and sid not in seen and true <= 64:
                    assert x[C["prev_used_again"]] == 1.0 and x[C["occ_has_next"]] == 1.0
                    assert np.expm1(x[C["log_prev_dist"]] * 8.0) == pytest.approx(true, abs=1e-3)
                    checked += 1
    assert checked >= 4


def _next_uses(it, position):
    """Per storage, its next access after ``position`` in iteration ``it``."""
    out = {}
    for j in range(len(it.ops) - 1, position, -1):
        for sid in _accessed(it.ops[j]):
            out[sid] = j
    return out


def test_the_evaluation_ranks_a_planned_optimizer_by_the_plan(trace, monkeypatch):
    """In a planned optimizer a candidate with a replayed next use is ranked at it (the true one),
    where the model, which never saw a re-planned optimizer, ranks worse: the pilot's window recall
    is higher than the model's own ranking, and equal to it outside the planned optimizers."""
    from dynn_runtime.pilot.config import cached_model, default_weights_path
    from dynn_runtime.pilot.training import evaluate as ev

    model = cached_model(default_weights_path())
    checked = 0
    for d in data.walk(trace, SEEN_ALL + 1, group=model.config.group, baselines=False):
        assert d.planned == (trace.iterations[SEEN_ALL + 1].ops[d.position].phase == "optimizer")
        if not d.planned:
            continue
        score = model.expected_log_distance(model.probs(d.X, d.ctx), d.expected_len)
        planned = plan_scores(d.X, score)
        for x, true, s in zip(d.X, d.dist, planned):
            if x[C["prev_used_again"]] and true <= 64:
                assert np.exp(s) == pytest.approx(true)
                checked += 1
    assert checked > 50
    with_plan = ev.evaluate(model, [trace])["all"].methods["pilot"]["window_recall"]
    monkeypatch.setattr(ev, "plan_scores", lambda X, score: score)
    assert with_plan > ev.evaluate(model, [trace])["all"].methods["pilot"]["window_recall"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_policy_predicts_a_planned_optimizer_from_the_plan(trace, backend):
    """At a decision point in a planned optimizer the policy's predicted next use of a storage the
    plan replays is its true next use, on either backend."""
    from dynn_runtime.pilot.policy import PilotPolicy
    from dynn_runtime.sim import simulate

    it = trace.iterations[-1]
    checked = []

    class Spy(PilotPolicy):
        def _score(self, rows, position, n_live):
            super()._score(rows, position, n_live)
            state = self._state
            if not state.in_plan():
                return
            nxt = _next_uses(it, position)
            for s in rows.tolist():
                sid = state.sid.item(s)
                true = nxt.get(sid)
                if true is not None and true - position <= 64 and sid in alive:
                    assert self.predict(sid) == pytest.approx(true)
                    checked.append(sid)

    alive = set(it.live_at_start(trace))
    policy = Spy(backend=backend)
    assert simulate(trace, policy, 0.5).feasible
    assert len(checked) > 20
