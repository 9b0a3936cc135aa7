"""The residency state machine the simulator and the live runtime share.

Every managed storage is in one :class:`Status`. The simulator (:mod:`dynn_runtime.sim.engine`) and
the live manager (:mod:`dynn_runtime.runtime.manager`) both keep their storages in a
:class:`Residency`; they differ only in their clock (simulated seconds, or the host's) and their
copy backend (simulated copy engines, or real streams and events), which each supplies through the
hooks below.

Invariants :class:`Residency` keeps:

1. A status changes only through :meth:`Residency.set_status`, which rejects a transition not in
   :data:`TRANSITIONS` (a bug, reported as one) and keeps the count of device bytes: a storage holds
   its bytes while it is in :data:`HOLDS_DEVICE` (``resident``; ``offloading``, whose device copy
   lives until its copy ends; ``fetching``, whose space is taken when its copy starts).
2. The storages with a copy in flight are exactly those in ``offloading`` (``Residency.offloading``;
   their bytes are ``pending``: they leave the device when the copy lands) and ``fetching``
   (``Residency.fetching``), so reaping and waiting look only there.
3. :meth:`Residency.make_room` frees room for ``need`` more bytes by evicting the policy's victims,
   best first, counting an offload in flight as gone; when that is not enough it lets a copy in
   flight land (a prefetch holds space and becomes evictable), and only when nothing moved and
   nothing is in flight does it report out of memory. Before it returns, the bytes held (offloads in
   flight included) plus ``need`` are within the budget.
4. Every transition into ``resident`` from anything but ``absent`` is told to the policy
   (``on_return``) as it happens: a policy that sets storages it found away aside (lru) needs it.
5. The read side of the policy interface (:class:`~dynn_runtime.policies.base.MemoryView`) reads
   the same records in both.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Iterator
from typing import Any

from .errors import BudgetError, internal_assert
from .memory import format_bytes

__all__ = ["Status", "TRANSITIONS", "HOLDS_DEVICE", "IN_FLIGHT", "PERSISTENT_KINDS", "Record", "Residency", "next_access"]


class Status(str, enum.Enum):
    """Where a storage's bytes are. A ``str`` enum: policies compare ``view.status(sid)`` with plain
    strings (``"resident"``)."""

    ABSENT = "absent"          # not allocated yet, or freed by the program
    RESIDENT = "resident"
    OFFLOADING = "offloading"  # device-to-host copy in flight; the device copy is still valid
    HOST = "host"              # only on the host
    FETCHING = "fetching"      # host-to-device copy in flight; device space taken
    DROPPED = "dropped"        # freed for recompute

    def __str__(self) -> str:
        return self.value


S = Status
TRANSITIONS: dict[Status, frozenset[Status]] = {
    S.ABSENT: frozenset({S.RESIDENT}),
    S.RESIDENT: frozenset({S.OFFLOADING, S.HOST, S.DROPPED, S.ABSENT}),
    S.OFFLOADING: frozenset({S.HOST, S.RESIDENT, S.ABSENT}),
    S.HOST: frozenset({S.FETCHING, S.RESIDENT, S.ABSENT}),
    S.FETCHING: frozenset({S.RESIDENT, S.ABSENT}),
    S.DROPPED: frozenset({S.RESIDENT, S.ABSENT}),
}
# The members as module constants: ``Status.X`` is a class attribute lookup through the enum's
# metaclass, several times a plain global's, and the state machine runs for every birth, death and move.
_ABSENT, _RESIDENT, _OFFLOADING, _FETCHING = S.ABSENT, S.RESIDENT, S.OFFLOADING, S.FETCHING
HOLDS_DEVICE = frozenset({S.RESIDENT, S.OFFLOADING, S.FETCHING})
IN_FLIGHT = frozenset({S.OFFLOADING, S.FETCHING})
AWAY = frozenset({S.HOST, S.DROPPED})
#: per legal transition, what :meth:`Residency.set_status` does to the counts, derived from the sets
#: above: ``_STEPS[old][new]`` = (device bytes: +1 entering HOLDS_DEVICE, -1 leaving, 0; away bytes: the
#: same for AWAY); a transition not in TRANSITIONS has no entry
_STEPS: dict[Status, dict[Status, tuple[int, int]]] = {
    old: {new: ((new in HOLDS_DEVICE) - (old in HOLDS_DEVICE), (new in AWAY) - (old in AWAY)) for new in news}
    for old, news in TRANSITIONS.items()
}
#: kinds that live across iterations: their next access after the last one is the next iteration's first
PERSISTENT_KINDS = frozenset({"param", "buffer", "opt_state"})


def next_access(accesses: list[int] | None, position: int, kind: str, length: int) -> int | None:
    """The first of ``accesses`` (sorted operator positions of one iteration of ``length``
    operators) after ``position``; a persistent storage's wraps to the next iteration. None: never."""
    if not accesses:
        return None
    k = bisect.bisect_right(accesses, position)
    if k < len(accesses):
        return accesses[k]
    return length + accesses[0] if kind in PERSISTENT_KINDS else None


