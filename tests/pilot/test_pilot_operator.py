"""The pilot's fused ``on_operator`` (what the live runtime's native source calls once per
operator) against the per-notification path it replaces: the same feature state, predictions,
heap entries and decisions on recorded workloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dynn_runtime as dr
from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.policies.base import OPERATOR, TOUCH_ALLOC, TOUCH_FREE, Policy
from dynn_runtime.runtime.events import native_module
from dynn_runtime.workload import load_workload, make_optimizer, train_step

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native event source is not built")

#: every per-slot array of the feature state, and the policy's own per-slot arrays
_STATE = ("active", "sid", "kind", "saved", "persistent", "log_bytes", "born", "born_phase", "last", "last_phase",
          "count", "count_phase", "count_phase_of", "acc_phase", "producer_iv", "has_producer", "consumer_iv",
          "stack_idx", "stack_pos", "announce", "prev", "mirror_tgt", "hint_at", "pred", "touched")
_POLICY = ("_due", "_skip", "_away")
#: the feature state's scalars and per-iteration tables that the decision points read
_SCALARS = ("position", "phase", "phase_start", "_hist_allocs", "_frontier", "_stack_counter", "_announced",
            "_last_decision", "_anchor", "_op_seen", "_fwd_freed", "_ext_next", "_mirror")


class _PerNotification(PilotPolicy):
    """The pilot told one notification at a time (the interface's default ``on_operator``)."""

    name = "pilot-per-notification"
    on_operator = Policy.on_operator


class _Lockstep(PilotPolicy):
    """The runtime's pilot (fused ``on_operator``) with a shadow told the same notifications one at
    a time; after every decision point and every fifth operator both must hold the same state."""

    name = "pilot-lockstep"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.shadow = _PerNotification(**kw)
        self.compared = 0
        # what the runtime tells outside on_operator goes to both; instance attributes, so that the
        # class's on_alloc stays the pilot's and its on_operator stays fused
        for name in ("on_alloc", "on_free", "on_hint", "on_label"):
            setattr(self, name, self._both(getattr(self, name), getattr(self.shadow, name)))

    @staticmethod
    def _both(mine: object, shadow: object) -> object:
        def call(*args: object) -> None:
            mine(*args)
            shadow(*args)
        return call

    def attach(self, view: object) -> None:
        super().attach(view)
        self.shadow.attach(view)

    def begin_iteration(self, index: int, context: object = None) -> None:
        super().begin_iteration(index, context)
        self.shadow.begin_iteration(index, context)

    def on_operator(self, position: int, op: object, accessed: object) -> None:
        assert self._fused  # the runtime's pilot takes the fused path
        # on the native kernel, in one kernel call per operator (dynn_pilot_operator)
        assert (self._fused_native is not None) == (self.backend == "native")
        decisions = self.decisions
        super().on_operator(position, op, accessed)
        self.shadow.on_operator(position, op, accessed)
        # every decision point, and every few operators between them (all of them: a slow test)
        if self.decisions != decisions or position % 5 == 0:
            assert_same(self, self.shadow, f"after operator {position} ({op.name})")
            self.compared += 1


class _BulkLockstep(PilotPolicy):
    """The runtime's pilot told in batches (``on_operators``), with a shadow told the same events one
    notification at a time, with the view's phase and position as the per-operator path gives them and
    its ``after_op`` asked after each operator (it must have nothing to do); after every batch both
    must hold the same state."""

    name = "pilot-bulk-lockstep"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.shadow = _PerNotification(**kw)
        self.compared = self.batches = self.bulk_ops = self.runs = 0
        self._in_batch = False
        for name in ("on_alloc", "on_free", "on_hint", "on_label"):  # outside a batch, both are told
            setattr(self, name, self._both(getattr(self, name), getattr(self.shadow, name)))

    def _both(self, mine: object, shadow: object) -> object:
        def call(*args: object) -> None:
            mine(*args)
            if not self._in_batch:
                shadow(*args)
        return call

    def attach(self, view: object) -> None:
        super().attach(view)
        self.shadow.attach(view)

    def begin_iteration(self, index: int, context: object = None) -> None:
        super().begin_iteration(index, context)
        self.shadow.begin_iteration(index, context)

    def _run_native(self, *args: object) -> None:
        self.runs += 1  # a run of records in one dynn_pilot_operators call
        super()._run_native(*args)

    def on_operators(self, events: object, phase: str) -> None:
        self._in_batch = True
        try:
            super().on_operators(events, phase)
        finally:
            self._in_batch = False
        view, shadow = self.view, self.shadow
        kept = view.phase, view.position
        try:
            view.phase = phase
            for ev in events:
                if ev[0] == OPERATOR:
                    _, j, op, accessed = ev
                    view.phase, view.position = op.phase, j
                    shadow.on_operator(j, op, accessed)
                    assert shadow.after_op(j) == [], f"after operator {j}: operators_in_bulk broke its promise"
                    self.bulk_ops += 1
                elif ev[0] == TOUCH_ALLOC:
                    shadow.on_alloc(ev[1], ev[2])
                else:
                    assert ev[0] == TOUCH_FREE
                    shadow.on_free(ev[1])
        finally:
            view.phase, view.position = kept
        self.batches += 1
        assert_same(self, shadow, f"after the batch ending at operator {view.position - 1}")
        self.compared += 1


def assert_same(a: PilotPolicy, b: PilotPolicy, where: str) -> None:
    sa, sb = a._state, b._state
    assert sa._slot == sb._slot, where
    assert sa._free == sb._free, where
    n = sa._cap
    for name in _STATE:
        np.testing.assert_array_equal(getattr(sa, name)[:n], getattr(sb, name)[:n], err_msg=f"{name}, {where}")
    for name in _POLICY:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"{name}, {where}")
    np.testing.assert_array_equal(sa._hist, sb._hist, err_msg=where)
    for name in _SCALARS:
        assert getattr(sa, name) == getattr(sb, name), f"{name}, {where}"
    assert [p for p, _ in sa._fwd_log] == [p for p, _ in sb._fwd_log], where
    assert sa.replayed == sb.replayed, where
    assert (a.decisions, a.candidates, a.ops) == (b.decisions, b.candidates, b.ops), where
    assert _entries(a._heap) == _entries(b._heap), f"eviction heap, {where}"
    assert sorted(a._off) == sorted(b._off), f"prefetch heap, {where}"
    assert a._small._small == b._small._small and a._small._peak == b._small._peak, where


