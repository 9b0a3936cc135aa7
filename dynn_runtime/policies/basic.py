"""Policies that need no knowledge beyond the present: none, lru, save_on_cpu, uvm."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import accumulate, repeat
from operator import sub
from typing import Any, ClassVar

from .base import (
    NO_CONTEXT,
    TOUCH_ALLOC,
    TOUCH_FREE,
    Action,
    IterationContext,
    Policy,
    SmallStorages,
    register,
    tells_in_bulk,
)
from .recency import RecencyOrder

#: lru's notifications: a subclass that keeps them as they are may have its order kept natively
_ORDER_HOOKS = ("on_alloc", "on_access", "on_free", "on_return", "on_touches", "order")


@register
class NonePolicy(Policy):
    """PyTorch alone: everything stays resident; over budget is out-of-memory."""

    name = "none"
    description = "PyTorch alone: everything resident"
    moves_nothing = True
    reads_operators = False


@register
class LRUPolicy(Policy):
    """Evict the least recently used resident storage on pressure; fetch on demand (no prefetch).

    The order is a :class:`~dynn_runtime.policies.recency.RecencyOrder`: a victim search passes
    only the storages that stay resident (excluded, or refused by the mechanism), not the ones away."""

    name = "lru"
    description = "evict least recently used on pressure, fetch on demand"
    #: storages under this fraction of the largest footprint go last (:class:`SmallStorages`; 0: off)
    small_fraction: ClassVar[float] = 1e-4
    reads_operators = False  # recency is all it reads
    #: on the native event source the observer keeps the order (csrc/recency.h); False: this
    #: policy keeps it in Python there too (the reference the native order is tested against)
    native_order: ClassVar[bool] = True

    def __init__(self, native_order: bool | None = None) -> None:
        super().__init__()
        if native_order is not None:  # the option (policy_options={"native_order": False}) over the class's
            self.native_order = bool(native_order)
        self._recency = RecencyOrder()
        self._small = SmallStorages(self.small_fraction)
        #: the native observer keeping the order instead (:meth:`keep_order_in`), or None
        self._native: Any = None

    def order(self) -> list[int]:
        """The storages told of and not freed, least recently used first (both tiers merged)."""
        if self._native is not None:
            return self._native.recency_order()
        return self._recency.order()

    def keep_order_in(self, observer: Any) -> bool:
        # The observer's order (csrc/recency.h) is this class's: the same tiers, classes and touches.
        # A subclass that changes a notification keeps its own order in Python.
        cls = type(self)
        if not self.native_order or cls.page_bytes is not None or not tells_in_bulk(cls) or any(
                getattr(cls, m) is not getattr(LRUPolicy, m) for m in _ORDER_HOOKS):
            return False
        observer.set_recency(float(self.small_fraction))
        self._native = observer
        return True

    def release_order(self) -> None:
        if self._native is not None:
            self._native.set_recency(None)
            self._native = None
            self._recency = RecencyOrder()
            self._small = SmallStorages(self.small_fraction)

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        if self.small_fraction and self._native is None:
            self._small.begin_iteration(context)

    def on_alloc(self, sid: int, position: int) -> None:
        if self._native is not None:
            self._native.recency_alloc(sid, self.view.nbytes(sid))
            return
        small = self._small.alloc(sid, self.view.nbytes(sid)) if self.small_fraction else False
        self._recency.touch(sid, small)

    def on_access(self, sid: int, position: int) -> None:
        if self._native is not None:
            self._native.recency_access(sid)
            return
        small = self._small.access(sid) if self.small_fraction else False
        self._recency.touch(sid, small)

    def on_free(self, sid: int) -> None:
        if self._native is not None:
            self._native.recency_free(sid)
            return
        self._recency.forget(sid)
        self._small.free(sid)

    def on_return(self, sid: int) -> None:
        if self._native is None:
            self._recency.returned(sid)

    def on_touches(self, events: Sequence[int]) -> None:
        if self._native is not None:
            self._native.recency_touches(events)
            return
        # on_alloc / on_access / on_free inlined, in the same order: the same state
        # (SmallStorages' alloc, access and free, RecencyOrder's touch and forget, inlined on local
        # copies of their counters)
        if events[0::4].count(TOUCH_ALLOC) * 4 == len(events) and self._allocs_at_once(events):
            return
        rec, small = self._recency, self._small
        big, tiny = rec.tiers
        away, back = rec.away, rec.back
        stamp = rec.stamp
        classes = bool(self.small_fraction)
        sizes, smalls, fraction = small._bytes, small._small, small.fraction
        live, peak = small._live, small._peak
        threshold = fraction * peak
        for i in range(0, len(events), 4):
            kind, sid = events[i], events[i + 1]
            if away and away.pop(sid, None) is not None:
                back.discard(sid)
            if kind == TOUCH_FREE:
                if big.pop(sid, None) is None:
                    tiny.pop(sid, None)
                live -= sizes.pop(sid, 0)
                smalls.discard(sid)
                continue
            is_small = False
            if classes:
                if kind == TOUCH_ALLOC:
                    nbytes = events[i + 3]
                    live += nbytes - sizes.get(sid, 0)
                    sizes[sid] = nbytes
                    if live > peak:
                        peak = live
                        threshold = fraction * peak
                    is_small = nbytes < threshold
                else:
                    is_small = sizes.get(sid, 0) < threshold
                if is_small:
                    smalls.add(sid)
                else:
                    smalls.discard(sid)
            stamp += 1
            if is_small:
                if tiny.pop(sid, None) is None:
                    big.pop(sid, None)
                tiny[sid] = stamp
            else:
                if big.pop(sid, None) is None and tiny:
                    tiny.pop(sid, None)
                big[sid] = stamp
        rec.stamp = stamp
        small._live, small._peak = live, peak

    def _allocs_at_once(self, events: Sequence[int]) -> bool:
        """A batch of allocations of distinct storages (what the program holds, announced when a
        step starts) applied as whole-list operations, to the state the ``on_alloc`` calls in turn
        would leave: the storages last in the order, in the batch's order; each storage's size
        counted again, the running footprint's maximum after each; each classed by the threshold of
        its moment. False (nothing done) where a storage comes twice."""
        sids = events[1::4]
        told = set(sids)
        if len(told) != len(sids):
            return False
        if not sids:
            return True
        if self.small_fraction:
            small = self._small
            sizes, fraction = small._bytes, small.fraction
            nbytes = events[3::4]
            live = list(accumulate(map(sub, nbytes, map(sizes.get, sids, repeat(0))), initial=small._live))
            peaks = list(accumulate(live, max, initial=small._peak))[2:]  # the maximum after each allocation
            sizes.update(zip(sids, nbytes))
            small._live, small._peak = live[-1], max(small._peak, peaks[-1])
            smalls = small._small
            smalls.difference_update(sids)
            smalls.update(sid for sid, n, p in zip(sids, nbytes, peaks) if n < fraction * p)
        else:
            smalls = set()
        rec = self._recency
        away, back = rec.away, rec.back
        for sid in told.intersection(away):
            del away[sid]
            back.discard(sid)
        base = rec.stamp
        rec.stamp = base + len(sids)
        rec.tiers = tuple(  # type: ignore[assignment]
            OrderedDict([(sid, st) for sid, st in tier.items() if sid not in told]
                        + [(sid, base + 1 + i) for i, sid in enumerate(sids) if (sid in smalls) == bool(k)])
            for k, tier in enumerate(rec.tiers))
        return True

    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        if self.view is None:  # not attached yet (the Python source tracks parameters first): told nothing
            return iter(())
        if self._native is not None:
            return self._native_walk(exclude)
        movable = self.view.movable
        return (sid for sid in self._recency.walk(self.view.status, exclude) if movable(sid))

    def _native_walk(self, exclude: set[int]) -> Iterator[int]:
        """The observer's order walked as :meth:`RecencyOrder.walk` walks its own: resident storages
        not in ``exclude``, least recently touched first, the large tier before the small one. The
        observer passes over those away or with a copy in flight; a status is read when the walk
        reaches its storage (what the caller evicted meanwhile is seen as away), and those under the
        view's ``victim_floor`` are passed over there too."""
        after = self._native.recency_after
        view = self.view
        evictable = view.evictable
        tier, sid, stamp, size = 0, 0, -1, 8
        while tier < 2:
            batch, tier, sid, stamp = after(tier, sid, stamp, size, view.victim_floor)
            size = 64  # the first few usually suffice; a long walk takes more per call
            for s in batch:
                if s not in exclude and evictable(s):
                    yield s


