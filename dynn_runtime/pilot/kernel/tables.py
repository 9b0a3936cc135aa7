"""The kernel's view of Python objects: address tables of a FeatureState, a model and the policy.

Calls pass pointers, not arrays: a ``.ctypes.data`` costs about a microsecond per array, so a
:class:`~dynn_runtime.pilot.features.FeatureState`'s arrays are gathered once into a table of
addresses (rebuilt when the state reallocates them) and a model's folded weights likewise; the
per-call scalars go into a ctypes structure whose address is fixed. The structures' fields are
declared once, in :mod:`.abi`.
"""

from __future__ import annotations

import ctypes
import math
from array import array
from typing import TYPE_CHECKING, Any

import numpy as np

from .abi import (
    ALLOC,
    BATCH,
    FUSED,
    FUSED_ACCESS_WORDS,
    FUSED_ALLOC_WORDS,
    LANES,
    MODEL,
    OP,
    POINT,
    POLICY,
    STATE,
)

if TYPE_CHECKING:
    from .calls import NativeKernel

__all__ = ["StateTable", "ModelTable", "PolicyTable", "NativeHeap", "FusedTable", "BatchTable"]

# ---- tables the kernel's logarithms come from (filled by numpy, so both round alike) ----------------

_TABLES: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _tables(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = _TABLES.get(n)
    if t is None:
        i64 = np.arange(n, dtype=np.int64)
        f32 = np.arange(n, dtype=np.float32)
        # the expressions of FeatureState.features_numpy, on every integer argument: log1p of int64
        # (float64) / 8.0 stored as float32, and log1p of float32 counts / 4.0 and / 6.0 in float32
        l8 = (np.log1p(i64) / 8.0).astype(np.float32)
        l4 = np.log1p(f32) / 4.0
        l6 = np.log1p(f32) / 6.0
        t = _TABLES[n] = (l8, l4.astype(np.float32), l6.astype(np.float32))
    return t


def _table_size(need: int) -> int:
    n = 4096
    while n < need:
        n *= 2
    return n


_Point = POINT.ctypes()
_Policy = POLICY.ctypes()
_Op = OP.ctypes()
_Alloc = ALLOC.ctypes()
_Fused = FUSED.ctypes()
_Batch = BATCH.ctypes()
_W = STATE.index


def _none() -> None:
    return None


class StateTable:
    """A :class:`FeatureState`'s arrays as the kernel's address table (``dynn_state`` in
    ``_native.c``), its per-call structures (``dynn_point``, ``dynn_op``, ``dynn_alloc``) and a buffer of
    rows for the policy.
    Holds references to every array it points to. Rebuilt when the state reallocates
    (``FeatureState._grow``); a new previous iteration (``_index_previous``) and a new backward
    mirror (:mod:`..mirror`) replace only their own entries (:meth:`set_previous`, :meth:`set_mirror`)."""

    def __init__(self, st: Any) -> None:
        arrays = {
            "active": (st.active, np.bool_), "sid": (st.sid, np.int64), "kind": (st.kind, np.int64),
            "saved": (st.saved, np.float32), "persistent": (st.persistent, np.float32),
            "log_bytes": (st.log_bytes, np.float32), "born": (st.born, np.int64),
            "born_phase": (st.born_phase, np.int64), "last": (st.last, np.int64),
            "last_phase": (st.last_phase, np.int64), "count": (st.count, np.float32),
            "count_phase": (st.count_phase, np.float32), "count_phase_of": (st.count_phase_of, np.int64),
            "acc_phase": (st.acc_phase, np.float32), "producer_iv": (st.producer_iv, np.float32),
            "has_producer": (st.has_producer, np.float32), "consumer_iv": (st.consumer_iv, np.float32),
            "stack_idx": (st.stack_idx, np.int64), "stack_pos": (st.stack_pos, np.int64),
            "announce": (st.announce, np.int64), "prev": (st.prev, np.int64), "pred": (st.pred, np.float64),
            "touched": (st.touched, np.bool_), "hist": (st._hist, np.float32),
            "mirror_tgt": (st.mirror_tgt, np.int64), "hint_at": (st.hint_at, np.int64),
        }
        self.words = words = np.zeros(STATE.words, dtype=np.uint64)
        self._point_at(arrays)
        words[_W("cap")] = st._cap
        self.keep = list(arrays.values())
        self.addr = words.ctypes.data
        self.ntab = 0
        self.ratio = math.nan
        self.set_previous(st)
        self.set_mirror(st)
        self.point = _Point()
        self.point_addr = ctypes.addressof(self.point)
        self.rows = np.zeros(max(st._cap, 64), dtype=np.int64)
        self.rows_addr = self.rows.ctypes.data
        self.op = _Op()
        self.op_addr = ctypes.addressof(self.op)
        self.op.hist = st._hist.ctypes.data
        self.op.decay = st._hist_decay.ctypes.data
        self.alloc = _Alloc()
        self.alloc_addr = ctypes.addressof(self.alloc)
        self.keep.append((st._hist_decay, np.float32))
        self.op_room(64)

    def _point_at(self, arrays: dict[str, tuple[np.ndarray, Any]]) -> None:
        words = self.words
        for name, (a, dt) in arrays.items():
            if a.dtype != dt or not a.flags.c_contiguous:
                raise RuntimeError(f"pilot native: state array {name} is {a.dtype}, contiguous={a.flags.c_contiguous}")
            words[_W(name)] = a.ctypes.data

    def set_previous(self, st: Any) -> None:
        """The previous iteration's index (``FeatureState._index_previous``): its sorted keys
        (index * 2^32 + position) as per-index segments of positions, the backward/forward ratio."""
        keys = st._prev_keys
        pos = np.ascontiguousarray(keys & ((1 << 32) - 1), dtype=np.int64)
        off = np.zeros(len(st._prev_count) + 1, dtype=np.int64)
        np.cumsum(st._prev_count.astype(np.int64), out=off[1:])
        if off[-1] != len(keys):
            raise RuntimeError("pilot native: previous-iteration index inconsistent")
        self.keep_previous = {"prev_pos": (pos, np.int64), "prev_off": (off, np.int64),
                              "prev_count": (st._prev_count, np.float32)}
        self._point_at(self.keep_previous)
        words = self.words
        words[_W("nk")], words[_W("prev_len")] = len(keys), st._prev_len
        words[_W("n_prev")] = len(st._prev_count)
        ratio = float(st._ratio)
        if ratio != self.ratio:
            self.ratio = ratio
            dbl = words.view(np.float64)
            dbl[_W("ratio")] = ratio
            dbl[_W("log1p_ratio")] = float(np.float32(np.log1p(ratio)))  # ctx log_bwd_fwd_ratio, as float32
            n, self.ntab = self.ntab, 0  # the stack estimate's table depends on the ratio
            self.ensure(n)
        self.ensure(max(st._cap, st._prev_len, st.position) + 2)

    def set_mirror(self, st: Any) -> None:
        """The backward mirror's segments (:mod:`..mirror`)."""
        self.keep_mirror = {"mir_pos": (st._mir_pos, np.int64), "mir_off": (st._mir_off, np.int64),
                            "mir_sid": (st._mir_sid, np.int64)}
        self._point_at(self.keep_mirror)
        self.words[_W("n_mir")] = len(st._mir_sid)

    def op_room(self, n: int) -> None:
        """Buffers for an operator of up to ``n`` allocations and ``n`` accesses (:meth:`NativeKernel.op`)."""
        self.op_n = n
        # alloc slots, alloc prev, access slots, replay, match: ctypes arrays (a slice assignment from a
        # list costs a quarter of numpy's)
        self.op_bufs = [(ctypes.c_int64 * n)() for _ in range(5)]
        o, a = self.op, [ctypes.addressof(b) for b in self.op_bufs]
        o.alloc_slots, o.alloc_prev, o.acc_slots, o.replay, o.match = a

    def __reduce__(self) -> Any:  # addresses do not survive pickling: the state rebuilds its table
        return (_none, ())

    def ensure(self, need: int) -> None:
        """Tables of at least ``need`` entries (every integer argument of a logarithm is below it)."""
        if need <= self.ntab:
            return
        n = _table_size(need)
        l8, l4, l6 = _tables(n)
        # stack_est: np.log1p(span * ratio) / 8.0 with span a float64 integer, stored as float32
        lest = (np.log1p(np.arange(n, dtype=np.float64) * self.ratio) / 8.0).astype(np.float32)
        self.tabs = (l8, l4, l6, lest)
        for name, a in zip(("l8", "l4", "l6", "lest"), self.tabs):
            self.words[_W(name)] = a.ctypes.data
        self.words[_W("ntab")] = n
        self.ntab = n

    def set_point(self, st: Any, rows_addr: int, m: int, n_live: int) -> None:
        p = self.point
        p.pos = st.position
        p.phase = st.phase
        p.phase_start = st.phase_start
        p.frontier = st._frontier
        p.p_here, p.q = st._anchor
        p.stack_counter = st._stack_counter
        p.n_live = n_live
        p.hist_allocs = st._hist_allocs
        p.rows = rows_addr
        p.m = m
        p.nrem = -1
        p.mirror = st._mirror
        p.h_active = st._h_active
        if st._h_active:
            p.h_step, p.h_start, p.h_len = st._h_step, st._h_start, st._hint_len()


class FusedTable:
    """A :class:`~dynn_runtime.pilot.policy.PilotPolicy`'s side of ``dynn_pilot_operator``: the
    call's structure (``dynn_fused``, at a fixed address), its word buffer and result buffers, and
    the per-slot scratch. The policy points it at the arrays and the heap in use (:meth:`point`)
    only when they change."""

    def __init__(self) -> None:
        self.f = _Fused()
        self.addr = ctypes.addressof(self.f)
        self.state: Any = None  # the StateTable, arrays and heap pointed at now
        self.arrays: tuple[Any, ...] = ()
        self.heap: Any = None
        self.where = np.empty(0, dtype=np.int64)
        self.room(64)

    def room(self, n: int) -> None:
        """Buffers for an operator of up to ``n`` allocations, ``n`` told accesses and ``n`` accesses."""
        self.n = n
        self.words = (ctypes.c_int64 * ((FUSED_ALLOC_WORDS + FUSED_ACCESS_WORDS + 1) * n))()
        self.replay, self.match, self.need = ((ctypes.c_int64 * n)() for _ in range(3))
        f = self.f
        f.words, f.replay, f.match, f.need = (ctypes.addressof(b) for b in (self.words, self.replay, self.match,
                                                                              self.need))

    def point(self, t: StateTable, away: np.ndarray, skip: np.ndarray, heap: NativeHeap, cap: int) -> None:
        """Point the call at state table ``t``, the policy's ``away`` and ``skip`` (uint8 per slot)
        and its eviction heap; the scratch grows to ``cap`` slots."""
        f = self.f
        if t is not self.state:
            self.state = t
            f.hist, f.decay = t.op.hist, t.op.decay
        if not self.arrays or self.arrays[0] is not away or self.arrays[1] is not skip:
            if away.dtype != np.uint8 or skip.dtype != np.uint8:
                raise ValueError("pilot native: away and skip must be uint8 arrays")
            self.arrays = (away, skip)
            f.away, f.skip = away.ctypes.data, skip.ctypes.data
        if heap is not self.heap:
            self.heap = heap
            f.heap = heap.h
        if len(self.where) < cap:
            self.where = np.empty(max(cap, 2 * len(self.where)), dtype=np.int64)
            f.where = self.where.ctypes.data

    def __reduce__(self) -> Any:  # addresses do not survive pickling
        return (FusedTable, ())


class BatchTable:
    """A :class:`~dynn_runtime.pilot.policy.PilotPolicy`'s side of ``dynn_pilot_operators``: the
    call's structure (``dynn_batch``, at a fixed address) pointing at the policy's
    :class:`FusedTable` and prior table, the record buffer and the buffer of the dead storages'
    ``log_bytes``."""

    def __init__(self, fused: FusedTable, priors: np.ndarray) -> None:
        if priors.dtype != np.float64 or priors.ndim != 2 or not priors.flags.c_contiguous:
            raise ValueError("pilot native: the prior table must be a C-contiguous 2-d float64 array")
        self.b = _Batch()
        self.addr = ctypes.addressof(self.b)
        self.fused = fused
        self.priors = priors
        b = self.b
        b.fused = fused.addr
        b.priors = priors.ctypes.data
        b.n_rows, b.n_class = priors.shape
        self.n = 0
        self.words_addr = 0
        self.freed = np.empty(0, dtype=np.float64)
        self.room(1024, 256)

    def room(self, n_words: int, n_freed: int) -> None:
        """Buffers for ``n_words`` record words and ``n_freed`` reported deaths (grown, never shrunk).
        The policy points ``words`` at this buffer or at the C packing's run (``kernel/pack.c``'s
        ``Run``) before each call."""
        b = self.b
        if n_words > self.n:
            self.n = n = max(n_words, 2 * self.n)
            self.words = (ctypes.c_int64 * n)()
            self.words_addr = b.words = ctypes.addressof(self.words)
        if n_freed > len(self.freed):
            self.freed = np.empty(max(n_freed, 2 * len(self.freed)), dtype=np.float64)
            b.freed_lb = self.freed.ctypes.data

    def __reduce__(self) -> Any:  # addresses do not survive pickling
        return (_none, ())


class ModelTable:
    """A model's folded weights (``PilotModel._folded``) as the kernel's ``dynn_model``."""

    def __init__(self, model: Any) -> None:
        fold = model._folded()
        w1, _, wx, bx = fold
        a = model.arrays
        k = a["W3"].shape[1]
        kp = -(-k // LANES) * LANES  # the last layer's outputs zero-padded to whole vectors
        w3 = np.zeros((a["W3"].shape[0], kp), dtype=np.float32)
        w3[:, :k] = a["W3"]
        b3 = np.zeros(kp, dtype=np.float32)
        b3[:k] = a["b3"]
        arrays = [np.ascontiguousarray(x, dtype=np.float32) for x in (w1, wx, bx, a["W2"], a["b2"], w3, b3)]
        bounds = [np.ascontiguousarray(x, dtype=np.float32) for x in model.bounds()]
        words = np.zeros(MODEL.words, dtype=np.uint64)
        for name, x in zip(("w1", "wx", "bx", "w2", "b2", "w3", "b3"), arrays):
            words[MODEL.index(name)] = x.ctypes.data
        nf, h = arrays[0].shape
        for name, v in zip(("nf", "nc", "h", "k", "kp"), (nf, arrays[1].shape[0], h, k, kp)):
            words[MODEL.index(name)] = v
        for name, x in zip(("lo", "hi", "lo_ctx", "hi_ctx"), bounds):  # the input clamp
            words[MODEL.index(name)] = x.ctypes.data
        arrays += bounds
        self.fold = fold
        self.keep = arrays
        self.words = words
        self.addr = words.ctypes.data
        self.k = int(k)

    def __reduce__(self) -> Any:  # addresses do not survive pickling: the model rebuilds its table
        return (_none, ())


class PolicyTable:
    """A :class:`~dynn_runtime.pilot.policy.PilotPolicy`'s side of a decision (``dynn_policy``): the
    bucket representatives of this iteration, ``due``, and the output buffers (storage ids,
    predictions) that the policy's heaps take (``NativeKernel.merge``)."""

    def __init__(self, lower: np.ndarray, quantile: float, recheck: float) -> None:
        self.q = _Policy()
        self.addr = ctypes.addressof(self.q)
        self.lower = np.ascontiguousarray(lower, dtype=np.float64)
        self.q.lower = self.lower.ctypes.data
        self.q.quantile = float(quantile)
        self.q.recheck = float(recheck)
        self.logreps: np.ndarray | None = None
        self.due: np.ndarray | None = None
        self.due_addr = 0
        self._addrs: dict[str, tuple[np.ndarray, int]] = {}  # address_of()'s: not pickled (__reduce__)
        self.grow(256)

    def __reduce__(self) -> Any:  # rebuilt with fresh addresses
        return (_policy_table, (self.lower, self.q.quantile, self.q.recheck, self.logreps, self.due))

    def grow(self, n: int) -> None:
        self.sids_out = np.zeros(n, dtype=np.int64)
        self.score_out = np.zeros(n, dtype=np.float64)
        self.sids_addr = self.q.sids_out = self.sids_out.ctypes.data
        self.score_addr = self.q.score_out = self.score_out.ctypes.data
        self.n = n

    def address_of(self, slot: str, a: np.ndarray) -> int:
        """The data address of the policy's array ``a``, kept per ``slot`` while ``a`` is the array
        last given for it (a ``.ctypes.data`` costs one to three microseconds per call; the policy's arrays
        change only when they grow). The entry holds ``a``, so its address cannot be reused by
        another array meanwhile."""
        hit = self._addrs.get(slot)
        if hit is None or hit[0] is not a:
            hit = self._addrs[slot] = (a, a.ctypes.data)
        return hit[1]

    def set_logreps(self, logreps: np.ndarray) -> None:
        if logreps is not self.logreps:
            self.logreps = np.ascontiguousarray(logreps, dtype=np.float64)
            self.q.logreps = self.logreps.ctypes.data

    def set_due(self, due: np.ndarray) -> None:
        if due is not self.due:
            if due.dtype != np.float64 or not due.flags.c_contiguous:
                raise ValueError("pilot native: due must be a contiguous float64 array")
            self.due = due
            self.due_addr = self.q.due = due.ctypes.data


def _policy_table(lower: np.ndarray, quantile: float, recheck: float, logreps: np.ndarray | None,
                  due: np.ndarray | None) -> PolicyTable:
    t = PolicyTable(lower, quantile, recheck)
    if logreps is not None:
        t.set_logreps(logreps)
    if due is not None:
        t.set_due(due)
    return t


class NativeHeap:
    """:class:`~dynn_runtime.pilot.policy.PilotPolicy`'s eviction heap (``NextUsePolicy._res``) in
    the kernel (``dynn_heap``): entries ``(key, sid)`` popped in the order heapq pops the same
    tuples, each with its storage's slot so that a pop skips stale entries in C (the slot no longer
    holds that storage, or the key is not its current prediction ``-pred[slot]``). Pushes from
    Python are staged in arrays and enter the heap in one call before the next pop, ``len`` or
    compaction; a decision point's rows enter from the kernel (:meth:`NativeKernel.merge`)."""

    def __init__(self, kern: NativeKernel) -> None:
        self._lib = kern.lib
        h = kern.lib.dynn_heap_new()
        if not h:
            raise MemoryError("pilot native: no memory for the eviction heap")
        self.h = h
        self._keys, self._sids, self._slots = array("d"), array("q"), array("q")
        self._out = (ctypes.c_int64 * 3)()
        self._out_addr = ctypes.addressof(self._out)
        self._key = ctypes.c_double.from_buffer(self._out)

    def __del__(self) -> None:
        h, self.h = getattr(self, "h", None), None
        if h:
            self._lib.dynn_heap_free(h)

    def __reduce__(self) -> Any:  # the entries survive pickling; the heap is rebuilt in this process
        return (_heap_from, (self.entries(),))

    def push(self, key: float, sid: int, slot: int) -> None:
        self._keys.append(key)
        self._sids.append(sid)
        self._slots.append(slot)

    def _flush(self) -> None:
        n = len(self._keys)
        if n:
            if self._lib.dynn_heap_push(self.h, self._keys.buffer_info()[0], self._sids.buffer_info()[0],
                                        self._slots.buffer_info()[0], n):
                raise MemoryError("pilot native: no memory for the eviction heap")
            del self._keys[:], self._sids[:], self._slots[:]

    def __len__(self) -> int:
        if self._keys:
            self._flush()
        return self._lib.dynn_heap_len(self.h)

    def pop(self, state_addr: int) -> tuple[float, int, int] | None:
        """The least entry that is not stale against the state at ``state_addr``, or None."""
        if self._keys:
            self._flush()
        if not self._lib.dynn_heap_pop(self.h, state_addr, self._out_addr):
            return None
        return self._key.value, self._out[1], self._out[2]

    def compact(self, state_addr: int, n_slots: int) -> None:
        """Keep the entries that match their storage's prediction, once each."""
        if self._keys:
            self._flush()
        mark = np.empty(max(n_slots, 1), dtype=np.int64)
        self._lib.dynn_heap_compact(self.h, state_addr, mark.ctypes.data)

    def entries(self) -> list[tuple[float, int, int]]:
        """Every entry (key, sid, slot), in heap order (tests, pickling)."""
        n = len(self)
        keys, sids, slots = np.empty(n), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        self._lib.dynn_heap_dump(self.h, keys.ctypes.data, sids.ctypes.data, slots.ctypes.data)
        return list(zip(keys.tolist(), sids.tolist(), slots.tolist()))


def _heap_from(entries: list[tuple[float, int, int]]) -> NativeHeap:
    from . import kernel, reason

    k = kernel()
    if k is None:
        raise RuntimeError(f"pilot native: unpickling an eviction heap needs the native kernel ({reason()})")
    h = NativeHeap(k)
    for e in entries:
        h.push(*e)
    return h