def _entries(heap: object) -> list[tuple[float, int, int]]:
    if hasattr(heap, "entries"):
        return sorted(heap.entries())
    return sorted((k, sid, -1) for k, sid in heap.items)


def _run(family: str, policy: PilotPolicy, budget: object, steps: int = 3,
         records_in_batch: bool = False, stats: list | None = None,
         stops_in_c: bool = True) -> tuple[list[float], list]:
    """``steps`` steps of ``family`` (tiny) under the native source; the losses and every move made.
    ``records_in_batch``: the runtime records every storage a batch sees born (its reference path).
    ``stops_in_c`` off: a batch whose ``after_op`` calls may act is told one operator at a time (the
    runtime's reference loop).
    ``stats``: extended with the manager's per-step ``StepStats``."""
    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    moves: list[tuple[int, str, int]] = []
    victims, after_op = policy.victims, policy.after_op

    def record_victims(need: int, exclude: set[int]) -> object:
        for sid in victims(need, exclude):
            moves.append((policy.view.position, "evict", sid))
            yield sid

    def record_after_op(position: int) -> list:
        actions = after_op(position)
        moves.extend((position, a.kind, a.sid) for a in actions)
        return actions

    policy.victims, policy.after_op = record_victims, record_after_op
    mm = dr.MemoryManager(budget, policy=policy, device="cpu", events="native").attach(model, opt)
    mm.records_in_batch = records_in_batch
    mm.stops_in_c = stops_in_c
    losses = []
    try:
        for step in range(steps):
            with mm.step():
                loss = train_step(wl, model, opt, wl.make_batch(step))
            losses.append(loss.item())
        assert mm.stats()["event_source"] == "native"
        if stats is not None:
            stats.extend(mm.steps)
    finally:
        mm.detach()
    return losses, moves


def _plain_losses(family: str, steps: int = 3) -> list[float]:
    """``_run``'s losses under PyTorch alone."""
    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    return [train_step(wl, model, opt, wl.make_batch(step)).item() for step in range(steps)]


@pytest.mark.parametrize(("family", "backend"), [("tree_lstm", "native"), ("moe", "native"), ("moe", "numpy")])
def test_fused_operator_notification_keeps_the_per_notification_state(family, backend):
    """Throughout a live run (budget above the peak: the pilot still decides every 32 operators), the
    fused path and the per-notification path hold the same slots, feature arrays,
    predictions, due times, heap entries and small-storage classes."""
    pol = _Lockstep(backend=backend, defer_idle=False)  # every decision point runs (none is read here)
    _run(family, pol, 1 << 40)
    assert pol.compared > 50 and pol.decisions > 3


