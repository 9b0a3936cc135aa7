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

import bisect
import dataclasses
import heapq
import itertools
from typing import Any

import numpy as np

from .layout import CAND_FEATURES, KEY_BASE

__all__ = ["ReplayState", "plan_scores"]

_PREV_AGAIN = CAND_FEATURES.index("prev_used_again")
_LOG_PREV_DIST = CAND_FEATURES.index("log_prev_dist")


class ReplayState:
    """The replay half of :class:`~dynn_runtime.pilot.features.FeatureState` (see the module
    docstring); a mixin over the state's arrays (``prev``, ``count``) and slots, not used alone."""

    #: this iteration's optimizer was planned (:meth:`_realign_optimizer` replaced the previous
    #: iteration's in the index): in the optimizer phase, replayed next uses are the true ones
    planned = False
    native_index: bool  # FeatureState's

    def in_plan(self) -> bool:
        """In the optimizer phase of an iteration whose optimizer was planned."""
        return self.planned and self.phase == 2

    def _index_previous(self, prev: Any) -> None:
        self._prev_ops = {}
        self._prev_allocs = {}
        self._prev_idx = {}
        self._prev_len = 0
        self._prev_external: list[int] = []
        self._prev_sids: list[int] = []
        self._ext_next = 0
        self._ratio = 1.5
        self._prev_flat: list[int] = []
        self._prev_start: list[int] = [0]
        self._prev_iter = prev
        self._prev_extra: list[tuple[int, int]] = []
        self.planned = False
        if prev is None:
            self._prev_keys = np.zeros(0, dtype=np.int64)
            self._prev_count = np.zeros(0, dtype=np.float32)
            self._previous_changed()
            return
        self._prev_extra = self._opt_memory.skipped(prev)
        self._index_ops(prev.ops, self._prev_extra)
        born = set(itertools.chain.from_iterable(op.allocs for op in prev.ops))
        self._prev_external = [sid for sid in self._prev_sids if sid not in born]  # dict order: first access
        self._previous_changed()

    def _index_ops(self, ops: Any, extra: Any = ()) -> None:
        """Index ``ops`` as the previous iteration: operator keys, allocations, accesses per storage;
        ``extra``: (storage, position) accesses added. The C module ``kernel/pack.c`` builds the
        dictionaries and lists where it is built and ``native_index`` is set, else
        :meth:`_index_ops_py` (the reference: the same contents in the same orders)."""
        index = None
        if self.native_index:
            from .kernel import indexer

            index = indexer()
        if index is None:
            index = self._index_ops_py
        self._prev_ops, self._prev_allocs, seen, self._prev_idx, flat, start = index(ops, extra)
        phases: dict[str, int] = {}
        for (_, _, phase), c in seen.items():
            phases[phase] = phases.get(phase, 0) + c
        n_fwd, n_bwd = phases.get("forward", 0), phases.get("backward", 0)
        self._ratio = n_bwd / n_fwd if n_fwd and n_bwd else 1.5
        self._prev_len = len(ops)
        self._prev_sids = list(self._prev_idx)
        # counterpart i's positions: _prev_flat[_prev_start[i]:_prev_start[i + 1]]; two lists for the
        # iteration, not one per storage (objects kept that long make Python's collector walk
        # everything the program holds)
        self._prev_flat, self._prev_start = flat, start
        n = len(start) - 1
        lens = np.diff(np.asarray(start, dtype=np.int64))
        pos = np.asarray(flat, dtype=np.int64)
        # sorted: by index, then position (each list is in operator order)
        self._prev_keys = np.repeat(np.arange(n, dtype=np.int64) * KEY_BASE, lens) + pos
        self._prev_count = lens.astype(np.float32)

    @staticmethod
    def _index_ops_py(ops: Any, extra: Any) -> tuple[dict, dict, dict, dict[int, int], list[int], list[int]]:
        """:meth:`_index_ops`'s dictionaries and lists: the operators by (name, module, phase,
        occurrence) key, their allocations by position, the occurrences per (name, module, phase),
        each storage's counterpart index (in first-access order, an operator's storages in the
        order of the set of its inputs, outputs and writes) and each counterpart's positions in
        order, as one flat list cut by the starts."""
        prev_ops: dict[tuple[str, str, str, int], int] = {}
        prev_allocs: dict[int, Any] = {}
        seen: dict[tuple[str, str, str], int] = {}
        acc: dict[int, list[int]] = {}
        for j, op in enumerate(ops):
            k = (op.name, op.module, op.phase)
            c = seen.get(k, 0)
            seen[k] = c + 1
            prev_ops[(*k, c)] = j
            if op.allocs:
                prev_allocs[j] = op.allocs
            for sid in {*op.inputs, *op.outputs, *op.writes}:
                lst = acc.get(sid)
                if lst is None:
                    acc[sid] = [j]
                else:
                    lst.append(j)
        for sid, j in extra:
            acc.setdefault(sid, []).append(j)
        for sid in {sid for sid, _ in extra}:
            acc[sid].sort()
        lists = list(acc.values())
        flat = list(itertools.chain.from_iterable(lists))
        start = [0, *itertools.accumulate(map(len, lists))]
        return prev_ops, prev_allocs, seen, dict(zip(acc, range(len(lists)))), flat, start

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

    # ---- the optimizer, aligned by parameter ----------------------------------------------------
    def _realign_optimizer(self) -> None:
        """The optimizer phase begins: replace the previous iteration's optimizer in the index by the
        one planned for this step (:meth:`OptimizerMemory.plan`), so that the operator keys
        (occurrences per phase) and every counterpart's next use follow the parameters that have a
        gradient now. Counterparts keep their storage; a storage alive at the start that the
        previous iteration did not access becomes its own counterpart; a gradient without one (of
        a parameter the previous iteration did not update) takes the gradient of the parameter's
        last update of its size, in birth order."""
        prev = self._prev_iter
        if prev is None:
            return
        slot = self._slot
        count = self.count

        def active(sid: int) -> bool:
            s = slot.get(sid)
            return s is not None and count.item(s) > 0

        memory = self._opt_memory
        n = self._cap
        # parameters used now that no optimizer phase updated and the previous iteration did not use
        # (one it used without updating it is frozen), in announcement order
        new = np.flatnonzero(self.active[:n] & (self.born[:n] < 0) & (self.count[:n] > 0) & (self.kind[:n] == 0))
        fresh = [sid for sid in self.sid[new[np.argsort(self.announce[new], kind="stable")]].tolist()
                 if sid not in memory.params and sid not in self._prev_idx]
        plan = memory.plan(prev, active, fresh, lambda sid: self.announce.item(slot[sid]),
                           lambda sid: self.log_bytes.item(slot[sid]))
        if plan is None:
            return
        start, ops, taken = plan
        old_sids = self._prev_sids
        extra = [(sid, j) for sid, j in self._prev_extra if j < start]
        # a first-time parameter's accesses so far, at its last one's place (shifted so that the
        # optimizers start together): its planned update is then its next access, as for the others
        planned = {sid for op in ops for sid in op.inputs}
        for sid in fresh:
            if sid in planned:
                s = slot[sid]
                extra += [(sid, max(self.last.item(s) - self.phase_start + start, 0))] * int(count.item(s))
        self._index_ops([*prev.ops[:start], *ops], extra)
        idx = self._prev_idx
        remap = np.asarray([idx.get(sid, -1) for sid in old_sids] + [-1], dtype=np.int64)
        n = self._cap
        p = self.prev[:n]
        p[:] = remap[np.where(p >= 0, p, len(old_sids))]
        # a storage alive at the start is its own counterpart where the plan has it (one the previous
        # iteration did not access was matched by first-access order as if it were the batch)
        for s in np.flatnonzero(self.active[:n] & (self.born[:n] < 0)).tolist():
            own = idx.get(self.sid.item(s))
            if own is not None:
                p[s] = own
        if taken:
            # gradients: one whose counterpart is a planned gradient keeps it (backward aligned it);
            # the others (their layer not in the previous step, or aligned to another storage where
            # backward ran other operators), per size, in birth order against the planned gradients
            # nobody claims, in reverse update order (backward runs the model backwards)
            planned = {g for _, g in taken}
            sids = self._prev_sids
            act = np.flatnonzero(self.active[:n] & (self.born_phase[:n] == 1))
            act = act[np.lexsort((self.announce[act], self.born[act]))].tolist()
            claims: dict[int, list[int]] = {}
            for s in act:
                c = p.item(s)
                if c >= 0 and sids[c] in planned:
                    claims.setdefault(sids[c], []).append(s)
            claimed = {g for g, by in claims.items() if len(by) == 1}
            mine: dict[float, list[int]] = {}
            for s in act:
                c = p.item(s)
                if c < 0 or sids[c] not in claimed:
                    mine.setdefault(self.log_bytes.item(s), []).append(s)
            theirs: dict[float, list[int]] = {}
            for param, grad in reversed(taken):
                ps = slot.get(param)
                if ps is not None and grad not in claimed and grad in idx:
                    theirs.setdefault(self.log_bytes.item(ps), []).append(grad)
            for size, slots in mine.items():
                grads = theirs.get(size, [])
                if len(grads) == len(slots):
                    for s, g in zip(slots, grads):
                        p[s] = idx[g]
        ext = self._prev_external
        done = [sid for sid in ext[: self._ext_next] if sid in idx]
        self._prev_external = done + [sid for sid in ext[self._ext_next:] if sid in idx]
        self._ext_next = len(done)
        self.planned = True
        self._previous_changed()


