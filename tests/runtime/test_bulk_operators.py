"""A policy that reads operators, told a batch in one Policy.on_operators call on the native source, gets
the events the per-operator path tells it, in the same order and with the same arguments."""

from __future__ import annotations

import gc

import pytest
import torch

import dynn_runtime as dr
from dynn_runtime.policies.base import OPERATOR, TOUCH_ALLOC, TOUCH_FREE, Policy
from dynn_runtime.runtime.events import native_module

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native event source is not built")


class _Told(Policy):
    """Records every notification; with ``bulk``, asks for batches and records what its view says of
    the storages a batch saw die (the runtime forgets them only after the call)."""

    name = "test-told"

    def __init__(self, bulk: bool) -> None:
        super().__init__()
        self.bulk = bulk
        self.told: list[tuple] = []
        self.batches = 0
        self.dead_sizes: list[int] = []
        self.dead_labels: list[tuple] = []  # a dead storage's sid, size, kind, saved flag, as the view says
        self.labels: list[tuple] = []  # the same of each operator's allocations and accesses
        self.recordless = 0  # deaths told of storages without a record during the call

    def operators_in_bulk(self) -> bool:
        return self.bulk

    def on_operators(self, events, phase):
        self.batches += 1
        view = self.view
        for ev in events:
            if ev[0] == TOUCH_FREE:
                self.dead_sizes.append(view.nbytes(ev[1]))
                self.dead_labels.append((ev[1], view.nbytes(ev[1]), view.kind(ev[1]), view.saved(ev[1])))
                self.recordless += ev[1] not in view.st
            elif ev[0] == OPERATOR:
                for sid in (*ev[2].allocs, *ev[3]):
                    self.labels.append((sid, view.nbytes(sid), view.kind(sid), view.saved(sid)))
        super().on_operators(events, phase)

    def on_alloc(self, sid, position):
        self.told.append(("alloc", sid, position))

    def on_free(self, sid):
        self.told.append(("free", sid))

    def on_operator(self, position, op, accessed):
        self.told.append(("op", position, op.name, op.phase, op.allocs, tuple(accessed)))

    def after_op(self, position):  # acts ahead: the runtime reads its log every 32 operators
        return []


def _run(policy: _Told, records_in_batch: bool = False, keep: list | None = None) -> list[tuple]:
    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    lin = torch.nn.Linear(16, 16)
    inp = torch.randn(4, 16)
    mm = dr.MemoryManager(1 << 40, policy=policy, device="cpu", events="native").attach(lin)
    mm.records_in_batch = records_in_batch
    if keep is not None:
        keep.append(mm)
    try:
        for _ in range(3):
            with mm.step():
                y = x
                for _ in range(20):
                    y = torch.relu(torch.mm(y * 0.5 + x, w))
                lin(inp * y.sum()).sum().backward()
                lin.zero_grad(set_to_none=True)
    finally:
        mm.detach()
    # storage ids as first told (two managers number their storages apart)
    ids: dict[int, int] = {}

    def norm(sids):
        return tuple(ids.setdefault(s, len(ids)) for s in sids)

    out = []
    for ev in policy.told:
        if ev[0] == "op":
            out.append((*ev[:4], norm(ev[4]), tuple(sorted(norm(ev[5])))))
        else:
            out.append((ev[0], *norm(ev[1:2]), *ev[2:]))
    return out


def test_a_batch_told_in_bulk_is_the_per_operator_calls():
    per_op, bulk = _Told(bulk=False), _Told(bulk=True)
    expected = _run(per_op)
    got = _run(bulk)
    assert per_op.batches == 0 and bulk.batches > 5
    assert sum(ev[0] == "op" for ev in got) > 200 and any(ev[0] == "free" for ev in got)
    assert got == expected
    assert bulk.dead_sizes and all(n > 0 for n in bulk.dead_sizes)


def test_the_default_on_operators_makes_the_calls_in_order():
    pol = _Told(bulk=True)
    op = type("Op", (), {"name": "aten::mul.Tensor", "phase": "forward", "allocs": (7,)})()
    Policy.on_operators(pol, [(TOUCH_ALLOC, 3, -1), (OPERATOR, 0, op, [3, 7]), (TOUCH_FREE, 3)], "forward")
    assert pol.told == [("alloc", 3, -1), ("op", 0, "aten::mul.Tensor", "forward", (7,), (3, 7)), ("free", 3)]


