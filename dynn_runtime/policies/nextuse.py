"""Policies driven by a prediction of each storage's next use: oracle, replay (and pilot, later).

One mechanism, :class:`NextUsePolicy`, with one question left to subclasses: *when will this
storage be used next?* (:meth:`NextUsePolicy.predict`). From the answer it

* evicts the resident storage predicted to be needed furthest in the future (Belady's rule), and
* prefetches offloaded storages soonest-needed first, into free memory, up to ``lookahead``
  operators ahead.

``oracle`` answers with the true next use read from the trace (the practical lower bound of a
swapping policy); ``replay`` answers from the previous iteration, assuming this one repeats it
(AppObMem's premise, which dynamic networks break).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator

from ..trace.format import Iteration, Op
from .base import NO_CONTEXT, Action, IterationContext, Policy, SmallStorages, register

_INF = float("inf")
#: kinds of storage that outlive an iteration by design (made once, then kept)
PERSISTENT = frozenset({"param", "buffer", "opt_state"})


class NextUsePolicy(Policy):
    """Belady eviction and Belady-consistent prefetch over predicted next uses."""

    #: how far ahead (in operators) prefetch looks; None: as early as memory allows. A bound keeps
    #: prefetches out of the memory the allocations before their use need, or every allocation
    #: evicts again (the values compared: docs/benchmarks.md, "Prefetch lookahead").
    lookahead: int | None = 32
    #: at most this many moves per decision point (keeps one decision cheap)
    max_actions: int = 64
    #: storages under this fraction of the largest footprint are offered as victims only after every
    #: larger one (:class:`~dynn_runtime.policies.base.SmallStorages`; 0: one tier, Belady's order)
    small_fraction: float = 1e-4

    def __init__(self) -> None:
        super().__init__()
        self._res: list[tuple[float, int]] = []  # max-heap of resident by predicted next use: (-nu, sid)
        self._off: list[tuple[float, int]] = []  # min-heap of offloaded by predicted next use: (nu, sid)
        self._small = SmallStorages(self.small_fraction)
        #: a small storage had to be offered as a victim in this run (the pilot then scores them too)
        self.small_evicted = False
        #: entries a search passed over for the view's victim floor, (nbytes, key, sid): out of the heap
        #: until a search with a lower floor, or the next iteration, so that searches with the same
        #: floor do not pop and push them back each time
        self._parked: list[tuple[int, float, int]] = []
        self._parked_max = 0  # the largest nbytes parked
        #: the eviction heap is compacted (:meth:`_compact`) at a search that finds it longer than this
        self._compact_at = 4096

    # subclasses: predicted next use (operator position) of sid after the current position
    def predict(self, sid: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def _nu(self, sid: int) -> float:
        nu = self.predict(sid)
        return _INF if nu is None else float(nu)

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        if self.small_fraction:
            self._small.begin_iteration(context)
        self._unpark(0)  # (those of storages that died since are dropped when popped)

    def on_alloc(self, sid: int, position: int) -> None:
        if self.small_fraction:
            self._small.alloc(sid, self.view.nbytes(sid))
        self._res_push(-self._nu(sid), sid)

    def on_free(self, sid: int) -> None:
        self._small.free(sid)

    def on_access(self, sid: int, position: int) -> None:
        if self.small_fraction:
            self._small.access(sid)
        self._res_push(-self._nu(sid), sid)

    # the eviction heap: entries (-predicted next use, sid), least first (a subclass may keep it elsewhere)
    def _res_push(self, key: float, sid: int) -> None:
        heapq.heappush(self._res, (key, sid))

    def _res_pop(self) -> tuple[float, int] | None:
        res = self._res
        return heapq.heappop(res) if res else None

    def _unpark(self, floor: int) -> None:
        """Back into the heap: the parked entries a search with victim floor ``floor`` may take."""
        keep = []
        for item in self._parked:
            if item[0] >= floor:
                self._res_push(item[1], item[2])
            else:
                keep.append(item)
        self._parked = keep
        self._parked_max = max((item[0] for item in keep), default=0)

    def _compact(self) -> None:
        """The eviction heap made again from what is resident (:meth:`_rebuild`): an access pushes an
        entry and leaves the storage's older ones stale, and only those that reach the top are ever
        popped, so without this the heap grows by every access of every iteration."""
        self._rebuild()
        self._parked = []  # the rebuilt heap has them again
        self._parked_max = 0
        self._compact_at = 4 * len(self._res) + 4096

    def _rebuild(self) -> None:
        view = self.view
        self._res = [(-self._nu(sid), sid) for sid in view.resident()]
        heapq.heapify(self._res)

    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        """Resident storages, furthest predicted next use first: the larger ones (first tier), then,
        when those run out, the small ones (:class:`SmallStorages`) in the same order. Those under
        the view's ``victim_floor`` (which this search's mechanism passes over) are left out and
        keep their entries, parked until a search with a lower floor (the order of what is offered
        is the heap's either way)."""
        view = self.view
        movable, nbytes, floor = view.movable, view.nbytes, view.victim_floor
        if len(self._res) > self._compact_at:
            self._compact()
        if self._parked and floor <= self._parked_max:
            self._unpark(floor)
        parked = self._parked
        small = self._small
        tiered = bool(small.fraction)
        skipped = []
        later = []  # small storages put off to the second tier
        rebuilt = False
        try:
            while True:
                item = self._res_pop()
                if item is None:
                    if tiered and later:
                        for item in later:
                            self._res_push(*item)
                        later = []
                        tiered = False  # second tier: the small ones too
                        continue
                    if rebuilt:
                        return
                    for item in skipped:
                        self._res_push(*item)
                    skipped = []
                    self._compact()  # entries can only go stale, never missing: but never OOM on bookkeeping
                    parked = self._parked
                    rebuilt = True
                    continue
                neg, sid = item
                st = view.status(sid)
                if st == "fetching":
                    skipped.append((neg, sid))  # in flight: not evictable yet, keep its entry
                    continue
                if st != "resident" or -neg != self._nu(sid):
                    continue  # stale entry: evicted, freed, or used since
                if not movable(sid):
                    continue  # the mechanism would refuse it: dropped, pushed again at its next use
                if sid in exclude:
                    skipped.append((neg, sid))
                    continue
                if floor:
                    n = nbytes(sid)
                    if n < floor:
                        parked.append((n, neg, sid))
                        if n > self._parked_max:
                            self._parked_max = n
                        continue
                if small.small(sid):
                    if tiered:
                        later.append((neg, sid))
                        continue
                    self.small_evicted = True
                heapq.heappush(self._off, (-neg, sid))
                yield sid
        finally:
            for item in skipped:
                self._res_push(*item)
            for item in later:
                self._res_push(*item)

    def after_op(self, position: int) -> list[Action]:
        """Prefetch soonest-needed first, into free memory only, up to ``lookahead`` operators ahead.

        Never evicts to make room for a prefetch: the victim's offload holds its device memory until
        the copy lands, so the prefetch would rarely fit in time and the eviction would waste
        bandwidth.

        A storage whose offload copy is still in flight keeps its entry, so it is prefetched once it
        has landed instead of coming back only on demand. The mechanism reports landed copies
        lazily (when it needs room), which leaves the memory to the allocations that follow.
        """
        off = self._off
        if not off or (self.lookahead is not None and off[0][0] - position > self.lookahead):
            return []  # the soonest entry, stale or not, is past the lookahead: so is every valid one
        view = self.view
        actions: list[Action] = []
        free = view.free_bytes()
        in_flight = []  # offloads not landed yet: not fetchable now, their entries kept for later
        while self._off and len(actions) < self.max_actions:
            nu, sid = self._off[0]
            st = view.status(sid)
            if st != "host" or nu != self._nu(sid):
                heapq.heappop(self._off)
                if st == "offloading" and nu == self._nu(sid):
                    in_flight.append((nu, sid))
                continue  # else stale: fetched, freed, dropped for recompute, or predicted again since
            if nu == _INF or (self.lookahead is not None and nu - position > self.lookahead):
                break
            size = view.nbytes(sid)
            if free < size:
                break
            heapq.heappop(self._off)
            actions.append(Action("prefetch", sid))
            free -= size
            self._res_push(-nu, sid)
        for item in in_flight:
            heapq.heappush(self._off, item)
        return actions


@register
class OraclePolicy(NextUsePolicy):
    """Perfect knowledge of the future (the trace being replayed)."""

    name = "oracle"
    requires = frozenset({"future"})
    description = "Belady with the true future: evict furthest next use, prefetch as early as memory allows"

    def predict(self, sid: int) -> float | None:
        return self.view.next_use(sid)

    def evict_mode(self, sid: int) -> str:
        return "discard" if self.view.next_use(sid) is None else "offload"


@register
class ReplayPolicy(NextUsePolicy):
    """AppObMem-style: the previous iteration's access pattern, position for position, is the plan.

    A storage of this iteration is matched to the previous iteration's storage allocated by the
    operator at the same position (and output slot; where that operator allocated nothing, the
    storage it returned, an in-place operator's); parameters, optimizer state and other persistent
    storages match themselves. Its predicted next use is the first access of its match
    after the current position. Where the iterations diverge (different operators, shapes or
    lengths), the plan is simply wrong, which is what dynamic networks do to trace-and-replay.

    Positions are those of the previous iteration's *timeline* (:attr:`timeline`): its operators
    less the ones that created persistent state this iteration starts with (an optimizer's state
    made in its first step, a lazily built parameter), which do not run again once that state
    exists; every later operator of that iteration moves up by the creations before it. Without
    that, the step after the state was made is planned with every optimizer access late by the
    creations (all of them, before a multi-tensor optimizer's first operator).
    """

    name = "replay"
    requires = frozenset({"history"})
    description = "plan from the previous iteration's trace (AppObMem)"

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        # The plan is matched as storages appear (on_alloc), never by looking at this iteration's
        # operators ahead of time: the live runtime does not know them either.
        super().begin_iteration(index, context)
        self._plan: dict[int, list[int]] = {}
        self._prev_acc: dict[int, list[int]] = {}
        self._prev_slot: dict[tuple[int, int], int] = {}
        self._slots: dict[int, int] = {}
        self._n_prev = 0
        #: the previous iteration's operators as this iteration is expected to run them (plan positions)
        self.timeline: list[Op] = []
        if not context.history:
            return
        prev = context.history[-1]
        self.timeline = ops = self._timeline(prev, context.iteration is not None)
        for j, op in enumerate(ops):
            for sid in set(op.inputs) | set(op.outputs) | set(op.writes):
                self._prev_acc.setdefault(sid, []).append(j)
            # an operator that allocated nothing returned storages it was given (written in place, or
            # viewed): an allocation at its position here (the out-of-place variant, which autograd
            # may pick instead from one step to the next) takes that storage as its match
            for k, sid in enumerate(op.allocs or op.outputs):
                self._prev_slot[(j, k)] = sid
        self._n_prev = len(ops)

    def _timeline(self, prev: Iteration, known_ahead: bool) -> list[Op]:
        """``prev``'s operators less those that made persistent state this iteration starts with (see
        the class): an operator whose every allocation and write is a persistent storage alive now
        that first appeared at that operator (allocated there, or first seen just before it: state
        made outside the dispatcher, such as an optimizer's step counter, whose first operator
        marks it). Alive now: not freed in ``prev`` and, live, not absent; where the iteration is
        ``known_ahead`` (a simulator replaying a trace, which tells the storages alive at the start
        only once the iteration runs), the trace's frees are all there is."""
        first: dict[int, int] = {}
        for j, sids in prev.pre_allocs.items():
            if j > 0:  # at 0: what existed before the iteration (a trace's parameters)
                for sid in sids:
                    first.setdefault(sid, j)
        for j, op in enumerate(prev.ops):
            for sid in op.allocs:
                first.setdefault(sid, j)
        freed = {sid for sids in prev.frees.values() for sid in sids}
        view = self.view

        def made_state(j: int, op: Op) -> bool:
            made = set(op.allocs) | set(op.writes)
            return bool(made) and all(
                first.get(sid) == j and sid not in freed and (known_ahead or view.status(sid) != "absent")
                and view.kind(sid) in PERSISTENT for sid in made)

        return [op for j, op in enumerate(prev.ops) if not made_state(j, op)]

    def on_alloc(self, sid: int, position: int) -> None:
        if position >= 0 and sid not in self._prev_acc:
            k = self._slots.get(position, 0)
            self._slots[position] = k + 1
            match = self._prev_slot.get((position, k))
            if match is not None:
                self._plan[sid] = self._prev_acc.get(match, [])
        elif sid in self._prev_acc:  # persistent storages (parameters, optimizer state) match themselves
            self._plan[sid] = self._prev_acc[sid]
        super().on_alloc(sid, position)

    def plan(self, sid: int) -> list[int] | None:
        """The previous iteration's access positions of ``sid``'s match, ascending (None: no match)."""
        return self._plan.get(sid)

    def predict(self, sid: int) -> float | None:
        acc = self._plan.get(sid)
        pos = self.view.position
        if acc is None:
            return pos + 1  # no plan for it: keep it (the replay plan never saw it)
        k = bisect.bisect_right(acc, pos)
        if k < len(acc):
            return acc[k]
        if self.view.kind(sid) in PERSISTENT and acc:
            return self._n_prev + acc[0]
        return None
