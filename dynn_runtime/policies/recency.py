"""Least-recently-used order of storages, walked for victims without passing the ones away.

:class:`RecencyOrder` is what lru (:class:`~dynn_runtime.policies.basic.LRUPolicy`) keeps: every
storage it was told of, ordered by its last touch (an allocation or an access), in two tiers (large
storages, then small ones: :class:`~dynn_runtime.policies.base.SmallStorages`). A victim search
yields the resident storages not excluded, least recently touched first, the large tier before the
small one. Under a budget most of the least recently touched storages are away (on the host), and a
walk from the head would pass all of them at every search; instead a walk notes the ones it found
away, and the next search takes them out of their tier (``away``) until they are touched, freed, or
come back to the device without a touch (:meth:`RecencyOrder.returned`: the mechanism says so for every
storage that becomes resident again, ``Policy.on_return``), when a walk merges them back in by
their stamp.

Invariants:

1. Every storage told of and not freed is in exactly one of ``tiers[0]``, ``tiers[1]`` and
   ``away``, with its stamp: the count of touches when it was last touched, so stamps are distinct
   and order the storages as the touches did. Each tier is in increasing stamp (a touch appends).
2. ``back`` is the part of ``away`` that became resident again since it was taken out.
3. A storage in ``away`` and not in ``back`` is not resident: it was taken out only when the
   view said it was away or in flight, and every return to the device since then would have put
   it in ``back``. So a walk that skips those storages yields what a walk over all of them in
   stamp order yields.
4. The tiers change only between walks (touches and frees come between victim searches, as the
   order an OrderedDict iterator needs); taking storages out waits until no walk is open.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

__all__ = ["RecencyOrder"]

#: the most storages a walk may note for taking out while another walk is still open
_PENDING_CAP = 1 << 14


class RecencyOrder:
    """The storages by last touch, in two tiers (0: large, 1: small); see the module docstring."""

    __slots__ = ("tiers", "away", "back", "pending", "stamp", "walking")

    def __init__(self) -> None:
        #: sid -> stamp, each in increasing stamp (invariant 1)
        self.tiers: tuple[OrderedDict[int, int], OrderedDict[int, int]] = (OrderedDict(), OrderedDict())
        #: taken out of their tier, found away: sid -> (stamp, tier)
        self.away: dict[int, tuple[int, int]] = {}
        #: the storages of ``away`` that are resident again (invariant 2)
        self.back: set[int] = set()
        #: found away by a walk, taken out at the next search (an ordered set)
        self.pending: dict[int, None] = {}
        self.stamp = 0
        self.walking = 0

    def touch(self, sid: int, small: bool) -> None:
        """``sid`` was allocated or accessed: it becomes the most recent of tier ``small``."""
        away = self.away
        if away and away.pop(sid, None) is not None:
            self.back.discard(sid)
        self.stamp += 1
        mine, other = self.tiers[1] if small else self.tiers[0], self.tiers[0] if small else self.tiers[1]
        if mine.pop(sid, None) is None and other:
            other.pop(sid, None)
        mine[sid] = self.stamp

    def forget(self, sid: int) -> None:
        """``sid`` was freed."""
        big, tiny = self.tiers
        if big.pop(sid, None) is None and tiny.pop(sid, None) is None and self.away.pop(sid, None) is not None:
            self.back.discard(sid)

    def returned(self, sid: int) -> None:
        """``sid`` is resident again (a fetch landed, an offload was cancelled, a drop rebuilt),
        touched or not: if it was taken out, walks merge it back in by its stamp."""
        if sid in self.away:
            self.back.add(sid)

    def order(self) -> list[int]:
        """Every storage told of and not freed, least recently touched first (both tiers merged)."""
        entries = [(st, sid) for tier in self.tiers for sid, st in tier.items()]
        entries += [(st, sid) for sid, (st, _) in self.away.items()]
        return [sid for _, sid in sorted(entries)]

    def tier_order(self, tier: int) -> list[int]:
        """The storages of ``tier``, taken out ones included, least recently touched first."""
        entries = list(self.tiers[tier].items()) + [(sid, st) for sid, (st, k) in self.away.items() if k == tier]
        return [sid for sid, _ in sorted(entries, key=lambda e: e[1])]

    def walk(self, status: Callable[[int], str], exclude: set[int] | frozenset[int]) -> Iterator[int]:
        """The resident storages not in ``exclude``, least recently touched first, the large tier
        before the small one; ``status(sid)`` is the view's. Lazy: a status is read when the walk
        reaches its storage (what the caller evicted meanwhile is seen as away)."""
        if self.pending:
            if not self.walking:
                self._take_out(status)
            elif len(self.pending) > _PENDING_CAP:
                self.pending.clear()  # only ever a saving: a storage left in its tier is walked past
        return self._walk(status, exclude)

    def _take_out(self, status: Callable[[int], str]) -> None:
        """Take the storages walks found away out of their tiers (invariant 3: only if they still are)."""
        big, tiny = self.tiers
        away, back = self.away, self.back
        for sid in self.pending:
            st = status(sid)
            if st == "resident" or st == "absent":  # came back, or freed and not yet told
                continue
            if sid in back:
                back.discard(sid)  # left again: skipped as any taken out
                continue
            stamp = big.pop(sid, None)
            if stamp is not None:
                away[sid] = (stamp, 0)
                continue
            stamp = tiny.pop(sid, None)
            if stamp is not None:
                away[sid] = (stamp, 1)
        self.pending.clear()

    def _walk(self, status: Callable[[int], str], exclude: set[int] | frozenset[int]) -> Iterator[int]:
        self.walking += 1
        try:
            pending, back, away = self.pending, self.back, self.away
            for k, tier in enumerate(self.tiers):
                merged = sorted((away[sid][0], sid) for sid in back if away[sid][1] == k) if back else None
                if not merged:
                    for sid in tier:
                        if sid in exclude:
                            continue
                        st = status(sid)
                        if st == "resident":
                            yield sid
                        elif st != "absent":
                            pending[sid] = None
                    continue
                j, n = 0, len(merged)
                for sid, stamp in tier.items():
                    while j < n and merged[j][0] < stamp:
                        other = merged[j][1]
                        j += 1
                        if other in back and other not in exclude:
                            if status(other) == "resident":
                                yield other
                            else:
                                pending[other] = None
                    if sid in exclude:
                        continue
                    st = status(sid)
                    if st == "resident":
                        yield sid
                    elif st != "absent":
                        pending[sid] = None
                for _, other in merged[j:]:
                    if other in back and other not in exclude:
                        if status(other) == "resident":
                            yield other
                        else:
                            pending[other] = None
        finally:
            self.walking -= 1
