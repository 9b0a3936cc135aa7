"""What the pilot model sees: generic, per-candidate features built from the policy notifications.

One class, :class:`FeatureState`, is fed the same notifications a :class:`~dynn_runtime.policies.Policy`
receives (``begin_iteration``, ``on_alloc``, ``on_free``, ``on_op``) and, at a decision point,
returns one feature row per live storage (the *candidates*) and one context row shared by all of
them. The policy (:mod:`.policy`) and the training-data walk (:mod:`.data`) both drive this class,
so what the model is trained on is exactly what it sees when it runs.

Rules it keeps (why each is there):

1. Nothing reads the current iteration's future. Inputs are the operators that already ran (their
   idiom vectors, phase, module path, the storages they touched), sizes and kinds from the
   :class:`~dynn_runtime.policies.MemoryView`, and *earlier* iterations (``context["history"]``).
2. Nothing is specific to a zoo family: no operator names, module names or storage ids appear as
   features. Operator names and module paths are only used to *align* this iteration with the
   previous one (rule 4), never as inputs.
3. Storage ids are opaque ints; per-storage state lives in numpy arrays indexed by a slot that is
   recycled when the storage is freed, so the state stays as large as the live set, and a decision
   point is a handful of vectorised numpy operations over it (no Python loop over candidates), or
   one call of the native kernel (:mod:`.native`), which reads the same arrays and returns the same
   rows bit for bit.
4. History alignment ("anchored replay"): every operator is keyed by (name, module, phase,
   occurrence of that triple so far in the iteration) and matched to the previous iteration's
   operator with the same key. The last matched operator *anchors* the current position to a
   position in the previous iteration; a candidate's counterpart there (itself for persistent
   storages, the storage that the matched producer allocated in the same output slot for fresh
   ones) then says when it was next used after the anchor. Unlike positional replay this survives
   shifted and re-ordered operator sequences (variable lengths, skipped blocks, different experts);
   the model learns how far to trust it from the other features. Occurrences count per phase: the
   optimizer's operators are the same every step, and counted from the start of the iteration they
   were shifted by how often forward and backward ran the same operator (evoformer's recycling
   passes run a different number of times per step); with the phase in the key, held-out window
   recall on evoformer rose from 94.9% to 97.4%. Matching instead the same key's operator nearest
   to where the last match extrapolates was tried: higher recall (tree_lstm 82.8% against 80.3%),
   but 8-10% slower simulated iterations on evoformer `small` at 1/2 and 1/4 and 80.5% recall on
   early_exit left out of training, so it was not kept.
5. Backward consumes saved tensors roughly in reverse production order: each saved storage (not a
   parameter, buffer or optimizer state) produced in forward (for the batch: last used in forward)
   and not yet read in backward has a *stack depth* (how many such storages came after it) and a
   *stack span*: the forward operators between its push and the forward position that backward has
   reached (the push position of the storage it read last from the stack; in forward, now), times
   the previous iteration's backward/forward operator ratio, as an estimate of its distance in
   backward operators; one pushed after that position and still unread is *overdue*.
6. Storages alive at the start that are new to the iteration (the batch) are matched, at their first
   access, to the previous iteration's storages that no operator allocated (in first-access order).
   Before their first access they get, tentatively, the counterpart they will be matched to if they
   are first accessed in the order they were announced (``ext_by_order``).
7. Estimated distances (anchored replay, occurrence gap, stack span) also enter as cumulative
   indicators "<= t operators" at the bucket and window edges, so that the network can draw sharp
   boundaries where an exact replay is right.
8. After every operator, :attr:`FeatureState.replayed` holds, for each storage it accessed whose
   counterpart's next access after the same occurrence exists in the previous iteration, that next
   access replayed from now (the occurrence gap of rule 4 as a position). The policy predicts with
   it between decision points (rule 9 of :mod:`.policy`); it is not a model input.
9. Backward *mirrors* forward, operator by operator: every operator carries its autograd node
   (:attr:`~dynn_runtime.trace.format.Op.node`: in forward the node it created, in backward the node
   that ran it), so a backward operator names the forward operator whose gradient it computes, and
   the forward position backward has reached (the *mirror*) is known exactly. A storage that forward
   accessed is next used in backward when the mirror passes its latest forward access below the
   mirror (the backward of the operator that read it); a storage backward allocates is taken for the
   gradient of the mirrored forward operator's input of the nearest size at least its own, and is
   accumulated into when the mirror passes that input's forward accesses, then consumed at the
   first. A gradient that the backward of its target's producer passes on unchanged (``add``,
   ``index_add``'s ``self``) then follows that producer's input of the nearest size at least its
   own, the first on ties (on the held-out tree_lstm traces the shipped model's backward misses fell
   from 530 to 487 before retraining). Its distance in forward operators (times the backward/forward operator ratio, as for the
   stack) enters with cumulative indicators. Trace-agnostic: any autograd workload has nodes. On
   the held-out tree_lstm traces (whose backward follows each batch's trees, which no earlier
   iteration predicts) a tree_lstm-only model's window recall rose from 85.0% to 92.1%.
10. The workload may say what it knows of its own near future (:mod:`dynn_runtime.hints`), in its
   own steps (a tree level, a layer, a recycling pass): ``step()`` marks a step's start and
   ``next_use(tensors, steps=k)`` says they are read again k steps on (``None``: not again in this
   pass). A hinted storage gets the steps to its hinted step and their estimate in operators (the
   pass's mean operators per completed step, else the previous pass's, minus those already run in
   the current step), with cumulative indicators, and whether a storage hinted for the current step
   has already been read in it (the read the hint announced may be over: tree_lstm held out 94.7%
   -> 95.9%); the context row says whether this iteration has
   hints at all, so the network can tell "no hint" from "hints, but none for this storage". A hint
   holds through its step (a storage read several times in it stays due), and at most until the
   phase ends; the workload re-hints a storage after its use. The
   features are generic (any loop can mark steps) and absent for workloads that give no hints.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._log import logger
from ..trace.format import KINDS, PHASES
from .layout import (
    BUCKET_EDGES,
    CAND_FEATURES,
    COARSE_NAMES,
    COARSE_OF_FINE,
    CTX_FEATURES,
    HINT_MAX,
    N_COARSE,
    N_FINE,
    THRESH,
    fine_bucket,
)

__all__ = [
    "CAND_FEATURES",
    "CTX_FEATURES",
    "FeatureState",
    "BUCKET_EDGES",
    "COARSE_OF_FINE",
    "COARSE_NAMES",
    "N_FINE",
    "N_COARSE",
    "fine_bucket",
    "PERSISTENT_KINDS",
]

PERSISTENT_KINDS = frozenset({"param", "buffer", "opt_state"})
_KIND_IDX = {k: i for i, k in enumerate(KINDS)}
_PHASE_IDX = {p: i for i, p in enumerate(PHASES)}

_C = {n: i for i, n in enumerate(CAND_FEATURES)}
_THRESH_ARR = np.asarray(THRESH, dtype=np.float64)
_X = {n: i for i, n in enumerate(CTX_FEATURES)}
_BIG = 1 << 32
#: rule 9: how many producers down a pass-through gradient is followed at once
_PASS_DEPTH = 8
_IV_CACHE: dict[tuple[int, ...], np.ndarray] = {}
_IVK_CACHE: dict[tuple[Any, ...], np.ndarray] = {}
#: per (idiom, decays): ((iv, its address), (the histories' increment, its address)), for the kernel
_NATIVE_IV: dict[tuple[Any, ...], tuple[tuple[np.ndarray, int], tuple[np.ndarray, int]]] = {}


class FeatureState:
    """Per-storage and per-stream state of one run; see the module docstring for the rules.

    ``view`` must answer ``nbytes``, ``kind`` and ``saved`` for a storage when it is announced.
    ``group``: decision points fall every ``group`` operators and at every phase change.
    ``backend``: how :meth:`features` computes the rows: ``"native"`` (the C kernel,
    :mod:`.native`), ``"numpy"`` (:meth:`features_numpy`, the reference), or None: native when it is
    available. Both give the same rows bit for bit.
    """

    def __init__(self, view: Any, group: int = 16, decays: tuple[float, float] = (0.5, 0.9),
                 backend: str | None = None) -> None:
        from . import kernel as native

        self.view = view
        self.group = int(group)
        self.decays = decays
        self.backend = native.resolve(backend)
        self._kernel = native.kernel() if self.backend == "native" else None
        self._native_tab = None
        # the idiom histories, fast (6) then slow (6), updated in place (the native kernel reads them)
        self._hist = np.zeros(12, dtype=np.float32)
        self._hist_fast = self._hist[:6]
        self._hist_slow = self._hist[6:]
        self._set_decays()
        self._cap = 0
        self._slot: dict[int, int] = {}
        self._free: list[int] = []
        self._grow(1024)
        self._stack_counter = 0
        self._announced = 0
        self._warned_nodes = False
        self._h_prev_len = 0  # rule 10: operators per step of the previous pass that had steps
        self._h_step = self._h_start = 0
        self._h_first = -1
        self._ratio = 1.5
        self._prev_ops: dict[tuple[str, str, str, int], int] = {}
        self._prev_len = 0
        self._prev_idx: dict[int, int] = {}
        self._prev_keys = np.zeros(0, dtype=np.int64)
        self._prev_count = np.zeros(0, dtype=np.float32)
        self._prev_allocs: dict[int, tuple[int, ...]] = {}
        self._prev_lists: list[list[int]] = []
        #: rule 8: after :meth:`op`, the storages it accessed whose counterpart in the previous
        #: iteration was accessed again after the same occurrence: sid -> that next use replayed here
        self.replayed: dict[int, int] = {}
        self.begin_iteration(0, [])

    def _set_decays(self) -> None:
        f, sl = self._hist_decays = self.decays
        self._hist_decay = np.asarray([f] * 6 + [sl] * 6, dtype=np.float32)
        self._native_tab = None  # the kernel's table points at the decays
        self._hist_keep = np.asarray([1 - f] * 6 + [1 - sl] * 6, dtype=np.float32)

    # ---- storage slots ------------------------------------------------------------------------
    def _grow(self, cap: int) -> None:
        old = self._cap
        def ext(a: np.ndarray | None, fill: float, dtype: Any, width: int = 0) -> np.ndarray:
            shape = (cap,) if not width else (cap, width)
            new = np.full(shape, fill, dtype=dtype)
            if a is not None and old:
                new[:old] = a
            return new
        g = getattr
        self.active = ext(g(self, "active", None), False, bool)
        self.sid = ext(g(self, "sid", None), -1, np.int64)
        self.kind = ext(g(self, "kind", None), 0, np.int64)
        self.saved = ext(g(self, "saved", None), 0, np.float32)
        self.persistent = ext(g(self, "persistent", None), 0, np.float32)
        self.log_bytes = ext(g(self, "log_bytes", None), 0, np.float32)
        self.born = ext(g(self, "born", None), -1, np.int64)
        self.born_phase = ext(g(self, "born_phase", None), -1, np.int64)
        self.last = ext(g(self, "last", None), -1, np.int64)
        self.last_phase = ext(g(self, "last_phase", None), -1, np.int64)
        self.count = ext(g(self, "count", None), 0, np.float32)
        self.count_phase = ext(g(self, "count_phase", None), 0, np.float32)
        self.count_phase_of = ext(g(self, "count_phase_of", None), -1, np.int64)
        self.acc_phase = ext(g(self, "acc_phase", None), 0, np.float32, 3)
        self.producer_iv = ext(g(self, "producer_iv", None), 0, np.float32, 6)
        self.has_producer = ext(g(self, "has_producer", None), 0, np.float32)
        self.consumer_iv = ext(g(self, "consumer_iv", None), 0, np.float32, 6)
        self.stack_idx = ext(g(self, "stack_idx", None), -1, np.int64)
        self.stack_pos = ext(g(self, "stack_pos", None), -1, np.int64)
        self.announce = ext(g(self, "announce", None), -1, np.int64)
        self.prev = ext(g(self, "prev", None), -1, np.int64)
        # rule 9: the forward storage (index into this iteration's mirror segments) it follows
        self.mirror_tgt = ext(g(self, "mirror_tgt", None), -1, np.int64)
        # rule 10: the workload's step it said the storage is next read in; -2: not again this pass
        self.hint_at = ext(g(self, "hint_at", None), -1, np.int64)
        # owned by the policy: the predicted next-use position of the last scoring (the policy's cache
        # holds the current prediction, provisional ones included), and "moved since the last decision"
        self.pred = ext(g(self, "pred", None), np.inf, np.float64)
        self.touched = ext(g(self, "touched", None), True, bool)
        self._free.extend(range(cap - 1, old - 1, -1))
        self._cap = cap
        self._native_tab = None  # the arrays moved: the native kernel's address table is stale

    def slot_of(self, sid: int) -> int | None:
        return self._slot.get(sid)

    def _new_slot(self, sid: int) -> int:
        if not self._free:
            self._grow(self._cap * 2)
        s = self._free.pop()
        self._slot[sid] = s
        self.active[s] = True
        self.sid[s] = sid
        self.pred[s] = np.inf
        self.touched[s] = True
        return s

    # ---- notifications ------------------------------------------------------------------------
    def begin_iteration(self, index: int, history: Sequence[Any] | None) -> None:
        """A new iteration: reset per-iteration counters, index the previous iteration (if any)."""
        self.position = -1
        self.phase = 0
        self.phase_start = 0
        self._op_seen: dict[tuple[str, str, str], int] = {}
        self._anchor = (-1, -1)  # (position here, matched position in the previous iteration)
        self._last_decision = -1
        self._hist[:] = 0
        self._hist_allocs = 0.0
        self._stack_counter = 0
        self._frontier = -1
        n = self._cap
        self.last[:n] = -1
        self.last_phase[:n] = -1
        self.count[:n] = 0
        self.count_phase[:n] = 0
        self.count_phase_of[:n] = -1
        self.acc_phase[:n] = 0
        self.stack_idx[:n] = -1
        self.stack_pos[:n] = -1
        self.born[:n] = -1
        self.born_phase[:n] = -1
        self.prev[:n] = -1
        self.mirror_tgt[:n] = -1
        self._reset_mirror()
        self._reset_hints(n)
        self._h_active = False
        self._index_previous(history[-1] if history else None)
        for sid, s in self._slot.items():
            self.persistent[s] = 1.0
            self.prev[s] = self._prev_idx.get(sid, -1)

    def _index_previous(self, prev: Any) -> None:
        self._prev_ops = {}
        self._prev_allocs = {}
        self._prev_idx = {}
        self._prev_len = 0
        self._prev_external: list[int] = []
        self._ext_next = 0
        self._ratio = 1.5
        self._prev_lists = []
        self._native_tab = None  # new previous-iteration index and ratio
        if prev is None:
            self._prev_keys = np.zeros(0, dtype=np.int64)
            self._prev_count = np.zeros(0, dtype=np.float32)
            return
        seen: dict[tuple[str, str, str], int] = {}
        acc: dict[int, list[int]] = {}
        n_fwd = sum(1 for op in prev.ops if op.phase == "forward")
        n_bwd = sum(1 for op in prev.ops if op.phase == "backward")
        self._ratio = n_bwd / n_fwd if n_fwd and n_bwd else 1.5
        for j, op in enumerate(prev.ops):
            k = (op.name, op.module, op.phase)
            c = seen.get(k, 0)
            seen[k] = c + 1
            self._prev_ops[(*k, c)] = j
            if op.allocs:
                self._prev_allocs[j] = op.allocs
            for sid in {*op.inputs, *op.outputs, *op.writes}:
                lst = acc.get(sid)
                if lst is None:
                    acc[sid] = [j]
                else:
                    lst.append(j)
        self._prev_len = len(prev.ops)
        born = {sid for op in prev.ops for sid in op.allocs}
        self._prev_external = [sid for sid in acc if sid not in born]  # dict order: first access
        keys: list[int] = []
        self._prev_lists = list(acc.values())
        counts = np.zeros(len(acc), dtype=np.float32)
        for i, (sid, lst) in enumerate(acc.items()):
            self._prev_idx[sid] = i
            base = i * _BIG
            keys.extend(base + j for j in lst)
            counts[i] = len(lst)
        self._prev_keys = np.asarray(keys, dtype=np.int64)  # already sorted: by index, then position
        self._prev_count = counts

    # ---- rule 10: workload hints ---------------------------------------------------------------
    def _reset_hints(self, n: int) -> None:
        """Rule 10: hints hold for the pass they were given in; a new phase starts without any."""
        done = self._h_steps_len()
        if done > 0:
            self._h_prev_len = done
        self.hint_at[:n] = -1
        self._h_live = False  # some storage holds a hint
        self._h_step = 0  # the workload's steps started in this pass
        self._h_first = -1  # position of the first step's first operator
        self._h_start = 0  # position of the current step's first operator

    def _h_steps_len(self) -> int:
        """Operators per workload step, measured over this pass's completed steps (0: fewer than one)."""
        if self._h_step >= 2:
            return (self._h_start - self._h_first) // (self._h_step - 1)
        return 0

    def _hint_len(self) -> int:
        """Operators per step to convert hinted steps into operators: this pass's mean, else the
        previous pass's, else the current step's length so far."""
        n = self._h_steps_len()
        if n > 0:
            return n
        if self._h_prev_len > 0:
            return self._h_prev_len
        return max(self.position + 1 - self._h_start, 1)

    def hint(self, hint: Any) -> None:
        """``on_hint``: a :class:`~dynn_runtime.hints.Hint` from the workload, before the next operator."""
        self._h_active = True
        if hint.kind == "step":
            start = self.position + 1
            if self._h_step == 0:
                self._h_first = start
            self._h_step += 1
            self._h_start = start
            if self._h_live:  # a hint holds through its step: those for the step that ended expire
                at = self.hint_at[: self._cap]
                over = np.flatnonzero((at >= 0) & (at < self._h_step))
                at[over] = -1
                self.touched[over] = True
            return
        at = -2 if hint.steps is None else self._h_step + int(hint.steps)
        slot = self._slot
        for sid in hint.sids:
            s = slot.get(sid)
            if s is not None:
                self.hint_at[s] = at
                self.touched[s] = True
                self._h_live = True

    # ---- rule 9: backward mirrors forward ------------------------------------------------------
    def _reset_mirror(self) -> None:
        self._mirror = -1  # forward position of the node backward is running; -1: none yet
        self._fwd_log: list[tuple[int, Any]] = []  # (position, operator) of forward since the last backward
        self._fwd_node: dict[int, tuple[int, tuple[int, ...]]] = {}  # node -> (position, inputs)
        self._fwd_freed: dict[int, float] = {}  # log_bytes of storages forward freed
        self._mir_index: dict[int, int] = {}
        self._mir_sid = np.zeros(0, dtype=np.int64)
        self._mir_pos = np.zeros(0, dtype=np.int64)
        self._mir_off = np.zeros(1, dtype=np.int64)
        self._mir_keys = np.zeros(0, dtype=np.int64)
        self._mir_first = np.zeros(0, dtype=np.int64)
        self._fwd_ops: dict[int, Any] = {}  # forward position -> operator, for relinking
        self._relink: list[tuple[int, int, int, int]] = []  # heap of (-first access of target, slot, sid, target)
        self._native_tab = None

    def _build_mirror(self) -> None:
        """Backward starts: index the forward accesses since the last backward (several forward and
        backward passes in one step: each backward mirrors its own forward) per storage, as sorted
        segments of positions, and point every live storage that forward accessed at its own segment."""
        log = self._fwd_log
        nodes = self._fwd_node
        for p, op in log:
            node = getattr(op, "node", -1)
            if node >= 0:
                nodes[node] = (p, op.inputs)
        if log and not nodes and not self._warned_nodes:
            self._warned_nodes = True
            logger.warning("pilot: no forward operator of this iteration carries an autograd node (a trace "
                           "recorded before schema 2?), so backward has no mirror (rule 9) and the pilot "
                           "predicts backward less well. Re-record the trace with this dynn-runtime.")
        acc = [{*op.inputs, *op.outputs, *op.writes} for _, op in log]
        sids = np.fromiter(itertools.chain.from_iterable(acc), dtype=np.int64)
        pos = np.repeat(np.fromiter((p for p, _ in log), dtype=np.int64, count=len(log)),
                        np.fromiter(map(len, acc), dtype=np.int64, count=len(acc)))
        uniq, first, inv = np.unique(sids, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # segments in first-access order
        rank = np.empty(len(uniq), dtype=np.int64)
        rank[order] = np.arange(len(uniq))
        idx = rank[inv] if len(sids) else np.zeros(0, dtype=np.int64)
        keys = np.sort(idx * _BIG + pos)
        self._mir_keys = keys
        self._mir_pos = np.ascontiguousarray(keys % _BIG)
        self._mir_sid = np.ascontiguousarray(uniq[order])
        self._mir_off = np.zeros(len(uniq) + 1, dtype=np.int64)
        np.cumsum(np.bincount(idx, minlength=len(uniq)), out=self._mir_off[1:])
        self._mir_index = dict(zip(self._mir_sid.tolist(), range(len(uniq))))
        self._mir_first = self._mir_pos[self._mir_off[:-1]]
        mi = self._mir_index
        for sid, s in self._slot.items():
            self.mirror_tgt[s] = mi.get(sid, -1)
        self._fwd_ops = dict(log)
        self._relink = []
        self._fwd_log = []
        self._mirror = -1
        self._native_tab = None

    def _nearest_input(self, own: float, inputs: Any, exclude: int = -1) -> int:
        """Mirror segment of the input of the nearest size at least ``own`` (the first on ties), or -1."""
        mi, slot, lb, freed = self._mir_index, self._slot, self.log_bytes, self._fwd_freed
        best, best_lb = -1, math.inf
        for f in inputs:
            t = mi.get(f)
            if t is None or t == exclude:
                continue
            fs = slot.get(f)
            f_lb = lb[fs] if fs is not None else freed.get(f)
            if f_lb is not None and own <= f_lb < best_lb:
                best, best_lb = t, f_lb
        return best

    def _link(self, allocs: Any, inputs: Any) -> None:
        """Storages a backward operator allocated follow the mirrored forward operator's input of the
        nearest size at least their own (its gradient, or a piece of it)."""
        slot = self._slot
        for sid in allocs:
            s = slot.get(sid)
            if s is None:
                continue
            t = self._nearest_input(self.log_bytes[s], inputs)
            self.mirror_tgt[s] = t
            if t >= 0:
                heapq.heappush(self._relink, (-int(self._mir_first[t]), s, sid, t))

    def _pass_through(self, mirror: int) -> None:
        """A gradient outlives the backward of its target's producer when that operator passes it on
        unchanged (``add``, ``index_add``'s ``self``, views): once the mirror reaches the producer, a
        linked storage follows the producer's input of the nearest size at least its own, the first
        on ties (``self``), and so on down while the mirror has passed that one's producer too."""
        heap, first, ops, msid = self._relink, self._mir_first, self._fwd_ops, self._mir_sid
        while heap and -heap[0][0] >= mirror:
            _, s, sid, t = heapq.heappop(heap)
            if self.sid[s] != sid or self.mirror_tgt[s] != t:
                continue  # freed, or linked again since
            for _ in range(_PASS_DEPTH):
                op = ops.get(int(first[t]))
                tsid = int(msid[t])
                if op is None or (tsid not in op.allocs and tsid not in op.outputs):
                    break  # not produced by forward (the batch, a parameter): its gradient ends here
                nt = self._nearest_input(self.log_bytes[s], op.inputs, exclude=t)
                if nt < 0:
                    break
                t = nt
                if first[t] < mirror:
                    heapq.heappush(heap, (-int(first[t]), s, sid, t))
                    break
            if self.mirror_tgt[s] != t:
                self.mirror_tgt[s] = t
                self.touched[s] = True

    def alloc(self, sid: int, position: int) -> tuple[int, str, bool]:
        """``on_alloc``: ``position`` -1 means alive when the iteration started. Returns the slot and
        the storage's kind and saved flag as the view gave them."""
        s = self._slot.get(sid)
        if s is None:
            s = self._new_slot(sid)
        view = self.view
        kind = view.kind(sid)
        saved = view.saved(sid)
        # math.log2 and numpy's agree once stored as float32 (checked on 2.2 million sizes)
        log_bytes = math.log2(max(view.nbytes(sid), 1)) / 30.0
        kind_idx = _KIND_IDX.get(kind, _KIND_IDX["temp"])
        prev = self._prev_idx.get(sid, -1)
        announce = self._announced
        self._announced += 1
        self.mirror_tgt[s] = -1
        self.hint_at[s] = -1
        if self._kernel is not None:
            self._kernel.alloc(self, s, kind_idx, 1.0 if saved else 0.0, log_bytes, announce, position, prev)
            return s, kind, saved
        self.kind[s] = kind_idx
        self.saved[s] = 1.0 if saved else 0.0
        self.log_bytes[s] = log_bytes
        self.last[s] = -1
        self.last_phase[s] = -1
        self.count[s] = 0
        self.count_phase[s] = 0
        self.acc_phase[s] = 0
        self.stack_idx[s] = -1
        self.stack_pos[s] = -1
        self.announce[s] = announce
        self.consumer_iv[s] = 0
        self.producer_iv[s] = 0
        self.has_producer[s] = 0
        self.prev[s] = prev
        self.persistent[s] = 1.0 if position < 0 else 0.0
        self.born[s] = position if position >= 0 else -1
        self.born_phase[s] = self.phase if position >= 0 else -1
        return s, kind, saved

    def _match_external(self, s: int) -> None:
        """A storage alive at the start, new to this iteration (the batch), at its first access: match it
        to the previous iteration's next unmatched external storage in first-access order (rule 4)."""
        ext = self._prev_external
        while self._ext_next < len(ext):
            cand = ext[self._ext_next]
            self._ext_next += 1
            if cand not in self._slot:  # alive now: a persistent storage, matched by its own id
                self.prev[s] = self._prev_idx[cand]
                return

    def free(self, sid: int) -> None:
        s = self._slot.pop(sid, None)
        if s is not None:
            if self.phase == 0:
                self._fwd_freed[sid] = self.log_bytes.item(s)
            self.active[s] = False
            self.sid[s] = -1
            self._free.append(s)

    def op(self, position: int, op: Any) -> bool:
        """``on_op``: operator ``position`` ran. Returns whether this is a decision point."""
        ph = _PHASE_IDX.get(op.phase, 0)
        if ph != self.phase:
            self.phase = ph
            self.phase_start = position
            new_phase = True
            if self._h_live or self._h_step:
                self._reset_hints(self._cap)
        else:
            new_phase = position == 0
        self.position = position
        if ph == 0:  # rule 9: forward, indexed for backward when it starts
            self._fwd_log.append((position, op))
        elif ph == 1:  # rule 9: the mirror moves to the forward operator of the node running
            if self._fwd_log:
                self._build_mirror()
            hit = self._fwd_node.get(getattr(op, "node", -1))
            if hit is not None:
                if hit[0] != self._mirror:
                    self._mirror = hit[0]
                    self._pass_through(hit[0])
                if op.allocs:
                    self._link(op.allocs, hit[1])
        if self._kernel is not None:
            return self._op_native(position, op, ph, new_phase)
        iv = _IV_CACHE.get(op.idiom)
        if iv is None:
            iv = _IV_CACHE[op.idiom] = np.asarray(op.idiom, dtype=np.float32) / 3.0
        if self.decays is not self._hist_decays:
            self._set_decays()
        f, sl = self.decays
        # fast = fast * f + iv * (1 - f), slow likewise with sl: the same float32 roundings, in place
        key = (op.idiom, f, sl)
        ivk = _IVK_CACHE.get(key)
        if ivk is None:
            ivk = _IVK_CACHE[key] = np.concatenate([iv, iv]) * self._hist_keep
        h = self._hist
        h *= self._hist_decay
        h += ivk
        self._hist_allocs = self._hist_allocs * sl + len(op.allocs) * (1 - sl)
        prev_allocs = self._align(position, op)
        slot = self._slot
        replayed = self.replayed
        replayed.clear()
        for i, sid in enumerate(op.allocs):
            s = slot.get(sid)
            if s is None:
                continue
            self.producer_iv[s] = iv
            self.has_producer[s] = 1.0
            if i < len(prev_allocs):
                self.prev[s] = self._prev_idx.get(prev_allocs[i], -1)
        for sid in {*op.inputs, *op.outputs, *op.writes}:
            s = slot.get(sid)
            if s is None:
                continue
            self.last[s] = position
            self.last_phase[s] = ph
            self.count[s] += 1
            if self.count_phase_of[s] != ph:
                self.count_phase_of[s] = ph
                self.count_phase[s] = 0
            self.count_phase[s] += 1
            if ph == 1 and self.stack_idx[s] >= 0 and self.acc_phase[s, 1] == 0:
                self._frontier = int(self.stack_pos[s])  # popped: backward has reached its push
            self.acc_phase[s, ph] = 1.0
            self.consumer_iv[s] = iv
            if ph == 0 and self.saved[s] > 0 and self.kind[s] > 2 and (self.born[s] < 0 or self.stack_idx[s] < 0):
                # rule 5: produced storages by production order, the batch by its last forward use
                self.stack_idx[s] = self._stack_counter
                self.stack_pos[s] = position
                self._stack_counter += 1
            if self.prev[s] < 0 and self.born[s] < 0 and self.count[s] == 1:
                self._match_external(s)
            self._replay(sid, s, position)
        return self._tick(position, new_phase)

    def _replay(self, sid: int, s: int, position: int) -> None:
        """Rule 8: after its k-th access here, the counterpart's (k+1)-th came this much later."""
        pi = self.prev.item(s)
        if pi >= 0:
            lst = self._prev_lists[pi]
            k = int(self.count.item(s))
            if k < len(lst):
                self.replayed[sid] = position + lst[k] - lst[k - 1]

    def _tick(self, position: int, new_phase: bool) -> bool:
        """Whether operator ``position`` is a decision point: every ``group`` operators, every phase change."""
        if new_phase or position - self._last_decision >= self.group:
            self._last_decision = position
            return True
        return False

    def _align(self, position: int, op: Any) -> tuple[int, ...]:
        """Rule 4: match the operator to the previous iteration's with the same (name, module, phase,
        occurrence) key, move the anchor there; returns what that operator allocated (or ())."""
        key = (op.name, op.module, op.phase)
        c = self._op_seen.get(key, 0)
        self._op_seen[key] = c + 1
        q = self._prev_ops.get((*key, c))
        if q is None:
            return ()
        self._anchor = (position, q)
        return self._prev_allocs.get(q, ())

    def _op_native(self, position: int, op: Any, ph: int, new_phase: bool) -> bool:
        """:meth:`op` with the per-storage writes in the native kernel (``dynn_pilot_op``): the same
        arrays, stack and replayed next uses (tested against the Python path at every operator)."""
        if self.decays is not self._hist_decays:
            self._set_decays()
        f, sl = self.decays
        key = (op.idiom, f, sl)
        hit = _NATIVE_IV.get(key)
        if hit is None:
            iv = np.asarray(op.idiom, dtype=np.float32) / 3.0
            ivk = np.concatenate([iv, iv]) * self._hist_keep
            hit = _NATIVE_IV[key] = ((iv, iv.ctypes.data), (ivk, ivk.ctypes.data))
        self._hist_allocs = self._hist_allocs * sl + len(op.allocs) * (1 - sl)
        prev_allocs = self._align(position, op)
        slot = self._slot
        a_slots, a_prev = [], []
        if op.allocs:
            prev_idx = self._prev_idx
            n_prev = len(prev_allocs)
            for i, sid in enumerate(op.allocs):
                s = slot.get(sid)
                if s is not None:
                    a_slots.append(s)
                    a_prev.append(prev_idx.get(prev_allocs[i], -1) if i < n_prev else -2)
        acc = list({*op.inputs, *op.outputs, *op.writes})
        rep, match = self._kernel.op(self, position, ph, hit[0], hit[1], a_slots, a_prev,
                                     [slot.get(sid, -1) for sid in acc])
        replayed = self.replayed
        replayed.clear()
        for sid, r in zip(acc, rep):
            if r >= 0:
                replayed[sid] = r
        for i in match:  # rule 6 at its first access, then its replay (as op() does in the loop)
            sid = acc[i]
            s = slot[sid]
            self._match_external(s)
            self._replay(sid, s, position)
        return self._tick(position, new_phase)

    # ---- features at a decision point ---------------------------------------------------------
    def active_slots(self) -> np.ndarray:
        """Slots of every live storage (the candidates), in slot order."""
        return np.flatnonzero(self.active[: self._cap])

    def features(self, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sids, X, ctx)``: candidate storage ids, their feature rows, the shared context row.

        ``idx``: only these slots (a subset of :meth:`active_slots`); default every live storage.
        Computed by the native kernel when this state's ``backend`` is ``"native"``, else by
        :meth:`features_numpy`; the results are equal bit for bit.
        """
        if self._kernel is not None:
            return self._kernel.features(self, idx)
        return self.features_numpy(idx)

    def _ext_rem(self, n: int) -> list[int]:
        """Rule 6 ahead of time: the previous iteration's indices of the first ``n`` external storages
        not matched yet and not alive now (what :meth:`features_numpy` builds as ``rem``)."""
        ext = self._prev_external
        slot = self._slot
        out: list[int] = []
        if n <= 0:
            return out
        stop = min(len(ext), self._ext_next + n + len(slot))
        for i in range(self._ext_next, stop):
            c = ext[i]
            if c not in slot:
                out.append(self._prev_idx[c])
                if len(out) == n:
                    break
        return out

    def features_numpy(self, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`features` in numpy: the reference the native kernel is tested against."""
        n_live = int(self.active[: self._cap].sum()) if idx is not None else None
        if idx is None:
            idx = self.active_slots()
        pos = self.position
        m = len(idx)
        X = np.zeros((m, len(CAND_FEATURES)), dtype=np.float32)
        kind = self.kind[idx]
        X[np.arange(m), kind] = 1.0
        X[:, _C["saved"]] = self.saved[idx]
        X[:, _C["persistent"]] = self.persistent[idx]
        X[:, _C["log_bytes"]] = self.log_bytes[idx]
        last = self.last[idx]
        accessed = last >= 0
        X[:, _C["accessed_this_iter"]] = accessed
        age = np.where(accessed, pos - last, pos + 1)
        X[:, _C["log_age"]] = np.log1p(np.maximum(age, 0)) / 8.0
        X[:, _C["age0"]] = accessed & (age == 0)
        X[:, _C["log_count"]] = np.log1p(self.count[idx]) / 4.0
        cp = np.where(self.count_phase_of[idx] == self.phase, self.count_phase[idx], 0.0)
        X[:, _C["log_count_phase"]] = np.log1p(cp) / 4.0
        X[:, _C["acc_forward"]: _C["acc_optimizer"] + 1] = self.acc_phase[idx]
        born = self.born[idx]
        b = born >= 0
        X[:, _C["born_this_iter"]] = b
        X[:, _C["log_since_birth"]] = np.where(b, np.log1p(np.maximum(pos - born, 0)) / 8.0, 0.0)
        bp = self.born_phase[idx]
        rows = np.flatnonzero(bp >= 0)
        X[rows, _C["born_forward"] + bp[rows]] = 1.0
        lp = self.last_phase[idx]
        rows = np.flatnonzero(lp >= 0)
        X[rows, _C["last_forward"] + lp[rows]] = 1.0
        X[:, _C["producer_iv0"]: _C["producer_iv5"] + 1] = self.producer_iv[idx]
        X[:, _C["has_producer"]] = self.has_producer[idx]
        X[:, _C["consumer_iv0"]: _C["consumer_iv5"] + 1] = self.consumer_iv[idx]
        # stack depth among saved activations not yet read in backward (rule 5)
        st = self.stack_idx[idx]
        on = (st >= 0) & (self.acc_phase[idx, 1] == 0)
        if on.any():
            rows = np.flatnonzero(on)
            # depth among every live storage on the stack, not only among the rows asked for (idx may
            # be a subset: the policy's incremental rescoring); stack indices are unique
            cap = self._cap
            st_all = self.stack_idx[:cap]
            st_all = np.sort(st_all[self.active[:cap] & (st_all >= 0) & (self.acc_phase[:cap, 1] == 0)])
            depth = (len(st_all) - np.searchsorted(st_all, st[rows], side="right")).astype(np.float32)
            X[rows, _C["on_stack"]] = 1.0
            X[rows, _C["log_stack_depth"]] = np.log1p(depth) / 6.0
            X[rows, _C["stack_top"]] = depth < 1
            # forward operators between its push and the forward position backward has reached (the
            # push position of the storage it read last from the stack; in forward: now), scaled by
            # the previous iteration's backward/forward operator ratio: backward replays forward in
            # reverse. Pushed after that position and still unread: overdue.
            if self.phase == 0:
                front = pos
            else:
                front = self._frontier if self._frontier >= 0 else self.phase_start
            span = (front - self.stack_pos[idx[rows]]).astype(np.float64)
            X[rows, _C["stack_overdue"]] = span < 0
            span = np.maximum(span, 0.0)
            est = span * self._ratio
            X[rows, _C["log_stack_span"]] = np.log1p(span) / 8.0
            X[rows, _C["log_stack_est"]] = np.log1p(est) / 8.0
            X[rows, _C["stack_le8"]: _C["stack_le256"] + 1] = est[:, None] <= _THRESH_ARR
        # backward mirrors forward (rule 9)
        if self.phase == 1 and self._mirror >= 0:
            tgt = self.mirror_tgt[idx]
            rows = np.flatnonzero(tgt >= 0)
            if len(rows):
                t = tgt[rows]
                keys = self._mir_keys
                mir = self._mirror
                k = np.searchsorted(keys, t * _BIG + mir, side="left")
                first = self._mir_off[t]
                ok = k > first
                rows, k, first, t = rows[ok], k[ok], first[ok], t[ok]
                span = (mir - keys[k - 1] % _BIG).astype(np.float64)
                est = span * self._ratio
                X[rows, _C["mirror"]] = 1.0
                X[rows, _C["mirror_linked"]] = self._mir_sid[t] != self.sid[idx[rows]]
                X[rows, _C["mirror_final"]] = k - 1 == first
                X[rows, _C["log_mirror_span"]] = np.log1p(span) / 8.0
                X[rows, _C["log_mirror_est"]] = np.log1p(est) / 8.0
                X[rows, _C["mirror_le8"]: _C["mirror_le256"] + 1] = est[:, None] <= _THRESH_ARR
        # anchored replay (rule 4)
        prev = self.prev[idx]
        p_here, q = self._anchor
        has_prev = prev >= 0
        X[:, _C["matched"]] = has_prev
        # rule 6 ahead of time: an external storage not accessed yet gets the counterpart it will be
        # matched to if externals are first accessed in the order they were announced
        pend = ~has_prev & (self.born[idx] < 0) & (self.count[idx] == 0)
        if self._prev_len and pend.any():
            act = np.flatnonzero(self.active[: self._cap])
            pa = act[(self.prev[act] < 0) & (self.born[act] < 0) & (self.count[act] == 0)]
            rank_of = np.empty(self._cap, dtype=np.int64)
            rank_of[pa[np.argsort(self.announce[pa], kind="stable")]] = np.arange(len(pa))
            ext = self._prev_external
            rem = [self._prev_idx[c] for c in ext[self._ext_next: self._ext_next + len(pa) + len(self._slot)]
                   if c not in self._slot][: len(pa)]
            rows = np.flatnonzero(pend)
            rk = rank_of[idx[rows]]
            ok = rk < len(rem)
            if ok.any():
                prev = prev.copy()
                prev[rows[ok]] = np.asarray(rem, dtype=np.int64)[rk[ok]]
                X[rows[ok], _C["ext_by_order"]] = 1.0
                has_prev = prev >= 0
        if self._prev_len and has_prev.any():
            rows = np.flatnonzero(has_prev)
            pi = prev[rows]
            qm = q + (pos - p_here) if q >= 0 else pos
            keys = self._prev_keys
            k = np.searchsorted(keys, pi * _BIG + qm, side="right")
            ok = k < len(keys)
            kk = np.minimum(k, len(keys) - 1)
            ok &= (keys[kk] // _BIG) == pi
            dist = np.where(ok, keys[kk] % _BIG - qm, 0)
            X[rows, _C["prev_used_again"]] = ok
            X[rows, _C["log_prev_dist"]] = np.where(ok, np.log1p(np.maximum(dist, 0)) / 8.0, 0.0)
            X[rows, _C["prev_le8"]: _C["prev_le256"] + 1] = ok[:, None] & (dist[:, None] <= _THRESH_ARR)
            X[rows, _C["log_prev_count"]] = np.log1p(self._prev_count[pi]) / 4.0
            # occurrence-anchored: after its k-th access the counterpart was next used g operators later
            cnt = self.count[idx[rows]].astype(np.int64)
            acc_r = cnt > 0
            first = np.searchsorted(keys, pi * _BIG, side="left")
            jn = first + cnt
            okn = acc_r & (jn < len(keys))
            jn_c = np.minimum(jn, len(keys) - 1)
            okn &= (keys[jn_c] // _BIG) == pi
            gap = (keys[jn_c] % _BIG) - (keys[np.maximum(jn_c - 1, 0)] % _BIG)
            age_r = pos - self.last[idx[rows]]
            X[rows, _C["occ_has_next"]] = okn
            X[rows, _C["log_occ_gap"]] = np.where(okn, np.log1p(np.maximum(gap, 0)) / 8.0, 0.0)
            X[rows, _C["log_occ_remaining"]] = np.where(okn, np.log1p(np.maximum(gap - age_r, 0)) / 8.0, 0.0)
            X[rows, _C["occ_le8"]: _C["occ_le256"] + 1] = okn[:, None] & ((gap - age_r)[:, None] <= _THRESH_ARR)
        # workload hints (rule 10)
        if self._h_active:
            at = self.hint_at[idx]
            rows = np.flatnonzero(at >= 0)
            if len(rows):
                steps = np.minimum(np.maximum(at[rows] - self._h_step, 0), HINT_MAX)
                est = np.minimum(np.maximum(steps * self._hint_len() - (pos + 1 - self._h_start), 0), HINT_MAX)
                X[rows, _C["hinted"]] = 1.0
                X[rows, _C["log_hint_steps"]] = np.log1p(steps.astype(np.float32)) / 4.0
                X[rows, _C["log_hint_est"]] = np.log1p(est) / 8.0
                X[rows, _C["hint_le8"]: _C["hint_le256"] + 1] = est[:, None] <= _THRESH_ARR
                # hinted for this step and already read in it: the read the hint announced may be over
                X[rows, _C["hint_read"]] = (steps == 0) & (self.last[idx[rows]] >= self._h_start)
            X[at == -2, _C["hint_done"]] = 1.0
        ctx = np.zeros(len(CTX_FEATURES), dtype=np.float32)
        ctx[self.phase] = 1.0
        ctx[_X["log_in_phase"]] = np.log1p(pos - self.phase_start) / 8.0
        if self._prev_len:
            ctx[_X["has_history"]] = 1.0
            qm = q + (pos - p_here) if q >= 0 else pos
            ctx[_X["anchored_progress"]] = min(qm / self._prev_len, 3.0)
            ctx[_X["progress"]] = min(pos / self._prev_len, 3.0)
            ctx[_X["log_since_anchor"]] = np.log1p(pos - p_here if q >= 0 else pos + 1) / 8.0
        ctx[_X["hist_fast_iv0"]: _X["hist_fast_iv5"] + 1] = self._hist_fast
        ctx[_X["hist_slow_iv0"]: _X["hist_slow_iv5"] + 1] = self._hist_slow
        ctx[_X["hist_slow_allocs"]] = min(self._hist_allocs, 8.0) / 4.0
        ctx[_X["log_candidates"]] = np.log1p(m if n_live is None else n_live) / 8.0
        ctx[_X["log_bwd_fwd_ratio"]] = np.log1p(self._ratio)
        ctx[_X["hints"]] = self._h_active
        return self.sid[idx].copy(), X, ctx

    def expected_length(self) -> int:
        """Operators expected in this iteration (the previous one's length; 0 without history)."""
        return self._prev_len