@pytest.mark.parametrize(("family", "backend"), [("tree_lstm", "native"), ("moe", "numpy")])
def test_operators_told_in_bulk_keep_the_per_notification_state(family, backend):
    """The runtime tells the pilot a batch in one ``on_operators`` call (nothing away): after every batch
    it holds the state of a pilot told each notification of the batch separately, and none of the
    ``after_op`` calls the batch skips would have acted."""
    pol = _BulkLockstep(backend=backend, defer_idle=False)
    _run(family, pol, 1 << 40)
    assert pol.batches > 10 and pol.bulk_ops > 200 and pol.decisions > 3
    # on the native kernel the runs of forward operators go to it in one call each (dynn_pilot_operators)
    assert (pol.runs > pol.batches) == (backend == "native")


def test_fused_operator_notification_keeps_the_state_where_the_optimizer_is_planned():
    """LayerDrop changes which parameters the optimizer updates, so from the second step the pilot
    re-plans the previous iteration's optimizer when the phase begins: the fused native path must
    re-index before it aligns that operator, as the per-notification path does."""
    from pathlib import Path

    spec = f"{Path(__file__).with_name('layerdrop_workload.py')}:build"
    pol = _Lockstep(backend="native", defer_idle=False)
    _run(spec, pol, 1 << 40, steps=5)
    assert pol.compared > 50 and pol.decisions > 3
    bulk = _BulkLockstep(backend="native", defer_idle=False)
    _run(spec, bulk, 1 << 40, steps=5)
    assert bulk.batches > 10 and bulk.decisions > 3 and bulk.runs > 10


@pytest.mark.parametrize("family", ["evoformer", "moe"])
def test_fused_operator_notification_makes_the_same_moves_under_a_budget(family):
    """Under a budget that makes the pilot evict and prefetch, the fused path (on the native kernel:
    one kernel call per operator) makes the same moves, in the same order, as the per-notification
    path, and training is bit for bit PyTorch alone's."""
    losses, moves = _run(family, _PerNotification(), "3/4")
    pilot = PilotPolicy()
    fused_losses, fused_moves = _run(family, pilot, "3/4")
    assert pilot._fused_native is not None or pilot.backend == "numpy"
    assert any(kind == "evict" for _, kind, _ in moves) and any(kind == "prefetch" for _, kind, _ in moves)
    assert fused_moves == moves
    assert fused_losses == losses == _plain_losses(family)


def test_a_subclass_that_overrides_a_notification_gets_every_call():
    """A subclass's own on_alloc and on_access are not skipped by the fused path."""

    class Counting(PilotPolicy):
        name = "pilot-counting"

        def __init__(self) -> None:
            super().__init__(defer_idle=False)  # above the peak: told every step
            self.allocs = self.accesses = 0

        def on_alloc(self, sid: int, position: int) -> None:
            self.allocs += position >= 0
            super().on_alloc(sid, position)

        def on_access(self, sid: int, position: int) -> None:
            self.accesses += 1
            super().on_access(sid, position)

    pol = Counting()
    _run("moe", pol, 1 << 40, steps=2)
    assert not pol._fused
    assert pol.allocs > 50 and pol.accesses > pol.allocs
    assert pol.ops > 50


class _KernelPerOperator(PilotPolicy):
    """The pilot told in bulk with one kernel call per operator (the path before dynn_pilot_operators)."""

    name = "pilot-kernel-per-operator"
    batch_kernel = False


@pytest.mark.parametrize(("family", "budget"), [("tree_lstm", "3/4"), ("evoformer", "3/4"), ("moe", "3/4"),
                                                ("moe", 1 << 40)])
def test_runs_in_one_kernel_call_make_the_same_decisions(family, budget):
    """The bulk path's runs of forward operators in one ``dynn_pilot_operators`` call make the same
    moves (evictions and prefetches, in order, at the same positions), the same decision points and
    rows scored as one kernel call per operator, and training is PyTorch alone's bit for bit (the
    state itself, batch by batch: test_operators_told_in_bulk_keep_the_per_notification_state).
    The heaps' stale entries are not compared: two runs of the same code differ there (storages
    freed by Python's collector)."""
    every = budget == 1 << 40  # above the peak, idle decision points would be deferred
    base = _KernelPerOperator(backend="native", defer_idle=not every)
    losses, moves = _run(family, base, budget)
    pilot = PilotPolicy(backend="native", defer_idle=not every)
    run_losses, run_moves = _run(family, pilot, budget)
    assert pilot.batch_kernel and pilot._batch is not None  # the runs went to the kernel
    assert base._batch is None
    if budget != 1 << 40:
        assert any(kind == "evict" for _, kind, _ in moves)
    assert run_moves == moves
    assert (pilot.decisions, pilot.candidates, pilot.ops) == (base.decisions, base.candidates, base.ops)
    assert run_losses == losses == _plain_losses(family)