class _Labelled(_Told):
    """Reads saved flags, labels and modules: the runtime hooks saved tensors, labels gradients and
    tracks modules for it."""

    reads_saved = True
    reads_labels = True
    reads_modules = True

    def __init__(self, bulk: bool) -> None:
        super().__init__(bulk)
        self.tables: list[list[tuple]] = []  # per call, the records of the storages alive at the batch's end

    def on_operators(self, events, phase):
        gone = {ev[1] for ev in events if ev[0] == TOUCH_FREE}
        self.tables.append([(sid, s.kind, s.saved, s.nbytes, s.born_pos, s.last_access, s.count)
                            for sid, s in self.view.st.items() if sid not in gone])
        super().on_operators(events, phase)


def _numbered(mm, policy: _Told) -> tuple:
    """What a run leaves that storage records feed, with sids numbered as first told: the history's
    operators, frees and births before operators, the records left (kind, saved flag, size, birth
    position, last access, count, in table order), and what the view said of each storage told."""
    ids: dict[int, int] = {}

    def num(sid):
        return ids.setdefault(sid, len(ids))

    for ev in policy.told:  # the numbering of _run's
        for sid in (ev[1:2] if ev[0] != "op" else (*ev[4], *sorted(ev[5]))):
            num(sid)
    # (not the autograd node: its sequence numbers go on from run to run in one process)
    hist = [([(o.name, o.idiom, o.phase, o.module, *(tuple(map(num, x)) for x in (o.inputs, o.outputs, o.writes, o.allocs)))
              for o in it.ops],
             {k: [num(s) for s in v] for k, v in it.frees.items()},
             {k: [num(s) for s in v] for k, v in it.pre_allocs.items()}) for it in mm.history]
    table = [(num(sid), s.kind, s.saved, s.nbytes, s.born_pos, s.last_access, s.count) for sid, s in mm.st.items()]
    labels = [(num(sid), *rest) for sid, *rest in policy.labels]
    dead = [(num(sid), *rest) for sid, *rest in policy.dead_labels]
    tables = [[(num(sid), *rest) for sid, *rest in t] for t in policy.tables]
    return hist, table, labels, dead, tables, list(mm._timeline)


def test_a_batch_without_the_records_of_its_short_lived_storages_tells_what_the_records_would():
    """The bulk path makes no record for a storage born and dead in its batch: the policy is told
    the same events, its view answers the same sizes, kinds and saved flags during the call, and
    the history and the records left are the reference's (every birth recorded as it is read)."""
    ref_mm: list = []
    new_mm: list = []
    ref, new = _Labelled(bulk=True), _Labelled(bulk=True)
    expected = _run(ref, records_in_batch=True, keep=ref_mm)
    got = _run(new, keep=new_mm)
    assert got == expected
    assert ref.recordless == 0 and new.recordless > 50  # the path under test was taken
    assert any(kind == "activation" and saved for _, _, kind, saved in new.dead_labels)
    assert _numbered(new_mm[0], new) == _numbered(ref_mm[0], ref)
    assert not new_mm[0].recordless


class _Watched(_Labelled):
    """:class:`_Labelled` that also records, at each call, what the manager holds of its batch:
    the recordless table's entries (every field), the records' access fields (the time of the last
    access taken out: it is the clock's), the state the next batch starts from (position, phase,
    last operator's name, busy set, outputs), the positions' births, and the Op records' fields."""

    def __init__(self, bulk: bool) -> None:
        super().__init__(bulk)
        self.mm = None
        self.calls: list[tuple] = []

    def on_operators(self, events, phase):
        mm = self.mm
        ops = [ev[2] for ev in events if ev[0] == OPERATOR]
        self.calls.append((
            phase,
            [(sid, type(b), b.nbytes, b.kind, b.saved, b.fresh, b.pos, b.last_access, b.count, b.dead)
             for sid, b in mm.recordless.items()],
            [(sid, s.kind, s.saved, s.nbytes, s.last_access, s.count, s.pf, s.born_pos) for sid, s in mm.st.items()],
            (mm.position, mm.phase, mm._last_name, tuple(sorted(mm._last_busy)), tuple(mm._last_outs)),
            {k: list(v) for k, v in mm._pre.items()},
            ops,
            [ev if ev[0] != OPERATOR else (ev[0], ev[1], list(ev[3])) for ev in events],
            mm._cur.prefetch_hits,
        ))
        super().on_operators(events, phase)


