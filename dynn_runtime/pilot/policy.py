"""The ``pilot`` policy: Belady eviction and prefetch over next uses predicted by the pilot model.

It reads only what the live runtime can give (the :class:`~dynn_runtime.policies.MemoryView`
protocol's ``position``, ``phase``, ``nbytes``, ``kind``, ``saved``, ``status``, ``resident``,
``offloaded``, ``free_bytes``; the notifications; ``context.history``), never the current
iteration's future. Options: :class:`~.config.PilotPolicyConfig`. When and where decisions run (decision
points, the ones deferred while nothing would read them, the cost governor, host time, the worker
thread): :mod:`.scheduling`.

**Scoring.** At a decision point the chosen storages are scored in one batch
(:meth:`PilotModel.probs <dynn_runtime.pilot.model.PilotModel.probs>`; on the native kernel,
:mod:`.kernel`, features, network and the arithmetic below run in one call, and
``backend="numpy"`` makes the same decisions). The expected log next-use distance under the bucket
probabilities orders them; ``position + exp(that)`` is the predicted position. A storage whose
most likely bucket is "not again this iteration" predicts ``None`` (evicted first) unless it is
persistent (parameter, buffer, optimizer state): the next iteration needs those.

**The cache and the heaps.** The feature state's per-slot ``pred`` is the cache of current
predictions (NaN: nothing predicted this iteration), so that the kernel writes it directly. A
decision point changes only the rescored storages' entries and pushes their new entries on the
eviction heap (resident storages) and the prefetch heap (those this policy evicted); the older
entries no longer match the cache, so ``NextUsePolicy`` skips them as stale, and a heap is
compacted when it holds more than 4x the live storages (+1024). A decision point therefore costs
in proportion to the rows it scores, not to the live storages. On the native backend the eviction
heap lives in the kernel (:class:`~dynn_runtime.pilot.kernel.NativeHeap`: the same pop order as
heapq over the same entries, stale entries skipped in C) and a decision point's rows enter it in
one call (``dynn_pilot_merge``).

**Between decision points** a storage allocated or accessed gets a provisional prediction, so
that an access costs a dictionary write: its counterpart's next use in the previous iteration,
replayed from this access (:attr:`FeatureState.replayed
<dynn_runtime.pilot.features.FeatureState.replayed>`), else a small prior table shipped with the
weights (the median next-use distance right after an access, by phase and storage class). Its
heap entry is pushed in ``on_op``, once the replay is known (one push per access).

**Incremental rescoring.** A decision point rescores the storages allocated or accessed since the
last one, those whose predicted position has passed (the prediction was wrong), and those *due*:
scored at ``t`` with bucket probabilities whose ``quantile`` falls in a bucket starting at ``L``
operators, a storage is due at ``t + recheck * L``, before the earliest time it could plausibly be
needed. The others keep their predicted *position*, which stays valid while nothing happens to the
storage. A far prediction is coarse (the buckets are octaves) and gets precise when rescored
closer. Every phase change rescores everything.

**Small storages.** ``NextUsePolicy`` offers storages under ``small_fraction`` of the footprint as
victims only after every larger one (:class:`~dynn_runtime.policies.base.SmallStorages`: a copy's
fixed latency makes moving them a loss). As long as none of them has had to leave their order
never matters, so they keep the provisional prediction and are not scored (the kernel's
``select`` skips them): the same decisions for fewer rows. Once one is offered, memory is so short
that their order matters: a decision point comes at the next operator and every later one scores
them too.

**Online refit** (``online=True``): the feature rows of a sample of each decision point are kept;
when the next iteration begins, ``context.history[-1]`` (the iteration just finished) labels them,
and every ``refit_every`` iterations the model is fine-tuned on them in numpy on a background thread
(:class:`~dynn_runtime.pilot.training.online.OnlineRefit`); the refit replaces the model only once
it has beaten it on a later iteration's rows. Every decision point then rescores everything.

**Fallback** (``fallback=True``): a :class:`~.adapt.RecallJudge` measures, on the run's own
accesses, the window recall of the model, of ``replay`` and of ``lru`` at every decision point
once its window has run; while another one's recent recall beats the model's, the decision
point's predictions are that one's (the cache and heaps take them as they take the model's), and
so are the provisional predictions until the next one. The model side itself takes replay's
prediction for a storage where replay's plan has held to the operator so far in the iteration
(:class:`~.adapt.ExactReplay`: the same operators at the same positions, the storage born and
accessed where its match was): there the plan is exact, where the model estimates. Every decision
point then rescores everything on the numpy rows, as the online refit does.

**A planned optimizer** (:func:`~.replay.plan_scores`): in an optimizer phase that
:class:`~.replay.OptimizerMemory` re-planned (the parameters updated changed), a storage with a
replayed next use is predicted at it, not at the model's estimate; such decision points
materialise the rows instead of taking the kernel's fused decision.

Weights load on first use (``attach``), not at import. Inference is numpy or C only: no torch
operator runs inside the runtime's dispatch mode. The measurements behind these choices are in
docs/pilot-lab-notes.md ("Policy design").
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import PolicyError
from ..policies.base import (
    NO_CONTEXT,
    OPERATOR,
    TOUCH_ALLOC,
    TOUCH_FREE,
    Action,
    IterationContext,
    SmallStorages,
    register,
)
from ..policies.nextuse import NextUsePolicy
from ..residency import Residency
from .config import PilotPolicyConfig, cached_model, default_weights_path
from .features import _KIND_IDX, _NATIVE_IV, BUCKET_EDGES, CAND_FEATURES, FeatureState
from .heaps import PredictionHeaps, PyHeap
from .replay import plan_scores
from .scheduling import HANDOFF_COST, WORKER_COST, Scheduling, _Job

__all__ = ["PilotPolicy", "PilotPolicyConfig", "default_weights_path"]

_CLASS_OF_KIND = {"param": 1, "buffer": 1, "opt_state": 1, "grad": 3, "activation": 2, "input": 4, "temp": 4}
#: lower end (operators) of each fine bucket's distances; "not again" counted as twice the last edge
_PREV_AGAIN = CAND_FEATURES.index("prev_used_again")
_LOWER = np.asarray((1,) + BUCKET_EDGES[:-1] + (BUCKET_EDGES[-1], 2 * BUCKET_EDGES[-1]), dtype=np.float64)
_PHASES = {"forward": 0, "backward": 1, "optimizer": 2}
_TEMP = _KIND_IDX["temp"]
_OPTIMIZER = _PHASES["optimizer"]
#: record tags of dynn_pilot_operators' run (kernel.abi)
_BATCH_OP, _BATCH_FREE, _BATCH_LINK = 1, 2, 3


#: the kinds of which a saved storage is a saved activation (class 2)
_SAVED_KINDS = ("activation", "temp", "input")


def storage_class(kind: str, saved: bool, fresh: bool) -> int:
    """Row of the provisional prior: 0 just allocated, 1 persistent, 2 saved activation, 3 gradient, 4 other
    (``kernel/pack.c``'s ``storage_class`` too)."""
    if fresh:
        return 0
    if saved and kind in _SAVED_KINDS:
        return 2
    return _CLASS_OF_KIND.get(kind, 4)


class _Run(list):
    """A run of kernel records (the list: its int64 words) and, per operator record, its mark
    ``(end, position, told, acc, acc_slots, phase row)``: where its record ends, its told storages
    as flat (sid, slot) pairs, what it touches and their slots. The Python reference of
    ``kernel/pack.c``'s ``Run``, which keeps the same in flat int64 arrays (its words handed to the
    kernel by address) and answers the same calls."""

    __slots__ = ("marks",)

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[int, int, list[int], list[int], list[int], int]] = []

    def clear(self) -> None:
        super().clear()
        self.marks.clear()

    def n_marks(self) -> int:
        return len(self.marks)

    def find(self, end: int, k: int) -> int:
        """The first mark from ``k`` on whose record ends at word ``end``."""
        marks = self.marks
        while marks[k][0] != end:
            k += 1
        return k

    def mark(self, k: int) -> tuple[int, int, list[int], list[int], list[int], int]:
        return self.marks[k]

    def words(self) -> list[int]:
        return list(self)