def plan_scores(X: np.ndarray, score: np.ndarray) -> np.ndarray:
    """``score`` (log next-use distances, one per row of ``X``) at a decision point in a planned
    optimizer (``FeatureState.planned`` in the optimizer phase), with each candidate that has a
    replayed next use scored at it instead: the plan is the optimizer that runs (the rule of
    :meth:`OptimizerMemory.plan` held on every step seen), so that distance is the true one, where
    the model, which never saw an optimizer re-planned (a first update with history, a subset
    that changes), ranks worse than the feature it reads."""
    ok = X[:, _PREV_AGAIN] > 0
    if not ok.any():
        return score
    out = np.array(score, dtype=np.float64)
    # the column holds log1p(distance) / 8 in float32; the distance is a whole number of operators >= 1
    dist = np.maximum(np.rint(np.expm1(X[ok, _LOG_PREV_DIST].astype(np.float64) * 8.0)), 1.0)
    out[ok] = np.log(dist)
    return out


Block = tuple[frozenset[int], list[Any]]


def _opt_blocks(it: Any) -> tuple[int, list[Any], list[Block], list[Any], set[int], list[Block], set[int]] | None:
    """An iteration's optimizer phase cut into blocks, each ending at an operator that touches a
    parameter (a storage the iteration did not allocate, accessed before the optimizer and in it);
    the block's key is the set of parameters that operator touches. Blocks that created state that
    outlives the iteration (an optimizer's first update of a parameter) are kept apart.

    Returns (first optimizer position, the leading operators that touch no storage, the blocks, the
    operators after the last block, storages born in backward, the state-creating blocks, the
    storages the operators before the optimizer touch), or None
    when the iteration has no optimizer phase or operators after it touch storages (operators that
    touch none, a profiler mark of ``zero_grad`` say, may follow it: they stay after it)."""
    ops = it.ops
    start = next((j for j, op in enumerate(ops) if op.phase == "optimizer"), None)
    if start is None:
        return None
    end = next((j for j in range(start, len(ops)) if ops[j].phase != "optimizer"), len(ops))
    if any(op.inputs or op.outputs or op.writes or op.allocs for op in ops[end:]):
        return None
    pre = ops[:start]
    flat = itertools.chain.from_iterable
    born = set(flat(op.allocs for op in pre))
    born_bwd = set(flat(op.allocs for op in pre if op.phase == "backward"))
    before = set(flat(itertools.chain(op.inputs, op.outputs, op.writes) for op in pre))
    freed = set(flat(it.frees.values()))
    params = before - born
    lead: list[Any] = []
    j = start
    while j < len(ops) and not (ops[j].inputs or ops[j].outputs or ops[j].writes or ops[j].allocs):
        lead.append(ops[j])
        j += 1
    blocks: list[Block] = []
    inits: list[Block] = []
    cur: list[Any] = []
    for op in ops[j:end]:
        cur.append(op)
        key = params.intersection((*op.inputs, *op.outputs, *op.writes))
        if key:
            init = any(sid not in freed for o in cur for sid in o.allocs)
            (inits if init else blocks).append((frozenset(key), cur))
            cur = []
    return start, lead, blocks, cur + ops[end:], born_bwd, inits, before


