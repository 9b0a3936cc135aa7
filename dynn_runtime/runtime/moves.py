"""Moving storages on and off the device: the live side of :class:`~dynn_runtime.residency.Residency`.

Evictions, demand fetches and prefetches go through the copy engine (:mod:`.copies`) under the
invariants of :mod:`.manager`'s docstring; every status change goes through
:meth:`~dynn_runtime.residency.Residency.set_status`, and room is made by the shared
:meth:`~dynn_runtime.residency.Residency.make_room` with the hooks below. An eviction releases its
device bytes at once, stream-ordered, so no offload is ever pending here: storages go
``resident -> host`` and come back ``host -> fetching -> resident`` (asynchronous copies) or
``host -> resident`` (synchronous ones).

Storages a collective still runs on (``c10d::`` operators: DDP's buckets) and those ``pin()``-ned
never leave. An eviction's copy waits for the compute stream and for the stream of the storage's
last access (the native observer's ``last_stream``; ``_S.stream`` on the Python source).

State: ``_copies``, ``async_copies``, ``_copy_storages`` (the engine takes storages: ``copies.py``),
``_asks_mode`` (the policy may answer ``evict_mode`` with "drop": asked per eviction),
``pool``, ``_walked_at`` (the pool's ``handed_out`` at the last walk of the observer's table), ``_cur``
(the step's statistics), ``_pending_stalls``, ``_held`` and ``_collectives`` (what collectives hold),
``_pinned``, ``_no_prefetch`` (a prefetch ran out of device memory in this step).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..errors import BudgetError, internal_assert
from ..memory import format_bytes
from ..policies.base import Policy
from ..residency import HOLDS_DEVICE, IN_FLIGHT, Record, Residency, Status
from .events import native_module
from .storages import _S, _u8

RESIDENT, HOST, FETCHING, ABSENT = Status.RESIDENT, Status.HOST, Status.FETCHING, Status.ABSENT


class Moves(Residency):
    """Evict, fetch and prefetch on real copies; the make-room hooks."""

    #: the byte view a copy reads or writes is made by ``dynn_runtime._C.byte_view`` where the extension
    #: loads (the same operators, without their Python argument parsing); off, :func:`._u8` (the reference)
    byte_view_in_c = True

    def _bytes(self, st: torch.UntypedStorage) -> torch.Tensor:
        """A uint8 tensor over the whole of ``st`` (what a copy reads or writes)."""
        mod = native_module() if self.byte_view_in_c else None
        return _u8(st, self.device) if mod is None else mod.byte_view(st)

    def movable(self, sid: int) -> bool:
        """MemoryView: what :meth:`_evict` would refuse for good (``_S.movable``: the program's own
        since a step ended, or storage that cannot be resized); pinned and held storages are refused
        only for now, and so still offered."""
        s = self.st.get(sid)
        return s is None or s.movable

    def _evict(self, s: _S) -> bool:
        """Move a resident storage off the device. False if it cannot leave."""
        sid = s.sid
        if s.status is not RESIDENT or not s.movable or sid in self._pinned or sid in self._held:
            return False
        st = s.storage()
        if st is None:
            return False
        obs = self._obs
        if obs is not None:
            if not st.resizable():
                s.movable = False
                return False
            if s.host_valid and not obs.host_valid(sid):  # written since its host copy was made
                self._drop_host(s)
        if self._asks_mode and self.policy.evict_mode(sid) == "drop":
            return False  # recompute at runtime: not supported; the policy must offload
        # "discard" (the oracle's never-used-again) is never honoured live: the trace could be wrong,
        # and a wrong discard loses data. Offload instead.
        t0 = time.perf_counter()
        cur = self._cur
        host = s.host
        if s.host_valid and host is not None:
            self._release_device(s, st)
            self.set_status(s, HOST)
        else:
            nbytes = s.nbytes
            if host is None or host.nbytes != nbytes:
                if host is not None:
                    self._drop_host(s)
                s.host = host = self.pool.alloc(nbytes)
            last = obs.last_stream(sid) if obs is not None else s.stream
            # Released now, stream-ordered (copies.py): the block is not reused before the copy
            # has read it, so the host never waits for an eviction.
            if self._copy_storages:  # the copy and the release in one call
                s.event = self._copies.evict(st, host.tensor, last, True)
            else:
                src = self._bytes(st)
                s.event = self._copies.to_host(src, host.tensor, last)
                del src
                self._copies.release(st)
            s.host_valid = True
            if obs is not None:
                obs.set_evicted(sid)  # away, its host copy valid
            self.set_status(s, HOST)
            cur.bytes_offloaded += nbytes
        cur.evictions += 1
        dt = time.perf_counter() - t0
        cur.copy_seconds += dt
        if not self.async_copies:
            cur.stall_seconds += dt
        return True

    def _release_device(self, s: _S, st: torch.UntypedStorage) -> None:
        self._copies.release(st)
        if self._obs is not None:
            self._obs.set_away(s.sid, True)

    # ---- collectives: what a c10d operator reads or writes stays until its work completes -------
    def _hold_for_collective(self, sids: set[int], works: list[Any] | None) -> None:
        """A ``c10d::`` operator (DDP's bucket all-reduce) was issued on ``sids``: its work runs on in
        the background (NCCL's stream, gloo's threads) and reads them, so they may not move until it
        completes. ``works``: its ``Work`` objects (the Python source), or None where they are not
        visible (the native source): then the storages are held until the step ends."""
        held = self._held
        sids = tuple(x for x in sids if x in self.st)
        for sid in sids:
            held[sid] = held.get(sid, 0) + 1
        self._collectives.append((tuple(works) if works else None, sids))

    def _release_collectives(self, wait: bool) -> None:
        """Release the storages of collectives whose work completed; ``wait``: of all of them (the
        step ends: a collective still running is waited for first)."""
        keep = []
        for works, sids in self._collectives:
            done = works is not None and all(w.is_completed() for w in works)
            if not done and not wait:
                keep.append((works, sids))
                continue
            for w in works if not done and works is not None else ():
                w.wait()
            for sid in sids:
                n = self._held.get(sid, 0) - 1
                if n > 0:
                    self._held[sid] = n
                else:
                    self._held.pop(sid, None)
        self._collectives = keep

    def _reap(self) -> None:
        """Offloads whose copies have landed release their device bytes; prefetches that landed
        stay FETCHING until first use (the compute stream still has to wait on their event)."""
        if not self.async_copies:
            return
        for s in list(self.fetching.values()):
            if s.fetch_event is not None and s.fetch_event.query():
                st = s.storage()
                if st is not None:
                    self._finish_fetch(s, st)

    def _fetch_now(self, s: _S, budgeted: bool = True, exclude: set[int] | None = None, where: object = "",
                   retry: bool | None = None) -> None:
        """Make ``s`` resident now (a demand fetch: the compute stream waits for it). Where its
        allocation runs out of device memory, room is made and it is tried once more when ``retry``
        (default: in a step; the end of a step passes True); a second failure leaves ``s`` as it was
        (on the host, its copy valid) and raises the allocator's error."""
        st = s.storage()
        if st is None:
            internal_assert(False, f"runtime: storage {s.sid} is needed but was freed")
        status = s.status
        if status is RESIDENT:
            return
        if status is FETCHING:
            self._finish_fetch(s, st)
            return
        if status is not HOST or s.host is None or not s.host_valid:
            internal_assert(False, f"runtime: storage {s.sid} is {s.status} without a valid host copy")

        def what() -> str:  # built only where it is said: this runs per fetch
            return f"{where or 'an access'} (fetching a {format_bytes(s.nbytes)} {s.kind} back)"

        nbytes = s.nbytes
        if budgeted and self.budget is not None and self.used + nbytes > self.budget:
            self.make_room(nbytes, (exclude or set()) | {s.sid}, what())
        t0 = time.perf_counter()
        inline = self._fetch_inline and self.inline_demand_fetches
        start = self._start_inline if inline else self._start_fetch
        try:
            start(s, st)
        except torch.OutOfMemoryError as exc:
            if not (self._in_step if retry is None else retry):
                raise
            # the allocator's count is not the manager's (oom.py): room, then once more; a failed
            # allocation changed nothing, so the fetch starts again from where it was
            self._room_after_oom(str(exc), (exclude or set()) | {s.sid}, what(), s.nbytes)
            try:
                start(s, st)
            except torch.OutOfMemoryError as again:
                self._oom_retry_failed(str(again), what())
                raise
        if not inline:  # an inline fetch lands resident, its copy ordered on the compute stream
            self._finish_fetch(s, st)
        cur = self._cur
        cur.prefetch_misses += 1
        cur.bytes_fetched_on_demand += nbytes
        dt = time.perf_counter() - t0
        cur.copy_seconds += dt
        if not self.async_copies:
            cur.stall_seconds += dt

    def _start_fetch(self, s: _S, st: torch.UntypedStorage) -> None:
        copies = self._copies
        copies.allocate(st, s.nbytes)
        if self._obs is not None:
            self._obs.set_away(s.sid, False)
        if self._copy_storages:
            ev = copies.fetch(s.host.tensor, st, s.event)
        else:
            dst = self._bytes(st)
            ev = copies.to_device(s.host.tensor, dst, s.event)
            del dst
        if self.async_copies:
            s.fetch_event = ev
            s.event = ev
            self.set_status(s, FETCHING)
        else:
            s.fetch_event = None
            self.set_status(s, RESIDENT)
        self._note_peak()

    #: a demand fetch is copied on the compute stream, where the engine can (``fetch_inline``,
    #: copies.py); off: on the host-to-device side stream, as a prefetch is
    inline_demand_fetches = True

    def _start_inline(self, s: _S, st: torch.UntypedStorage) -> None:
        """A demand fetch on the compute stream (the engine's ``fetch_inline``): resident at once, a
        late fetch by construction (the compute stream runs its copy), timed as late fetches are."""
        timed = self._late_fetch()
        try:  # the block is allocated by the same call
            pair = self._copies.fetch_inline(s.host.tensor, st, s.event, timed, s.nbytes)
        except torch.OutOfMemoryError:
            self._cur.late_fetches -= 1  # nothing changed: the retry counts it
            raise
        if self._obs is not None:
            self._obs.set_away(s.sid, False)  # after the allocation: the observer hears the new block
        if pair is not None:
            self._pending_stalls.append(pair)
        # s.event stays the copy that filled the host buffer: a host read of the buffer (state_dict's
        # copy of a storage away) waits for it, and a buffer given back waits for it
        s.fetch_event = None
        self.set_status(s, RESIDENT)
        self._note_peak()

    def _finish_fetch(self, s: _S, st: torch.UntypedStorage) -> None:
        """A fetched storage becomes usable: the compute stream waits on its copy (invariant 3)."""
        if s.fetch_event is not None:
            if not s.fetch_event.query() and self._late_fetch():  # late, and in the timed sample
                pair = self._copies.timed_wait(s.fetch_event)
                if pair is not None:
                    self._pending_stalls.append(pair)
            else:
                self._copies.compute_waits(s.fetch_event)
            s.fetch_event = None
        if s.status is FETCHING:  # synchronous copies land resident (_start_fetch)
            self.set_status(s, RESIDENT)

    def _prefetch(self, s: _S) -> None:
        """Start bringing ``s`` back ahead of its use, where it fits the budget. A prefetch is optional:
        where the allocator runs out for it (its count is not the manager's, oom.py), it is dropped,
        what it took is given back and ``s`` stays on the host, and no other prefetch starts in this
        step (each would meet the same full allocator, whose out-of-memory path synchronizes the
        device); its access fetches it on demand, with the retry of :meth:`_fetch_now`."""
        st = s.storage()
        if st is None or s.status != HOST or not s.host_valid or self._no_prefetch:
            return
        if self.used + s.nbytes > self.budget:
            return
        t0 = time.perf_counter()
        try:
            self._start_fetch(s, st)
        except torch.OutOfMemoryError:
            if s.status is HOST and st.nbytes() > 0:  # allocated, then the copy's own work ran out
                self._release_device(s, st)
            self._no_prefetch = True
            self._cur.prefetches_dropped += 1
            return
        s.pf = True
        self._cur.bytes_prefetched += s.nbytes
        dt = time.perf_counter() - t0
        self._cur.copy_seconds += dt
        if not self.async_copies:
            self._cur.stall_seconds += dt

    def _room_before(self, need: int) -> bool:
        if self._collectives:
            self._release_collectives(wait=False)
        if self._obs is not None and self._walk_for_room(need) and self._obs.sweep():  # died since the last look
            self._native_parse(in_step=self._in_step)
            if self.fits(need):
                return True
        self._reap()
        return False

    #: walk the observer's table for deaths before every make-room, whatever the drain found (off:
    #: only where the walk can help, :meth:`_walk_for_room`)
    walk_every_room = False

    def _walk_for_room(self, need: int) -> bool:
        """Whether a walk of the observer's table (``sweep``) can help make room for ``need`` bytes.
        Where no entry counted in ``used`` is exposed (events.cpp, invariant 9), the drain that read
        ``used`` found every death that frees device bytes, and a walk finds only storages that died
        away, whose host buffers it frees. Then it walks once the host pool has handed out a quarter
        of what it holds since the last walk, or where it has less than ``need`` free, so that those
        buffers come back before the pool grows for them (a pinned chunk is slow to make). Both
        follow the moves alone, so two runs that move the same walk at the same points."""
        obs = self._obs
        pool = self.pool
        if (not self.walk_every_room and not obs.exposed and pool.reserved - pool.in_use >= need
                and pool.handed_out - self._walked_at < pool.in_use >> 2):
            return False
        self._walked_at = pool.handed_out
        return True

    def _evict_for_room(self, s: _S) -> bool:
        return self._evict(s)

    def _land_fetch(self) -> bool:
        """Make in-flight prefetches usable (the compute stream waits on them; they become
        evictable); False if none was in flight."""
        fetch = list(self.fetching.values())
        for s in fetch:
            st = s.storage()
            if st is not None:
                self._finish_fetch(s, st)
        self._reap()
        return bool(fetch)

    def _land_offload(self) -> None:
        internal_assert(False, "runtime: an eviction releases its device bytes at once (stream-ordered), so no "
                               "offload is ever pending")

    def _out_of_memory(self, need: int, exclude: set[int], where: object) -> None:
        if self._parse_due:  # a fault put its read of the log off: the message counts every record
            self._native_parse(in_step=self._in_step)
        held = sum(self.st[x].nbytes for x in exclude if x in self.st)
        # what the program made between steps or kept past a step's end (Steps._end_step) never
        # moves: named where freeing it would make the room
        fixed = sum(s.nbytes for s in self.st.values() if s.status is RESIDENT and not s.movable and s.sid not in exclude)
        fixes = ["Raise the budget"]
        if type(self.policy).victims is Policy.victims:
            fixes.append("use a policy that moves tensors (lru, pilot)")
        if fixed and (fixed >= self.used + need - self.budget or 4 * fixed >= self.budget):
            fixes.append(f"free what the program keeps from one step to the next or makes between steps "
                         f"({format_bytes(fixed)} here, never moved: code outside the dispatcher may read it)")
        raise BudgetError(
            f"runtime: out of memory under policy {self.policy.name!r} at {where}: {format_bytes(need)} more needed, "
            f"{format_bytes(self.used)} of {format_bytes(self.budget)} in use ({format_bytes(held)} of it needed by "
            f"this operator) and nothing the policy may move. {', or '.join(fixes)}. "
            f"In use: {self._in_use(exclude)}.")

    def _in_use(self, exclude: set[int]) -> str:
        """The device bytes in use by kind and by why each may not move (what a failed make-room is
        read with): the largest groups first, then what is counted but not tracked here."""
        groups: dict[tuple[str, str], int] = {}
        tracked = 0
        for s in self.st.values():
            if s.status not in HOLDS_DEVICE:
                continue
            why = ("needed now" if s.sid in exclude else "pinned" if s.sid in self._pinned
                   else "held by a collective" if s.sid in self._held
                   else s.status.value if s.status is not RESIDENT
                   else "movable" if s.movable else "not movable")
            groups[(s.kind, why)] = groups.get((s.kind, why), 0) + s.nbytes
            tracked += s.nbytes
        parts = [f"{kind} {format_bytes(n)} ({why})" for (kind, why), n in sorted(groups.items(), key=lambda kv: -kv[1])]
        if self.used != tracked:
            parts.append(f"{format_bytes(self.used - tracked)} counted but not among the tracked storages")
        return ", ".join(parts[:8]) or "nothing tracked"

    def _account(self, delta: int) -> None:
        # told only where no native observer counts device bytes itself (``_counts_held``;
        # events.cpp, invariant 2)
        self._books.used += delta

    def _flight_changed(self, s: Record, old: Status, new: Status) -> None:
        obs = s.obs  # the observer watches the next access of a storage with a copy in flight
        if obs is not None and new is not ABSENT:
            obs.set_watch(s.sid, new in IN_FLIGHT)

    def _copies_outstanding(self) -> bool:
        """Whether a copy may still be in flight (a storage offloading or fetching, a host buffer
        waiting for its copy) or a timed wait is unread: what a step's end waits for. Where there is
        none, the end waits for nothing, and the host runs on into the next step while the device
        finishes this one, as it does under PyTorch alone."""
        return bool(self.offloading or self.fetching or self._pending_stalls or self.pool.waiting)

    def _sync(self) -> None:
        self._copies.sync()
        if self.async_copies:
            self._reap()
        self.pool.poll()

    def _apply(self, actions: list[Any], busy: set[int]) -> None:
        for a in actions:
            s = self.st.get(a.sid)
            if s is None:
                continue
            if a.kind == "evict":
                if a.sid not in busy:
                    self._evict(s)
            elif a.kind == "prefetch" and s.status == HOST:
                self._prefetch(s)

    #: one late fetch in this many has its wait timed on the device (the step's first always is):
    #: ``stall_seconds`` is their time scaled up to every late fetch
    time_late_every = 8

    def _late_fetch(self) -> bool:
        """Count a late fetch (the compute stream waits for its copy); whether its wait is one of the
        sample timed on the device (two timing events on the compute stream)."""
        cur = self._cur
        cur.late_fetches += 1
        return (cur.late_fetches - 1) % self.time_late_every == 0

    def _resolve_stalls(self) -> None:
        """The step's timed waits into ``stall_seconds``, scaled up to all its late fetches; after the
        step's copies completed (``_sync``), so every pair's events have been reached."""
        pairs = self._pending_stalls
        if pairs:
            cur = self._cur
            timed = sum(before.elapsed_time(after) for before, after in pairs) * 1e-3
            cur.late_fetches_timed += len(pairs)
            cur.stall_seconds += timed * max(1.0, cur.late_fetches / len(pairs))
        self._pending_stalls = []