@register
class PilotPolicy(Scheduling, PredictionHeaps, NextUsePolicy):
    """Next uses predicted by the pilot model (DyNN-Offload); see the module docstring."""

    name = "pilot"
    reads_modules = True
    reads_saved = True
    reads_labels = True
    requires = frozenset({"pilot"})
    description = "Belady over next uses predicted by the learned pilot model (idiom features)"
    Config: ClassVar[type[PilotPolicyConfig]] = PilotPolicyConfig
    #: operators between decision points (plus one at every phase change): fewer cost inference
    #: time, more lose decisions (docs/pilot-lab-notes.md, "Policy design")
    decision_every: int = 32
    #: rescore only what moved, what is overdue and what is due (True), or every live storage at
    #: every decision point (False: an experiment's setting, tools/pilot_lab.py)
    incremental: bool = True
    #: provisional predictions replay the counterpart's next use (True), or use the prior only
    #: (False: an experiment's setting)
    replay_provisional: bool = True
    #: on the native kernel, a bulk call's runs of forward operators and deaths go to the kernel in
    #: one call each (True), or each operator in its own kernel call (False: an experiment's setting,
    #: tools/pilot_host_cost.py --paired-kernel)
    batch_kernel: bool = True
    #: on the native kernel, a batch's common events walked, the runs' records packed into int64
    #: arrays and sent to the kernel, and the state's per-iteration index built by the C module
    #: ``kernel/pack.c`` where it is built (True), or by the Python loop of
    #: :meth:`_operators_native`, :meth:`_pack_run_op` and ``FeatureState``'s Python (False: an
    #: experiment's setting, tools/pilot_host_cost.py --paired-pack); the same writes either way
    native_pack: bool = True

    def __init__(self, config: PilotPolicyConfig | None = None, /, **options: Any) -> None:
        super().__init__()
        cfg = self.config = self.Config.build(config, options)
        self._weights = Path(cfg.weights) if cfg.weights is not None else default_weights_path()
        if cfg.model is None and not self._weights.is_file():
            raise PolicyError(
                f"policies: pilot needs trained weights; {str(self._weights)!r} does not exist. Train them with "
                "`dynn pilot train --traces ... -o FILE` and pass weights=FILE.")
        #: the cost model charged instead of measured time (seconds per decision point, per row
        #: scored, per operator); None: measured
        self.host_cost = cfg.host_cost
        self.worker: bool | str = cfg.worker
        #: decision points deferred while nothing would read them (:mod:`.scheduling`)
        self.defer_idle = cfg.defer_idle
        #: the worker's seconds per decision point and per row where it is modelled (the simulator)
        self.worker_cost: tuple[float, ...] = WORKER_COST
        #: the issuing thread's share of a decision point handed to the worker, charged instead of
        #: ``host_cost``'s first two terms where ``host_cost`` is set
        self.handoff_cost: tuple[float, ...] = HANDOFF_COST
        self._model = cfg.model
        self._online = cfg.online
        self._group = cfg.group
        self.recheck = float(cfg.recheck)
        self.quantile = float(cfg.quantile)
        #: inference time / elapsed device time (``view.now()``) kept at or under this
        self.max_share = None if cfg.max_share is None else float(cfg.max_share)
        self._timer = time.perf_counter
        self._refit_every = cfg.refit_every
        self._refit = None
        self._fallback = cfg.fallback
        #: the online refit or the fallback needs every decision point's rows (numpy path, full rescoring)
        self._rows = cfg.online or cfg.fallback
        self._judge: Any = None
        self._shadow: Any = None
        #: fallback: per storage, its last access (lru's prediction); the predictor followed now, and
        #: how many decision points followed each
        self._last_access: dict[int, int] = {}
        #: fallback: where replay's plan has held exactly so far (the model side takes replay's there)
        self._exact: Any = None
        self.following = "pilot"
        self.followed: dict[str, int] = {}
        #: inference backend: "native", "numpy", or None: native when it is available; after
        #: attach, the one in use
        self.backend = cfg.backend
        self._kernel = None
        self._state: FeatureState | None = None
        self._heap: Any = None
        self._pending: list[int] = []
        self._due = np.zeros(0, dtype=np.float64)
        self._skip = np.zeros(0, dtype=np.uint8)
        #: per slot, a storage this policy evicted and has not seen back (the prefetch heap's)
        self._away = np.zeros(0, dtype=np.uint8)
        #: small storages are scored (one was offered as a victim); a decision point is due now
        self._small_scored = False
        self._force_decision = False
        #: decision points, and seconds spent in feature building + inference (cost report)
        self.decisions = 0
        self.inference_s = 0.0
        #: seconds in the per-operator feature-state update (every operator, not only decisions; on
        #: the native kernel's fused path, the whole operator's notifications)
        self.bookkeeping_s = 0.0
        #: rows scored, summed over decision points; live storages at them, summed
        self.candidates = 0
        #: decision points handed to the worker, and their rows (in the counts above too)
        self.handoffs = self.handoff_rows = 0
        self.live_total = 0
        #: decision points the governor put off
        self.deferred = 0
        #: decision points deferred while idle (nobody would read them: ``defer_idle``), and the full
        #: rescorings run for them at a first victim search (``Scheduling._searching``)
        self.deferred_idle = 0
        self.catch_ups = 0
        #: a victim search has begun in this iteration, in the previous one; a decision point was
        #: deferred since the last one that ran (in this iteration)
        self._searched = self._searched_before = False
        self._stale = False
        #: the last iteration whose operators were told (begin_iteration: an idle step's are not)
        self._walked: Any = None
        #: the feature state's start of the iteration, put off while it starts idle (_wake)
        self._asleep: tuple[int, list[Any]] | None = None
        #: operators seen (on_op calls), for the per-operator term of ``host_cost``
        self.ops = 0
        #: the decision point in flight on the worker (None: none), the worker's clock where
        #: it is modelled (host seconds), host seconds the issuing thread waited for it, results
        #: merged and dropped (the iteration ended first), the thread pool where it is real
        self._job: _Job | None = None
        self._worker_free = 0.0
        self.wait_s = 0.0
        self.merged = self.dropped = 0
        self._pool: Any = None
        self._buf = _Job()
        #: on_operator fuses the notifications (set in attach)
        self._fused = False
        #: inside on_operators: the view's phase as the per-operator calls would find it (None: ask the view)
        self._bulk_phase: str | None = None

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = cached_model(self._weights)
        return self._model

    def attach(self, view: Any) -> None:
        super().attach(view)
        self._walked = self._asleep = None
        model = self.model  # first use: load the weights now, not at import
        from . import kernel as native

        backend = native.resolve(self.backend)
        if backend == "native" and not native.kernel().supports(model):
            if self.backend == "native":
                raise PolicyError("policies: pilot backend 'native': the native kernel does not take this "
                                  f"model's shape (hidden {model.arrays['W2'].shape[0]}); use backend='numpy'.")
            backend = "numpy"
        self._state = FeatureState(view, group=self._group or self.decision_every, backend=backend)
        self.backend = backend
        self._kernel = self._state._kernel
        if self._kernel is not None:
            from .kernel import PolicyTable

            self._pt = PolicyTable(_LOWER, self.quantile, self.recheck)
        self._away_out = (np.empty(256, dtype=np.int64), np.empty(256, dtype=np.float64))
        if self.worker and (self._kernel is None or self._rows):
            self.worker = False  # the worker runs the native kernel; the refit and the fallback need every row here
        self._prior = np.exp(model.arrays["prior"].astype(np.float64))
        self._prior_rows = self._prior.tolist()  # the same float64 values, read without numpy indexing
        self._clock0 = self._clock()
        self._spent = 0.0
        if self._online and self._refit is None:
            from .training.online import OnlineRefit

            self._refit = OnlineRefit(model, refit_every=self._refit_every, background=self.config.refit_background)
        if self._fallback and self._judge is None:
            from ..policies.nextuse import ReplayPolicy
            from .adapt import ExactReplay, RecallJudge
            from .training.evaluate import WINDOW_OPS

            self._judge = RecallJudge(window=WINDOW_OPS)
            self._shadow = ReplayPolicy()
            self._shadow.attach(view)
            self._exact = ExactReplay(self._shadow, near=WINDOW_OPS)
        cls = type(self)
        self._fused = (self._judge is None and cls.on_alloc is PilotPolicy.on_alloc
                       and cls.on_access is PilotPolicy.on_access)
        # on the native kernel, a fused operator is one kernel call (dynn_pilot_operator), unless a
        # subclass changes on_op or the provisional rule
        self._fused_native = None
        self._batch = None
        if (self._fused and self._kernel is not None and cls.on_op is PilotPolicy.on_op
                and cls.replay_provisional and self.replay_provisional):
            from .kernel import FusedTable

            self._fused_native = FusedTable()

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        super().begin_iteration(index, context)
        history = context.history
        if self._refit is not None:
            new = self._refit.end_iteration(history)
            if new is not None:
                self._model = new
        if self._judge is not None:
            self._judge.close()  # the iteration's accesses are all its open windows will hold
            if len(history) == 1:  # the first iteration ended: judged without a previous iteration
                self._judge.forget()
            self._shadow.begin_iteration(index, context)
            self._exact.begin_iteration(self._shadow.timeline)
            self._last_access.clear()
        # The iterations whose operators were told: an idle step read light (idle_step) has none in
        # its history entry; the last one told stands in for it as the previous iteration.
        told = [it for it in history if it.ops]
        if history and not told and self._walked is not None and self._walked.index < history[-1].index:
            told = [self._walked]
        self._walked = told[-1] if told else None
        self._pending = []
        self._off = []
        self._away[:] = 0
        self._phase = -1
        self._last_decision = -(1 << 30)
        self._full_due = True
        # whether the previous iteration searched for victims: seen here live, told by the simulator
        self._searched_before = self._searched if context.bound_before is None else context.bound_before
        self._searched = False
        self._stale = False  # the deferred points were of the iteration that ended
        if self._job is not None:  # predictions for the iteration that ended: dropped
            if self._job.future is not None:
                self._job.future.result()  # its buffers are used again
            self._job = None
            self.dropped += 1
        self._worker_free = 0.0
        # An iteration that starts idle needs its state only at the first notification: its own
        # start (the previous iteration's index, the arrays' reset) waits for it (_wake), and a step
        # the runtime reads light never pays it. Nothing reads the state before a notification.
        self._asleep = (index, told)
        if not self.idle_step():
            self._wake()

    def _wake(self) -> None:
        """The feature state's side of :meth:`begin_iteration`, where it was put off."""
        index, told = self._asleep
        self._asleep = None
        state = self._state
        state.native_index = self.native_pack
        state.begin_iteration(index, told)
        state.pred[:] = np.nan  # nothing predicted yet this iteration
        self._heap = PyHeap() if self._kernel is None else self._kernel.new_heap()
        self._expected_len = self._state.expected_length()
        if self._kernel is not None:
            from .model import _log_bucket_reps

            pt = self._pt
            pt.set_logreps(_log_bucket_reps(self._expected_len))
            pt.q.quantile, pt.q.recheck = self.quantile, self.recheck

    def close(self) -> None:
        if self._job is not None and self._job.future is not None:
            self._job.future.result()  # the worker's decision point completes (its buffers are ours)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._refit is not None:
            self._refit.close()

    # ---- notifications ------------------------------------------------------------------------
    def _provisional(self, position: int, kind: str, saved: bool, fresh: bool) -> float:
        """The prior: position + the median next-use distance of its phase and storage class."""
        cls = storage_class(kind, saved, fresh)
        phase = self._bulk_phase
        return max(position, 0) + self._prior_rows[_PHASES.get(self.view.phase if phase is None else phase, 0)][cls]

    def on_alloc(self, sid: int, position: int) -> None:
        if self._asleep is not None:
            self._wake()
        v = None
        if self._shadow is not None:
            self._shadow.on_alloc(sid, position)
            self._last_access[sid] = position
            self._exact.alloc(sid, position)
            if self.following == "pilot" and self._exact.exact(sid):
                v = self._shadow.predict(sid)
        state = self._state
        s, kind, saved = state.alloc(sid, position)
        state.pred[s] = self._provisional(position, kind, saved, position >= 0) if v is None else float(v)
        state.touched[s] = True
        if s >= len(self._skip):
            self._grow_due()
        self._away[s] = 0
        super().on_alloc(sid, position)
        self._skip[s] = self._small.small(sid)

    def on_access(self, sid: int, position: int) -> None:
        if self._asleep is not None:
            self._wake()
        # the provisional prediction is set in on_op, once the replayed next use is known;
        # the prior is computed there only for the storages that have none. Until then a storage
        # keeps its last prediction (one never predicted is kept: see predict)
        if self._judge is not None:
            self._judge.access(sid, position)
            self._last_access[sid] = position
            self._exact.access(sid, position)
        state = self._state
        s = state.slot_of(sid)
        if s is not None:
            state.touched[s] = True
            self._away[s] = 0
        if self.small_fraction:
            self._small.access(sid)
        # the eviction heap's entry is pushed in on_op, once the replayed next use is known
        self._pending.append(sid)
        if s is not None:
            self._skip[s] = self._small.small(sid)

    def on_free(self, sid: int) -> None:
        if self._shadow is not None:
            self._shadow.on_free(sid)
            self._last_access.pop(sid, None)
            self._exact.free(sid)
        self._state.free(sid)
        super().on_free(sid)

    def on_hint(self, hint: Any) -> None:
        if self._asleep is not None:
            self._wake()
        t0 = self._timer()
        self._state.hint(hint)
        self.bookkeeping_s += self._timer() - t0

    def on_label(self, sid: int) -> None:
        if self._asleep is not None:  # told again with its labels when the state wakes (alloc)
            return
        t0 = self._timer()
        self._state.label(sid)
        self.bookkeeping_s += self._timer() - t0

    def on_operator(self, position: int, op: Any, accessed: Sequence[int]) -> None:
        """:meth:`on_alloc` for each of ``op.allocs``, :meth:`on_access` for each of ``accessed``,
        then :meth:`on_op`, fused: the same writes in the same order (slots, predictions, heap
        entries, small-storage classes), without the per-notification calls. The plain calls
        where they do more: with ``fallback`` (its shadow predictors), or in a subclass that
        overrides ``on_alloc`` or ``on_access``."""
        if self._asleep is not None:
            self._wake()
        if not self._fused:
            super().on_operator(position, op, accessed)
            return
        # the operator that begins the optimizer takes the Python fused path: there the optimizer's
        # plan (FeatureState._realign_optimizer) re-indexes the previous iteration before this
        # operator is aligned and its allocations take their counterparts, as per notification
        if self._fused_native is not None and not self._pending and not (
                op.phase == "optimizer" and self._state.phase != _OPTIMIZER):
            self._operator_native(position, op, accessed)
            return
        state = self._state
        small = self._small
        fraction = self.small_fraction
        push = self._heap.push
        if op.allocs:
            view = self.view
            # _provisional of a fresh storage: its class is 0 whatever its kind (the view's phase is
            # the operator's when it is told)
            prior = max(position, 0) + self._prior_rows[_PHASES.get(op.phase, 0)][0]
            for sid in op.allocs:
                s = state.alloc(sid, position)[0]
                state.pred[s] = prior
                state.touched[s] = True
                if s >= len(self._skip):
                    self._grow_due()
                self._away[s] = 0
                # NextUsePolicy.on_alloc: class it, then the eviction entry of its prediction (predict())
                skip = small.alloc(sid, view.nbytes(sid)) if fraction else small.small(sid)
                push(-prior, sid, s)
                self._skip[s] = skip
        if accessed:
            slot = state._slot
            touched, away, skip_of = state.touched, self._away, self._skip
            self._pending.extend(accessed)
            for sid in accessed:
                s = slot.get(sid)
                if fraction:
                    small.access(sid)
                if s is not None:
                    touched[s] = True
                    away[s] = 0
                    skip_of[s] = small.small(sid)
        self.on_op(position, op)

    def idle_step(self) -> bool:
        """True where the iteration starts idle (:meth:`~.scheduling.Scheduling._idle`: ``defer_idle``,
        no victim search in the previous iteration, no fallback or online refit) with nothing of
        this policy's away: then no decision point of it would run before the first victim search,
        which rescores every live storage, so the runtime may tell the step's operators there, or
        never if memory is never short (:meth:`Policy.idle_step`). Only once an iteration has been
        told (``_walked``): one that runs short after a step sat out then indexes that one as its
        previous iteration, never none. A subclass whose ``after_op`` may act before that answers
        for itself."""
        return self._walked is not None and self._idle() and not self._away.any()

    @property
    def idles_unbound(self) -> bool:  # type: ignore[override]
        return bool(self.defer_idle and not self._rows)

    def operators_in_bulk(self) -> bool:
        """True where every ``after_op`` of the batch would return nothing and change nothing: the
        fused path, nothing evicted by this policy (so no decision point can fill the prefetch
        heap), no decision point on the worker or put off by the governor, and no subclass that
        changes ``on_operator`` or ``after_op``."""
        cls = type(self)
        return (self._fused and cls.on_operator is PilotPolicy.on_operator and cls.after_op is PilotPolicy.after_op
                and not self._off and self._job is None and self.max_share is None and not self._away.any())

    def stops_in_bulk(self) -> bool:
        """True on the fused path where no subclass changes ``on_operator`` or ``after_op`` and no
        governor reads the clock: :meth:`on_operators` then calls ``after`` at each operator
        where :meth:`_after_op_acts` (and ``after_op`` returns nothing and changes nothing at
        the others)."""
        cls = type(self)
        return (self._fused and cls.on_operator is PilotPolicy.on_operator and cls.after_op is PilotPolicy.after_op
                and self.max_share is None)

    def _after_op_acts(self, position: int) -> bool:
        """Whether :meth:`after_op` at ``position`` may return an action or change this policy's
        state: the negation of its early return (asleep, a worker's decision point to poll, or a
        prefetch entry, stale or not, within ``lookahead`` of ``position``)."""
        if self._asleep is not None or self._job is not None:
            return True
        off = self._off
        if not off:
            return False
        la = self.lookahead
        return la is None or not (off[0][0] - position > la)

    def _stop_limit(self, nxt: int, first: int, op_idx: list[int], n: int) -> int:
        """In a batch whose operator at position ``first + k`` is event ``op_idx[k]``: the index
        just past the first operator from ``nxt`` on where :meth:`_after_op_acts` (the heaps and
        the worker as they are now: it holds at every later position too), ``n + 1`` if none."""
        k = nxt - first
        if k >= len(op_idx):
            return n + 1
        if self._after_op_acts(nxt):
            return op_idx[k] + 1
        off = self._off
        if not off:
            return n + 1
        nu, la = off[0][0], self.lookahead
        last = first + len(op_idx) - 1
        if nu - last > la:  # nu - p only falls as p grows (an infinite nu: never)
            return n + 1
        p = max(nxt, int(nu - la) - 1)  # at or before the first p with not (nu - p > la)
        while nu - p > la:
            p += 1
        return op_idx[p - first] + 1

    def on_operators(self, events: Sequence[tuple[Any, ...]], phase: str, after: Any = None) -> None:
        """The batch's notifications in order (the fused :meth:`on_operator` per operator), and
        what each ``after_op`` would do: poll the worker (operators_in_bulk: nothing else); with
        ``after`` (:meth:`stops_in_bulk`), ``after(position, op)`` right after each operator
        where :meth:`_after_op_acts`, the heaps and the worker as that operator left them. On the
        native kernel, runs of forward operators and deaths go to it in one call
        (:meth:`_operators_native`)."""
        if self._asleep is not None:
            self._wake()
        try:
            self._bulk_phase = phase
            if (self._fused_native is not None and self.batch_kernel and self._shadow is None
                    and type(self).on_free is PilotPolicy.on_free):
                self._operators_native(events, after)
                return
            on_operator = self.on_operator
            native = self._operator_native if self._fused_native is not None else None
            state = self._state
            slots, free_slots, small = state._slot, state._free, self._small
            plain_free = type(self).on_free is PilotPolicy.on_free and self._shadow is None
            for ev in events:
                tag = ev[0]
                if tag == OPERATOR:
                    op = ev[2]
                    self._bulk_phase = phase = op.phase
                    if native is not None and not self._pending and (phase != "optimizer" or state.phase == _OPTIMIZER):
                        native(ev[1], op, ev[3])  # what on_operator picks for it
                    else:
                        on_operator(ev[1], op, ev[3])
                    if after is not None:
                        if self._after_op_acts(ev[1]):
                            after(ev[1], op)
                    elif self._job is not None:
                        self._poll()
                elif tag == TOUCH_ALLOC:
                    self.on_alloc(ev[1], ev[2])
                elif plain_free:  # on_free, inlined: FeatureState.free, then SmallStorages.free
                    sid = ev[1]
                    s = slots.pop(sid, None)
                    if s is not None:
                        if state.phase == 0:
                            state._fwd_freed[sid] = state.log_bytes.item(s)
                        state.active[s] = False
                        state.sid[s] = -1
                        free_slots.append(s)
                    small._live -= small._bytes.pop(sid, 0)
                    small._small.discard(sid)
                else:
                    self.on_free(ev[1])
        finally:
            self._bulk_phase = None

    def _operators_native(self, events: Sequence[tuple[Any, ...]], after: Any = None) -> None:
        """:meth:`on_operators` on the native kernel: an operator of the state's phase past the
        iteration's first (the common kind; in backward, once the mirror is built, one that
        allocates nothing the mirror links) and a death are packed as records (Python keeps what
        only it holds: the slot map and free list, the small-storage classes, the anchor, the
        forward log, the allocation history) and a run of them goes to the kernel in one
        ``dynn_pilot_operators`` call, which writes the feature state, the predictions (replayed or
        prior), the flags and the heap entries as the per-operator kernel call and its Python
        would. The run is handed over (:meth:`_run_native`) before anything that reads or writes
        what the kernel has not written yet: an operator of another kind (its fused path as
        before), a move of the backward mirror (then ``MirrorState._pass_through``, as
        ``FeatureState.enter`` does it), an announcement, a death the anchor's external matching
        could see (a storage of the previous iteration), and a decision point or a poll of the
        worker after an operator (then :meth:`_after_update`). Where ``kernel/pack.c`` is built
        (``native_pack``), its ``walk`` does this loop's work for the operators that need none of
        these but a move of the mirror with no gradient to pass on (its links included) and for
        the deaths, and the loop takes only the others.

        With ``after`` (:meth:`on_operators`), the run is handed over too after each operator
        where :meth:`_after_op_acts`, and ``after`` called: the walk takes the events only up to
        the next such operator (``limit``, found again after every decision point and every
        ``after``: only they change the heaps or the worker)."""
        state = self._state
        small = self._small
        slot = state._slot
        free = state._free
        prev_idx = state._prev_idx
        nbytes_of = self.view.nbytes
        ctx = self._pack_context()
        run, pack, walk = self._packing()
        sl = state.decays[1]
        group = state.group
        if walk is not None:
            wctx = (self, state, sl, group, _NATIVE_IV, _PHASES, OPERATOR, TOUCH_FREE)
            if type(events) is not list:
                events = list(events)
        n_events = len(events)
        limit = n_events + 1  # past the operator whose after_op may act next (none: n_events + 1)
        if after is not None:
            op_idx = [k for k, ev in enumerate(events) if ev[0] == OPERATOR]
            first_op = events[op_idx[0]][1] if op_idx else 0
            limit = self._stop_limit(first_op, first_op, op_idx, n_events)
        seg = events if limit >= n_events else events[:limit]  # the walk's events (the same indices)
        # the records, and per operator its mark (the run's slots, not the slot map's, which is at the
        # run's end): a _Run, or kernel/pack.c's Run with the C packing
        freed: list[int] = []  # the dead storages that report their log_bytes, in order
        widest = 0
        timer = self._timer
        t0 = timer()
        i = 0
        while True:
            if i == limit:  # the operator just told: its after_op may act
                if run:
                    self._run_native(run, freed, widest)
                    widest = 0
                self.bookkeeping_s += timer() - t0
                _, position, op, _ = events[i - 1]
                after(position, op)
                limit = self._stop_limit(position + 1, first_op, op_idx, n_events)
                seg = events if limit >= n_events else events[:limit]
                t0 = timer()
                continue
            if i >= n_events:
                break
            if walk is not None:
                # the common events in C (kernel/pack.c's walk: this loop's work for them, the same writes
                # in the same order); it stops before an event it leaves to this loop, or after an
                # operator whose decision point is due
                i, due, position, tick, widest = walk(seg, i, ctx, wctx, prev_idx, run, freed, widest)
                if due:
                    self._run_native(run, freed, widest)
                    widest = 0
                    self.bookkeeping_s += timer() - t0
                    self._after_update(position, tick)
                    if after is not None:
                        limit = self._stop_limit(position, first_op, op_idx, n_events)
                        seg = events if limit >= n_events else events[:limit]
                    t0 = timer()
                    continue
                if i >= n_events or i == limit:
                    continue  # the end, or the operator's after_op first
            ev = events[i]
            i += 1
            tag = ev[0]
            if tag == OPERATOR:
                position, op, accessed = ev[1], ev[2], ev[3]
                self._bulk_phase = op.phase
                ph = _PHASES.get(op.phase)
                hit = None
                if ph == 1 and ph == state.phase and not state._fwd_log:
                    # FeatureState.enter in backward: the mirror moves to this operator's node and
                    # links the storages it allocates
                    hit = state._fwd_node.get(getattr(op, "node", -1))
                if (ph != state.phase or position == 0 or self._pending or (ph == 1 and state._fwd_log)):
                    if run:
                        self._run_native(run, freed, widest)
                        widest = 0
                    self.bookkeeping_s += timer() - t0
                    if self._pending or (op.phase == "optimizer" and state.phase != _OPTIMIZER):
                        self.on_operator(position, op, accessed)
                    else:
                        self._operator_native(position, op, accessed)
                    if after is not None:  # its after_op: called at the loop's top where it may act
                        limit = self._stop_limit(position, first_op, op_idx, n_events)
                        seg = events if limit >= n_events else events[:limit]
                    elif self._job is not None:
                        self._poll()
                    prev_idx = state._prev_idx  # the optimizer's plan, when it begins, indexes anew
                    t0 = timer()
                    continue
                # _operator_native's Python for an operator of the state's phase past the first, its
                # kernel call left to the run
                if hit is not None and hit[0] != state._mirror:  # the mirror moves
                    relink = state._relink
                    if run and relink and -relink[0][0] >= hit[0]:
                        # MirrorState._pass_through has a gradient to move on: it reads the arrays.
                        # (One whose slot this operator allocates anew is skipped as stale either
                        # way: freed there, of another storage after the allocation's writes.)
                        self._run_native(run, freed, widest)
                        widest = 0
                    state._mirror = hit[0]
                    state._pass_through(hit[0])
                self.ops += 1
                allocs = op.allocs
                prev_allocs = state._align(position, op)
                (_, iv), (_, ivk) = state.native_iv(op)
                na = len(allocs)
                n, top = pack(run, ctx, prev_idx, position, ph, iv, ivk, allocs, prev_allocs, accessed,
                              op.inputs, op.outputs, op.writes)
                if top >= len(self._skip):
                    self._grow_due()
                if n > widest:
                    widest = n
                if hit is not None and allocs:
                    # MirrorState._link, from the sizes (the row's log_bytes as the kernel will write
                    # it: float32(log2(size) / 30)); the kernel writes the targets after the rows
                    relink, first, inputs = state._relink, state._mir_first, hit[1]
                    for sid in allocs:
                        s = slot.get(sid)
                        if s is None:
                            continue
                        own = np.float32(math.log2(max(nbytes_of(sid), 1)) / 30.0)
                        tgt = state._nearest_input(own, inputs)
                        run += (_BATCH_LINK, s, tgt)
                        if tgt >= 0:
                            heapq.heappush(relink, (-int(first[tgt]), s, sid, tgt))
                state.position = position  # FeatureState.enter in the same phase, past the first operator
                if ph == 0:  # indexed for the mirror (a list the mirror replaces when backward starts)
                    state._log_forward(position, op)
                state._hist_allocs = state._hist_allocs * sl + na * (1 - sl)
                if position - state._last_decision >= group:  # FeatureState._tick
                    state._last_decision = position
                    tick = True
                else:
                    tick = False
                # what _after_update would do: nothing unless a decision point is due or the worker holds one
                if tick or self._job is not None or self._force_decision or self._phase != state.phase:
                    self._run_native(run, freed, widest)
                    widest = 0
                    self.bookkeeping_s += timer() - t0
                    self._after_update(position, tick)
                    if after is not None:
                        limit = self._stop_limit(position, first_op, op_idx, n_events)
                        seg = events if limit >= n_events else events[:limit]
                    t0 = timer()
            elif tag == TOUCH_ALLOC:
                if run:
                    self._run_native(run, freed, widest)
                    widest = 0
                self.on_alloc(ev[1], ev[2])
            else:  # on_free, inlined: FeatureState.free (the slot's arrays in the run), SmallStorages.free
                sid = ev[1]
                if sid in prev_idx and run:
                    # a storage of the previous iteration: the anchor's external matching asks whether it
                    # is alive (FeatureState._match_external), so its death waits for the run before it
                    self._run_native(run, freed, widest)
                    widest = 0
                s = slot.pop(sid, None)
                if s is not None:
                    if state.phase == 0:
                        run += (_BATCH_FREE, s, 1)
                        freed.append(sid)
                    else:
                        run += (_BATCH_FREE, s, 0)
                    free.append(s)
                small._live -= small._bytes.pop(sid, 0)
                small._small.discard(sid)
        if run:
            self._run_native(run, freed, widest)
        self.bookkeeping_s += timer() - t0

    def _run_native(self, run: Any, freed: list[int], widest: int) -> None:
        """One ``dynn_pilot_operators`` call over the records of ``run`` (a :class:`_Run`, or
        ``kernel/pack.c``'s ``Run``, whose words the kernel reads where they are; then emptied, as
        ``freed``); an operator whose external storage needs matching returns to Python here
        (FeatureState._match_external, its replays and predictions), and the call goes on after it."""
        state = self._state
        kern = self._kernel
        ft = self._fused_native
        bt = self._batch
        if bt is None or bt.fused is not ft:
            from .kernel import BatchTable

            bt = self._batch = BatchTable(ft, self._prior)
        if widest > ft.n:
            ft.room(max(widest, 2 * ft.n))
        n_words = len(run)
        bt.room(n_words if type(run) is _Run else 0, len(freed))
        t = state._native_tab
        if t is None:
            t = kern.table(state)
        ft.point(t, self._away, self._skip, self._heap, state._cap)
        f, b = ft.f, bt.b
        call = None
        if type(run) is _Run:
            bt.words[:n_words] = run
            b.words = bt.words_addr
            b.n_words = n_words
            b.at = 0
            b.n_freed = 0
            f.announced, f.frontier, f.stack_counter = state._announced, state._frontier, state._stack_counter
        else:
            # the C packing's Run: kernel/pack.c's operators points the call at its int64 words (not
            # copied), sets and takes back the kernel's scalars and calls the kernel, as the lines above
            # and below do around the ctypes call
            from .kernel import pack_module

            call, fn = pack_module().operators, kern.operators_addr
        stopped = -1
        k = 0  # run.mark(k): the first operator not yet matched to a stop
        first = True
        while True:
            if call is not None:
                rc = call(fn, t.addr, bt.addr, run, state, first)
                first = False
            else:
                rc = kern.operators(t.addr, bt.addr)
                state._frontier, state._stack_counter, state._announced = f.frontier, f.stack_counter, f.announced
            if rc == 0:
                break
            if rc != 1:
                if rc == -2:
                    raise MemoryError("pilot native: no memory for the eviction heap")
                raise IndexError(f"pilot native kernel: a slot, class or record of the run is out of range (code {rc})")
            k = run.find(b.at, k)
            _, position, told, acc, acc_slots, ph = run.mark(k)
            stopped = k
            # an external storage's first access: matched and replayed in Python, then predicted (the
            # rc == 1 branch of _operator_native, with the slots of the run's words)
            state._replayed_from = (acc, ft.replay)
            replayed = state.replayed
            for i in ft.match[: f.n_match]:
                s = acc_slots[i]
                state._match_external(s)
                state._replay(acc[i], s, position)
            pred = state.pred
            push = self._heap.push
            row = self._prior_rows[ph]
            base = max(position, 0)
            view = self.view
            for i in range(0, len(told), 2):
                sid, s = told[i], told[i + 1]
                v = replayed.get(sid)
                if v is None:
                    v = base + row[storage_class(view.kind(sid), view.saved(sid), False)]
                pred[s] = v = float(v)
                push(-v, sid, s)
        n_marks = run.n_marks()
        if stopped != n_marks - 1 and n_marks:
            state._replayed_from = (run.mark(n_marks - 1)[3], ft.replay)  # the last operator's replayed next uses
        if freed:
            fwd_freed = state._fwd_freed
            for sid, lb in zip(freed, bt.freed[: b.n_freed].tolist()):
                fwd_freed[sid] = lb
        run.clear()
        freed.clear()

    def _pack_context(self) -> tuple[Any, ...]:
        """What :meth:`_pack_run_op` (and its C twin) read besides the operator, for one
        ``on_operators`` call: the view is the batch's end throughout the call, so a storage's class
        is read once per call (``cls_of``). The order is ``kernel/pack.c``'s (``C_SLOT`` ...); the
        last five are the C packing's alone: the view's record table where the view reads it there,
        the storage-class tables, whether the small-storage classes are the plain ``SmallStorages``
        (whose ``alloc`` and ``access`` it then does itself), and the view's ``recordless`` beside
        its record table."""
        state, view = self._state, self.view
        kind_of, saved_of = view.kind, view.saved

        def classify(sid: int) -> int:
            return storage_class(kind_of(sid), saved_of(sid), False)

        def grow() -> None:
            state._grow(state._cap * 2)  # extends the same free list

        # the live runtime's view reads its record table (Residency: ``st[sid].nbytes``, ``.kind``,
        # ``.saved``): the C packing reads the records there, and ``recordless`` for a sid the table
        # lacks, instead of calling the view
        v = type(view)
        table = (view.st if isinstance(view, Residency) and v.nbytes is Residency.nbytes and v.kind is Residency.kind
                 and v.saved is Residency.saved else None)
        return (state._slot, state._free, grow, view.nbytes, kind_of, saved_of, _KIND_IDX, _TEMP, self._small,
                bool(self.small_fraction), {}, classify, table, _CLASS_OF_KIND, _SAVED_KINDS,
                type(self._small) is SmallStorages, None if table is None else view.recordless)

    def _packing(self) -> tuple[Any, Any, Any]:
        """A bulk call's run, its packing and its walk: ``kernel/pack.c``'s ``Run``, ``pack`` and
        ``walk`` where the module is built and ``native_pack`` is set; else a :class:`_Run`,
        :meth:`_pack_run_op` and no walk (the Python loop takes every event)."""
        if self.native_pack:
            from .kernel import pack_module

            mod = pack_module()
            if mod is not None:
                return mod.Run(), mod.pack, mod.walk
        return _Run(), self._pack_run_op, None

    def _pack_run_op(self, run: _Run, ctx: tuple[Any, ...], prev_idx: dict[int, int], position: int, ph: int,
                     iv: int, ivk: int, allocs: Sequence[int], prev_allocs: Sequence[int], accessed: Sequence[int],
                     inputs: Sequence[int], outputs: Sequence[int], writes: Sequence[int]) -> tuple[int, int]:
        """An operator's record of a run and its mark: the header (``_BATCH_OP``, position, phase row
        and born phase, the idiom vectors' addresses, the counts of allocations, accesses told and
        storages touched, the prior row), its allocations (:meth:`_pack_allocs`), then per storage
        told as accessed its slot, sid, small class and storage class (-1, sid, 0, 0 without a slot;
        the mark's ``told`` gets (sid, slot) of the others), then the slots of what it touches, in
        the order of the set of its inputs, outputs and writes. Returns the most of its
        allocations, accesses told and storages touched, and the largest slot allocated (-1:
        none). ``kernel/pack.c``'s ``pack`` does the same reads and writes in the same order."""
        slot, _, _, _, kind_of, saved_of, _, _, small, fraction, cls_of = ctx[:11]
        h = len(run)  # the header's count of touched storages is known once they are packed
        run += (_BATCH_OP, position, ph, ph, iv, ivk, len(allocs), len(accessed), 0, ph)
        told: list[int] = []
        top = self._pack_allocs(run, allocs, prev_allocs, prev_idx) if allocs else -1
        if fraction:  # SmallStorages.access, inlined (as in _operator_native)
            sizes, smalls, thr = small._bytes, small._small, small.fraction * small._peak
            for sid in accessed:
                s = slot.get(sid)
                if sizes.get(sid, 0) < thr:
                    smalls.add(sid)
                    sk = 1
                else:
                    smalls.discard(sid)
                    sk = 0
                if s is None:
                    run += (-1, sid, 0, 0)
                    continue
                c = cls_of.get(sid)
                if c is None:
                    c = cls_of[sid] = storage_class(kind_of(sid), saved_of(sid), False)
                run += (s, sid, sk, c)
                told += (sid, s)
        else:
            for sid in accessed:
                s = slot.get(sid)
                if s is None:
                    run += (-1, sid, 0, 0)
                    continue
                c = cls_of.get(sid)
                if c is None:
                    c = cls_of[sid] = storage_class(kind_of(sid), saved_of(sid), False)
                run += (s, sid, small.small(sid), c)
                told += (sid, s)
        acc = list({*inputs, *outputs, *writes})
        acc_slots = [slot.get(sid, -1) for sid in acc]
        run += acc_slots
        run[h + 8] = len(acc)
        run.marks.append((len(run), position, told, acc, acc_slots, ph))
        return max(len(allocs), len(accessed), len(acc)), top

    def _pack_allocs(self, words: list[int], allocs: Sequence[int], prev_allocs: Sequence[int],
                     prev_idx: dict[int, int]) -> int:
        """Append an operator's allocations to the kernel's words, eight per storage (slot, sid, kind,
        saved, bytes, its and its match's index in the previous iteration, small), the same for one
        operator's call and a run's record. A storage without a slot takes one here
        (FeatureState._new_slot; the kernel marks the slot active and writes its sid). Returns the
        largest slot (the caller grows the policy's per-slot arrays to it)."""
        state, view, small, fraction = self._state, self.view, self._small, self.small_fraction
        slot, free = state._slot, state._free
        n_prev = len(prev_allocs)
        top = -1
        for i, sid in enumerate(allocs):
            s = slot.get(sid)
            if s is None:
                if not free:
                    state._grow(state._cap * 2)  # extends the same free list
                s = slot[sid] = free.pop()
            if s > top:
                top = s
            nb = view.nbytes(sid)
            words += (s, sid, _KIND_IDX.get(view.kind(sid), _TEMP), 1 if view.saved(sid) else 0, nb,
                      prev_idx.get(sid, -1), prev_idx.get(prev_allocs[i], -1) if i < n_prev else -2,
                      small.alloc(sid, nb) if fraction else small.small(sid))
        return top

    def _operator_native(self, position: int, op: Any, accessed: Sequence[int]) -> None:
        """The fused :meth:`on_operator` and :meth:`on_op`'s per-operator update in one kernel call
        (``dynn_pilot_operator``): Python finds the slots, classes the small storages, aligns the
        operator and moves the backward mirror; the kernel writes the feature state, the
        predictions, the flags and the heap entries. The same state as the Python fused path
        (tests/pilot/test_pilot_operator.py checks it at every decision point)."""
        self.ops += 1
        timer = self._timer
        t0 = timer()
        state = self._state
        view = self.view
        small = self._small
        fraction = self.small_fraction
        slot = state._slot
        allocs = op.allocs
        words: list[int] = []
        prior = 0.0
        born_phase = state.phase
        prev_allocs = state._align(position, op)
        if allocs:
            prior = max(position, 0) + self._prior_rows[_PHASES.get(op.phase, 0)][0]
            if self._pack_allocs(words, allocs, prev_allocs, state._prev_idx) >= len(self._skip):
                self._grow_due()
        if fraction:  # SmallStorages.access, inlined: class each again (the threshold is fixed from here)
            sizes, smalls, thr = small._bytes, small._small, small.fraction * small._peak
            for sid in accessed:
                s = slot.get(sid)
                if sizes.get(sid, 0) < thr:
                    smalls.add(sid)
                    words += (-1, sid, 0) if s is None else (s, sid, 1)
                else:
                    smalls.discard(sid)
                    words += (-1, sid, 0) if s is None else (s, sid, 0)
        else:
            for sid in accessed:
                s = slot.get(sid)
                words += (-1, sid, 0) if s is None else (s, sid, small.small(sid))
        acc = list({*op.inputs, *op.outputs, *op.writes})
        words += [slot.get(sid, -1) for sid in acc]
        (_, iv), (_, ivk) = state.native_iv(op)  # before the table: new decays rebuild it
        kern = self._kernel
        ft = self._fused_native
        n = max(len(allocs), len(accessed), len(acc))
        if n > ft.n:
            ft.room(max(n, 2 * ft.n))
        ft.words[: len(words)] = words
        f = ft.f
        f.position = position
        f.born_phase = born_phase
        f.iv, f.ivk = iv, ivk
        f.n_alloc, f.n_told, f.n_acc = len(allocs), len(accessed), len(acc)
        f.prior = prior
        f.announced = state._announced
        if allocs and op.phase == "backward":
            # the mirror links the allocations by their sizes and indexes every live slot: after
            # their writes (a first call), as in the Python path
            f.stage = 1
            self._operator_call(kern, state, ft)
            f.stage = 2
            ph, new_phase = state.enter(position, op)
        else:
            f.stage = 3
            if state.phase == 0 and position != 0 and op.phase == "forward":
                # FeatureState.enter in forward, past its first operator: the position, and the
                # operator indexed for the mirror
                state.position = position
                state._log_forward(position, op)
                ph, new_phase = 0, False
            else:
                ph, new_phase = state.enter(position, op)
        sl = state.decays[1]
        state._hist_allocs = state._hist_allocs * sl + len(allocs) * (1 - sl)
        f.phase = ph
        f.frontier, f.stack_counter = state._frontier, state._stack_counter
        rc = self._operator_call(kern, state, ft)
        state._frontier, state._stack_counter, state._announced = f.frontier, f.stack_counter, f.announced
        state._replayed_from = (acc, ft.replay)
        if rc == 1:  # an external storage's first access: matched and replayed in Python, then predicted here
            replayed = state.replayed
            for i in ft.match[: f.n_match]:
                sid = acc[i]
                s = slot[sid]
                state._match_external(s)
                state._replay(sid, s, position)
            self._predict_pending(position, accessed, replayed)
        elif f.n_need:  # no replayed next use: the prior (_provisional)
            pred = state.pred
            push = self._heap.push
            row = self._prior_rows[_PHASES.get(op.phase, 0)]
            base = max(position, 0)
            for i in ft.need[: f.n_need]:
                sid = accessed[i]
                s = slot[sid]
                pred[s] = v = float(base + row[storage_class(view.kind(sid), view.saved(sid), False)])
                push(-v, sid, s)
        if new_phase or position - state._last_decision >= state.group:  # FeatureState._tick
            state._last_decision = position
            tick = True
        else:
            tick = False
        self.bookkeeping_s += timer() - t0
        self._after_update(position, tick)

    def _operator_call(self, kern: Any, state: FeatureState, ft: Any) -> int:
        """One ``dynn_pilot_operator`` call on the state's current table, arrays and heap; its code
        (0, or 1: external storages to match in Python); an error for the others."""
        t = state._native_tab
        if t is None:
            t = kern.table(state)
        ft.point(t, self._away, self._skip, self._heap, state._cap)
        rc = kern.operator(t.addr, ft.addr)
        if rc < 0:
            if rc == -2:
                raise MemoryError("pilot native: no memory for the eviction heap")
            raise IndexError(f"pilot native kernel: a slot or counterpart is out of range (code {rc})")
        return rc

    def _predict_pending(self, position: int, sids: Sequence[int], rep: dict[int, int]) -> None:
        """The provisional predictions of the storages just accessed: the counterpart's next use
        in the previous iteration replayed from this access (``rep``), else the prior; each with its
        eviction heap entry."""
        state = self._state
        pred = state.pred
        slot = state._slot
        push = self._heap.push
        follow = self.following
        for sid in sids:
            s = slot.get(sid)
            if s is None:
                continue  # freed since its access
            if follow != "pilot":
                v = self._fallback_prediction(follow, sid, position)
            elif self._exact is not None and self._exact.exact(sid):
                v = self._shadow.predict(sid)
            else:
                v = rep.get(sid)
            if v is None:
                v = self._provisional(position, self.view.kind(sid), self.view.saved(sid), False)
            pred[s] = v = float(v)
            push(-v, sid, s)

    def on_op(self, position: int, op: Any) -> None:
        if self._asleep is not None:
            self._wake()
        self.ops += 1
        if self._exact is not None:
            self._exact.op(position, op)
        timer = self._timer
        t0 = timer()
        state = self._state
        tick = state.op(position, op)
        pending = self._pending
        if pending:
            # the counterpart's next use in the previous iteration, replayed from this access
            self._predict_pending(position, pending, state.replayed if self.replay_provisional else {})
            pending.clear()
        self.bookkeeping_s += timer() - t0
        self._after_update(position, tick)

    def _after_update(self, position: int, tick: bool) -> None:
        """:meth:`on_op` once the state is updated: the worker's results, and the decision point
        (deferred while idle: :meth:`~.scheduling.Scheduling._idle`)."""
        if self._job is not None:
            self._poll()
        if not self._decide(position, tick):
            return
        if self._idle():
            self._defer(position)
            return
        self._decision(position)

    def _decision(self, position: int) -> None:
        """The decision point at ``position`` (the state's last operator): the rows chosen, scored,
        and their predictions into the cache and the heaps."""
        timer = self._timer
        state = self._state
        t0 = timer()
        if self._job is not None:  # the previous decision point's results first (select reads them)
            self._wait(self._job)
            self._merge(self._job)
        self._last_decision = position
        if self._kernel is not None and not self._rows and not state.in_plan():
            self._finish_s = 0.0
            self._on_decision_native(position)
            dt = timer() - t0 - self._finish_s  # the modelled worker's share is not this thread's
            self.inference_s += dt
            self._spent += dt
            return
        live = state.active_slots()
        if not len(live):
            return
        full = self._full_due or not self.incremental or self._rows
        self._full_due = False
        self._grow_due()
        if full:
            rows = live
        else:
            # incremental: rescore what moved since the last decision point and what is due (overdue, or
            # its distance's low quantile may have elapsed); the rest keeps its predicted position
            rows = live[state.touched[live] | (self._due[live] <= position)]
        if not self._rows and self._skip_small():
            rows = rows[self._skip[rows] == 0]  # small storages keep their provisional prediction
        self.decisions += 1
        self.live_total += len(live)
        if len(rows):
            self._score(rows, position, len(live))
        dt = timer() - t0
        self.inference_s += dt
        self._spent += dt

    def _grow_due(self) -> None:
        """``due``, ``_skip`` (per slot, a small storage) and ``_away`` as long as the state's arrays."""
        cap = len(self._state.pred)
        if len(self._due) < cap:
            grown = np.zeros(cap, dtype=np.float64)
            grown[: len(self._due)] = self._due
            self._due = grown
        if len(self._skip) < cap:
            skip = np.zeros(cap, dtype=np.uint8)
            skip[: len(self._skip)] = self._skip
            self._skip = skip
        if len(self._away) < cap:
            away = np.zeros(cap, dtype=np.uint8)
            away[: len(self._away)] = self._away
            self._away = away
        if self._kernel is not None:
            self._pt.set_due(self._due)

    def _on_decision_native(self, position: int) -> bool:
        """on_op's decision point on the native kernel: the same rows as the numpy path (every live
        storage, or the incremental choice), scored in one call (:meth:`_score`'s work, fused). False when no
        storage is live."""
        state = self._state
        full = self._full_due or not self.incremental
        if len(self._due) < state._cap or self._pt.due is not self._due:
            self._grow_due()
        n_live, m = self._kernel.select(state, self._pt, position, full,
                                        self._pt.address_of("skip", self._skip) if self._skip_small() else None)
        if not n_live:
            return False
        self._full_due = False
        self.decisions += 1
        self.live_total += n_live
        if m:
            if self.worker and self._hand_off(m, full):
                self._submit(position, m, n_live)
            else:
                self._score_native(None, m, n_live)
        return True

    def _score_native(self, rows_addr: int | None, m: int, n_live: int, count: bool = False) -> None:
        """Score ``m`` slots (at ``rows_addr``; None: the ones select() chose) in one kernel call;
        ``count``: the kernel counts the live storages for the context row (as features() does).
        Their entries go on the eviction heap in a second call (:meth:`_absorb`)."""
        pt, kern, state = self._pt, self._kernel, self._state
        kern.decide(state, self.model, pt, rows_addr, m, -1 if count else n_live)
        self.candidates += m
        if rows_addr is None:
            rows_addr = state._native_tab.rows_addr
        self._absorb(pt.score_addr, None, pt.sids_addr, rows_addr, m, n_live)

    def _score(self, rows: np.ndarray, position: int, n_live: int) -> None:
        """Score slots ``rows`` at decision point ``position``: features, model, predicted positions,
        when each is due again, cache and heaps. On the native kernel in one call
        (the rows and the context are not materialised) unless the online refit needs them."""
        state = self._state
        planned = state.in_plan()
        if self._kernel is not None and not self._rows and not planned and position == state.position:
            if len(self._due) < state._cap or self._pt.due is not self._due:
                self._grow_due()
            rows = np.ascontiguousarray(rows, dtype=np.int64)
            self._score_native(rows.ctypes.data, len(rows), n_live, count=True)
            return
        state.touched[rows] = False
        sids, X, ctx = state.features(rows)
        self.candidates += len(sids)
        if self._kernel is not None:
            P, score, k = self.model.score(X, ctx, self._expected_len, self.quantile, backend="native")
        else:
            P = self.model.probs(X, ctx)
            score = self.model.expected_log_distance(P, self._expected_len)
            k = None
        # "not again" only for storages that the next iteration does not need either (not persistent)
        never = (P.argmax(axis=1) == P.shape[1] - 1) & (X[:, :3].sum(axis=1) == 0)
        if planned:  # the planned optimizer's replayed next uses are the true ones
            score = plan_scores(X, score)
            never &= X[:, _PREV_AGAIN] == 0
        np.exp(score, out=score)
        score += position
        score[never] = np.inf
        state.pred[rows] = score
        # due again when overdue, or once a low quantile of the distance could have elapsed
        if k is None:
            k = (np.cumsum(P, axis=1) >= self.quantile).argmax(axis=1)
        self._due[rows] = np.minimum(score, position + self.recheck * _LOWER[k])
        if self._refit is not None:
            self._refit.observe(position, sids, X, ctx)
        if self._judge is not None:
            score = self._follow(position, sids, score)
            state.pred[rows] = score
        self._update(sids.tolist(), score.tolist(), rows.tolist(), n_live)

    # ---- fallback -----------------------------------------------------------------------------
    @property
    def judged_recall(self) -> dict[str, float | None]:
        """With ``fallback``: each predictor's window recall over every decision point judged so far in
        this run (the model's as it ranks live); ``{}`` without."""
        if self._judge is None:
            return {}
        return {m: (h / k if k else None) for m, (h, k) in self._judge.totals.items()}

    def _fallback_prediction(self, method: str, sid: int, position: int) -> float | None:
        """``replay``'s or ``lru``'s predicted next-use position of ``sid`` (None: never this iteration)."""
        if method == "replay":
            return self._shadow.predict(sid)
        last = self._last_access.get(sid, -1)
        return position + max(1, position - last)  # used again as long after as it was last used

    def _follow(self, position: int, sids: np.ndarray, pilot: np.ndarray) -> np.ndarray:
        """The decision point's predictions (positions, ``inf`` never): the judge sees every predictor's,
        and the one it chooses is followed until the next decision point."""
        judge = self._judge
        scores = {"pilot": pilot}
        ids = sids.tolist()
        for m in judge.methods[1:]:
            vals = [self._fallback_prediction(m, sid, position) for sid in ids]
            scores[m] = np.array([math.inf if v is None else float(v) for v in vals], dtype=np.float64)
        exact = self._exact
        if exact.in_sync:  # the model side: replay's prediction where its plan has held exactly
            on = np.fromiter(map(exact.exact, ids), dtype=bool, count=len(ids))
            if on.any():
                scores["pilot"] = pilot = np.where(on, scores["replay"], pilot)
        judge.decision(position, sids, scores)
        self.following = follow = judge.choice()
        self.followed[follow] = self.followed.get(follow, 0) + 1
        return scores[follow] if follow != "pilot" else pilot

    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        if self._asleep is not None:
            self._wake()
        if self._job is not None:
            self._poll()
        self._searching()  # the first search of the iteration: deferred decision points caught up first
        slot = self._state._slot
        status = self.view.status
        inner = super().victims(need_bytes, exclude)
        try:
            for sid in inner:
                self._away[slot[sid]] = 1
                if self.small_evicted and not self._small_scored:
                    self._small_scored = True  # the first small victim: score them all from the next op
                    self._force_decision = True
                yield sid
                # asked for the next one: still resident, the mechanism refused it (pinned, held
                # for now), so it is not away (the last one offered was taken: the caller stops then)
                if status(sid) == "resident":
                    self._away[slot[sid]] = 0
        finally:
            inner.close()  # its own finally puts back the entries it skipped, now, not at collection

    def after_op(self, position: int) -> list[Action]:
        if self._asleep is not None:
            self._wake()
        if self._job is not None:
            self._poll()
        actions = super().after_op(position)
        if actions:
            away = self._away
            slot = self._state._slot
            for a in actions:
                away[slot[a.sid]] = 0
        return actions

    def predict(self, sid: int) -> float | None:
        state = self._state
        s = state._slot.get(sid)
        if s is not None:
            v = state.pred.item(s)
            if v == v:
                return None if v == math.inf else v
        return self.view.position + 1  # never predicted this iteration: keep it