class OptimizerMemory:
    """What the optimizer phases seen so far did, per parameter, for :meth:`plan`: the blocks of each
    parameter's latest update (:func:`_opt_blocks`), one order of every parameter ever updated
    (merged from the iterations' orders), and whether the rule of :meth:`plan` held on the latest
    iteration. Fed every finished iteration once (:meth:`ingest`), from ``context.history``."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.last = -1  # index of the latest iteration ingested
        self.blocks: dict[frozenset[int], list[Any]] = {}
        self.grads: dict[frozenset[int], list[int]] = {}
        self.order: list[frozenset[int]] = []
        self.after: dict[frozenset[int], set[frozenset[int]]] = {}
        self.init_blocks: dict[frozenset[int], list[Any]] = {}
        self.cut: Any = None
        self.params: set[int] = set()
        self.last_used: dict[int, Any] = {}  # parameter -> the latest iteration that used it
        self.ok = True

    def ingest(self, history: Any) -> None:
        """Take in the iterations of ``history`` not seen yet (by index; an older index: a new run)."""
        if history and history[-1].index < self.last:
            self.reset()
        for it in history:
            if it.index > self.last:
                self.last = it.index
                self._ingest(it)

    def _ingest(self, it: Any) -> None:
        cut = self.cut = _opt_blocks(it)  # (the latest: the previous iteration's, for plan())
        if cut is None:
            self.ok = False
            return
        start, _, blocks, _, born_bwd, inits, before = cut
        keys: list[frozenset[int]] = []
        for k, _ in blocks:
            if not keys or keys[-1] != k:
                keys.append(k)
        if len(set(keys)) != len(keys):
            self.ok = False  # a parameter updated in two places: not one order
            return
        # the rule: of the parameters known, those used before the optimizer are the ones updated
        known = set(self.order)
        self.ok = {k for k in known if k & before} == known.intersection(keys)
        if self.ok and known:  # and a known parameter that the optimizer touched was used before it
            touched = {sid for op in it.ops[start:] for sid in (*op.inputs, *op.outputs, *op.writes)}
            self.ok = not any(sid in touched and sid not in before for k in known for sid in k)
        fresh: dict[frozenset[int], list[Any]] = {}
        for k, ops in blocks:
            fresh.setdefault(k, []).extend(ops)
        for k, ops in fresh.items():
            self.blocks[k] = ops
            self.grads[k] = list(dict.fromkeys(sid for op in ops for sid in op.inputs if sid in born_bwd))
            self.after.setdefault(k, set())
        for a, b in zip(keys, keys[1:]):
            self.after[a].add(b)
        created: dict[frozenset[int], list[Any]] = {}
        for k, ops in inits:
            created.setdefault(k, []).extend(ops)
        self.init_blocks.update(created)
        self.params.update(*self.after)
        for sid in before:
            if sid in self.params:
                self.last_used[sid] = it
        self._sort()

    def _sort(self) -> None:
        """One order of every parameter consistent with every iteration's (a topological sort of
        "updated right after"); parameters no iteration ordered go by their smallest storage id."""
        indeg = dict.fromkeys(self.after, 0)
        for succ in self.after.values():
            for b in succ:
                indeg[b] += 1
        ready = [(min(k), sorted(k), k) for k, d in indeg.items() if d == 0]
        heapq.heapify(ready)
        order: list[frozenset[int]] = []
        while ready:
            k = heapq.heappop(ready)[2]
            order.append(k)
            for b in self.after[k]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    heapq.heappush(ready, (min(b), sorted(b), b))
        if len(order) != len(indeg):
            self.ok = False  # orders that contradict each other: not one fixed order
        self.order = order

    def skipped(self, prev: Any) -> list[tuple[int, int]]:
        """Accesses of the parameters ``prev`` did not use (a layer it skipped) as (storage, position
        in ``prev``): their accesses in the latest iteration that used them, each placed after the
        operator of ``prev`` that matches (by name, module, phase and occurrence) the nearest one
        before it there, as far after it as there."""
        if not self.ok or self.last != prev.index:
            return []
        if all(it is prev for it in self.last_used.values()):
            return []  # every parameter's latest use is prev's: none skipped (the common step)
        used = set(itertools.chain.from_iterable(itertools.chain(op.inputs, op.outputs, op.writes) for op in prev.ops))
        by_it: dict[int, tuple[Any, set[int]]] = {}
        for sid, it in self.last_used.items():
            if sid not in used and it is not prev:
                by_it.setdefault(id(it), (it, set()))[1].add(sid)
        if not by_it:
            return []
        keys: dict[tuple[str, str, str, int], int] = {}
        seen: dict[tuple[str, str, str], int] = {}
        for j, op in enumerate(prev.ops):
            k = (op.name, op.module, op.phase)
            c = seen.get(k, 0)
            seen[k] = c + 1
            keys[(*k, c)] = j
        out: list[tuple[int, int]] = []
        for it, want in by_it.values():
            seen = {}
            at, base = -1, -1  # position in prev of the latest matched operator, its position in it
            for j, op in enumerate(it.ops):
                if op.phase == "optimizer":
                    break
                k = (op.name, op.module, op.phase)
                c = seen.get(k, 0)
                seen[k] = c + 1
                q = keys.get((*k, c))
                if q is not None:
                    at, base = q, j
                hit = want.intersection((*op.inputs, *op.outputs, *op.writes))
                if hit:  # (before any match: as far from the start)
                    out.extend((sid, at + j - base) for sid in hit)
        return out

    def plan(self, prev: Any, active: Any, fresh: Any = (), rank: Any = None,
             size: Any = None) -> tuple[int, list[Any], list[tuple[int, int]]] | None:
        """The optimizer operators expected in this step. An optimizer updates the parameters that
        have a gradient, in one fixed order, each the same way every step: so the plan is the
        parameters ever updated, in their order, kept where ``active`` (accessed in this iteration
        before the optimizer) for one of them, each with its blocks from ``prev`` where it updated
        it, else from its latest update; ``prev``'s leading and trailing operators around them.

        ``fresh``: parameters used now that no optimizer phase seen has updated (a layer that runs
        for the first time): each gets the state creation and update of the first parameter of its
        ``size`` in the order, its own storages standing for that one's, placed after the planned
        parameter of the highest ``rank`` below its own (announcement order: the model's).

        Returns (``prev``'s first optimizer position, the operators, (parameter, gradient) of every
        block, in update order), or None to keep ``prev`` as it is: no
        optimizer phase, the rule failed on the latest iteration (an optimizer that also updates
        parameters without a gradient, a parameter updated twice), or the plan is ``prev``'s own
        optimizer (nothing changed: the zoo)."""
        if not self.ok or self.last != prev.index:
            return None
        cut = self.cut
        if cut is None:
            return None
        start, lead, blocks, tail, born_prev, inits, _ = cut
        mine: dict[frozenset[int], list[Any]] = {}
        for k, ops in blocks:
            mine.setdefault(k, []).extend(ops)
        planned = [k for k in self.order if any(active(sid) for sid in k)]
        out = list(lead)
        # prev's state creations stay where they ran while the parameters updated are prev's (the
        # features were trained with them there); the rest of their operators (profiler marks) too
        same = not fresh and set(planned) == set(mine)
        for k, ops in inits:
            if same and any(active(sid) for sid in k):
                out.extend(ops)
            else:
                out.extend(op for op in ops if not (op.inputs or op.outputs or op.writes or op.allocs))
        after: dict[frozenset[int] | None, list[tuple[int, list[Any], list[int]]]] = {}
        if fresh and rank is not None and size is not None:
            template: dict[float, frozenset[int]] = {}
            for k in self.order:
                if len(k) == 1 and k in self.init_blocks:
                    template.setdefault(size(next(iter(k))), k)
            ranked = sorted((rank(next(iter(k))), i) for i, k in enumerate(planned) if len(k) == 1)
            fake = -2
            for q in fresh:
                k0 = template.get(size(q))
                if k0 is None:
                    continue
                sub: dict[int, int] = {next(iter(k0)): q}
                for op in (*self.init_blocks[k0], *self.blocks[k0]):
                    for sid in (*op.inputs, *op.outputs, *op.writes, *op.allocs):
                        if sid not in sub:
                            sub[sid] = fake  # a storage of this update: one of its own (no id yet)
                            fake -= 1
                out.extend(_renamed(op, sub) for op in self.init_blocks[k0])
                i = bisect.bisect_left(ranked, (rank(q), -1)) - 1
                pred = planned[ranked[i][1]] if i >= 0 else None
                after.setdefault(pred, []).append(
                    (q, [_renamed(op, sub) for op in self.blocks[k0]], [sub[g] for g in self.grads[k0] if g in sub]))
        taken: list[tuple[int, int]] = []
        for q, ops, grads in after.pop(None, []):
            out.extend(ops)
            taken.extend((q, g) for g in grads)
        for k in planned:
            ops = mine.get(k)
            if ops is None:
                ops = self.blocks[k]
                grads = self.grads[k]
            else:
                grads = list(dict.fromkeys(sid for op in ops for sid in op.inputs if sid in born_prev))
            if len(k) == 1:
                taken.extend((next(iter(k)), g) for g in grads)
            out.extend(ops)
            for q, ops2, grads in after.pop(k, []):
                out.extend(ops2)
                taken.extend((q, g) for g in grads)
        out.extend(tail)
        same_ops = prev.ops[start:]
        if len(out) == len(same_ops) and all(a is b for a, b in zip(out, same_ops)):
            return None  # the previous iteration's optimizer, as it ran: nothing to replace
        return start, out, taken


def _renamed(op: Any, sub: dict[int, int]) -> Any:
    """``op`` with its storages renamed by ``sub``."""
    def r(sids: Any) -> tuple[int, ...]:
        return tuple(sub.get(sid, sid) for sid in sids)
    return dataclasses.replace(op, inputs=r(op.inputs), outputs=r(op.outputs), writes=r(op.writes),
                               allocs=r(op.allocs))