def _train_watched(family: str, in_c: bool) -> tuple:
    """Three tiny steps of ``family`` under :class:`_Watched` with the batch read in C or by the
    Python loop: the losses, what it saw at each call, the history, the records and the timeline
    left, the number of calls."""
    from dynn_runtime.workload import load_workload, make_optimizer, train_step

    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    pol = _Watched(bulk=True)
    mm = dr.MemoryManager(1 << 40, policy=pol, device="cpu", events="native").attach(model, opt)
    mm.operators_in_c = in_c
    pol.mm = mm
    losses = []
    # the cyclic collector frees what it finds (the storages of a model's reference cycles) where
    # its thresholds fall, which the two parses' allocations move: off, every death is the program's
    gc.collect()
    gc.disable()
    try:
        for step in range(3):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(step)).item())
        assert mm.stats()["event_source"] == "native"
    finally:
        gc.enable()
        mm.detach()
    # Storage ids are the observer's own count from 1 and the log's order is the program's
    # (events.cpp, invariant 14), so two runs' ids and deaths are alike. Autograd nodes are numbered
    # as first met (their count is the process's).
    nodes: dict[int, int] = {-1: -1}

    def op_fields(o):
        return (type(o), len(vars(o)), o.name, o.idiom, o.phase, o.module, o.inputs, o.outputs, o.writes, o.allocs,
                o.duration_s, o.flops, o.nbytes, nodes.setdefault(o.node, len(nodes)))

    calls = [(phase, recordless, table, state, pre, [op_fields(o) for o in ops], events, hits)
             for phase, recordless, table, state, pre, ops, events, hits in pol.calls]
    history = [([op_fields(o) for o in it.ops], dict(it.frees), it.pre_allocs)
               for it in mm.history]
    table = [(sid, s.kind, s.saved, s.nbytes, s.born_pos, s.last_access, s.count) for sid, s in mm.st.items()]
    return losses, calls, (history, table, list(mm._timeline)), len(pol.calls)


@pytest.mark.parametrize("family", ["moe", "tree_lstm", "evoformer"])
def test_the_c_parse_of_a_batch_is_the_python_loop(family):
    """_C.parse_operators makes what NativeSource._native_operators's Python loop makes, on live
    training: the events told, the Op records field for field (ordinary Op instances), the records'
    access fields, the recordless table during the call, the state the next batch starts from, the
    history and the timeline."""
    ref = _train_watched(family, in_c=False)
    got = _train_watched(family, in_c=True)
    assert got[3] > 3 and any(call[1] for call in got[1])  # batches told, some with storages born and dead
    for k, (a, b) in enumerate(zip(got[1], ref[1], strict=True)):
        assert a == b, f"call {k}"
    assert got[2] == ref[2]
    assert got[0] == ref[0]


def test_a_corrupt_log_is_the_same_clear_error_in_c():
    """A batch with a word that starts no record: both parses raise the runtime's internal error,
    naming the tag and the word."""
    assert native_module().parse_operators is not None
    errors = []
    for in_c in (False, True):
        pol = _Told(bulk=True)
        keep: list = []
        mm = dr.MemoryManager(1 << 40, policy=pol, device="cpu", events="native")
        mm.operators_in_c = in_c
        keep.append(mm)
        x = torch.randn(4, 4)
        mm.attach(torch.nn.Linear(4, 4))
        try:
            with mm.step():
                torch.relu(x)
                with pytest.raises(AssertionError) as info:
                    mm._native_operators([2, 10**9, 64, 1, 9, 1])
                errors.append(str(info.value))
        finally:
            mm.detach()
    assert errors[0] == errors[1]
    assert "corrupt native event log (tag 9 at word 4)" in errors[1]


