"""The ``pilot`` policy: Belady eviction and prefetch over next uses predicted by the pilot model.

It reads only what the live runtime can give (the :class:`~dynn_runtime.policies.MemoryView`
protocol's ``position``, ``phase``, ``nbytes``, ``kind``, ``saved``, ``status``, ``resident``,
``offloaded``, ``free_bytes``; the notifications; ``context["history"]``), never the current
iteration's future.

How a prediction is made and kept (why):

1. At a decision point (every ``decision_every`` operators and at every phase change) every live storage is
   scored in one batch (:meth:`PilotModel.probs`; by default features, network and the arithmetic
   below run in one call of the native kernel, :mod:`.native`, ``backend="numpy"`` keeps it all in
   numpy: same decisions); the expected log next-use distance under the
   bucket probabilities orders them, ``position + exp(that)`` is the cached predicted position. A
   storage whose most likely bucket is "not again this iteration" and that is not persistent
   (parameter, buffer, optimizer state) predicts ``None``.
2. Between decision points :meth:`predict` reads the cache. A storage allocated or accessed since the
   last decision point gets a provisional prediction: its replayed next use (rule 9) or a small
   prior table shipped with the weights (median next-use distance right after an access, by phase
   and storage class), so per-access cost is a dictionary write.
3. After a decision point only the rescored storages' entries change: their cache values are
   updated and new entries pushed on the eviction (resident) or prefetch (offloaded) heap; the older
   entries no longer match the cache, so ``NextUsePolicy`` skips them as stale, and a heap is compacted
   when it holds more than 4x the live storages (+1024). No O(live) rebuild per decision point.
   The cache is the feature state's per-slot ``pred`` (NaN: nothing predicted this iteration), so
   that the kernel writes it; on the native backend the eviction heap is the kernel's too
   (:class:`~dynn_runtime.pilot.native.NativeHeap`: same pop order as heapq over the same entries,
   stale entries skipped in C), and a decision point's rows enter it in the kernel (``dynn_pilot_merge``)
   with no Python per row. Measured: the same simulated runs on the small grid, every cell.
4. Weights load on first use (``attach``), not at import. Inference is numpy only: no torch operator
   runs inside the runtime's dispatch mode.
5. Incremental rescoring (``incremental=True``, the default): a decision point rescores (a) the
   storages allocated or accessed since the last one, (b) those whose predicted position has passed
   (the prediction was wrong), (c) those *due*: scored at ``t`` with bucket probabilities whose
   ``quantile`` (10%) falls in a bucket starting at ``L`` operators, a storage is due at
   ``t + recheck * L`` (``recheck`` 0.25). The others keep their predicted *position* (not a
   distance, so it stays valid while nothing happens to the storage). A far prediction is coarse
   (an octave: the buckets go up to 16384 operators; with one "later" bucket past 256, far
   storages were due every 64 operators and the rows scored per decision point grew with the
   model's depth) and gets precise only when rescored closer: keeping it until its predicted
   position comes within a fixed horizon (128; measured with the former buckets) lost up to
   36% of simulated time (evoformer small at 1/4: 2.03x vs 1.49x; moe at 1/8: 2.80x vs 2.22x), and
   rescoring a rotating share of the rest up to 24%; (c) rescores a storage before the earliest time
   it could plausibly be needed. Every phase change
   rescores everything. Measured at 1/2, 1/4, 1/8 on the small zoo traces: within 1.7% of full
   rescoring's simulated time with 1.5-2x fewer rows scored; on the reduced-knob `large` recordings
   of skipnet, tree_lstm and moe within 2.7%. ``recheck`` 0.35 scored 2.2-2.9x fewer rows and was
   within 1.5% on the small traces, but lost 10% on skipnet's `large` recording at 1/2.
6. Optional online refit (``online=True``): the feature rows of a sample of each decision point are
   kept; when the next iteration begins, ``context["history"][-1]`` (the iteration just finished)
   labels them, and every ``refit_every`` iterations the model is fine-tuned on them in numpy
   (:class:`~dynn_runtime.pilot.online.OnlineRefit`); with it every decision point rescores everything.
7. Optional cost governor (``max_share=0.02``): decision points are put off while the inference
   time spent so far exceeds ``max_share`` of the elapsed device time, read from ``view.now()``
   (simulated seconds in the simulator, wall seconds in the live runtime); a phase change's full
   rescoring waits for the next allowed point. Between decision points storages keep their
   provisional or last predictions.
8. Small storages are not scored. ``NextUsePolicy`` offers storages under ``small_fraction`` (1e-4) of
   the footprint as victims only after every larger one (:class:`~dynn_runtime.policies.base.SmallStorages`:
   a copy's fixed latency makes moving them a loss); as long as none of them has had to leave,
   their order never matters, so they keep the provisional prediction and are left out of the rows
   (the native kernel's ``select`` skips them): the same decisions, 1.7-8x fewer rows on the small
   zoo traces at 1/2 (evoformer 269 -> 35, moe 241 -> 103). Once one is offered, a decision point
   comes at the next operator and every later one scores them too (sticky for the run: memory is
   that short).
9. Between decision points an accessed storage is predicted by its counterpart's next use replayed
   (``provisional="replay"``, the default; :attr:`FeatureState.replayed`: after its k-th access here,
   the counterpart's (k+1)-th access came that many operators after its k-th), and by the prior of
   rule 2 where the counterpart has no next access or there is none. The heap entry of an access is
   pushed in ``on_op``, once that is known (one push per access, as before). Measured on the small
   zoo traces (seeds 0 and 10) and tiny x8 depth at 1/2, 1/4, 1/8 against the prior alone: equal
   or faster in 31 of 38 cases (moe small 1/8 +7.4% -> +3.3% over the oracle, varlen small 1/4
   +7.9% -> +4.8%, varlen x8 1/8 +3.7% -> +0.9%), at most 2.2% slower in the others (skipnet
   small seed 10 at 1/4, still 12% under the oracle; evoformer small 1/8 +1.8% -> +3.2%). With
   sparse decision points it matters most (every 512 operators, moe small 1/8: 2.18x -> 1.87x;
   under the 2% governor, varlen small 1/2: 2.50x -> 1.48x).
10. Host time. :attr:`host_seconds` is what the policy has spent on the host: measured (inference
   and the per-operator update), or charged by a cost model ``host_cost=(per decision point, per
   row scored, per operator)`` seconds, which makes a simulated run deterministic and lets a tool
   charge the cost of a bigger or smaller machine. The governor (rule 7) reads the same charge.
   The simulator's host timeline (``simulate(..., host_timeline=True)``, rule 8 of
   :mod:`dynn_runtime.sim.engine`) puts it on the thread that issues the operators, so what it
   costs the iteration is what the device waits for, not the sum.
11. Inference on a worker thread (``worker=True``, native backend; opt-in). At a decision point the
   issuing thread chooses the rows and gathers their feature rows (the state changes under a
   worker, so it cannot read the state itself), clears their touched flags, and hands the network
   and the arithmetic of rule 1 and 5 to one worker thread (``dynn_pilot_finish``; ctypes releases
   the GIL). When the results are in (polled at the next ``on_op``, ``victims`` or ``after_op``)
   the issuing thread merges them (``dynn_pilot_merge``), skipping every storage touched since the
   gather: its provisional prediction is newer. A decision point that finds the previous one in
   flight waits for it (charged as host time). In the simulator the worker is modelled on the
   host clock (``view.host_now()``) with ``worker_cost`` (default :data:`WORKER_COST`), so runs are
   deterministic; a free worker gives the synchronous run exactly. Where the view has no host clock
   (the live runtime) it is a real thread. Measured (docs/pilot-lab-notes.md, "In the simulator"): the issuing thread's share is
   8.2 us + 0.065 us per row (:data:`HANDOFF_COST`: one kernel call gathers the rows, their slots and
   clears their touched flags into buffers kept between decision points) instead of ~14 us + 0.33
   us, but the results land operators later, which costs decisions on some cells (skipnet `small`
   1/4 +3.8%, evoformer `small` 1/8 +6.6% with the default worker cost), so ``worker=True`` (every
   decision point on the worker) is for experiments; the default is rule 12.
12. Where inference runs (``worker="auto"``, the default). Deciding on the issuing thread costs the
   iteration nothing while the device has enough issued work queued to run meanwhile; it is on the
   critical path when the device is waiting for the host (small operators at the launch floor). So a
   decision point goes to the worker only when ``view.device_slack()`` (the simulator: its device
   clock ahead of its host clock; the live runtime: the CUDA event recorded at the previous call is
   still pending) is under ``slack_margin`` (10) times the decision's host cost (``host_cost``, or
   :data:`SYNC_COST`), and never a full rescoring (at a phase change every prediction is replaced;
   late ones cost most there: large early_exit 1/2 +6.0% -> 0.0%). No slack known (an untimed
   simulation, a CPU device): every decision here, the synchronous run exactly. Measured on the h100
   host timeline (docs/pilot-lab-notes.md): inference exposed at most 1.7% of the iteration on every `small`
   and `large` cell (synchronous: up to 17.7%, moe `small` 1/2), decisions as synchronous where the
   device is busy with copies (skipnet 1/4, evoformer 1/8).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._log import logger as _log
from ..errors import PolicyError
from ..policies.base import Action, register
from ..policies.nextuse import NextUsePolicy
from .features import BUCKET_EDGES, FeatureState

__all__ = ["PilotPolicy", "default_weights_path"]

_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
_CLASS_OF_KIND = {"param": 1, "buffer": 1, "opt_state": 1, "grad": 3, "activation": 2, "input": 4, "temp": 4}
#: lower end (operators) of each fine bucket's distances; "not again" counted as twice the last edge
_LOWER = np.asarray((1,) + BUCKET_EDGES[:-1] + (BUCKET_EDGES[-1], 2 * BUCKET_EDGES[-1]), dtype=np.float64)
_PHASES = {"forward": 0, "backward": 1, "optimizer": 2}
#: rule 11: the worker's seconds per decision point and per row (``dynn_pilot_finish``), where it is
#: modelled; measured best of 100 on the 2-core development CPU (docs/pilot-lab-notes.md "Inference cost")
WORKER_COST = (8e-6, 0.26e-6)
#: rule 11: the issuing thread's seconds per decision point and per row handed to the worker
#: (gather and merge), where they are charged by ``host_cost``; measured likewise
HANDOFF_COST = (8.2e-6, 0.065e-6)
#: rule 12: the seconds per decision point and per row of deciding on the issuing thread, for the
#: choice between it and the worker when no ``host_cost`` says; measured likewise (``cost``'s fit)
SYNC_COST = (14e-6, 0.33e-6)


def default_weights_path() -> Path:
    """The weights shipped in the package (trained on the zoo; provenance in ``zoo.json`` beside it)."""
    return _WEIGHTS_DIR / "zoo.npz"


_MODEL_CACHE: dict[str, Any] = {}


def _load(path: Path) -> Any:
    from .model import load_model

    key = str(path)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = None
    hit = _MODEL_CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    model = load_model(path)
    _MODEL_CACHE[key] = (stamp, model)
    return model


def _seconds(value: Any, name: str, per: tuple[str, ...]) -> tuple[float, ...] | None:
    """A cost model option (rules 10, 11): None, or ``len(per)`` non-negative finite seconds."""
    if value is None:
        return None
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        out = ()
    if len(out) != len(per) or not all(math.isfinite(v) and v >= 0 for v in out):
        raise PolicyError(f"policies: pilot {name} must be {len(per)} non-negative seconds ({', '.join(per)}), "
                          f"got {value!r}.")
    return out


def storage_class(kind: str, saved: bool, fresh: bool) -> int:
    """Row of the provisional prior: 0 just allocated, 1 persistent, 2 saved activation, 3 gradient, 4 other."""
    if fresh:
        return 0
    if saved and kind in ("activation", "temp", "input"):
        return 2
    return _CLASS_OF_KIND.get(kind, 4)


@register
class PilotPolicy(NextUsePolicy):
    """Next uses predicted by the pilot model (DyNN-Offload); see the module docstring."""

    name = "pilot"
    reads_modules = True
    reads_saved = True
    requires = frozenset({"pilot"})
    description = "Belady over next uses predicted by the learned pilot model (idiom features)"
    #: operators between decision points (plus one at every phase change). Measured on the small
    #: zoo traces at 1/8 and 1/4: 32 simulates as fast as 16 (moe 2.17x vs 2.13x, skipnet 2.32x vs
    #: 2.33x) at half the inference cost; 64 starts to lose (varlen 2.20x vs 2.04x).
    decision_every: int = 32
    #: rule 5: rescore only what moved, what is overdue and what is due (True), or every live
    #: storage at every decision point (False)
    incremental: bool = True
    #: rule 5: a storage not touched is rescored once the time since it was scored reaches this
    #: fraction of a low quantile (``quantile``) of its predicted next-use distance
    recheck: float = 0.25
    quantile: float = 0.1
    #: rule 9: between decision points an accessed storage is predicted by its counterpart's next use
    #: in the previous iteration after the same occurrence ("replay"), or by the prior only ("prior")
    provisional: str = "replay"
    #: rule 12: with ``worker="auto"`` a decision point is taken on the issuing thread only when the
    #: device's queued work covers this many times its host cost. Measured on the small zoo traces
    #: (h100 host timeline): 1 and 3 left moe's host-bound cells at 3-7% exposed (deciding there used
    #: up slack the dispatch of the next operators needed), 10 gave 0.7-5.2%, 30 lost skipnet 1/4
    #: and evoformer 1/8 to the worker's late results (+7.5%, +17.6%).
    slack_margin: float = 10.0

    def __init__(self, weights: str | Path | None = None, online: bool = False, refit_every: int = 4,
                 model: Any = None, group: int | None = None, incremental: bool | None = None,
                 recheck: float | None = None, quantile: float | None = None, max_share: float | None = None,
                 timer: Any = None, backend: str | None = None, provisional: str | None = None,
                 host_cost: tuple[float, float, float] | None = None, worker: bool | str = "auto",
                 worker_cost: tuple[float, float] | None = None,
                 handoff_cost: tuple[float, float] | None = None) -> None:
        super().__init__()
        self._weights = Path(weights) if weights is not None else default_weights_path()
        if model is None and not self._weights.is_file():
            raise PolicyError(
                f"policies: pilot needs trained weights; {str(self._weights)!r} does not exist. Train them with "
                "`dynn pilot train --traces ... -o FILE` and pass weights=FILE.")
        if max_share is not None and not 0 < float(max_share) <= 1:
            raise PolicyError(f"policies: pilot max_share must be in (0, 1], got {max_share!r}.")
        if backend not in (None, "auto", "native", "numpy"):
            raise PolicyError(f"policies: pilot backend must be 'native', 'numpy' or None (auto), got {backend!r}.")
        if provisional not in (None, "replay", "prior"):
            raise PolicyError(f"policies: pilot provisional must be 'replay' or 'prior', got {provisional!r}.")
        if provisional is not None:
            self.provisional = provisional
        host_cost = _seconds(host_cost, "host_cost", ("per decision point", "per row scored", "per operator"))
        #: rule 10: a cost model (seconds per decision point, per row scored, per operator) charged
        #: instead of the measured time, for the governor and :attr:`host_seconds`; None: measured
        self.host_cost = host_cost
        worker_cost = _seconds(worker_cost, "worker_cost", ("per decision point", "per row scored"))
        #: rule 11: the network runs on a worker thread (the issuing thread gathers the rows and
        #: merges the results); ``worker_cost``: the worker's seconds per decision point and per row
        #: where the worker is modelled (the simulator), default :data:`WORKER_COST`
        if worker not in (False, True, "auto"):
            raise PolicyError(f"policies: pilot worker must be False, True or 'auto', got {worker!r}.")
        self.worker: bool | str = worker
        self.worker_cost = worker_cost if worker_cost is not None else WORKER_COST
        handoff_cost = _seconds(handoff_cost, "handoff_cost", ("per decision point", "per row handed off"))
        #: rule 11: the issuing thread's share of a decision point handed to the worker, charged
        #: instead of ``host_cost``'s first two terms where ``host_cost`` is set
        self.handoff_cost = handoff_cost if handoff_cost is not None else HANDOFF_COST
        self._model = model
        self._online = online
        self._group = group
        if incremental is not None:
            self.incremental = bool(incremental)
        if recheck is not None:
            self.recheck = float(recheck)
        if quantile is not None:
            self.quantile = float(quantile)
        #: rule 7: inference time / elapsed device time (``view.now()``) kept at or under this
        self.max_share = None if max_share is None else float(max_share)
        self._timer = timer or time.perf_counter
        self._refit_every = refit_every
        self._refit = None
        #: inference backend: "native" (the C kernel, dynn_runtime.pilot.native), "numpy", or None:
        #: native when it is available; after attach, the one in use
        self.backend = backend
        self._kernel = None
        self._state: FeatureState | None = None
        self._heap: Any = None
        self._pending: list[int] = []
        self._due = np.zeros(0, dtype=np.float64)
        self._skip = np.zeros(0, dtype=np.uint8)
        #: rule 3: per slot, a storage this policy evicted and has not seen back (the prefetch heap's)
        self._away = np.zeros(0, dtype=np.uint8)
        #: rule 8: small storages are scored (one was offered as a victim); a decision point is due now
        self._small_scored = False
        self._force_decision = False
        #: decision points, and seconds spent in feature building + inference (cost report)
        self.decisions = 0
        self.inference_s = 0.0
        #: seconds in the per-operator feature-state update (every operator, not only decisions)
        self.bookkeeping_s = 0.0
        #: rows scored, summed over decision points; live storages at them, summed
        self.candidates = 0
        #: rule 11: decision points handed to the worker, and their rows (in the counts above too)
        self.handoffs = self.handoff_rows = 0
        self.live_total = 0
        #: decision points the governor put off (rule 7)
        self.deferred = 0
        #: operators seen (on_op calls), for the per-operator term of ``host_cost``
        self.ops = 0
        #: rule 11: the decision point in flight on the worker (None: none), the worker's clock where
        #: it is modelled (host seconds), host seconds the issuing thread waited for it, results
        #: merged and dropped (the iteration ended first), the thread pool where it is real
        self._job: _Job | None = None
        self._worker_free = 0.0
        self.wait_s = 0.0
        self.merged = self.dropped = 0
        self._pool: Any = None
        self._buf = _Job()

    @property
    def host_seconds(self) -> float:
        """Host seconds spent so far (rule 10): the ``host_cost`` model's charge when one is set,
        else the measured inference and per-operator bookkeeping (``on_op``; the notifications'
        dictionary writes are not timed)."""
        if self.host_cost is None:
            return self.inference_s + self.bookkeeping_s + self.wait_s
        return self._inference_spent() + self.ops * self.host_cost[2]

    def _inference_spent(self) -> float:
        """Seconds of inference so far, as the governor counts them (rule 7): measured, or the
        ``host_cost`` model's charge for the decision points and rows scored (rule 10)."""
        if self.host_cost is None:
            return self._spent + self.wait_s
        a, b, _ = self.host_cost
        ha, hb = self.handoff_cost
        return ((self.decisions - self.handoffs) * a + (self.candidates - self.handoff_rows) * b
                + self.handoffs * ha + self.handoff_rows * hb + self.wait_s)

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = _load(self._weights)
        return self._model

    def attach(self, view: Any) -> None:
        super().attach(view)
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
        if self.worker and (self._kernel is None or self._online):
            if self.worker is True:  # asked for; "auto" (the default) just decides here
                _log.info("pilot: worker=True needs the native kernel and no online refit; deciding on the "
                          "issuing thread (%s)", "online refit" if self._online else native.reason())
            self.worker = False
        self._prior = np.exp(model.arrays["prior"].astype(np.float64))
        self._prior_rows = self._prior.tolist()  # the same float64 values, read without numpy indexing
        self._clock0 = self._clock()
        self._spent = 0.0
        if self._online and self._refit is None:
            from .training.online import OnlineRefit

            self._refit = OnlineRefit(model, refit_every=self._refit_every)

    def _clock(self) -> float:
        now = getattr(self.view, "now", None)
        return float(now()) if now is not None else 0.0

    def begin_iteration(self, index: int, context: dict | None = None) -> None:
        super().begin_iteration(index, context)
        history = (context or {}).get("history") or []
        if self._refit is not None:
            new = self._refit.end_iteration(history)
            if new is not None:
                self._model = new
        state = self._state
        state.begin_iteration(index, history)
        state.pred[:] = np.nan  # rule 3: nothing predicted yet this iteration
        self._pending = []
        self._heap = _PyHeap() if self._kernel is None else self._kernel.new_heap()
        self._off = []
        self._away[:] = 0
        self._expected_len = self._state.expected_length()
        if self._kernel is not None:
            from .model import _log_bucket_reps

            pt = self._pt
            pt.set_logreps(_log_bucket_reps(self._expected_len))
            pt.q.quantile, pt.q.recheck = self.quantile, self.recheck
        self._phase = -1
        self._last_decision = -(1 << 30)
        self._full_due = True
        if self._job is not None:  # rule 11: predictions for the iteration that ended
            if self._job.future is not None:
                self._job.future.result()  # its buffers are used again
            self._job = None
            self.dropped += 1
        self._worker_free = 0.0

    # ---- notifications ------------------------------------------------------------------------
    def _provisional(self, position: int, kind: str, saved: bool, fresh: bool) -> float:
        """Rule 2's prior: position + the median next-use distance of its phase and storage class."""
        cls = storage_class(kind, saved, fresh)
        return max(position, 0) + self._prior_rows[_PHASES.get(self.view.phase, 0)][cls]

    def on_alloc(self, sid: int, position: int) -> None:
        state = self._state
        s, kind, saved = state.alloc(sid, position)
        state.pred[s] = self._provisional(position, kind, saved, position >= 0)
        state.touched[s] = True
        if s >= len(self._skip):
            self._grow_due()
        self._away[s] = 0
        super().on_alloc(sid, position)
        self._skip[s] = self._small.small(sid)

    def on_access(self, sid: int, position: int) -> None:
        # the provisional prediction is set in on_op, once the replayed next use is known (rule 9);
        # the prior is computed there only for the storages that have none. Until then a storage
        # keeps its last prediction (one never predicted is kept: see predict)
        state = self._state
        s = state.slot_of(sid)
        if s is not None:
            state.touched[s] = True
            self._away[s] = 0
        if self.small_fraction:
            self._small.access(sid)
        # rule 9: the eviction heap's entry is pushed in on_op, once the replayed next use is known
        self._pending.append(sid)
        if s is not None:
            self._skip[s] = self._small.small(sid)

    def on_free(self, sid: int) -> None:
        self._state.free(sid)
        super().on_free(sid)

    def on_hint(self, hint: Any) -> None:
        t0 = self._timer()
        self._state.hint(hint)
        self.bookkeeping_s += self._timer() - t0

    def _skip_small(self) -> bool:
        """Rule 8: whether the small storages are left out of scoring now: yes, unless one of them
        had to be offered as a victim in this run (memory is then so short that their order
        matters, and every later decision point scores them too)."""
        return self._small.fraction > 0 and not self.small_evicted

    def _decide(self, position: int, tick: bool) -> bool:
        """Whether operator ``position`` is a decision point: the feature state's rule (every
        ``decision_every`` operators, phase changes), or under a governor (rule 7) the same points
        put off while inference has used more than ``max_share`` of the elapsed device time."""
        ph = self._state.phase
        if ph != self._phase:
            self._phase = ph
            self._full_due = True
            tick = True
        if self._force_decision:
            self._force_decision = False
            tick = True
        if self.max_share is None:
            return tick
        due = self._full_due or position - self._last_decision >= self.decision_every
        if not due:
            return False
        if self._inference_spent() > self.max_share * (self._clock() - self._clock0):
            self.deferred += tick
            return False
        return True

    def on_op(self, position: int, op: Any) -> None:
        self.ops += 1
        timer = self._timer
        t0 = timer()
        state = self._state
        tick = state.op(position, op)
        pending = self._pending
        if pending:
            # rule 9: the counterpart's next use in the previous iteration, replayed from this access
            rep = state.replayed if self.provisional == "replay" else {}
            pred = state.pred
            slot = state._slot
            push = self._heap.push
            for sid in pending:
                s = slot.get(sid)
                if s is None:
                    continue  # freed since its access
                v = rep.get(sid)
                if v is None:
                    v = self._provisional(position, self.view.kind(sid), self.view.saved(sid), False)
                pred[s] = v = float(v)
                push(-v, sid, s)
            pending.clear()
        self.bookkeeping_s += timer() - t0
        if self._job is not None:
            self._poll()
        if not self._decide(position, tick):
            return
        t0 = timer()
        if self._job is not None:  # rule 11: the previous decision point's results first (select reads them)
            self._wait(self._job)
            self._merge(self._job)
        self._last_decision = position
        if self._kernel is not None and self._refit is None:
            self._finish_s = 0.0
            self._on_decision_native(position)
            dt = timer() - t0 - self._finish_s  # rule 11: the modelled worker's share is not this thread's
            self.inference_s += dt
            self._spent += dt
            return
        live = state.active_slots()
        if not len(live):
            return
        full = self._full_due or not self.incremental or self._refit is not None
        self._full_due = False
        self._grow_due()
        if full:
            rows = live
        else:
            # rule 5: rescore what moved since the last decision point and what is due (overdue, or
            # its distance's low quantile may have elapsed); the rest keeps its predicted position
            rows = live[state.touched[live] | (self._due[live] <= position)]
        if self._refit is None and self._skip_small():
            rows = rows[self._skip[rows] == 0]  # rule 8
        self.decisions += 1
        self.live_total += len(live)
        if len(rows):
            self._score(rows, position, len(live))
        dt = timer() - t0
        self.inference_s += dt
        self._spent += dt

    def _grow_due(self) -> None:
        """``due`` and ``_skip`` (rule 8: per slot, a small storage) as long as the state's arrays."""
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
        storage, or rule 5's), scored in one call (:meth:`_score`'s work, fused). False when no
        storage is live."""
        state = self._state
        full = self._full_due or not self.incremental
        if len(self._due) < state._cap or self._pt.due is not self._due:
            self._grow_due()
        n_live, m = self._kernel.select(state, self._pt, position, full,
                                        self._skip.ctypes.data if self._skip_small() else None)
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

    # ---- rule 11: the network on a worker thread ------------------------------------------------
    def _hand_off(self, m: int, full: bool) -> bool:
        """Whether a decision point of ``m`` rows (``full``: every live storage, at a phase change)
        goes to the worker: always with ``worker=True``; with ``"auto"`` (rule 12) never when full,
        else only when the device has less work queued than ``slack_margin`` times what deciding
        here would take (``view.device_slack()``). No slack known (no host timeline, a CPU
        device): decide here."""
        if self.worker is True:
            return True
        if full:
            return False
        slack_of = getattr(self.view, "device_slack", None)
        slack = slack_of() if slack_of is not None else None
        if slack is None:
            return False
        a, b = self.host_cost[:2] if self.host_cost is not None else SYNC_COST
        return slack < self.slack_margin * (a + b * m)

    def _submit(self, position: int, m: int, n_live: int) -> None:
        """Gather the ``m`` chosen rows' features here (the state changes under the worker), clear
        their touched flags (a storage touched before the results come back keeps its newer
        provisional prediction), and hand the network to the worker."""
        state, kern, pt = self._state, self._kernel, self._pt
        job = self._buf = self._buf.start(position, m, n_live)
        xa, ca, la, ia = job.addr[:4]
        kern.gather(state, state._native_tab.rows_addr, m, n_live, xa, ca, ia, la)
        self.candidates += m
        self.handoffs += 1
        self.handoff_rows += m
        mt = kern.model_table(self.model)
        args = (mt, job.X, m, job.ctx, pt.logreps, pt.lower, self.quantile, self.recheck, position, job.score, job.due)
        if self._pool is None and getattr(self.view, "host_now", None) is None:
            # rule 11: modelled where the view keeps a host clock (the simulator), a real thread otherwise
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynn-pilot")
        if self._pool is not None:
            job.future = self._pool.submit(kern.finish, *args)
        else:
            # modelled (the simulator): computed now, visible once the worker would have finished it.
            # The worker starts once the issuing thread has gathered the rows: the host_cost charge,
            # or at once when the time is measured (a wall-clock time here would make runs vary)
            timer = self._timer
            t0 = timer()
            kern.finish(*args)
            self._finish_s = timer() - t0
            spent = 0.0 if self.host_cost is None else self.handoff_cost[0] + m * self.handoff_cost[1]
            a, b = self.worker_cost
            start = max(self.view.host_now() + spent, self._worker_free)
            job.ready = self._worker_free = start + a + b * m
        self._job = job
        if job.future is None and job.ready <= self.view.host_now():
            self._merge(job)  # a worker that costs nothing: the same run as deciding here

    def _ready(self, job: _Job) -> bool:
        if job.future is not None:
            return job.future.done()
        return self.view.host_now() >= job.ready

    def _wait(self, job: _Job) -> None:
        """Block until ``job`` is done: a real wait, or the modelled one charged as host time."""
        if job.future is not None:
            job.future.result()
            return
        lag = job.ready - self.view.host_now()
        if lag > 0:
            self.wait_s += lag

    def _merge(self, job: _Job) -> None:
        """The results into the cache (``pred``), ``due`` and both heaps, for the rows whose storage
        was not touched since they were gathered (``dynn_pilot_merge``)."""
        self._job = None
        if job.future is not None:
            job.future.result()  # re-raises what the worker raised
        if len(self._due) < self._state._cap:
            self._grow_due()
        _, _, la, ia, sa, da = job.addr
        self.merged += self._absorb(sa, da, ia, la, job.m, job.n_live)

    def _absorb(self, score_addr: int, due_addr: int | None, sids_addr: int, slots_addr: int, m: int,
                n_live: int) -> int:
        """Rule 3 on the native backend: ``m`` scored rows onto the eviction heap in one kernel call,
        the rescored storages this policy evicted onto the prefetch heap, then compaction.
        ``due_addr`` not None: results back from the worker (rule 11; see ``NativeKernel.merge``).
        Returns the rows merged."""
        out = self._away_out
        if len(out[0]) < m:
            out = self._away_out = (np.empty(2 * m, dtype=np.int64), np.empty(2 * m, dtype=np.float64))
        merged, na = self._kernel.merge(self._state, self._heap, score_addr, due_addr, sids_addr, slots_addr, m,
                                        self._due, self._away, out)
        if na:
            off = self._off
            for v, sid in zip(out[1][:na].tolist(), out[0][:na].tolist()):
                heapq.heappush(off, (v, sid))
        self._compact_heaps(n_live)
        return merged

    def _score_native(self, rows_addr: int | None, m: int, n_live: int, count: bool = False) -> None:
        """Score ``m`` slots (at ``rows_addr``; None: the ones select() chose) in one kernel call;
        ``count``: the kernel counts the live storages for the context row (as features() does).
        Their entries go on the eviction heap in a second call (rule 3)."""
        pt, kern, state = self._pt, self._kernel, self._state
        kern.decide(state, self.model, pt, rows_addr, m, -1 if count else n_live)
        self.candidates += m
        if rows_addr is None:
            rows_addr = state._native_tab.rows_addr
        self._absorb(pt.score_out.ctypes.data, None, pt.sids_out.ctypes.data, rows_addr, m, n_live)

    def _score(self, rows: np.ndarray, position: int, n_live: int) -> None:
        """Score slots ``rows`` at decision point ``position``: features, model, predicted positions,
        when each is due again (rule 5), cache and heaps (rule 3). On the native kernel in one call
        (the rows and the context are not materialised) unless the online refit needs them."""
        state = self._state
        if self._kernel is not None and self._refit is None and position == state.position:
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
        # rule 1: "not again" only for storages that are not needed by the next iteration either
        never = (P.argmax(axis=1) == P.shape[1] - 1) & (X[:, :3].sum(axis=1) == 0)
        np.exp(score, out=score)
        score += position
        score[never] = np.inf
        state.pred[rows] = score
        # rule 5: due again when overdue, or once a low quantile of the distance could have elapsed
        if k is None:
            k = (np.cumsum(P, axis=1) >= self.quantile).argmax(axis=1)
        self._due[rows] = np.minimum(score, position + self.recheck * _LOWER[k])
        if self._refit is not None:
            self._refit.observe(position, sids, X, ctx)
        self._update(sids.tolist(), score.tolist(), rows.tolist(), n_live)

    def _update(self, sids: list[int], preds: list[float], slots: list[int], n_live: int) -> None:
        """Rule 3: both heaps take the new predictions (already in the state's ``pred``, the cache) of
        the rescored storages only. An older heap entry of a storage no longer matches its
        prediction, so NextUsePolicy skips it as stale; the heaps are compacted when stale entries
        far outnumber the live storages. (The native path does this in the kernel: ``_score_native``.)"""
        # every rescored storage gets an eviction entry (one that is not resident is skipped there as
        # stale); the ones this policy evicted and has not seen back get a prefetch entry
        push = self._heap.push
        away = self._away
        off = self._off
        for v, sid, s in zip(preds, sids, slots):
            push(-v, sid, s)
            if away[s]:
                heapq.heappush(off, (v, sid))
        self._compact_heaps(n_live)

    def _compact_heaps(self, n_live: int) -> None:
        limit = 4 * n_live + 1024
        heap = self._heap
        if len(heap) > limit:
            if isinstance(heap, _PyHeap):
                heap.items = _compact(heap.items, self._cached, -1.0)
            else:
                state = self._state
                heap.compact(self._kernel.table(state).addr, len(state.pred))
        if len(self._off) > limit:
            self._off = _compact(self._off, self._cached, 1.0)

    def _cached(self, sid: int) -> float | None:
        """The cached prediction of ``sid`` (rule 3: the state's ``pred``), None if it has none."""
        state = self._state
        s = state._slot.get(sid)
        if s is None:
            return None
        v = state.pred.item(s)
        return None if v != v else v

    # the eviction heap (NextUsePolicy's _res): native (NativeHeap) or heapq (_PyHeap), by backend
    def _res_push(self, key: float, sid: int) -> None:
        s = self._state._slot.get(sid)
        self._heap.push(key, sid, -1 if s is None else s)

    def _res_pop(self) -> tuple[float, int] | None:
        kern = self._kernel
        e = self._heap.pop(kern.table(self._state).addr if kern is not None else None)
        return None if e is None else (e[0], e[1])

    def _rebuild(self) -> None:
        self._heap = _PyHeap() if self._kernel is None else self._kernel.new_heap()
        for sid in self.view.resident():
            self._res_push(-self._nu(sid), sid)

    def _poll(self) -> None:
        """Rule 11: merge the worker's results if they are in (read before evicting or prefetching)."""
        job = self._job
        if job is not None and self._ready(job):
            t0 = self._timer()
            self._merge(job)
            dt = self._timer() - t0
            self.inference_s += dt
            self._spent += dt

    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        if self._job is not None:
            self._poll()
        away = self._away
        slot = self._state._slot
        inner = super().victims(need_bytes, exclude)
        try:
            for sid in inner:
                away[slot[sid]] = 1
                if self.small_evicted and not self._small_scored:
                    self._small_scored = True  # rule 8: the first small victim; score them all next op
                    self._force_decision = True
                yield sid
        finally:
            inner.close()  # its own finally puts back the entries it skipped, now, not at collection

    def after_op(self, position: int) -> list[Action]:
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


def _compact(heap: list[tuple[float, int]], cached: Any, sign: float) -> list[tuple[float, int]]:
    """The entries of ``heap`` that still match the cached prediction (``cached(sid)``), once each, as a heap."""
    keep = {}
    for key, sid in heap:
        v = cached(sid)
        if v is not None and key == sign * v:
            keep[sid] = key
    out = [(key, sid) for sid, key in keep.items()]
    heapq.heapify(out)
    return out


class _Job:
    """A decision point on the worker (rule 11): the gathered rows and the results' buffers, kept
    from one decision point to the next (one is in flight at a time) and grown as needed."""

    __slots__ = ("position", "m", "n_live", "cap", "slots", "X", "ctx", "sids", "score", "due", "addr",
                 "ready", "future")

    def __init__(self, cap: int = 256) -> None:
        from .features import CAND_FEATURES, CTX_FEATURES

        self.position = self.m = self.n_live = 0
        self.cap = cap
        self.X = np.empty((cap, len(CAND_FEATURES)), dtype=np.float32)
        self.ctx = np.empty(len(CTX_FEATURES), dtype=np.float32)
        self.slots = np.empty(cap, dtype=np.int64)
        self.sids = np.empty(cap, dtype=np.int64)
        self.score = np.empty(cap, dtype=np.float64)
        self.due = np.empty(cap, dtype=np.float64)
        #: the buffers' addresses: X, ctx, slots, sids, score, due
        self.addr = tuple(a.ctypes.data for a in (self.X, self.ctx, self.slots, self.sids, self.score, self.due))
        self.ready = 0.0
        self.future: Any = None

    def start(self, position: int, m: int, n_live: int) -> _Job:
        """This buffer set for a decision point of ``m`` rows (a bigger one if it has no room)."""
        job = self if m <= self.cap else _Job(max(m, 2 * self.cap))
        job.position, job.m, job.n_live = position, m, n_live
        job.ready, job.future = 0.0, None
        return job

    def __reduce__(self) -> Any:  # the rows in flight are not state worth keeping: a fresh buffer set
        return _Job, (self.cap,)


class _PyHeap:
    """The eviction heap in heapq, for the numpy backend: the same interface as
    :class:`~dynn_runtime.pilot.native.NativeHeap`, without skipping stale entries (NextUsePolicy
    does that for it)."""

    def __init__(self) -> None:
        self.items: list[tuple[float, int]] = []

    def push(self, key: float, sid: int, slot: int) -> None:
        heapq.heappush(self.items, (key, sid))

    def pop(self, _state: Any) -> tuple[float, int, int] | None:
        items = self.items
        if not items:
            return None
        key, sid = heapq.heappop(items)
        return key, sid, -1

    def __len__(self) -> int:
        return len(self.items)
