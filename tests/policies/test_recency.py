"""lru's recency order (policies/recency.py) against a plain reference lru.

The reference walks every storage from the least recently used at each search, as lru did before
it set the storages it found away aside; the two must yield the same victims, in the same order,
on random histories where storages are born, touched, freed, evicted and brought back (with and
without a touch), and searches are cut short as ``make_room`` cuts them."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from dynn_runtime.errors import BudgetError
from dynn_runtime.policies.base import TOUCH_ACCESS, TOUCH_ALLOC, TOUCH_FREE, Policy, SmallStorages
from dynn_runtime.policies.basic import LRUPolicy
from dynn_runtime.policies.recency import RecencyOrder


class _Reference:
    """lru with one OrderedDict walked from its head at every search."""

    def __init__(self, view, fraction: float) -> None:
        self.view = view
        self.fraction = fraction
        self.order: OrderedDict[int, None] = OrderedDict()
        self.small = SmallStorages(fraction)

    def alloc(self, sid: int) -> None:
        self.order[sid] = None
        self.order.move_to_end(sid)
        if self.fraction:
            self.small.alloc(sid, self.view.nbytes(sid))

    def access(self, sid: int) -> None:
        self.order[sid] = None
        self.order.move_to_end(sid)
        if self.fraction:
            self.small.access(sid)

    def free(self, sid: int) -> None:
        self.order.pop(sid, None)
        self.small.free(sid)

    def victims(self, exclude):
        later = []
        for sid in self.order:
            if sid not in exclude and self.view.status(sid) == "resident":
                if self.small.small(sid):
                    later.append(sid)
                    continue
                yield sid
        for sid in later:
            if self.view.status(sid) == "resident":
                yield sid


class _View:
    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.where: dict[int, str] = {}
        self.victim_floor = 0

    def nbytes(self, sid: int) -> int:
        return self.sizes[sid]

    def status(self, sid: int) -> str:
        return self.where.get(sid, "absent")

    def movable(self, sid: int) -> bool:
        return True


def _run(seed: int, fraction: float, bulk: bool) -> int:
    """One random history on both; returns how many victims they agreed on."""
    rng = random.Random(seed)
    view = _View()
    pol = type("_LRU", (LRUPolicy,), {"small_fraction": fraction})()
    pol.attach(view)
    ref = _Reference(view, fraction)
    live: list[int] = []
    next_sid = 1
    agreed = 0
    batch: list[int] = []

    def flush() -> None:
        if batch:
            pol.on_touches(list(batch))
            batch.clear()

    for _ in range(600):
        r = rng.random()
        if r < 0.2 or not live:  # a birth
            sid, next_sid = next_sid, next_sid + 1
            view.sizes[sid] = rng.choice([1, 8, 100, 10**4, 10**6, 10**7])
            view.where[sid] = "resident"
            live.append(sid)
            ref.alloc(sid)
            if bulk:
                batch.extend((TOUCH_ALLOC, sid, 0, view.sizes[sid]))
            else:
                pol.on_alloc(sid, 0)
        elif r < 0.45:  # an access: what is away comes back first, as a fault brings it
            sid = rng.choice(live)
            if view.where[sid] != "resident":
                view.where[sid] = "resident"
                pol.on_return(sid)
            ref.access(sid)
            if bulk:
                batch.extend((TOUCH_ACCESS, sid, 0, 0))
            else:
                pol.on_access(sid, 0)
        elif r < 0.52:  # a death
            sid = live.pop(rng.randrange(len(live)))
            del view.where[sid]
            ref.free(sid)
            if bulk:
                batch.extend((TOUCH_FREE, sid, 0, view.sizes[sid]))
            else:
                pol.on_free(sid)
        elif r < 0.6:  # back on the device without a touch (a fetch between steps, a prefetch landing)
            away = [s for s in live if view.where[s] != "resident"]
            if away:
                sid = rng.choice(away)
                view.where[sid] = "resident"
                pol.on_return(sid)
        elif r < 0.63:  # what the program holds, announced at a step's start (the bulk path)
            flush()
            held = []
            for sid in rng.sample(live, min(len(live), rng.randint(1, 12))):
                held += [TOUCH_ALLOC, sid, -1, view.sizes[sid]]
                ref.alloc(sid)
            pol.on_touches(held)
        else:  # a search, cut short; what it yields leaves the device (or is refused)
            flush()
            exclude = set(rng.sample(live, min(len(live), rng.randint(0, 3))))
            want = rng.randint(1, 6)
            got_ref, got = [], []
            mine = pol.victims(0, exclude)
            for a in ref.victims(exclude):
                b = next(mine, None)
                assert a == b, (seed, got_ref, a, b)
                got_ref.append(a)
                got.append(b)
                if rng.random() < 0.85:  # evicted; else refused (pinned, not movable) and left resident
                    view.where[a] = rng.choice(["host", "host", "offloading"])
                if len(got_ref) >= want:
                    break
            else:
                assert next(mine, None) is None
            del mine
            agreed += len(got_ref)
    flush()
    return agreed


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("fraction", [0.0, 1e-2])
@pytest.mark.parametrize("bulk", [False, True])
def test_victims_are_the_reference_lrus(seed, fraction, bulk):
    assert _run(seed, fraction, bulk) > 20  # the history searched enough to compare


def test_a_storage_back_without_a_touch_is_found_at_its_place():
    """Taken out when found away; back on the device untouched: it is again the least recent."""
    view = _View()
    pol = LRUPolicy()
    pol.attach(view)
    for sid in (1, 2, 3):
        view.sizes[sid], view.where[sid] = 10**6, "resident"
        pol.on_alloc(sid, 0)
    assert next(pol.victims(0, set())) == 1
    view.where[1] = "host"
    assert list(pol.victims(0, set())) == [2, 3]
    assert pol._recency.away == {}  # noted while walking, taken out at the next search
    list(pol.victims(0, set()))
    assert set(pol._recency.away) == {1}
    view.where[1] = "resident"
    pol.on_return(1)
    assert list(pol.victims(0, set())) == [1, 2, 3]
    assert pol.order() == [1, 2, 3]


def test_a_search_left_open_takes_nothing_out_under_it():
    """A second search while a first is still open must not change the tiers the first iterates."""
    view = _View()
    rec = RecencyOrder()
    for sid in range(1, 6):
        view.where[sid] = "resident"
        rec.touch(sid, False)
    view.where[1] = view.where[2] = "host"
    list(rec.walk(view.status, set()))  # notes 1 and 2
    first = rec.walk(view.status, set())  # takes 1 and 2 out
    assert next(first) == 3
    view.where[4] = "host"
    inner = list(rec.walk(view.status, set()))  # notes 4, takes nothing out while ``first`` is open
    assert inner == [3, 5]
    assert list(first) == [5]
    del first
    assert list(rec.walk(view.status, set())) == [3, 5]
    assert set(rec.away) == {1, 2, 4}
    assert rec.order() == [1, 2, 3, 4, 5]


def test_every_return_to_the_device_is_told_to_the_policy():
    """Residency.set_status tells ``on_return`` for each transition into resident but a birth."""
    from dynn_runtime.residency import Record, Residency, Status

    told = []

    class P(Policy):
        def on_return(self, sid):
            told.append(sid)

    class R(Residency):
        pass

    r = R()
    r.st, r.budget, r.policy = {}, None, P()
    r._init_residency()
    a, b = Record(1, 10, "temp"), Record(2, 10, "temp")
    r.set_status(a, Status.RESIDENT)
    r.set_status(b, Status.RESIDENT)
    r.set_status(a, Status.HOST)
    r.set_status(a, Status.FETCHING)
    r.set_status(a, Status.RESIDENT)
    r.set_status(b, Status.OFFLOADING)
    r.set_status(b, Status.RESIDENT)
    r.set_status(b, Status.HOST)
    r.set_status(b, Status.RESIDENT)
    assert told == [1, 2, 2]


class _Fixed:
    """A NextUse policy with next uses set by the test."""

    def __new__(cls, nu: dict[int, float]):
        from dynn_runtime.policies.nextuse import NextUsePolicy

        pol = type("_Fixed", (NextUsePolicy,), {"small_fraction": 0, "predict": lambda self, sid: nu[sid]})()
        return pol


def _evict_all(pol: Policy, view: _View) -> list[int]:
    """Every victim ``pol`` offers, each evicted as offered."""
    out = []
    for sid in pol.victims(1000, set()):
        view.where[sid] = "host"
        out.append(sid)
    return out


@pytest.mark.parametrize("policy", ["nextuse", "lru"])
def test_a_victim_search_passes_over_what_the_mechanism_would_refuse(policy):
    """A storage the mechanism may not move (the live runtime: what the program holds for good) is
    never offered, however far its next use: offered, it would be refused at every search."""
    view = _View()
    stuck = {3}
    view.movable = lambda sid: sid not in stuck  # type: ignore[method-assign]
    view.resident = lambda: [sid for sid, w in view.where.items() if w == "resident"]  # type: ignore[attr-defined]

    for sid in (1, 2, 3, 4):
        view.sizes[sid] = 100
        view.where[sid] = "resident"
    pol = _Fixed({1: 10.0, 2: 20.0, 3: 99.0, 4: 30.0}) if policy == "nextuse" else LRUPolicy()
    pol.attach(view)
    for sid in (3, 1, 2, 4):  # 3 is the least recently used and has the furthest next use
        pol.on_alloc(sid, 0)
    assert _evict_all(pol, view) == ([4, 2, 1] if policy == "nextuse" else [1, 2, 4])
    stuck.clear()  # movable again (a later label): offered once its next use is told again
    pol.on_access(3, 1)
    assert _evict_all(pol, view) == [3]


def _tiny_first(scale: int) -> tuple[list[int], int, bool]:
    """make_room for 1000 bytes under a budget of 1000, 200 bytes used by 20 storages of 10 bytes
    offered first and 800 by one of 800 offered last: which it evicted, what is then used, and
    whether it said it could not make the room."""
    from dynn_runtime.residency import Record, Residency, Status

    order = [*range(1, 21), 99]

    class P(Policy):
        def victims(self, need_bytes, exclude):
            return iter(order)

    class R(Residency):
        def _evict_for_room(self, s):
            if s.status is not Status.RESIDENT:
                return False
            self.set_status(s, Status.HOST)
            evicted.append(s.sid)
            return True

        def _out_of_memory(self, need, exclude, where):
            raise BudgetError("nothing moved")

    evicted: list[int] = []
    r = R()
    r.st, r.budget, r.policy = {}, 1000, P()
    r._init_residency()
    for sid in order:
        rec = Record(sid, 800 if sid == 99 else 10, "temp")
        r.st[sid] = rec
        r.set_status(rec, Status.RESIDENT)
    try:
        r.make_room(1000, set(), scale=scale)
    except BudgetError:
        return evicted, r.used, True
    return evicted, r.used, False


def test_room_made_ahead_passes_over_victims_under_a_256th_of_its_scale():
    """Residency.make_room's ``scale`` (the live runtime's reserve for the next operator): victims
    smaller than scale / 256 are passed over, so room is not made of many moves that each free a
    few bytes; without it, the policy's order is followed."""
    assert _tiny_first(0) == ([*range(1, 21), 99], 0, False)  # every victim, in the policy's order
    assert _tiny_first(1000) == ([*range(1, 21), 99], 0, False)  # floor 3 bytes: the 10-byte ones go too
    # floor 16 bytes: only the large one leaves, and the room the tiny ones would make is not made
    assert _tiny_first(1 << 12) == ([99], 200, True)


