"""Anchored replay: the feature state's alignment of this iteration with the previous one.

**Anchored replay.** Every operator is keyed by (name, module, phase, occurrence of that triple so
far in the phase) and matched to the previous iteration's operator with the same key. The last
matched operator *anchors* the current position to a position in the previous iteration; a
candidate's counterpart there (itself for persistent storages, the storage that the matched
producer allocated in the same output slot for fresh ones) says when it was next used after the
anchor. Unlike positional replay this survives shifted and re-ordered operator sequences
(variable lengths, skipped blocks, different experts); the model learns how far to trust it from
the other features. Occurrences count per phase, so that the optimizer's operators (the same every
step) are not shifted by how often forward and backward ran the same operator.

**External storages** alive at the start and new to the iteration (the batch) are matched, at their
first access, to the previous iteration's storages that no operator allocated, in first-access
order; before their first access they get, tentatively, the counterpart they will be matched to if
accessed in announcement order (``ext_by_order``).

**Replayed next uses.** After every operator,
:attr:`~dynn_runtime.pilot.features.FeatureState.replayed` holds, for each storage
it accessed whose counterpart was accessed again after the same occurrence in the previous
iteration, that next access replayed from now. The policy predicts with it between decision points;
it is not a model input.

Every operator's accesses in the previous iteration are indexed here once per iteration
(:meth:`ReplayState._index_previous`); the feature rows (:mod:`.rows`, the native kernel) read the
index as sorted keys ``counterpart * KEY_BASE + position``.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from .layout import KEY_BASE

__all__ = ["ReplayState"]


class ReplayState:
    """The replay half of :class:`~dynn_runtime.pilot.features.FeatureState` (see the module
    docstring); a mixin over the state's arrays (``prev``, ``count``) and slots, not used alone."""

    def _index_previous(self, prev: Any) -> None:
        self._prev_ops = {}
        self._prev_allocs = {}
        self._prev_idx = {}
        self._prev_len = 0
        self._prev_external: list[int] = []
        self._ext_next = 0
        self._ratio = 1.5
        self._prev_flat: list[int] = []
        self._prev_start: list[int] = [0]
        if prev is None:
            self._prev_keys = np.zeros(0, dtype=np.int64)
            self._prev_count = np.zeros(0, dtype=np.float32)
            self._previous_changed()
            return
        seen: dict[tuple[str, str, str], int] = {}
        acc: dict[int, list[int]] = {}
        phases: dict[str, int] = {}
        born: set[int] = set()
        prev_ops, prev_allocs = self._prev_ops, self._prev_allocs
        for j, op in enumerate(prev.ops):
            k = (op.name, op.module, op.phase)
            c = seen.get(k, 0)
            seen[k] = c + 1
            prev_ops[(*k, c)] = j
            if op.allocs:
                prev_allocs[j] = op.allocs
                born.update(op.allocs)
            for sid in {*op.inputs, *op.outputs, *op.writes}:
                lst = acc.get(sid)
                if lst is None:
                    acc[sid] = [j]
                else:
                    lst.append(j)
        for (_, _, phase), c in seen.items():
            phases[phase] = phases.get(phase, 0) + c
        n_fwd, n_bwd = phases.get("forward", 0), phases.get("backward", 0)
        self._ratio = n_bwd / n_fwd if n_fwd and n_bwd else 1.5
        self._prev_len = len(prev.ops)
        self._prev_external = [sid for sid in acc if sid not in born]  # dict order: first access
        lists = list(acc.values())
        n = len(lists)
        self._prev_idx = dict(zip(acc, range(n)))
        lens = np.fromiter(map(len, lists), dtype=np.int64, count=n)
        # counterpart i's positions: _prev_flat[_prev_start[i]:_prev_start[i + 1]]; two lists for the
        # iteration, not one per storage (objects kept that long make Python's collector walk
        # everything the program holds)
        self._prev_flat = flat = list(itertools.chain.from_iterable(lists))
        self._prev_start = [0, *itertools.accumulate(map(len, lists))]
        del lists, acc
        pos = np.asarray(flat, dtype=np.int64)
        # sorted: by index, then position (each list is in operator order)
        self._prev_keys = np.repeat(np.arange(n, dtype=np.int64) * KEY_BASE, lens) + pos
        self._prev_count = lens.astype(np.float32)
        self._previous_changed()

    def _previous_changed(self) -> None:
        """The native kernel's table points at the new index and ratio."""
        if self._native_tab is not None:
            self._native_tab.set_previous(self)

    def _match_external(self, s: int) -> None:
        """A storage alive at the start, new to this iteration (the batch), at its first access: match it
        to the previous iteration's next unmatched external storage in first-access order (external storages)."""
        ext = self._prev_external
        while self._ext_next < len(ext):
            cand = ext[self._ext_next]
            self._ext_next += 1
            if cand not in self._slot:  # alive now: a persistent storage, matched by its own id
                self.prev[s] = self._prev_idx[cand]
                return

    def _replay(self, sid: int, s: int, position: int) -> None:
        """Replayed next use: after its k-th access here, the counterpart's (k+1)-th came this much later."""
        pi = self.prev.item(s)
        if pi >= 0:
            lo = self._prev_start[pi]
            k = int(self.count.item(s))
            if k < self._prev_start[pi + 1] - lo:
                flat = self._prev_flat
                self.replayed[sid] = position + flat[lo + k] - flat[lo + k - 1]

    def _align(self, position: int, op: Any) -> tuple[int, ...]:
        """Anchored replay: match the operator to the previous iteration's with the same (name, module, phase,
        occurrence) key, move the anchor there; returns what that operator allocated (or ())."""
        key = (op.name, op.module, op.phase)
        c = self._op_seen.get(key, 0)
        self._op_seen[key] = c + 1
        q = self._prev_ops.get((*key, c))
        if q is None:
            return ()
        self._anchor = (position, q)
        return self._prev_allocs.get(q, ())

    def _ext_rem(self, n: int) -> list[int]:
        """External storages ahead of their first access: the previous iteration's indices of the first ``n`` external storages
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
