"""The loaded kernel library and the Python side of its calls (:class:`NativeKernel`)."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np

from . import abi
from .tables import ModelTable, NativeHeap, PolicyTable, StateTable

__all__ = ["NativeKernel"]

_V, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class NativeKernel:
    """The loaded library and the Python side of its calls."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.dynn_pilot_layout.argtypes = [_V, _I]
        lib.dynn_pilot_layout.restype = _I
        lib.dynn_pilot_features.argtypes = [_V, _V, _V, _V, _V]
        lib.dynn_pilot_features.restype = _I
        lib.dynn_pilot_gather.argtypes = [_V, _V, _V, _V, _V, _V]
        lib.dynn_pilot_gather.restype = _I
        lib.dynn_pilot_score.argtypes = [_V, _V, _I, _V, _V, _D, _V, _V, _V, _V]
        lib.dynn_pilot_score.restype = _I
        lib.dynn_pilot_decide.argtypes = [_V, _V, _V, _V]
        lib.dynn_pilot_decide.restype = _I
        lib.dynn_pilot_select.argtypes = [_V, _V, _I, _I, _V, _V, _V]
        lib.dynn_pilot_select.restype = _I
        lib.dynn_pilot_op.argtypes = [_V, _V]
        lib.dynn_pilot_op.restype = _I
        lib.dynn_pilot_alloc.argtypes = [_V, _V]
        lib.dynn_pilot_alloc.restype = _I
        lib.dynn_pilot_operator.argtypes = [_V, _V]
        lib.dynn_pilot_operator.restype = _I
        lib.dynn_pilot_operators.argtypes = [_V, _V]
        lib.dynn_pilot_operators.restype = _I
        lib.dynn_pilot_finish.argtypes = [_V, _V, _I, _V, _V, _V, _D, _D, _I, _V, _V]
        lib.dynn_pilot_finish.restype = _I
        lib.dynn_heap_new.argtypes = []
        lib.dynn_heap_new.restype = _V
        lib.dynn_heap_free.argtypes = [_V]
        lib.dynn_heap_free.restype = None
        lib.dynn_heap_len.argtypes = [_V]
        lib.dynn_heap_len.restype = _I
        lib.dynn_heap_push.argtypes = [_V, _V, _V, _V, _I]
        lib.dynn_heap_push.restype = _I
        lib.dynn_heap_pop.argtypes = [_V, _V, _V]
        lib.dynn_heap_pop.restype = _I
        lib.dynn_heap_compact.argtypes = [_V, _V, _V]
        lib.dynn_heap_compact.restype = _I
        lib.dynn_heap_dump.argtypes = [_V, _V, _V, _V]
        lib.dynn_heap_dump.restype = _I
        lib.dynn_pilot_merge.argtypes = [_V, _V, _V, _V, _V, _V, _I, _I, _V, _V, _V, _V, _V]
        lib.dynn_pilot_merge.restype = _I
        self.path = path
        self.lib = lib
        self._check_layout()
        self._features = lib.dynn_pilot_features
        self._gather = lib.dynn_pilot_gather
        self._score = lib.dynn_pilot_score
        self._decide = lib.dynn_pilot_decide
        self._select = lib.dynn_pilot_select
        self._op = lib.dynn_pilot_op
        self._alloc = lib.dynn_pilot_alloc
        #: PilotPolicy's fused operator (dynn_pilot_operator): called with the addresses of the
        #: state table and of a FusedTable's structure
        self.operator = lib.dynn_pilot_operator
        #: PilotPolicy.on_operators' run of records (dynn_pilot_operators): the state table's and a
        #: BatchTable's structure's addresses
        self.operators = lib.dynn_pilot_operators
        #: its address, for ``kernel/pack.c``'s ``operators`` (the call over a ``Run`` from C)
        self.operators_addr = ctypes.cast(lib.dynn_pilot_operators, ctypes.c_void_p).value
        self._n_rows = ctypes.c_int64(0)
        self._n_rows_addr = ctypes.addressof(self._n_rows)

    def __reduce__(self) -> Any:  # unpickled: this process's kernel (None when it has none)
        from . import kernel

        return (kernel, ())

    def _check_layout(self) -> None:
        """Refuse a library built from another header than :mod:`.abi` generates now."""
        want = abi.layout()
        out = np.zeros(max(128, 2 * len(want)), dtype=np.int64)
        n = self.lib.dynn_pilot_layout(out.ctypes.data, len(out))
        got = out[:n].tolist()
        if got != want:
            i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise RuntimeError(f"{self.path.name}: its layout differs from this dynn_runtime's at entry {i} "
                               f"({got[i] if i < len(got) else None} vs {want[i] if i < len(want) else None}): "
                               "built from other kernel sources or another pilot_kernel.h?")

    # ---- FeatureState ---------------------------------------------------------------------------
    @staticmethod
    def table(st: Any) -> StateTable:
        t = st._native_tab
        if t is None:
            t = st._native_tab = StateTable(st)
        return t

    def _settle(self, st: Any, t: StateTable, rc: int, call: Any) -> None:
        """Call again until the kernel has what it asked for: bigger tables (code -1), the pending
        externals' counterparts (code 1 + n, computed in Python: ``FeatureState._ext_rem``)."""
        rem = None
        while rc:
            if rc == -1:
                need = max(st.position, st._prev_len, st._cap, t.point.m) + 2
                if need <= t.ntab or st.position < 0:
                    raise RuntimeError(f"pilot native kernel: no decision point (position {st.position})")
                t.ensure(need)
            elif rc == -4:
                raise IndexError(f"pilot native kernel: a row is not a slot of this state (0..{st._cap - 1})")
            elif rc > 0 and rem is None:
                rem = np.ascontiguousarray(st._ext_rem(int(rc) - 1), dtype=np.int64)
                t.point.rem = rem.ctypes.data
                t.point.nrem = len(rem)
            else:
                raise RuntimeError(f"pilot native kernel failed (code {rc})")
            rc = call()
        t.point.rem = None
        t.point.nrem = -1

    def features(self, st: Any, idx: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``FeatureState.features`` (see there)."""
        from ..layout import CAND_FEATURES, CTX_FEATURES

        if st.position < 0:  # no operator yet this iteration: not a decision point; numpy handles it
            return st.features_numpy(idx)
        if idx is None:
            idx = st.active_slots()
            n_live = len(idx)
        else:
            n_live = -1  # counted by the kernel, as features_numpy does
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        m = len(idx)
        X = np.empty((m, len(CAND_FEATURES)), dtype=np.float32)
        ctx = np.empty(len(CTX_FEATURES), dtype=np.float32)
        sids = np.empty(m, dtype=np.int64)
        t = self.table(st)
        t.set_point(st, idx.ctypes.data, m, n_live)
        f, sa, pa, xa, ca, ia = self._features, t.addr, t.point_addr, X.ctypes.data, ctx.ctypes.data, sids.ctypes.data
        rc = f(sa, pa, xa, ca, ia)
        if rc:
            self._settle(st, t, rc, lambda: f(sa, pa, xa, ca, ia))
        return sids, X, ctx

    # ---- PilotModel -------------------------------------------------------------------------------
    @staticmethod
    def supports(model: Any) -> bool:
        """Whether the kernel takes this model's shape (the feature widths of this version, hidden
        width <= 256, <= 64 outputs); otherwise it is scored in numpy."""
        from ..layout import CAND_FEATURES, CTX_FEATURES

        a = model.arrays
        try:
            nf, h = a["W1c"].shape
            return (nf == len(CAND_FEATURES) and a["W1x"].shape == (len(CTX_FEATURES), h) and 0 < h <= abi.MAX_H
                    and a["W2"].shape == (h, h) and a["W3"].shape[0] == h
                    and 0 < -(-a["W3"].shape[1] // abi.LANES) * abi.LANES <= abi.MAX_K)
        except (KeyError, ValueError, AttributeError):
            return False

    def model_table(self, model: Any) -> ModelTable:
        t = model.__dict__.get("_native")
        if t is None or t.fold is not model._folded():
            t = model.__dict__["_native"] = ModelTable(model)
        return t

    def score(self, model: Any, X: np.ndarray, ctx: np.ndarray, logreps: np.ndarray,
              quantile: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``PilotModel.score`` (see there), and the most probable bucket of every row."""
        mt = self.model_table(model)
        X = np.ascontiguousarray(X, dtype=np.float32)
        ctx = np.ascontiguousarray(ctx, dtype=np.float32)
        logreps = np.ascontiguousarray(logreps, dtype=np.float64)
        m = len(X)
        P = np.empty((m, mt.k), dtype=np.float32)
        eld = np.empty(m, dtype=np.float64)
        kq = np.empty(m, dtype=np.int64)
        amax = np.empty(m, dtype=np.int64)
        rc = self._score(mt.addr, X.ctypes.data, m, ctx.ctypes.data, logreps.ctypes.data, float(quantile),
                         P.ctypes.data, eld.ctypes.data, kq.ctypes.data, amax.ctypes.data)
        if rc:
            raise RuntimeError(f"pilot native kernel: model shape not supported (code {rc})")
        return P, eld, kq, amax

    def alloc(self, st: Any, s: int, kind: int, saved: float, log_bytes: float, announce: int, position: int,
              prev: int) -> None:
        """``FeatureState.alloc``'s writes for slot ``s`` (see ``dynn_pilot_alloc``)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        a = t.alloc
        a.slot, a.kind, a.announce, a.position, a.phase, a.prev = s, kind, announce, position, st.phase, prev
        a.saved, a.log_bytes = saved, log_bytes
        if self._alloc(t.addr, t.alloc_addr):
            raise IndexError(f"pilot native kernel: slot {s} is not a slot of this state (0..{st._cap - 1})")

    def op(self, st: Any, position: int, phase: int, iv: Any, ivk: Any, alloc_slots: list[int],
           alloc_prev: list[int], acc_slots: list[int]) -> tuple[list[int], list[int]]:
        """``FeatureState.op``'s array update for one operator (see ``dynn_pilot_op``): ``iv`` and
        ``ivk`` are ``(array, address)`` pairs. Returns the replayed next use of every access (-1:
        none, or left to the caller) and the indices of the accesses that need
        ``FeatureState._match_external`` (their replay is the caller's, after the match)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        n = max(len(alloc_slots), len(acc_slots))
        if n > t.op_n:
            t.op_room(max(n, 2 * t.op_n))
        o, b = t.op, t.op_bufs
        o.position, o.phase = position, phase
        o.iv, o.ivk = iv[1], ivk[1]
        o.n_alloc = na = len(alloc_slots)
        if na:
            b[0][:na] = alloc_slots
            b[1][:na] = alloc_prev
        o.n_acc = nc = len(acc_slots)
        b[2][:nc] = acc_slots
        o.frontier, o.stack_counter = st._frontier, st._stack_counter
        rc = self._op(t.addr, t.op_addr)
        if rc:
            raise IndexError(f"pilot native kernel: a slot or counterpart is out of range (code {rc})")
        st._frontier, st._stack_counter = o.frontier, o.stack_counter
        nm = o.n_match
        return b[3][:nc], (b[4][:nm] if nm else ())

    # ---- PilotPolicy ------------------------------------------------------------------------------
    def select(self, st: Any, pt: PolicyTable, position: int, full: bool, skip_addr: int | None = None
               ) -> tuple[int, int]:
        """The live storages, and how many of them the policy scores now (their slots go to the
        state table's ``rows``): every one when ``full``, else those touched since scored or due
        (``pt.due``, as long as the state's arrays); none whose byte is set in the uint8 array at
        ``skip_addr`` (as long as the state's arrays; None: skip none)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        n_live = self._select(t.addr, pt.due_addr, position, full, skip_addr, t.rows_addr, self._n_rows_addr)
        return n_live, self._n_rows.value

    def gather(self, st: Any, rows_addr: int, m: int, n_live: int, X_addr: int, ctx_addr: int, sids_addr: int,
               slots_addr: int) -> None:
        """The worker hand-off's gather (``dynn_pilot_gather``): the feature rows of ``m`` slots (at
        ``rows_addr``) into ``X``, ``ctx``, ``sids`` (preallocated, at those addresses; ``features``
        without the allocations) under ``n_live`` live storages, the slots into ``slots``, and their
        touched flags cleared."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        t.set_point(st, rows_addr, m, n_live)
        f, sa, pa = self._gather, t.addr, t.point_addr
        rc = f(sa, pa, X_addr, ctx_addr, sids_addr, slots_addr)
        if rc:
            self._settle(st, t, rc, lambda: f(sa, pa, X_addr, ctx_addr, sids_addr, slots_addr))

    def finish(self, mt: ModelTable, X: np.ndarray, m: int, ctx: np.ndarray, logreps: np.ndarray,
               lower: np.ndarray, quantile: float, recheck: float, position: int, score: np.ndarray,
               due: np.ndarray) -> None:
        """``dynn_pilot_finish``: the network and the policy's arithmetic for ``m`` gathered rows,
        touching nothing but its arguments (the worker thread's call; the GIL is released)."""
        rc = self.lib.dynn_pilot_finish(mt.addr, X.ctypes.data, m, ctx.ctypes.data, logreps.ctypes.data,
                                        lower.ctypes.data, quantile, recheck, position, score.ctypes.data,
                                        due.ctypes.data)
        if rc:
            raise RuntimeError(f"pilot native kernel: model shape not supported (code {rc})")

    def new_heap(self) -> NativeHeap:
        return NativeHeap(self)

    def merge(self, st: Any, heap: NativeHeap, score_addr: int, due_in_addr: int | None, sids_addr: int,
              slots_addr: int, m: int, due_addr: int, away_addr: int, out_addrs: tuple[int, int]
              ) -> tuple[int, int]:
        """A decision point's ``m`` rows (scores, sids, slots at those addresses) into ``heap``
        (``dynn_pilot_merge``); ``due_in_addr`` not None: results back from the worker, so
        rows whose storage moved on are left out and the others' ``pred`` and ``due`` (float64 per
        slot, at ``due_addr``) are written. The rows whose byte in ``away`` (uint8 per slot, at
        ``away_addr``) is set go to ``out_addrs`` (int64 sids, float64 scores; room for ``m``).
        Returns (rows merged, away rows)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        n = self._n_rows
        na = self.lib.dynn_pilot_merge(t.addr, heap.h, score_addr, due_in_addr, sids_addr, slots_addr, m,
                                       due_in_addr is not None, due_addr, away_addr, out_addrs[0], out_addrs[1],
                                       self._n_rows_addr)
        if na < 0:
            raise MemoryError("pilot native: no memory for the eviction heap")
        return n.value, na

    def decide(self, st: Any, model: Any, pt: PolicyTable, rows_addr: int | None, m: int, n_live: int) -> None:
        """Score ``m`` rows (slots at ``rows_addr``; None: the state table's ``rows`` from
        :meth:`select`) under ``n_live`` live storages (-1: count them): predictions to the state's
        ``pred``, the policy's ``due`` and ``pt``'s outputs; ``touched`` cleared."""
        mt = model.__dict__.get("_native")
        if mt is None or mt.fold is not model.__dict__.get("_fold"):
            mt = self.model_table(model)
        t = st._native_tab
        if t is None:
            t = self.table(st)
        if pt.n < m:
            pt.grow(max(m, 2 * pt.n))
        t.set_point(st, t.rows_addr if rows_addr is None else rows_addr, m, n_live)
        f, sa, pa, ma, qa = self._decide, t.addr, t.point_addr, mt.addr, pt.addr
        rc = f(sa, pa, ma, qa)
        if rc:
            self._settle(st, t, rc, lambda: f(sa, pa, ma, qa))
