"""The C packing of a run's operator records (``pilot/kernel/pack.c``'s ``pack`` into its ``Run``)
against the Python packing it replaces (``PilotPolicy._pack_run_op`` into a ``_Run``): on the same
random operators, the same words, the same marks (told pairs, touched storages and their slots),
and the same slot map, free list and small-storage state afterwards; and the previous iteration's
index (``index_ops``) against ``ReplayState._index_ops_py``. (The walk over whole batches is
checked live in test_pilot_operator.py.)"""

from __future__ import annotations

import random

import pytest

from dynn_runtime.pilot import kernel as native
from dynn_runtime.pilot.features import _KIND_IDX
from dynn_runtime.pilot.policy import _TEMP, PilotPolicy, _Run
from dynn_runtime.policies.base import SmallStorages
from dynn_runtime.residency import Record, Residency

pytestmark = pytest.mark.skipif(native.packer() is None, reason="the C packing module (_pack) is not built")

_KINDS = ("param", "grad", "activation", "temp", "input", "opt_state", "buffer", "other")


class _State:
    """What the packing reads of FeatureState: the slot map, the free list, and growing it."""

    def __init__(self) -> None:
        self._slot: dict[int, int] = {}
        self._cap = 4
        self._free = list(range(self._cap - 1, -1, -1))

    def _grow(self, cap: int) -> None:
        self._free[:0] = range(cap - 1, self._cap - 1, -1)  # extends the same list, as FeatureState does
        self._cap = cap


class _View:
    """A view answering through its calls (the C packing calls them)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.sizes: dict[int, int] = {}
        self.kinds: dict[int, str] = {}
        self.saved_: dict[int, bool] = {}

    def born(self, sid: int) -> None:
        self.sizes[sid] = self.rng.choice((4, 64, 1 << 10, 1 << 16, 1 << 20))
        self.kinds[sid] = self.rng.choice(_KINDS)
        self.saved_[sid] = self.rng.random() < 0.3

    def nbytes(self, sid: int) -> int:
        return self.sizes[sid]

    def kind(self, sid: int) -> str:
        return self.kinds[sid]

    def saved(self, sid: int) -> bool:
        return self.saved_[sid]


class _RecordView(Residency):
    """The live runtime's kind of view: Residency's reads of a record table (the C packing reads the
    records), and of ``recordless`` for a storage without a record (one in four)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.st: dict[int, Record] = {}
        self.recordless: dict[int, Record] = {}

    def born(self, sid: int) -> None:
        table = self.recordless if self.rng.random() < 0.25 else self.st
        table[sid] = Record(sid, self.rng.choice((4, 64, 1 << 10, 1 << 16, 1 << 20)), self.rng.choice(_KINDS),
                            self.rng.random() < 0.3)


def _policy(view: _View, fraction: float) -> PilotPolicy:
    """A pilot with only what the packing reads (no model, no runtime)."""
    pol = PilotPolicy.__new__(PilotPolicy)
    pol._state = _State()
    pol.view = view
    pol.small_fraction = fraction
    pol._small = SmallStorages(fraction)
    return pol


def _context(pol: PilotPolicy) -> tuple:
    ctx = pol._pack_context()
    assert ctx[0] is pol._state._slot and ctx[1] is pol._state._free and ctx[6] is _KIND_IDX and ctx[7] == _TEMP
    return ctx


