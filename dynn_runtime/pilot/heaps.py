"""The pilot policy's prediction heaps: which storage to evict or prefetch next, kept incrementally.

The feature state's per-slot ``pred`` is the cache of current predictions. The eviction heap
(``NextUsePolicy``'s, keyed by minus the predicted position) and the prefetch heap (the storages
this policy evicted, keyed by the predicted position) take one entry per prediction made; an entry
that no longer matches the cache is stale and skipped when popped, so a decision point pushes only
its rescored storages' entries. A heap is compacted when it holds more than 4x the live storages
(+1024), which bounds its size without an O(live) rebuild at every decision point.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from .features import FeatureState

__all__ = ["PredictionHeaps", "PyHeap"]


class PredictionHeaps:
    """The heap side of :class:`~dynn_runtime.pilot.policy.PilotPolicy` (see the module docstring).
    A mixin: it reads the policy's ``_state``, ``_kernel``, ``_heap``, ``_off``, ``_away`` and
    ``_due`` and is not used alone."""

    _state: FeatureState
    _heap: Any
    _off: list[tuple[float, int]]

    def _absorb(self, score_addr: int, due_addr: int | None, sids_addr: int, slots_addr: int, m: int,
                n_live: int) -> int:
        """On the native backend: ``m`` scored rows onto the eviction heap in one kernel call,
        the rescored storages this policy evicted onto the prefetch heap, then compaction.
        ``due_addr`` not None: results back from the worker (see ``NativeKernel.merge``).
        Returns the rows merged."""
        out = self._away_out
        if len(out[0]) < m:
            out = self._away_out = (np.empty(2 * m, dtype=np.int64), np.empty(2 * m, dtype=np.float64))
        pt = self._pt
        merged, na = self._kernel.merge(self._state, self._heap, score_addr, due_addr, sids_addr, slots_addr, m,
                                        pt.address_of("due", self._due), pt.address_of("away", self._away),
                                        (pt.address_of("out_sids", out[0]), pt.address_of("out_scores", out[1])))
        if na:
            off = self._off
            for v, sid in zip(out[1][:na].tolist(), out[0][:na].tolist()):
                heapq.heappush(off, (v, sid))
        self._compact_heaps(n_live)
        return merged

    def _update(self, sids: list[int], preds: list[float], slots: list[int], n_live: int) -> None:
        """Both heaps take the new predictions (already in the state's ``pred``, the cache) of
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
            if isinstance(heap, PyHeap):
                heap.items = _compact(heap.items, self._cached, -1.0)
            else:
                state = self._state
                heap.compact(self._kernel.table(state).addr, len(state.pred))
        if len(self._off) > limit:
            self._off = _compact(self._off, self._cached, 1.0)

    def _cached(self, sid: int) -> float | None:
        """The cached prediction of ``sid`` (the state's ``pred``), None if it has none."""
        state = self._state
        s = state._slot.get(sid)
        if s is None:
            return None
        v = state.pred.item(s)
        return None if v != v else v

    # the eviction heap (NextUsePolicy's _res): native (NativeHeap) or heapq (PyHeap), by backend
    def _res_push(self, key: float, sid: int) -> None:
        s = self._state._slot.get(sid)
        self._heap.push(key, sid, -1 if s is None else s)

    def _res_pop(self) -> tuple[float, int] | None:
        kern = self._kernel
        e = self._heap.pop(kern.table(self._state).addr if kern is not None else None)
        return None if e is None else (e[0], e[1])

    def _rebuild(self) -> None:
        self._heap = PyHeap() if self._kernel is None else self._kernel.new_heap()
        for sid in self.view.resident():
            self._res_push(-self._nu(sid), sid)


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


class PyHeap:
    """The eviction heap in heapq, for the numpy backend: the same interface as
    :class:`~dynn_runtime.pilot.kernel.NativeHeap`, without skipping stale entries (NextUsePolicy
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