def test_a_next_use_search_leaves_out_what_is_under_the_floor_and_keeps_it_offerable():
    """Under the view's ``victim_floor`` (room made ahead), a next-use policy offers only the
    storages at or above it, furthest next use first; the ones left out keep their entries, so a
    later search without a floor offers them in their order."""
    view = _View()
    view.resident = lambda: [sid for sid, w in view.where.items() if w == "resident"]  # type: ignore[attr-defined]
    for sid, n in ((1, 10), (2, 1000), (3, 10), (4, 1000)):
        view.sizes[sid] = n
        view.where[sid] = "resident"
    pol = _Fixed({1: 50.0, 2: 20.0, 3: 40.0, 4: 10.0})
    pol.attach(view)
    for sid in (1, 2, 3, 4):
        pol.on_alloc(sid, 0)
    view.victim_floor = 100
    assert _evict_all(pol, view) == [2, 4]
    view.victim_floor = 0
    assert _evict_all(pol, view) == [1, 3]


def test_a_next_use_search_parks_what_is_under_its_floor_until_a_lower_floor_asks():
    """Searches with the same floor (the live runtime's reserve) do not pop the entries under it
    again and again: they are parked, and come back, in their order, for a search with a lower floor
    and at the next iteration."""
    view = _View()
    view.resident = lambda: [sid for sid, w in view.where.items() if w == "resident"]  # type: ignore[attr-defined]
    sizes = {1: 10, 2: 1000, 3: 50, 4: 1000, 5: 10, 6: 1000}
    nu = {1: 90.0, 2: 20.0, 3: 80.0, 4: 10.0, 5: 70.0, 6: 5.0}
    for sid, n in sizes.items():
        view.sizes[sid] = n
        view.where[sid] = "resident"
    pol = _Fixed(nu)
    pol.attach(view)
    for sid in sizes:
        pol.on_alloc(sid, 0)
    pops = []
    real_pop = pol._res_pop

    def counting_pop():
        item = real_pop()
        pops.append(item)
        return item

    pol._res_pop = counting_pop
    view.victim_floor = 100
    first = pol.victims(0, set())
    assert next(first) == 2  # the tiny ones with further next uses (1, 3, 5) popped, parked
    first.close()
    assert {item[1] for item in pops} == {1, 2, 3, 5}
    pops.clear()
    again = pol.victims(0, set())
    assert next(again) == 4  # (2, offered, left the heap) without popping 1, 3 and 5 again
    again.close()
    assert [item[1] for item in pops] == [4]
    view.victim_floor = 40  # 3 (50 bytes) may go now; 1 and 5 stay parked
    # (then the heap runs out and is rebuilt from what is resident: 2 and 4, offered and kept, again)
    assert _evict_all(pol, view) == [3, 6, 2, 4]
    view.victim_floor = 0
    assert _evict_all(pol, view) == [1, 5]
    for sid in sizes:  # all back, and one more iteration: what a floor parked returns with it
        view.where[sid] = "resident"
        pol.on_access(sid, 0)
    view.victim_floor = 100
    assert _evict_all(pol, view) == [2, 4, 6]
    pol.begin_iteration(1)
    view.victim_floor = 0
    assert _evict_all(pol, view) == [1, 3, 5]


def test_the_next_use_heap_is_compacted_before_its_stale_entries_pile_up():
    """Each access pushes an entry and leaves the storage's older ones stale; a search that finds
    the heap past its bound makes it again from what is resident, one entry each, and offers the
    same order."""
    view = _View()
    view.resident = lambda: [sid for sid, w in view.where.items() if w == "resident"]  # type: ignore[attr-defined]
    nu = {1: 30.0, 2: 10.0, 3: 20.0}
    for sid in nu:
        view.sizes[sid] = 1000
        view.where[sid] = "resident"
    pol = _Fixed(nu)
    pol.attach(view)
    for k in range(5000):
        pol.on_access(1 + k % 3, k)
    assert len(pol._res) == 5000
    search = pol.victims(0, set())
    assert next(search) == 1
    assert len(pol._res) == 2  # made again: 3 entries, then 1 offered
    search.close()
    view.where[1] = "host"
    assert _evict_all(pol, view) == [3, 2]