def _pilot_under_budget(family: str, in_c: bool) -> tuple:
    """Three tiny steps of ``family`` under the pilot at 3/4 of its peak, the batch read in C or by
    the Python loop: the losses, every move, the prefetches' hits per step, the calls that dropped
    host copies of written storages, and the history's operators."""
    from dynn_runtime.pilot.policy import PilotPolicy
    from dynn_runtime.workload import load_workload, make_optimizer, train_step

    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    pol = PilotPolicy(backend="native")
    moves: list[tuple] = []
    victims, after_op = pol.victims, pol.after_op

    def record_victims(need, exclude):
        for sid in victims(need, exclude):
            moves.append((pol.view.position, "evict", sid))
            yield sid

    def record_after_op(position):
        actions = after_op(position)
        moves.extend((position, a.kind, a.sid) for a in actions)
        return actions

    pol.victims, pol.after_op = record_victims, record_after_op
    mm = dr.MemoryManager("3/4", policy=pol, device="cpu", events="native").attach(model, opt)
    mm.operators_in_c = in_c
    dropped: list[tuple] = []
    drop = mm._drop_stale_hosts

    def record_drop(sids):
        before = sum(s.host is not None for s in mm.st.values())
        drop(sids)
        if sum(s.host is not None for s in mm.st.values()) != before:
            dropped.append((mm.position, tuple(sids)))

    mm._drop_stale_hosts = record_drop
    losses = []
    try:
        for step in range(3):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(step)).item())
        assert mm.stats()["event_source"] == "native"
    finally:
        mm.detach()
    ops = [[(o.name, o.phase, o.module, o.inputs, o.outputs, o.writes, o.allocs) for o in it.ops] for it in mm.history]
    return losses, moves, [s.prefetch_hits for s in mm.steps], dropped, ops


@pytest.mark.parametrize("family", ["evoformer", "moe"])
def test_the_c_parse_makes_the_pilots_moves_under_a_budget(family):
    """Under a budget the records' access fields and prefetch hits the C parse writes are what the
    pilot decides from: the same moves, hits, host copies dropped and losses as the Python loop."""
    ref = _pilot_under_budget(family, in_c=False)
    got = _pilot_under_budget(family, in_c=True)
    assert ref[1] and sum(ref[2]) > 0 and ref[3]  # moves made, prefetches used, host copies dropped
    assert got == ref


class _Stopping(_Told):
    """Asks for batches that stop for its ``after_op`` (every operator: the interface's default
    ``on_operators``) and records what its view says there: the position, phase and last operator,
    and whether every storage told dead is forgotten."""

    name = "test-stopping"

    def __init__(self, stops: bool) -> None:
        super().__init__(bulk=False)
        self.stops = stops
        self.afters: list[tuple] = []
        self.dead: set[int] = set()

    def stops_in_bulk(self) -> bool:
        return self.stops

    def on_operators(self, events, phase, after=None):
        self.batches += 1
        Policy.on_operators(self, events, phase, after)

    def on_free(self, sid):
        self.dead.add(sid)
        super().on_free(sid)

    def after_op(self, position):
        view = self.view
        self.afters.append((position, view.position, view.phase, view._last_name,
                            not any(sid in view.st for sid in self.dead)))
        return []


def test_a_batch_that_stops_for_after_op_shows_the_per_operator_view():
    """Told a batch in one call that stops for ``after_op`` (``stops_in_bulk``), a policy gets the
    per-operator path's notifications in the same order, and at each ``after_op`` its view shows
    what the per-operator loop shows there: that operator's position, phase and name, and every
    storage that died before it forgotten."""
    per_op, stopping = _Stopping(stops=False), _Stopping(stops=True)
    expected = _run(per_op)
    got = _run(stopping)
    assert per_op.batches == 0 and stopping.batches > 5
    assert sum(ev[0] == "op" for ev in got) > 200 and any(ev[0] == "free" for ev in got)
    assert got == expected
    assert len(stopping.afters) == sum(ev[0] == "op" for ev in got)
    assert stopping.afters == per_op.afters
    assert all(a[4] for a in stopping.afters)
