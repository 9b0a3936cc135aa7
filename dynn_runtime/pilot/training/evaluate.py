"""How good the predictions are: per-family metrics of the pilot against replay, recency and frequency.

At every decision point of every evaluated iteration (iterations with a previous one, so that
``replay`` has a plan), over *every* live storage:

* **bucket accuracy**: the predicted coarse bucket (next group, within 4 groups, within 16, later
  this iteration, not again this iteration) equals the true one. Baselines predict a distance
  (replay: its plan; recency: the time since last use, i.e. "reused as long after as it was last
  used"; frequency: the mean interval between its accesses so far), bucketed the same way.
* **window recall**: of the storages truly accessed within the next window (4 groups = 64
  operators), the share found among the same number of storages each method ranks soonest
  (R-precision: a method cannot raise it by predicting "soon" for everything).
* **rank correlation**: Spearman's rho between predicted and true next-use order (storages not used
  again this iteration tie last), averaged over decision points.

Also reported for the pilot: threshold recall and precision of "in the window" (probability >= 1/2).

The pilot's ranking is the policy's: in a planned optimizer (:func:`~dynn_runtime.pilot.replay.plan_scores`)
a candidate with a replayed next use is ranked at it; its buckets are the model's throughout.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...trace.format import Trace
from ..features import BUCKET_EDGES, COARSE_OF_FINE, fine_bucket
from ..model import PilotModel
from ..replay import plan_scores
from .data import trace_family, walk

__all__ = ["METHODS", "FamilyMetrics", "evaluate", "render_table", "WINDOW_OPS"]

METHODS = ("pilot", "replay", "lru", "frequency")
#: the "next window" of the recall metric: 4 groups of 16 operators
WINDOW_OPS = BUCKET_EDGES[5]


def _rank(a: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (``inf`` ties with ``inf``)."""
    order = np.argsort(a, kind="stable")
    s = a[order]
    ranks = np.empty(len(a), dtype=np.float64)
    # boundaries of runs of equal values
    change = np.empty(len(s), dtype=bool)
    change[0] = True
    change[1:] = s[1:] != s[:-1]
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], len(s))
    avg = (starts + ends - 1) / 2.0
    run = np.repeat(np.arange(len(starts)), ends - starts)
    ranks[order] = avg[run]
    return ranks


def _spearman(pred: np.ndarray, true: np.ndarray) -> float | None:
    if len(pred) < 2:
        return None
    rp, rt = _rank(pred), _rank(true)
    sp, st = rp.std(), rt.std()
    if sp == 0 or st == 0:
        return 0.0 if st != 0 else None
    return float(((rp - rp.mean()) * (rt - rt.mean())).mean() / (sp * st))


@dataclass
class _Acc:
    correct: int = 0
    total: int = 0
    hits: int = 0
    relevant: int = 0
    rho: list[float] = field(default_factory=list)
    tp: int = 0
    fp: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = {
            "bucket_accuracy": self.correct / self.total if self.total else None,
            "window_recall": self.hits / self.relevant if self.relevant else None,
            "rank_correlation": float(np.mean(self.rho)) if self.rho else None,
        }
        if self.tp or self.fp:
            d["threshold_recall"] = self.tp / self.relevant if self.relevant else None
            d["threshold_precision"] = self.tp / (self.tp + self.fp)
        return d


@dataclass
class FamilyMetrics:
    """Metrics of one workload family (all its evaluated traces and iterations)."""

    family: str
    decisions: int
    candidates: int
    methods: dict[str, dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"family": self.family, "decisions": self.decisions, "candidates": self.candidates,
                "methods": self.methods}


def _update(acc: _Acc, score: np.ndarray, pred_coarse: np.ndarray, true_dist: np.ndarray,
            true_coarse: np.ndarray) -> None:
    acc.correct += int((pred_coarse == true_coarse).sum())
    acc.total += len(true_coarse)
    inwin = true_dist <= WINDOW_OPS
    k = int(inwin.sum())
    if k:
        top = np.argsort(score, kind="stable")[:k]
        acc.hits += int(inwin[top].sum())
        acc.relevant += k
    rho = _spearman(score, np.where(np.isfinite(true_dist), true_dist, 1e12))
    if rho is not None:
        acc.rho.append(rho)


def _dist_score(d: np.ndarray) -> np.ndarray:
    return np.log(np.where(np.isfinite(d), np.maximum(d, 0.5), 1e12))


def evaluate(model: PilotModel, traces: Iterable[Trace], every: int = 1,
             families: Sequence[str] | None = None) -> dict[str, FamilyMetrics]:
    """Metrics per family (and ``"all"``) of ``model`` and the baselines on ``traces``' iterations 1..n-1."""
    accs: dict[str, dict[str, _Acc]] = {}
    counts: dict[str, list[int]] = {}
    group = model.config.group
    for tr in traces:
        fam = trace_family(tr)
        if families is not None and fam not in families:
            continue
        for i in range(1, len(tr.iterations)):
            for d in walk(tr, i, group=group, every=every):
                if not len(d.sids):
                    continue
                true_coarse = COARSE_OF_FINE[fine_bucket(d.dist)]
                P = model.probs(d.X, d.ctx)
                score = model.expected_log_distance(P, d.expected_len)
                if d.planned:  # the policy predicts a planned optimizer's replayed next uses as they are
                    score = plan_scores(d.X, score)
                Pc = PilotModel.coarse(P)
                preds = {
                    "pilot": (score, Pc.argmax(axis=1)),
                    "replay": (_dist_score(d.replay), COARSE_OF_FINE[fine_bucket(d.replay)]),
                    "lru": (_dist_score(d.lru), COARSE_OF_FINE[fine_bucket(d.lru)]),
                    "frequency": (_dist_score(d.freq), COARSE_OF_FINE[fine_bucket(d.freq)]),
                }
                for key in (fam, "all"):
                    fa = accs.setdefault(key, {m: _Acc() for m in METHODS})
                    c = counts.setdefault(key, [0, 0])
                    c[0] += 1
                    c[1] += len(d.sids)
                    for m, (s, pc) in preds.items():
                        _update(fa[m], s, pc, d.dist, true_coarse)
                    inwin_pred = (Pc[:, 0] + Pc[:, 1]) >= 0.5
                    inwin = d.dist <= WINDOW_OPS
                    fa["pilot"].tp += int((inwin_pred & inwin).sum())
                    fa["pilot"].fp += int((inwin_pred & ~inwin).sum())
    return {k: FamilyMetrics(family=k, decisions=counts[k][0], candidates=counts[k][1],
                             methods={m: a.as_dict() for m, a in v.items()}) for k, v in accs.items()}


def render_table(metrics: dict[str, FamilyMetrics]) -> str:
    """A markdown table: one row per family, the three metrics for each method."""
    head = "| family | metric | " + " | ".join(METHODS) + " |"
    lines = [head, "|---|---|" + "---:|" * len(METHODS)]
    names = {"bucket_accuracy": "bucket acc", "window_recall": "window recall", "rank_correlation": "rank corr"}

    def fmt(v: Any, pct: bool) -> str:
        if v is None:
            return "-"
        return f"{100 * v:.1f}%" if pct else f"{v:.3f}"

    order = [k for k in metrics if k != "all"] + (["all"] if "all" in metrics else [])
    for fam in order:
        fm = metrics[fam]
        for key, label in names.items():
            cells = [fmt(fm.methods[m][key], key != "rank_correlation") for m in METHODS]
            lines.append(f"| {fam} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"