@register
class SaveOnCPUPolicy(Policy):
    """Like ``torch.autograd.graph.save_on_cpu``: every saved activation goes to the host when the
    forward pass is done with it, copied on the compute stream; the backward pass copies it back,
    synchronously, when it unpacks it. Nothing else is ever moved, and there is no prefetch."""

    name = "save_on_cpu"
    description = "offload every saved activation, fetch on use (torch save_on_cpu)"
    sync_copies: ClassVar[bool] = True
    reads_saved: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._cands: set[int] = set()

    def on_alloc(self, sid: int, position: int) -> None:
        # Whether autograd saves it may only be known after the operator that made it (live, the
        # saved-tensor hook runs then): keep every candidate and look at ``saved`` when deciding.
        if position >= 0 and self.view.kind(sid) in ("activation", "input", "temp"):
            self._cands.add(sid)

    def on_free(self, sid: int) -> None:
        self._cands.discard(sid)

    def after_op(self, position: int) -> list[Action]:
        view = self.view
        if view.phase != "forward":
            return []
        done = [sid for sid in self._cands
                if view.saved(sid) and view.status(sid) == "resident" and view.forward_done(sid)]
        for sid in done:
            self._cands.discard(sid)
        return [Action("evict", sid) for sid in done]


@register
class UVMPolicy(LRUPolicy):
    """CUDA unified memory when oversubscribed: page-granular (64 KiB pages) demand migration.

    Faults are served in 2 MiB batches, each costing the profile's ``uvm_fault_s`` plus the
    migration at ``uvm_bytes_per_s``; the driver evicts least-recently-used pages, writing them back
    in the fault path (``sync_copies``). There is no prefetch (``cudaMemPrefetchAsync`` is not used
    by PyTorch).
    """

    name = "uvm"
    description = "unified memory: page-granular demand migration with fault cost"
    sync_copies: ClassVar[bool] = True
    page_bytes: ClassVar[int | None] = 64 << 10
    small_fraction: ClassVar[float] = 0.0  # the driver's page LRU knows no storage sizes
