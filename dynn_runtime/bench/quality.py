"""Prefetch quality, one vocabulary for the simulator, the live runtime and the trace metrics.

What the runtime *feels* of a policy's predictions is how many of the storages it needed were
already back on the device (**prefetch hits**), how many it had to fetch on demand (**misses**),
the seconds it stalled for them and the bytes it moved. What the trace metrics measure is how well
each predictor ranks the storages used next (**window recall**, :mod:`dynn_runtime.pilot.training.evaluate`).
Both are reported side by side, per workload and policy, by ``dynn bench`` (simulated) and
``dynn bench --real`` (live), so that a recall figure can be checked against what it buys.

* :func:`window_recall` scores the next-use predictors that are also policies (``pilot``,
  ``replay``, ``lru``) on a recorded trace;
* :func:`live_quality` and :func:`sim_quality` read the same four figures from a live run's stats
  and from a :class:`~dynn_runtime.sim.result.SimResult` record.
"""

from __future__ import annotations

from typing import Any

from .._log import logger

__all__ = ["RECALL_POLICIES", "window_recall", "live_quality", "sim_quality", "hit_rate"]

#: the policies whose predictor window recall scores (the evaluation's ``pilot``, ``replay``, ``lru``)
RECALL_POLICIES = ("pilot", "replay", "lru")


def window_recall(trace: Any, model: Any = None, every: int = 1) -> dict[str, float | None]:
    """Window recall of the pilot (``model``; None: the shipped weights), replay and lru (recency) over
    ``trace``'s iterations after the first, every ``every``-th decision point. A policy maps to None
    when nothing could be scored (a one-iteration trace); ``{}`` when the pilot has no weights."""
    from ..errors import DynnError
    from ..pilot.training.evaluate import evaluate

    if model is None:
        from ..pilot.config import cached_model, default_weights_path

        try:
            model = cached_model(default_weights_path())
        except DynnError as exc:
            logger.warning("bench: no window recall, the pilot's weights do not load: %s", exc)
            return {}
    metrics = evaluate(model, [trace], every=every).get("all")
    if metrics is None:
        return {p: None for p in RECALL_POLICIES}
    return {p: metrics.methods[p]["window_recall"] for p in RECALL_POLICIES}


def hit_rate(hits: int | None, misses: int | None) -> float | None:
    """Hits over hits + misses (None when neither happened: nothing was needed back)."""
    if hits is None or misses is None or hits + misses == 0:
        return None
    return hits / (hits + misses)


def live_quality(stats: dict[str, Any]) -> dict[str, Any]:
    """The four figures from :meth:`MemoryManager.stats` (or one entry of its ``per_step``).

    ``bytes_moved`` counts every copy in either direction: offloads, prefetches and demand fetches.
    """
    hits, misses = stats.get("prefetch_hits"), stats.get("prefetch_misses")
    return {"prefetch_hits": hits, "prefetch_misses": misses, "hit_rate": hit_rate(hits, misses),
            "stall_seconds": stats.get("stall_seconds"),
            "bytes_moved": sum(int(stats.get(k) or 0) for k in ("bytes_offloaded", "bytes_prefetched",
                                                                 "bytes_fetched_on_demand"))}


def sim_quality(record: dict[str, Any]) -> dict[str, Any]:
    """The same four figures from a simulated result (:meth:`SimResult.as_dict` or a bench record).

    The simulator counts fetches without splitting prefetch from demand, so ``bytes_moved`` is
    offloaded plus fetched, as live."""
    hits, misses = record.get("prefetch_hits"), record.get("prefetch_misses")
    return {"prefetch_hits": hits, "prefetch_misses": misses, "hit_rate": hit_rate(hits, misses),
            "stall_seconds": record.get("stall_time_s"),
            "bytes_moved": int(record.get("bytes_offloaded") or 0) + int(record.get("bytes_fetched") or 0)}
