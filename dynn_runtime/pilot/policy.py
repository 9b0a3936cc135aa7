"""The ``pilot`` policy: Belady eviction and prefetch over next uses predicted by the pilot model.

It reads only what the live runtime can give (the :class:`~dynn_runtime.policies.MemoryView`
protocol's ``position``, ``phase``, ``nbytes``, ``kind``, ``saved``, ``status``, ``resident``,
``offloaded``, ``free_bytes``; the notifications; ``context["history"]``), never the current
iteration's future.

How a prediction is made and kept (why):

1. At a decision point (every ``decision_every`` operators and at every phase change) every live storage is
   scored in one batch (:meth:`PilotModel.probs`); the expected log next-use distance under the
   bucket probabilities orders them, ``position + exp(that)`` is the cached predicted position. A
   storage whose most likely bucket is "not again this iteration" and that is not persistent
   (parameter, buffer, optimizer state) predicts ``None``.
2. Between decision points :meth:`predict` reads the cache. A storage allocated or accessed since the
   last decision point gets a provisional prediction from a small prior table shipped with the
   weights (median next-use distance right after an access, by phase and storage class), so
   per-access cost is a dictionary write.
3. After a decision point the eviction heap is rebuilt from the new predictions (entries pushed with
   older predictions would otherwise be treated as stale and skipped), and the prefetch heap re-keyed.
4. Weights load on first use (``attach``), not at import. Inference is numpy only: no torch operator
   runs inside the runtime's dispatch mode.
5. Incremental scoring: a decision point rescores the storages allocated or accessed since the last
   one, those whose predicted position has passed (the prediction was wrong), and a rotating
   ``1/refresh_every`` share of the rest; the others keep their predicted position (a position,
   not a distance, so it stays valid while nothing happens to the storage).
6. Optional online refit (``online=True``): the feature rows of a sample of each decision point are
   kept; when the next iteration begins, ``context["history"][-1]`` (the iteration just finished)
   labels them, and every ``refit_every`` iterations the model is fine-tuned on them in numpy
   (:class:`~dynn_runtime.pilot.online.OnlineRefit`).
"""

from __future__ import annotations

import heapq
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PolicyError
from ..policies.base import register
from ..policies.nextuse import NextUsePolicy
from .features import FeatureState

__all__ = ["PilotPolicy", "default_weights_path"]