@pytest.mark.parametrize("fraction", [0.0, 0.05])
@pytest.mark.parametrize("view_cls", [_View, _RecordView])
def test_pack_writes_what_the_python_packing_writes(fraction, view_cls):
    """Random operators (allocations new and announced again, accesses with and without a slot, some
    storages freed between them, the slot map growing): after every one, the C packing and the Python
    packing have appended the same words and told pairs and left the same state; whether the C side
    calls the view or reads its record table."""
    rng = random.Random(7)
    view = view_cls(rng)
    py, c = _policy(view, fraction), _policy(view, fraction)
    pack = native.packer()
    py_ctx, c_ctx = _context(py), _context(c)
    assert (c_ctx[12] is view.st and c_ctx[16] is view.recordless) if view_cls is _RecordView else c_ctx[12] is None
    prev_idx = {sid: rng.randrange(50) for sid in range(0, 400, 3)}
    next_sid, live = 0, []
    grew = 0
    py_run, c_run = _Run(), native.pack_module().Run()
    for op in range(300):
        if op % 37 == 0:  # a new run now and then (the kernel took the last)
            py_run.clear()
            c_run.clear()
            assert len(c_run) == 0 and c_run.n_marks() == 0
        allocs = []
        for _ in range(rng.choice((0, 0, 1, 2, 3))):
            if live and rng.random() < 0.1:
                allocs.append(rng.choice(live))  # announced again: it keeps its slot
            else:
                view.born(next_sid)
                allocs.append(next_sid)
                live.append(next_sid)
                next_sid += 1
        prev_allocs = tuple(rng.randrange(400) for _ in range(rng.randrange(len(allocs) + 2)))
        accessed = rng.sample(live, min(len(live), rng.randrange(5))) + [10_000 + op]  # the last has no slot
        inputs = tuple(accessed[:2])
        outputs = tuple(allocs)
        writes = tuple(accessed[1:3])
        if op % 5 == 0:
            py_run += (2, op, 1)  # a death's record between operators
            c_run += (2, op, 1)
        outs = []
        for ctx, fn, run in ((py_ctx, py._pack_run_op, py_run), (c_ctx, pack, c_run)):
            outs.append(fn(run, ctx, prev_idx, 7 * op, op % 3, 1 << 40 | op, 1 << 41 | op, tuple(allocs), prev_allocs,
                           accessed, inputs, outputs, writes))
        assert outs[0] == outs[1], f"operator {op}"
        assert [int(x) for x in py_run] == c_run.words() == [c_run[i] for i in range(len(c_run))], f"operator {op}"
        n = py_run.n_marks()
        assert c_run.n_marks() == n and [py_run.mark(k) for k in range(n)] == [c_run.mark(k) for k in range(n)]
        end = py_run.mark(n - 1)[0]
        assert py_run.find(end, 0) == c_run.find(end, 0) == n - 1
        assert py._state._slot == c._state._slot and py._state._free == c._state._free, f"operator {op}"
        assert py._state._cap == c._state._cap
        for name in ("_bytes", "_small", "_live", "_peak"):
            assert getattr(py._small, name) == getattr(c._small, name), f"operator {op}: {name}"
        assert py_ctx[10] == c_ctx[10]  # the storage classes read
        for sid in rng.sample(live, min(len(live), rng.randrange(3))):  # deaths between operators
            live.remove(sid)
            for pol in (py, c):
                s = pol._state._slot.pop(sid, None)
                if s is not None:
                    pol._state._free.append(s)
                pol._small.free(sid)
        grew = max(grew, py._state._cap)
    assert grew > 4  # the free list ran out and grew


def test_pack_refuses_arguments_of_the_wrong_types():
    pack = native.packer()
    pol = _policy(_View(random.Random(0)), 0.0)
    ctx = _context(pol)
    run = native.pack_module().Run()
    with pytest.raises(TypeError, match="pilot pack"):
        pack([], ctx, {}, 0, 0, 0, 0, (), (), [], (), (), ())  # a list, not a Run
    with pytest.raises(TypeError, match="pilot pack"):
        pack(run, ctx[:-1], {}, 0, 0, 0, 0, (), (), [], (), (), ())
    with pytest.raises(TypeError, match="pilot pack"):
        pack(run, ctx, {}, 0, 0, 0, 0, 5, (), [], (), (), ())
    bad = list(ctx)
    bad[0] = []  # the slot map is not a dict
    with pytest.raises(TypeError, match="pilot pack"):
        pack(run, tuple(bad), {}, 0, 0, 0, 0, (), (), [], (), (), ())
    assert len(run) == 0 and run.n_marks() == 0  # nothing half-written stays