class Record:
    """What both keep about one storage; each adds its own fields in a subclass."""

    __slots__ = ("sid", "nbytes", "kind", "saved", "status", "host_valid", "last_access", "last_access_t", "count")

    def __init__(self, sid: int, nbytes: int, kind: str, saved: bool = False) -> None:
        self.sid = sid
        self.nbytes = nbytes
        self.kind = kind
        self.saved = saved
        self.status = _ABSENT  # changed only by Residency.set_status (invariant 1)
        self.host_valid = False  # the host holds a copy of the current bytes (not written since)
        self.last_access = -1
        self.last_access_t = 0.0
        self.count = 0


class Residency:
    """Storages, their statuses, and the device bytes they hold under ``budget``.

    A subclass sets ``st``, ``budget`` (None: unlimited) and ``policy``, calls
    :meth:`_init_residency`, and supplies the hooks: :meth:`_evict_for_room`,
    :meth:`_land_fetch`, :meth:`_land_offload`, :meth:`_out_of_memory`, and where it needs them
    :meth:`_account`, :meth:`_flight_changed` and :meth:`_room_before`.
    """

    st: dict[int, Any]
    budget: int | None
    policy: Any
    #: MemoryView: victims smaller than this are passed over by the search in progress (make_room's
    #: ``scale``); 0 outside one
    victim_floor: int = 0
    #: :meth:`_account` is told of the device bytes each transition takes or gives back; False where
    #: something else counts them (the live runtime's native observer), so that no call is made
    _counts_held: bool = True

    def _init_residency(self) -> None:
        self.used = 0
        #: bytes of the storages away from the device (host, dropped): used + away is what the
        #: program would hold on the device without a manager
        self.away = 0
        #: device bytes of offloads in flight: they leave the device when their copies land
        self.pending = 0
        self.peak = 0
        self.offloading: dict[int, Any] = {}
        self.fetching: dict[int, Any] = {}
        #: storages the view answers ``nbytes``, ``kind`` and ``saved`` for without a record in ``st``:
        #: objects with those three attributes, set only for the length of one call to the policy (the
        #: live runtime tells a batch's storages born and dead in it without making their records)
        self.recordless: dict[int, Any] = {}

    # ---- the state machine ---------------------------------------------------------------------
    def set_status(self, s: Record, new: Status) -> None:
        """Move ``s`` to ``new`` (invariant 1) and keep the device-byte count and the in-flight sets."""
        old = s.status
        if (old is _ABSENT and new is _RESIDENT) or (old is _RESIDENT and new is _ABSENT):
            # a birth or a death, the commonest transitions (each storage has one of each): the
            # device bytes only; nothing is in flight, nothing returns from away
            if self._counts_held:
                self._account(s.nbytes if new is _RESIDENT else -s.nbytes)
            s.status = new
            return
        step = _STEPS[old].get(new)
        if step is None:  # (the message is built only then: this runs for every birth, death and move)
            internal_assert(False, f"residency: illegal transition {old.value} -> {new.value} for storage {s.sid}")
        held, away = step
        if held and self._counts_held:
            self._account(s.nbytes if held > 0 else -s.nbytes)
        if away:
            self.away += s.nbytes if away > 0 else -s.nbytes
        flight = False
        if old is _OFFLOADING:
            self.pending -= s.nbytes
            del self.offloading[s.sid]
            flight = True
        elif old is _FETCHING:
            del self.fetching[s.sid]
            flight = True
        if new is _OFFLOADING:
            self.pending += s.nbytes
            self.offloading[s.sid] = s
            flight = True
        elif new is _FETCHING:
            self.fetching[s.sid] = s
            flight = True
        s.status = new
        if new is _RESIDENT and old is not _ABSENT:
            self.policy.on_return(s.sid)
        if flight:
            self._flight_changed(s, old, new)

    def _account(self, delta: int) -> None:
        """Device bytes held changed by ``delta`` (a storage entered or left :data:`HOLDS_DEVICE`)."""
        self.used += delta
        if self.used > self.peak:
            self.peak = self.used

    def _flight_changed(self, s: Record, old: Status, new: Status) -> None:
        """Called after every transition into or out of a status in :data:`IN_FLIGHT`."""

    # ---- making room (invariant 3) -----------------------------------------------------------
    def fits(self, need: int) -> bool:
        return self.budget is None or self.used + need <= self.budget

    def make_room(self, need: int, exclude: set[int], where: object = "", scale: int = 0) -> None:
        """Evict until ``need`` more bytes fit in the budget; ``exclude`` may not move. ``where``: the
        place an error names (its ``str()``: the live runtime passes a fault's or decision point's
        values, formatted only then).

        ``scale`` (room made ahead of an allocation of ``scale`` bytes that may not come): best
        effort. The policy's victims smaller than ``scale >> 8`` bytes are passed over, so that the
        room is never made of hundreds of moves that each free a few bytes (the view's
        ``victim_floor`` says so to a policy that can leave them out of its offers); where nothing
        else moves, BudgetError says so briefly (the caller goes on short of that room)."""
        budget = self.budget
        if budget is None or self.used + need <= budget:
            return
        if self._room_before(need):
            return
        floor = self.victim_floor = scale >> 8
        try:
            while True:
                short = self.used - self.pending + need - budget
                if short <= 0:
                    break
                moved = False
                for sid in self._victims(short, exclude):
                    if sid in exclude:
                        continue
                    s = self.st.get(sid)
                    if s is None or s.nbytes < floor or not self._evict_for_room(s):
                        continue
                    moved = True
                    if self.used - self.pending + need <= budget:
                        break
                else:  # the victims ran out first (a break above: room made, read after its eviction)
                    if self.used - self.pending + need <= budget:
                        break
                    if self.fetching and self._land_fetch():
                        continue
                    if not moved:
                        if scale:  # the caller goes on without it (or tries with fewer storages excluded)
                            raise BudgetError(f"room ahead of {format_bytes(scale)} not made at {where or 'this point'}")
                        self._out_of_memory(need, exclude, where)
                    continue
                break
        finally:
            self.victim_floor = 0
        while self.offloading and self.used + need > budget:
            self._land_offload()

    def _victims(self, short: int, exclude: set[int]) -> Iterator[int]:
        """The policy's victims for ``short`` bytes (one decision point)."""
        return self.policy.victims(short, exclude)

    def _room_before(self, need: int) -> bool:
        """Before the first victim: settle what has happened since (copies that landed). True if
        ``need`` fits now."""
        return False

    def _evict_for_room(self, s: Any) -> bool:
        """Evict ``s`` to make room; False if it cannot leave."""
        raise NotImplementedError

    def _land_fetch(self) -> bool:
        """Let in-flight prefetches land (they hold space, and become evictable); False if none could."""
        raise NotImplementedError

    def _land_offload(self) -> None:
        """Wait for the earliest offload in flight to land (its device bytes are released)."""
        raise NotImplementedError

    def _out_of_memory(self, need: int, exclude: set[int], where: object) -> None:
        """Nothing moved and nothing is in flight: raise."""
        raise NotImplementedError

    # ---- MemoryView: what policies read (invariant 5) ------------------------------------------
    # A storage without a record in ``st`` that the policy is being told of (the live runtime's bulk
    # call, for one born and dead within its batch) is answered from ``recordless``.
    def nbytes(self, sid: int) -> int:
        s = self.st.get(sid)
        return (self.recordless[sid] if s is None else s).nbytes

    def kind(self, sid: int) -> str:
        s = self.st.get(sid)
        return (self.recordless[sid] if s is None else s).kind

    def saved(self, sid: int) -> bool:
        s = self.st.get(sid)
        return (self.recordless[sid] if s is None else s).saved

    def status(self, sid: int) -> str:
        s = self.st.get(sid)
        # ``_value_``: the member's value without Enum's property (victim searches call this per candidate)
        return "absent" if s is None else s.status._value_

    def resident(self) -> Iterator[int]:
        return (sid for sid, s in list(self.st.items()) if s.status is _RESIDENT)

    def movable(self, sid: int) -> bool:
        return True

    def evictable(self, sid: int) -> bool:
        return self.status(sid) == "resident" and self.movable(sid)

    def offloaded(self) -> Iterator[int]:
        return (sid for sid, s in list(self.st.items()) if s.status in AWAY)

    def last_access(self, sid: int) -> int:
        return self.st[sid].last_access

    def last_access_time(self, sid: int) -> float:
        return self.st[sid].last_access_t

    def access_count(self, sid: int) -> int:
        return self.st[sid].count

    def free_bytes(self) -> int:
        return (self.budget if self.budget is not None else 1 << 62) - self.used
