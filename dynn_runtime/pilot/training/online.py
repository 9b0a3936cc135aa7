"""Online adaptation: keep collecting accesses while the user's model trains, refit every K iterations.

:class:`OnlineRefit` is what the ``pilot`` policy uses with ``online=True`` (and what
:func:`shift_experiment` measures):

1. ``observe`` keeps a sample of each decision point's feature rows (``rows_per_decision``), with
   the storage ids and the position;
2. ``end_iteration(history)``, called when the next iteration begins, labels them with the true next
   use read from ``history[-1]`` (the iteration that just finished: no future is read) and appends
   them to a bounded buffer (the most recent ``buffer_rows``);
3. every ``refit_every`` iterations it fine-tunes a copy of the model on the buffer for ``epochs``
   passes (numpy, a few hundred milliseconds; with ``background``, on a thread while training goes
   on). The offline rows are not revisited, so the refit follows the workload's current distribution;
4. with ``validate`` (the default) a refit model is a *candidate*: at the next iteration end it is
   scored against the model in use on that iteration's rows, which neither was fitted on, and
   returned, to be swapped in, only when it is better: a higher window recall over the sampled rows
   of each decision point (ranked by the probability of a next use within the window), or an equal
   one and a lower mean cross-entropy of the true next-use bucket. Without ``validate`` a
   synchronous refit is returned at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..blas import one_blas_thread
from ..features import COARSE_OF_FINE, fine_bucket
from ..model import PilotModel, fit
from ..replay import plan_scores
from .data import _access_index, _next_after, walk
from .evaluate import WINDOW_OPS

__all__ = ["OnlineRefit", "shift_experiment", "ShiftResult"]


class OnlineRefit:
    """Collect labelled rows from the iterations a policy sees; refit the model every ``refit_every``."""

    def __init__(self, model: PilotModel, refit_every: int = 4, rows_per_decision: int = 48,
                 buffer_rows: int = 60_000, epochs: int = 3, seed: int = 0, background: bool = False,
                 validate: bool = True) -> None:
        self.model = model
        self.background = background
        self.validate = validate
        self._pool: ThreadPoolExecutor | None = None
        self._candidate: Future[PilotModel] | PilotModel | None = None
        #: candidates swapped in and turned down by validation; the last validation's two losses
        self.swaps = 0
        self.rejected = 0
        self.last_validation: tuple[Any, Any] | None = None
        self.refit_every = max(1, int(refit_every))
        self.rows_per_decision = rows_per_decision
        self.buffer_rows = buffer_rows
        self.epochs = epochs
        self._rng = np.random.default_rng(seed)
        self._pending: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []
        self._X: list[np.ndarray] = []
        self._C: list[np.ndarray] = []
        self._y: list[np.ndarray] = []
        self.iterations = 0
        self.refits = 0

    def observe(self, position: int, sids: np.ndarray, X: np.ndarray, ctx: np.ndarray) -> None:
        n = len(sids)
        take = (self._rng.choice(n, size=self.rows_per_decision, replace=False)
                if n > self.rows_per_decision else np.arange(n))
        self._pending.append((position, sids[take], X[take], ctx))

    def end_iteration(self, history: Sequence[Any]) -> PilotModel | None:
        """Label what was observed with ``history[-1]``; a refit model every ``refit_every`` iterations."""
        if not self._pending or not history:
            self._pending = []
            return None
        idx, keys = _access_index(history[-1].ops)
        groups = []
        for pos, sids, X, ctx in self._pending:
            groups.append((X, ctx, fine_bucket(_next_after(idx, keys, sids, pos))))
        self._pending = []
        out = self._validated(groups)
        for X, ctx, y in groups:
            self._X.append(X)
            self._C.append(np.broadcast_to(ctx, (len(y), len(ctx))))
            self._y.append(y)
        total = sum(len(y) for y in self._y)
        while total > self.buffer_rows and len(self._y) > 1:
            total -= len(self._y.pop(0))
            self._X.pop(0)
            self._C.pop(0)
        self.iterations += 1
        if self.iterations % self.refit_every or self._candidate is not None:
            return out
        X = np.concatenate(self._X)
        C = np.concatenate(self._C).astype(np.float32)
        y = np.concatenate(self._y)
        self.refits += 1
        if self.background:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynn-pilot-refit")
            self._candidate = self._pool.submit(_refit, self.model, X, C, y, self.epochs)
            return out
        new = _refit(self.model, X, C, y, self.epochs)
        if not self.validate:
            self.model = new
            return new
        self._candidate = new
        return out

    def close(self) -> None:
        """A background refit in flight completes (its model stays the candidate) and the thread
        ends; the next refit starts another."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _validated(self, groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> PilotModel | None:
        """The finished candidate if it beats the model in use on ``groups`` (rows neither was fitted on);
        it is then the model in use. A background refit still running stays the candidate."""
        cand = self._candidate
        if cand is None or (isinstance(cand, Future) and not cand.done()):
            return None
        self._candidate = None
        model = cand.result() if isinstance(cand, Future) else cand
        if self.validate and groups:
            new, old = _validation(model, groups), _validation(self.model, groups)
            self.last_validation = (new, old)
            if not new > old:
                self.rejected += 1
                return None
        self.model = model
        self.swaps += 1
        return model