def test_the_batch_call_refuses_a_malformed_run():
    """``dynn_pilot_operators`` stops at a record it cannot read (code -5) or a slot outside the
    state (code -4) instead of writing past the arrays, and the policy says which."""
    from dynn_runtime.pilot import kernel as native

    if not native.available():
        pytest.skip(native.reason())
    pol = PilotPolicy(backend="native", defer_idle=False)  # told the step: its batch state is built
    _run("moe", pol, 1 << 40, steps=1)
    kern, state = pol._kernel, pol._state
    t = kern.table(state)
    pol._fused_native.point(t, pol._away, pol._skip, pol._heap, state._cap)
    bt = pol._batch
    for words, code in (([7, 0, 0], -5), ([2, state._cap, 0], -4), ([1, 5, 0, 0, 0, 0, 0, 0, 0], -5),
                        ([1, 5, 0, 0, 0, 0, 1, 0, 0, 9], -5)):
        bt.words[: len(words)] = words
        bt.b.words, bt.b.n_words, bt.b.at = bt.words_addr, len(words), 0
        assert kern.operators(t.addr, bt.addr) == code, words
    from dynn_runtime.pilot.policy import _Run

    for run in (_Run(), *([native.pack_module().Run()] if native.pack_module() is not None else [])):
        run += (2, -1, 0)
        with pytest.raises(IndexError, match="out of range"):
            pol._run_native(run, [], 0)


class _WalkLockstep(_BulkLockstep):
    """:class:`_BulkLockstep` counting the events the C walk (``pilot/kernel/pack.c``) took."""

    name = "pilot-walk-lockstep"

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)
        self.walked = 0

    def _packing(self) -> tuple:
        run, pack, walk = super()._packing()
        if walk is None:
            return run, pack, None

        def counting(events: list, i: int, *args: object) -> tuple:
            out = walk(events, i, *args)
            self.walked += out[0] - i
            return out

        return run, pack, counting


@pytest.mark.parametrize("native_pack", [True, False])
def test_the_c_walk_keeps_the_per_notification_state(native_pack):
    """The bulk path with its common events walked in C (forward, optimizer and backward operators
    that neither move the mirror nor link, deaths) holds, after every batch, the state of a pilot told
    each notification separately; and so does the Python loop it replaces (``native_pack=False``)."""
    from dynn_runtime.pilot import kernel as native

    if native_pack and native.walker() is None:
        pytest.skip("the C packing module (_pack) is not built")
    pol = _WalkLockstep(backend="native", defer_idle=False)
    pol.native_pack = native_pack
    _run("tree_lstm", pol, 1 << 40)
    assert pol.batches > 10 and pol.bulk_ops > 200 and pol.decisions > 3 and pol.runs > pol.batches
    if native_pack:
        assert pol.walked > pol.bulk_ops // 2  # most events went through the walk
    else:
        assert pol.walked == 0


class _PythonPacking(PilotPolicy):
    """The pilot told in bulk with its runs packed by the Python loop (the path without ``_pack``)."""

    name = "pilot-python-packing"
    native_pack = False


@pytest.mark.parametrize(("family", "budget"), [("evoformer", "3/4"), ("moe", "3/4")])
def test_the_c_walk_makes_the_same_decisions(family, budget):
    """The C walk and packing make the same moves (evictions and prefetches, in order, at the same
    positions), decision points and rows scored as the Python loop, and training is PyTorch alone's."""
    from dynn_runtime.pilot import kernel as native

    if native.walker() is None:
        pytest.skip("the C packing module (_pack) is not built")
    base = _PythonPacking(backend="native")
    losses, moves = _run(family, base, budget)
    pilot = PilotPolicy(backend="native")
    walk_losses, walk_moves = _run(family, pilot, budget)
    assert any(kind == "evict" for _, kind, _ in moves)
    assert walk_moves == moves
    assert (pilot.decisions, pilot.candidates, pilot.ops) == (base.decisions, base.candidates, base.ops)
    assert walk_losses == losses == _plain_losses(family)