_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
_CLASS_OF_KIND = {"param": 1, "buffer": 1, "opt_state": 1, "grad": 3, "activation": 2, "input": 4, "temp": 4}
_PHASES = {"forward": 0, "backward": 1, "optimizer": 2}


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
    requires = frozenset({"pilot"})
    description = "Belady over next uses predicted by the learned pilot model (idiom features)"
    #: operators between decision points (plus one at every phase change). Measured on the small
    #: zoo traces at 1/8 and 1/4: 32 simulates as fast as 16 (moe 2.17x vs 2.13x, skipnet 2.32x vs
    #: 2.33x) at half the inference cost; 64 starts to lose (varlen 2.20x vs 2.04x).
    decision_every: int = 32
    #: storages not touched since the last decision point are rescored every this many decision
    #: points (rotating; overdue ones at once). Off (1) by default: 4 halved the inference time but
    #: cost up to 24% of simulated iteration time (evoformer small at 1/8: 2.14x vs 1.72x), since a
    #: far prediction is coarse and gets precise only as it is rescored closer (docs/pilot.md).
    refresh_every: int = 1

    def __init__(self, weights: str | Path | None = None, online: bool = False, refit_every: int = 4,
                 model: Any = None, group: int | None = None, refresh_every: int | None = None) -> None:
        super().__init__()
        self._weights = Path(weights) if weights is not None else default_weights_path()
        if model is None and not self._weights.is_file():
            raise PolicyError(
                f"policies: pilot needs trained weights; {str(self._weights)!r} does not exist. Train them with "
                "`dynn pilot train --traces ... -o FILE` and pass weights=FILE.")
        self._model = model
        self._online = online
        self._group = group
        if refresh_every is not None:
            self.refresh_every = max(1, int(refresh_every))
        self._refit_every = refit_every
        self._refit = None
        self._state: FeatureState | None = None
        self._cache: dict[int, float | None] = {}
        #: decision points, and seconds spent in feature building + inference (cost report)
        self.decisions = 0
        self.inference_s = 0.0
        #: seconds in the per-operator feature-state update (every operator, not only decisions)
        self.bookkeeping_s = 0.0
        self.candidates = 0

    @property
    def model(self) -> Any:
        if self._model is None:
            self._model = _load(self._weights)
        return self._model

    def attach(self, view: Any) -> None:
        super().attach(view)
        model = self.model  # first use: load the weights now, not at import
        self._state = FeatureState(view, group=self._group or self.decision_every)
        self._prior = np.exp(model.arrays["prior"].astype(np.float64))
        if self._online and self._refit is None:
            from .online import OnlineRefit

            self._refit = OnlineRefit(model, refit_every=self._refit_every)

    def begin_iteration(self, index: int, context: dict | None = None) -> None:
        history = (context or {}).get("history") or []
        if self._refit is not None:
            new = self._refit.end_iteration(history)
            if new is not None:
                self._model = new
        self._state.begin_iteration(index, history)
        self._cache = {}
        self._res = []
        self._off = []
        self._expected_len = self._state.expected_length()

    # ---- notifications ------------------------------------------------------------------------
    def _provisional(self, sid: int, position: int, fresh: bool) -> float:
        view = self.view
        ph = _PHASES.get(view.phase, 0)
        cls = storage_class(view.kind(sid), view.saved(sid), fresh)
        return max(position, 0) + float(self._prior[ph, cls])

    def on_alloc(self, sid: int, position: int) -> None:
        state = self._state
        state.alloc(sid, position)
        v = self._cache[sid] = self._provisional(sid, position, position >= 0)
        s = state.slot_of(sid)
        state.pred[s] = v
        state.touched[s] = True
        super().on_alloc(sid, position)

    def on_access(self, sid: int, position: int) -> None:
        v = self._cache[sid] = self._provisional(sid, position, False)
        state = self._state
        s = state.slot_of(sid)
        if s is not None:
            state.pred[s] = v
            state.touched[s] = True
        super().on_access(sid, position)

    def on_free(self, sid: int) -> None:
        self._state.free(sid)
        self._cache.pop(sid, None)

    def on_op(self, position: int, op: Any) -> None:
        t0 = time.perf_counter()
        decide = self._state.op(position, op)
        self.bookkeeping_s += time.perf_counter() - t0
        if not decide:
            return
        t0 = time.perf_counter()
        state = self._state
        live = state.active_slots()
        if not len(live):
            return
        rows = live
        if self.refresh_every > 1 and self._refit is None:
            # rule 5: rescore what moved since the last decision point, what is overdue, and a
            # rotating share of the rest; everything else keeps its predicted position
            sel = state.touched[live] | (state.pred[live] <= position)
            sel |= (live % self.refresh_every) == (self.decisions % self.refresh_every)
            rows = live[sel]
        state.touched[rows] = False
        sids, X, ctx = state.features(rows)
        self.decisions += 1
        self.candidates += len(sids)
        if len(sids):
            model = self.model
            P = model.probs(X, ctx)
            score = model.expected_log_distance(P, self._expected_len)
            # rule 1: "not again" only for storages that are not needed by the next iteration either
            never = (P.argmax(axis=1) == P.shape[1] - 1) & (X[:, :3].sum(axis=1) == 0)
            state.pred[rows] = np.where(never, np.inf, position + np.exp(score))
        if self._refit is not None:
            self._refit.observe(position, sids, X, ctx)
        all_sids = state.sid[live].tolist()
        pred = state.pred[live]
        self._cache = cache = dict(zip(all_sids, pred.tolist()))
        self.inference_s += time.perf_counter() - t0
        # rule 3: rebuild the eviction heap, re-key the prefetch heap
        self._res = list(zip((-pred).tolist(), all_sids))
        heapq.heapify(self._res)
        off = [(cache[s], s) for s in dict.fromkeys(s for _, s in self._off) if s in cache]
        heapq.heapify(off)
        self._off = off

    def predict(self, sid: int) -> float | None:
        v = self._cache.get(sid)
        if v is None:
            return self.view.position + 1  # never announced: keep it
        return None if v == math.inf else v