def _refit(model: PilotModel, X: np.ndarray, C: np.ndarray, y: np.ndarray, epochs: int) -> PilotModel:
    with one_blas_thread():  # small products: BLAS threads would take the training thread's cores
        return fit(X, C, y, init=model, epochs=epochs)[0]


def _validation(model: PilotModel, groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]
                ) -> tuple[float, float]:
    """What a candidate must raise: (window recall over ``groups``' rows, minus the bucket loss)."""
    return sampled_window_recall(model, groups), -bucket_loss(model, groups)


def sampled_window_recall(model: PilotModel, groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """Window recall over decision points' sampled rows ``(X, ctx, y)``: of the rows whose true next
    use is within :data:`WINDOW_OPS`, the share among as many rows ranked most likely within it."""
    hits = rel = 0
    for X, ctx, y in groups:
        inwin = COARSE_OF_FINE[y] <= 1  # coarse buckets "next group" and "within 4 groups"
        k = int(inwin.sum())
        if not k:
            continue
        Pc = PilotModel.coarse(model.probs(X, ctx))
        top = np.argsort(-(Pc[:, 0] + Pc[:, 1]), kind="stable")[:k]
        hits += int(inwin[top].sum())
        rel += k
    return hits / rel if rel else 0.0


def bucket_loss(model: PilotModel, groups: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """Mean cross-entropy of the true fine bucket over decision points' rows ``(X, ctx, y)``."""
    total, n = 0.0, 0
    for X, ctx, y in groups:
        P = model.probs(X, ctx)
        total -= float(np.log(np.maximum(P[np.arange(len(y)), y], 1e-12)).sum())
        n += len(y)
    return total / n if n else float("nan")


@dataclass
class ShiftResult:
    """Per-iteration bucket accuracy and window recall, with and without online refit."""

    family: str
    shift_at: int
    static: list[dict[str, float]]
    online: list[dict[str, float]]
    refits: int

    def summary(self) -> dict[str, Any]:
        def mean(xs: list[dict[str, float]], key: str) -> float:
            vals = [x[key] for x in xs[self.shift_at:] if x.get(key) is not None]
            return float(np.mean(vals)) if vals else float("nan")

        return {
            "family": self.family, "shift_at": self.shift_at, "refits": self.refits,
            "after_shift": {
                "static": {k: mean(self.static, k) for k in ("bucket_accuracy", "window_recall")},
                "online": {k: mean(self.online, k) for k in ("bucket_accuracy", "window_recall")},
            },
        }


def _iteration_metrics(model: PilotModel, trace: Any, i: int, refit: OnlineRefit | None) -> dict[str, float]:
    correct = total = hits = rel = 0
    for d in walk(trace, i, group=model.config.group, baselines=False):
        if not len(d.sids):
            continue
        P = model.probs(d.X, d.ctx)
        score = model.expected_log_distance(P, d.expected_len)
        if d.planned:
            score = plan_scores(d.X, score)
        pc = PilotModel.coarse(P).argmax(axis=1)
        tc = COARSE_OF_FINE[fine_bucket(d.dist)]
        correct += int((pc == tc).sum())
        total += len(tc)
        inwin = d.dist <= WINDOW_OPS
        k = int(inwin.sum())
        if k:
            hits += int(inwin[np.argsort(score, kind="stable")[:k]].sum())
            rel += k
        if refit is not None:
            refit.observe(d.position, d.sids, d.X, d.ctx)
    return {"iteration": i, "bucket_accuracy": correct / total if total else None,
            "window_recall": hits / rel if rel else None}


def shift_experiment(model: PilotModel, trace: Any, shift_at: int, refit_every: int = 2,
                     epochs: int = 3) -> ShiftResult:
    """Walk every iteration of ``trace`` (whose input distribution changes at iteration ``shift_at``)
    with ``model`` as is, and with an :class:`OnlineRefit` copy refit every ``refit_every`` iterations."""
    static = [_iteration_metrics(model, trace, i, None) for i in range(1, len(trace.iterations))]
    refit = OnlineRefit(model.copy(), refit_every=refit_every, epochs=epochs, validate=False)
    online = []
    current = refit.model
    for i in range(1, len(trace.iterations)):
        online.append(_iteration_metrics(current, trace, i, refit))
        new = refit.end_iteration(trace.iterations[: i + 1])
        if new is not None:
            current = new
    return ShiftResult(family=str(trace.header.get("workload")), shift_at=shift_at - 1, static=static,
                       online=online, refits=refit.refits)