@pytest.mark.parametrize(("family", "budget"), [("tree_lstm", "3/4"), ("moe", "3/4")])
def test_batches_without_records_of_their_short_lived_storages_make_the_same_decisions(family, budget):
    """The runtime's bulk path without records for the storages born and dead in a batch makes the
    pilot take the same moves, decision points and rows scored as with every birth recorded, and
    training is PyTorch alone's."""
    base = PilotPolicy(backend="native")
    losses, moves = _run(family, base, budget, records_in_batch=True)
    pilot = PilotPolicy(backend="native")
    new_losses, new_moves = _run(family, pilot, budget)
    assert any(kind == "evict" for _, kind, _ in moves)
    assert new_moves == moves
    assert (pilot.decisions, pilot.candidates, pilot.ops) == (base.decisions, base.candidates, base.ops)
    assert new_losses == losses == _plain_losses(family)


class _Decisions(PilotPolicy):
    """The pilot with its decision points recorded (position, rows scored there), and the calls that
    told a batch in one call stopping for its ``after_op`` calls counted."""

    name = "pilot-decisions"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.points: list[tuple[int, int]] = []
        self.stopping_calls = self.after_ops = 0

    def _decision(self, position: int) -> None:
        before = self.candidates
        super()._decision(position)
        self.points.append((position, self.candidates - before))

    def on_operators(self, events, phase, after=None):
        self.stopping_calls += after is not None
        if after is None:
            return super().on_operators(events, phase)
        def counted(position, op):
            self.after_ops += 1
            after(position, op)
        return super().on_operators(events, phase, counted)


@pytest.mark.parametrize(("family", "budget", "backend"), [
    ("tree_lstm", "3/4", "native"), ("evoformer", "3/4", "native"), ("moe", "3/4", "native"), ("moe", "1/2", "native"),
    ("moe", "3/4", "numpy")])
def test_batches_that_stop_for_after_op_make_the_same_decisions(family, budget, backend):
    """Under a binding budget (something the pilot evicted is away, so its ``after_op`` calls may act),
    the runtime parses each batch in C and tells it in one ``on_operators`` call that stops for the
    ``after_op`` calls that may act: the same moves in the same order at the same positions, the
    same decision points scoring the same rows, and losses bit for bit PyTorch alone's, as the
    runtime's per-operator loop (``stops_in_c`` off). With the numpy backend the pilot's Python
    loop over the batch stops."""
    ref, new = _Decisions(backend=backend), _Decisions(backend=backend)
    ref_losses, ref_moves = _run(family, ref, budget, steps=4, stops_in_c=False)
    losses, moves = _run(family, new, budget, steps=4)
    assert ref.stopping_calls == 0 and new.stopping_calls > 20
    assert 0 < new.after_ops < new.ops // 2  # most operators' after_op is provably idle, and skipped
    assert any(kind == "prefetch" for _, kind, _ in moves) and any(kind == "evict" for _, kind, _ in moves)
    assert moves == ref_moves
    assert new.points == ref.points and len(new.points) > 20
    assert (new.decisions, new.candidates, new.ops) == (ref.decisions, ref.candidates, ref.ops)
    assert losses == ref_losses == _plain_losses(family, steps=4)


def test_the_stop_limit_is_the_first_operator_whose_after_op_may_act():
    """``_stop_limit`` against ``_after_op_acts`` tried at every position, over prefetch heaps
    whose head falls before, inside and after a batch (NaN and infinity included), and with
    no lookahead."""
    import heapq
    import math
    import random

    pol = PilotPolicy()
    pol._asleep = pol._job = None
    rng = random.Random(0)
    op_idx = [0, 2, 3, 6, 7, 9]  # the batch's operators at events 0, 2, ...: positions 40..45
    first, n = 40, 11
    heads = [None, math.inf, math.nan, 0.0, 39.5, 40.0, 71.0, 72.0, 72.5, 74.999, 77.0, 78.0, 200.0]
    heads += [rng.uniform(30, 90) for _ in range(40)]
    for lookahead in (32, 0, None):
        pol.lookahead = lookahead
        for head in heads:
            pol._off = [] if head is None else [(head, 1)]
            heapq.heapify(pol._off)
            for nxt in range(first, first + len(op_idx) + 1):
                want = next((op_idx[p - first] + 1 for p in range(nxt, first + len(op_idx))
                             if pol._after_op_acts(p)), n + 1)
                assert pol._stop_limit(nxt, first, op_idx, n) == want, (lookahead, head, nxt)
    pol.lookahead, pol._off = 32, [(1000.0, 1)]
    pol._job = object()  # a worker's decision point to poll: every operator
    assert pol._stop_limit(41, first, op_idx, n) == 3