def test_the_c_run_keeps_words_and_marks_as_the_python_run():
    """``pack.c``'s ``Run``: words appended, overwritten and read back as a list's, int64 (bools as
    0 and 1), its words' address stable until it grows; bad indices and values are refused."""
    run = native.pack_module().Run()
    run += (1, -2, True, False, (1 << 63) - 1)
    run += [7]
    run[1] = -(1 << 63)
    assert run.words() == [1, -(1 << 63), 1, 0, (1 << 63) - 1, 7] and len(run) == 6 and run[5] == 7
    addr = run.addr
    assert addr and run.addr == addr
    with pytest.raises(IndexError, match="pilot Run"):
        run[6] = 0
    with pytest.raises(IndexError, match="pilot Run"):
        run.mark(0)
    with pytest.raises(IndexError, match="pilot Run"):
        run.find(3, 0)
    with pytest.raises(OverflowError):
        run += (1 << 64,)
    with pytest.raises(TypeError):
        run += ("x",)
    with pytest.raises(TypeError, match="pilot Run"):
        native.pack_module().Run(3)
    with pytest.raises(ValueError, match="pilot operators"):  # no kernel call through a null address
        native.pack_module().operators(0, 0, 0, run, object(), True)
    with pytest.raises(TypeError, match="pilot operators"):
        native.pack_module().operators(0, 0, 0, [], object(), True)


def test_index_ops_builds_what_the_python_index_builds():
    """The previous iteration's index (``pack.c``'s ``index_ops`` against ``ReplayState._index_ops_py``):
    on random operators (repeated names, modules and phases, storages read, written and allocated
    by several operators, large storage ids whose set order is not their numeric order) and extra
    accesses (new storages and ones the operators touched, out of order), the same dictionaries in
    the same insertion orders and the same flat lists; a bad extra access is refused."""
    from dynn_runtime.pilot.replay import ReplayState
    from dynn_runtime.trace.format import Op

    index = native.indexer()
    rng = random.Random(3)

    def pick(sids: list[int], k: int) -> tuple[int, ...]:
        return tuple(rng.choice(sids) for _ in range(rng.randrange(k)))

    for trial in range(20):
        sids = [rng.randrange(1 << 40) for _ in range(60)] + list(range(40))
        ops = []
        for _ in range(rng.randrange(0, 300)):
            ops.append(Op(rng.choice(("aten::mm", "aten::add.Tensor", "aten::relu")), (),
                          rng.choice(("forward", "backward", "optimizer")), rng.choice(("", "a", "a.b")),
                          pick(sids, 4), pick(sids, 3), pick(sids, 2), pick(sids, 3), 0.0, 0, 0))
        extra = [(rng.choice(sids + [1 << 50, 7 << 45]), rng.randrange(400)) for _ in range(rng.randrange(12))]
        want = ReplayState._index_ops_py(ops, extra)
        got = index(ops, extra)
        assert got == want, f"trial {trial}"
        for a, b in zip(got[:4], want[:4]):  # insertion orders too
            assert list(a) == list(b), f"trial {trial}"
        assert [type(x) for x in got[4]] == [type(x) for x in want[4]]
    with pytest.raises(TypeError, match="pilot index_ops"):
        index([], [(1, 2, 3)])
    assert index([], [[5, 2]]) == ReplayState._index_ops_py([], [[5, 2]])  # any pair, as Python unpacks it
    with pytest.raises(TypeError, match="pilot index_ops"):
        index(5, [])


def test_access_positions_flattens_what_the_python_mirror_flattens():
    """The mirror's flattened forward accesses (``pack.c``'s ``access_positions`` against
    ``MirrorState._access_positions`` in Python): the same storages in the same order, the same
    positions; a bad log entry is refused."""
    from dynn_runtime.pilot.features import FeatureState
    from dynn_runtime.trace.format import Op

    rng = random.Random(5)
    sids = [rng.randrange(1 << 40) for _ in range(50)] + list(range(30))
    log = []
    for p in range(400):
        pick = [tuple(rng.choice(sids) for _ in range(rng.randrange(k))) for k in (4, 3, 2)]
        log.append((3 * p, Op("aten::mm", (), "forward", "", *pick, (), 0.0, 0, 0)))
    state = FeatureState.__new__(FeatureState)
    got = {}
    for native_index in (True, False):
        state.native_index = native_index
        got[native_index] = state._access_positions(log)
    assert len(got[True][0]) > 400
    for a, b in zip(got[True], got[False]):
        assert a.dtype == b.dtype and a.tolist() == b.tolist()
    with pytest.raises(TypeError, match="pilot access_positions"):
        native.pack_module().access_positions([(1, 2, 3)])
