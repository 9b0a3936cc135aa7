"""What the pilot model sees: per-storage state built from the policy notifications.

One class, :class:`FeatureState`, is fed the same notifications a :class:`~dynn_runtime.policies.Policy`
receives (``begin_iteration``, ``on_alloc``, ``on_free``, ``on_op``) and, at a decision point,
returns one feature row per live storage (the *candidates*) and one context row shared by all of
them (:mod:`.rows` says what each column holds; :mod:`.layout` lists them). The policy
(:mod:`.policy`) and the training-data walk (:mod:`.training.data`) both drive this class, so what
the model is trained on is exactly what it sees when it runs.

Invariants, and why:

**No future.** Inputs are the operators that already ran (their idiom vectors, phase, module path,
the storages they touched), sizes and kinds from the :class:`~dynn_runtime.policies.MemoryView`,
and *earlier* iterations (``context.history``): the live runtime knows nothing else.

**Generic.** No operator names, module names or storage ids appear as features; names and module
paths only *align* this iteration with the previous one. So the model works on a user's own
workload, not only on the zoo it was trained on.

**Slots.** Storage ids are opaque ints; per-storage state lives in numpy arrays indexed by a slot
recycled when the storage is freed, so the state stays as large as the live set and a decision
point is a handful of vectorised operations over it (no Python loop over candidates), or one call
of the native kernel (:mod:`.kernel`), which reads the same arrays and returns the same rows bit
for bit.

**Anchored replay** (:mod:`.replay`): each operator is matched to the previous iteration's
operator with the same (name, module, phase, occurrence) key; a candidate's counterpart there says
when it was next used, and the batch's storages are matched to the previous batch's.

**The saved-activation stack.** Backward consumes saved tensors roughly in reverse production
order: each saved storage (not a parameter, buffer or optimizer state) produced in forward and not
yet read in backward has a *stack depth* (how many such storages came after it) and a *span*: the
forward operators between its push and the forward position backward has reached, times the
previous iteration's backward/forward operator ratio, as an estimate of its distance in backward
operators; one pushed after that position and still unread is *overdue*.

**The backward mirror** (:mod:`.mirror`): a backward operator names the forward operator whose
gradient it computes, so the forward position backward has reached is known exactly.

**Workload hints** (:mod:`dynn_runtime.hints`): the workload may say what it knows of its own near
future in its own steps (a tree level, a layer, a recycling pass): ``step()`` marks a step's start
and ``next_use(tensors, steps=k)`` says they are read again k steps on (``None``: not again in
this pass). A hint holds through its step (a storage read several times in it stays due) and at
most until the phase ends; the workload re-hints a storage after its use. Workloads that give no
hints get zero columns.

The measurements behind these choices are in docs/pilot-lab-notes.md ("Feature design").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..trace.format import KINDS, PHASES
from .layout import (
    BUCKET_EDGES,
    CAND_FEATURES,
    COARSE_NAMES,
    COARSE_OF_FINE,
    CTX_FEATURES,
    N_COARSE,
    N_FINE,
    fine_bucket,
)
from .mirror import MirrorState
from .replay import OptimizerMemory, ReplayState
from .rows import feature_rows

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

_IV_CACHE: dict[tuple[int, ...], np.ndarray] = {}
_IVK_CACHE: dict[tuple[Any, ...], np.ndarray] = {}
#: per (idiom, decays): ((iv, its address), (the histories' increment, its address)), for the kernel
_NATIVE_IV: dict[tuple[Any, ...], tuple[tuple[np.ndarray, int], tuple[np.ndarray, int]]] = {}


class FeatureState(ReplayState, MirrorState):
    """Per-storage and per-stream state of one run; see the module docstring for the rules.

    ``view`` must answer ``nbytes``, ``kind`` and ``saved`` for a storage when it is announced.
    ``group``: decision points fall every ``group`` operators and at every phase change.
    ``backend``: how :meth:`features` computes the rows: ``"native"`` (the C kernel,
    :mod:`.native`), ``"numpy"`` (:meth:`features_numpy`, the reference), or None: native when it is
    available. Both give the same rows bit for bit.
    """

    #: the per-iteration walks over the operators (the previous iteration's index, the mirror's
    #: accesses) by the C module ``kernel/pack.c`` where it is built (True), or in Python
    #: (False: the reference, :meth:`ReplayState._index_ops_py`; the pilot sets it from its
    #: ``native_pack``); the same dictionaries, lists and arrays either way
    native_index = True

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
        self._h_prev_len = 0  # hints: operators per step of the previous pass that had steps
        self._h_step = self._h_start = 0
        self._h_first = -1
        self._ratio = 1.5
        self._prev_ops: dict[tuple[str, str, str, int], int] = {}
        self._prev_len = 0
        self._prev_idx: dict[int, int] = {}
        self._prev_keys = np.zeros(0, dtype=np.int64)
        self._prev_count = np.zeros(0, dtype=np.float32)
        self._prev_allocs: dict[int, tuple[int, ...]] = {}
        self._prev_flat: list[int] = []
        self._prev_start: list[int] = [0]
        self._opt_memory = OptimizerMemory()
        # replayed next uses (the ``replayed`` property): the dict, or what it is built from on demand
        self._replayed: dict[int, int] = {}
        self._replayed_from: tuple[list[int], Any] | None = None
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
        # mirror: the forward storage (index into this iteration's mirror segments) it follows
        self.mirror_tgt = ext(g(self, "mirror_tgt", None), -1, np.int64)
        # hints: the workload's step it said the storage is next read in; -2: not again this pass
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
        self._opt_memory.ingest(history or ())
        self._index_previous(history[-1] if history else None)
        slot = self._slot
        if slot:  # what is alive at the start persists; matched to itself in the previous iteration
            n = len(slot)
            slots = np.fromiter(slot.values(), dtype=np.int64, count=n)
            self.persistent[slots] = 1.0
            prev_idx = self._prev_idx
            self.prev[slots] = np.fromiter((prev_idx.get(sid, -1) for sid in slot), dtype=np.int64, count=n)

    # ---- workload hints -----------------------------------------------------------------------
    def _reset_hints(self, n: int) -> None:
        """Hints hold for the pass they were given in; a new phase starts without any."""
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
        if self._kernel is not None:
            self._kernel.alloc(self, s, kind_idx, 1.0 if saved else 0.0, log_bytes, announce, position, prev)
            return s, kind, saved
        self.mirror_tgt[s] = -1
        self.hint_at[s] = -1
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

    def label(self, sid: int) -> None:
        """``on_label``: the view knows more of ``sid``'s kind or saved flag than at its announcement
        (live only: autograd saved it, or it became a gradient). Its row takes the view's labels, as a
        trace's row has its storage's final ones from the start; and one that joins the
        saved-activation stack in forward is pushed where the trace's rule pushed it: a storage produced
        in this iteration at its production, an external one at its latest forward access."""
        s = self._slot.get(sid)
        if s is None:
            return
        view = self.view
        kind_idx = _KIND_IDX.get(view.kind(sid), _KIND_IDX["temp"])
        saved = 1.0 if view.saved(sid) else 0.0
        self.kind[s] = kind_idx
        self.saved[s] = saved
        self.touched[s] = True
        if self.phase != 0 or not saved or kind_idx <= 2:
            return
        if self.born[s] >= 0:
            if self.stack_idx[s] < 0 and self.born_phase[s] == 0:
                self._push_at(s, int(self.born[s]))
        elif self.last_phase[s] == 0:
            self._push_at(s, int(self.last[s]))

    def _push_at(self, s: int, position: int) -> None:
        """Push slot ``s`` on the saved-activation stack as if at operator ``position`` (at or before now):
        after every push made at or before it, so the stack order stays the order of the pushes'
        positions; the stack indices after it move up by one (in place: the kernel reads these arrays)."""
        n = self._cap
        idx = self.stack_idx[:n]
        idx[s] = -1
        # pushes are made in position order, so the ones after ``position`` hold the top indices
        later = np.flatnonzero((self.stack_pos[:n] > position) & (idx >= 0))
        if len(later):
            x = int(idx[later].min())
            idx[later] += 1
        else:
            x = self._stack_counter
        idx[s] = x
        self.stack_pos[s] = position
        self._stack_counter += 1

    def free(self, sid: int) -> None:
        s = self._slot.pop(sid, None)
        if s is not None:
            if self.phase == 0:
                self._fwd_freed[sid] = self.log_bytes.item(s)
            self.active[s] = False
            self.sid[s] = -1
            self._free.append(s)

    @property
    def replayed(self) -> dict[int, int]:
        """After :meth:`op`, the storages it accessed whose counterpart in the previous iteration was
        accessed again after the same occurrence: sid -> that next use replayed here (built on
        demand after the policy's fused native update, which predicts from the kernel's output)."""
        lazy = self._replayed_from
        if lazy is not None:
            self._replayed_from = None
            acc, rep = lazy
            d = self._replayed
            d.clear()
            for sid, r in zip(acc, rep[: len(acc)]):
                if r >= 0:
                    d[sid] = r
        return self._replayed

    def op(self, position: int, op: Any) -> bool:
        """``on_op``: operator ``position`` ran. Returns whether this is a decision point."""
        ph, new_phase = self.enter(position, op)
        if self._kernel is not None:
            return self._op_native(position, op, ph, new_phase)
        return self._op_python(position, op, ph, new_phase)

    def enter(self, position: int, op: Any) -> tuple[int, bool]:
        """:meth:`op`'s first part: the phase (a new one resets the hints), the position, and the
        backward mirror's move. Returns the phase index and whether it is a new phase."""
        ph = _PHASE_IDX.get(op.phase, 0)
        if ph != self.phase:
            self.phase = ph
            self.phase_start = position
            new_phase = True
            if ph == 2:  # the optimizer begins: its plan follows the parameters that have a gradient now
                self._realign_optimizer()
            if self._h_live or self._h_step:
                self._reset_hints(self._cap)
        else:
            new_phase = position == 0
        self.position = position
        if ph == 0:  # forward, indexed for the mirror when backward starts
            self._log_forward(position, op)
        elif ph == 1:  # the mirror moves to the forward operator of the node running
            if self._fwd_log:
                self._build_mirror()
            hit = self._fwd_node.get(getattr(op, "node", -1))
            if hit is not None:
                if hit[0] != self._mirror:
                    self._mirror = hit[0]
                    self._pass_through(hit[0])
                if op.allocs:
                    self._link(op.allocs, hit[1])
        return ph, new_phase

    def _op_python(self, position: int, op: Any, ph: int, new_phase: bool) -> bool:
        """:meth:`op`'s per-storage update in numpy (the reference of the native kernel's)."""
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
        self._replayed_from = None
        replayed = self._replayed
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
                # the stack: produced storages by production order, the batch by its last forward use
                self.stack_idx[s] = self._stack_counter
                self.stack_pos[s] = position
                self._stack_counter += 1
            if self.prev[s] < 0 and self.born[s] < 0 and self.count[s] == 1:
                self._match_external(s)
            self._replay(sid, s, position)
        return self._tick(position, new_phase)

    def _tick(self, position: int, new_phase: bool) -> bool:
        """Whether operator ``position`` is a decision point: every ``group`` operators, every phase change."""
        if new_phase or position - self._last_decision >= self.group:
            self._last_decision = position
            return True
        return False

    def native_iv(self, op: Any) -> tuple[tuple[np.ndarray, int], tuple[np.ndarray, int]]:
        """For the native kernel: ``op``'s idiom vector / 3 and the histories' increment (the vector
        twice times one minus the decays), each as (array, address); the decays made current."""
        if self.decays is not self._hist_decays:
            self._set_decays()
        f, sl = self.decays
        key = (op.idiom, f, sl)
        hit = _NATIVE_IV.get(key)
        if hit is None:
            iv = np.asarray(op.idiom, dtype=np.float32) / 3.0
            ivk = np.concatenate([iv, iv]) * self._hist_keep
            hit = _NATIVE_IV[key] = ((iv, iv.ctypes.data), (ivk, ivk.ctypes.data))
        return hit

    def _op_native(self, position: int, op: Any, ph: int, new_phase: bool) -> bool:
        """:meth:`op` with the per-storage writes in the native kernel (``dynn_pilot_op``): the same
        arrays, stack and replayed next uses (tested against the Python path at every operator)."""
        hit = self.native_iv(op)
        self._hist_allocs = self._hist_allocs * self.decays[1] + len(op.allocs) * (1 - self.decays[1])
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
        self._replayed_from = None
        replayed = self._replayed
        replayed.clear()
        for sid, r in zip(acc, rep):
            if r >= 0:
                replayed[sid] = r
        for i in match:  # an external storage's match at its first access, then its replay (as op() does in the loop)
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

    def features_numpy(self, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`features` in numpy (:func:`.rows.feature_rows`): the reference the native kernel is
        tested against."""
        return feature_rows(self, idx)

    def expected_length(self) -> int:
        """Operators expected in this iteration (the previous one's length; 0 without history)."""
        return self._prev_len
