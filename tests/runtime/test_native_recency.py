"""lru's order kept by the native observer (csrc/recency.h) is the order the Python policy keeps."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.policies.base import TOUCH_ACCESS, TOUCH_ALLOC, TOUCH_FREE, Policy
from dynn_runtime.policies.basic import LRUPolicy
from dynn_runtime.runtime.events import native_module
from dynn_runtime.runtime.native_source import NativeSource

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

NATIVE = native_module() is not None
pytestmark = pytest.mark.skipif(not NATIVE, reason="the native event source is not built")


class _View:
    """What LRUPolicy reads of a mechanism: sizes and statuses."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.statuses: dict[int, str] = {}
        self.victim_floor = 0

    def nbytes(self, sid: int) -> int:
        return self.sizes[sid]

    def status(self, sid: int) -> str:
        return self.statuses.get(sid, "absent")

    def movable(self, sid: int) -> bool:
        return True

    def evictable(self, sid: int) -> bool:
        return self.status(sid) == "resident"


def _pair(fraction: float) -> tuple[LRUPolicy, LRUPolicy, object, _View, list[torch.Tensor]]:
    """A Python-ordered lru and one whose order an (unstarted) observer keeps, on one view."""

    class Lru(LRUPolicy):
        small_fraction = fraction

    obs = native_module().Observer("cpu")
    native, python = Lru(), Lru()
    python.native_order = False
    view = _View()
    for p in (native, python):
        p.attach(view)
    assert native.keep_order_in(obs) and not python.keep_order_in(obs)
    return native, python, obs, view, []


@pytest.mark.parametrize("fraction", [0.0, 1e-4, 0.05, 0.4])
@pytest.mark.parametrize("seed", range(6))
def test_the_observers_order_and_walk_are_the_python_policys(seed, fraction):
    """Random allocations, accesses, frees, statuses (resident, away, in flight, absent) and
    exclusions: after every batch, the same tiers, merged order and victims in the same order."""
    rng = random.Random(seed)
    native, python, obs, view, tensors = _pair(fraction)
    sid_of: list[int] = []  # observer sids of real storages, so that its walk can read their flags
    for _ in range(60):
        t = torch.empty(rng.choice([1, 8, 100, 10**3, 10**4, 10**5]), dtype=torch.uint8)
        tensors.append(t)
        sid = obs.track(t)
        sid_of.append(sid)
        view.sizes[sid] = t.untyped_storage().nbytes()
    told: set[int] = set()
    for _ in range(25):
        events: list[int] = []
        for pos in range(rng.randint(1, 30)):
            sid = rng.choice(sid_of)
            kind = rng.choice([TOUCH_ALLOC, TOUCH_ACCESS, TOUCH_ACCESS, TOUCH_FREE])
            if kind == TOUCH_FREE and sid not in told:
                kind = TOUCH_ALLOC
            events += [kind, sid, pos, view.sizes[sid]]
            (told.discard if kind == TOUCH_FREE else told.add)(sid)
        how = rng.random()
        for p in (native, python):  # in bulk, or as the separate calls
            (p.on_touches if how < 0.5 else lambda ev, p=p: Policy.on_touches(p, ev))(events)
        for sid in told:  # statuses change between batches; a storage returning is told as the mechanism tells it
            old = view.statuses.get(sid, "resident")
            new = rng.choice(["resident", "resident", "away", "offloading", "fetching"])
            view.statuses[sid] = new
            obs.set_away(sid, new == "away")
            obs.set_watch(sid, new in ("offloading", "fetching"))
            if new == "resident" and old != "resident":
                native.on_return(sid)
                python.on_return(sid)
        assert native.order() == python.order()
        assert [obs.recency_order(k) for k in (0, 1)] == [python._recency.tier_order(k) for k in (0, 1)]
        live, peak = obs.recency_footprint()
        if fraction:
            assert (live, peak) == (python._small._live, python._small._peak)
        exclude = set(rng.sample(sorted(told), min(3, len(told)))) if told else set()
        walked = list(python.victims(0, exclude))
        assert list(native.victims(0, exclude)) == walked
        # a search that passes over victims under a floor (room made ahead): the observer leaves
        # them out of its batches, the rest in the same order
        view.victim_floor = floor = rng.choice([100, 10**4])
        assert list(native.victims(0, exclude)) == [x for x in walked if view.sizes[x] >= floor]
        view.victim_floor = 0
        taken = rng.randint(0, 3)  # a walk left early resumes nothing: the next one starts afresh
        for a, b in zip(native.victims(0, set()), python.victims(0, set())):
            assert a == b
            taken -= 1
            if taken <= 0:
                break
    native.release_order()
    assert native._native is None and native.order() == []


def test_a_subclass_that_changes_a_notification_keeps_its_order_in_python():
    obs = native_module().Observer("cpu")

    class Counts(LRUPolicy):
        def on_access(self, sid, position):
            super().on_access(sid, position)

    class Paged(LRUPolicy):
        page_bytes = 4096

    class Wraps(LRUPolicy):  # victims only: the order is still lru's
        def victims(self, need_bytes, exclude):
            yield from super().victims(need_bytes, exclude)

    assert not Counts().keep_order_in(obs) and not Paged().keep_order_in(obs)
    assert Wraps().keep_order_in(obs)
    assert not Policy().keep_order_in(obs)


class _Proxy:
    """The manager's observer, with its log read in full: each batch is also told to a Python lru
    (the reference) in the order the observer applies it (an operator's allocations, its inputs in
    argument order, then outputs that are not inputs), and every touch the policy forwards too."""

    def __init__(self, obs, shadow: LRUPolicy) -> None:
        obs.op_records_while_live = True  # the reference reads every operator's record
        self._obs = obs
        self._shadow = shadow
        self._sizes: dict[int, int] = {}
        self.batches = 0

    def __getattr__(self, name):
        return getattr(self._obs, name)

    def __eq__(self, other):  # the manager finds its observer in events.QUIET at detach
        return other is self or other is self._obs

    __hash__ = object.__hash__

    def take_log(self, compact=False):
        live = self._obs.recency_live
        words, names = self._obs.take_log(False)
        log = memoryview(words).cast("q")
        events: list[int] = []
        i = 0
        while i < len(log):
            tag = log[i]
            if tag == 1:  # kOp
                ni, no, nw, na = log[i + 5:i + 9]
                ins = list(log[i + 9:i + 9 + ni])
                outs = list(log[i + 9 + ni:i + 9 + ni + no])
                allocs = list(log[i + 9 + ni + no + nw:i + 9 + ni + no + nw + na])
                if live:
                    for sid in allocs:
                        events += [TOUCH_ALLOC, sid, 0, self._sizes.get(sid, 0)]
                    for sid in ins + [x for x in outs if x not in ins]:
                        events += [TOUCH_ACCESS, sid, 0, 0]
                i += 9 + ni + no + nw + na
            elif tag == 2:  # kAlloc
                sid, nb, fresh = log[i + 1:i + 4]
                self._sizes[sid] = nb
                if live and not fresh:
                    events += [TOUCH_ALLOC, sid, 0, nb]
                i += 4
            else:  # kFree: applied whether or not the order is live
                events += [TOUCH_FREE, log[i + 1], 0, 0]
                i += 2
        if events:
            self.batches += 1
            self._shadow.on_touches(events)  # the separate calls' state (test_bulk_touches), sizes from the log
        return words, names

    def recency_alloc(self, sid, nbytes):
        self._shadow.on_touches([TOUCH_ALLOC, sid, 0, nbytes])
        self._obs.recency_alloc(sid, nbytes)

    def recency_access(self, sid):
        self._shadow.on_access(sid, 0)
        self._obs.recency_access(sid)

    def recency_free(self, sid):
        self._shadow.on_free(sid)
        self._obs.recency_free(sid)

    def recency_touches(self, events):
        self._shadow.on_touches(events)
        self._obs.recency_touches(events)

    def recency_announce(self, sids):
        nbytes = self._obs.nbytes
        self._shadow.on_touches([x for sid in sids for x in (TOUCH_ALLOC, sid, -1, nbytes(sid))])
        self._obs.recency_announce(sids)


class _Checked(LRUPolicy):
    """lru whose every victim search is compared with the shadow's before it is answered."""

    shadow: LRUPolicy
    searches = 0

    def begin_iteration(self, index, context=None):
        super().begin_iteration(index)
        if index == 0 and self._native is not None:  # the first step: nothing was told yet
            assert self._native.recency_order() == []
            self.shadow = LRUPolicy()
            self.shadow.native_order = False
            self.shadow.attach(self.view)
            self._native = _Proxy(self._native, self.shadow)
            self.view._obs = self._native  # the manager reads its log through the proxy

    def victims(self, need_bytes, exclude):
        if not isinstance(self._native, _Proxy):
            return super().victims(need_bytes, exclude)
        # The manager read the log before it searches: the shadow was told what the observer
        # applied, but for deaths the observer found since (reading `used` drains them), which the
        # Python order learns at the next read: storages that are dead either way are left out.
        alive = self._native._obs.alive
        assert [x for x in self.order() if alive(x)] == [x for x in self.shadow.order() if alive(x)]
        mine = list(super().victims(need_bytes, exclude))
        floor, nbytes = self.view.victim_floor, self.view.nbytes  # the observer's walk passes over those under it
        assert [x for x in mine if alive(x)] == [x for x in self.shadow.victims(need_bytes, exclude)
                                                 if alive(x) and nbytes(x) >= floor]
        self.searches += 1
        return iter(mine)


@pytest.mark.parametrize("family", ["moe", "tree_lstm", "evoformer", "early_exit"])
def test_training_with_the_observers_order_is_bit_identical_and_walks_the_python_order(family, monkeypatch):
    # the shadow is told what the manager reads of the log, so every search must follow a read: faults
    # read the log first here (test_fault_parse.py compares putting that read off)
    monkeypatch.setattr(NativeSource, "defer_parse", False)
    fraction = 0.6 if family in ("tree_lstm", "early_exit") else 0.5
    base_losses, base_state, _ = train_family(family)
    pol = _Checked()
    losses, state, stats = train_family(family, pol, fraction, events="native")
    assert stats["event_source"] == "native"
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(state, base_state, strict=True))
    assert pol.searches > 0 and pol._native is None  # searched with the observer's order; released at detach
    assert sum(s["evictions"] for s in stats["per_step"]) > 0


def test_the_native_order_runs_where_lru_is_plain_and_is_released_at_detach():
    import dynn_runtime as dr
    from dynn_runtime.workload import load_workload, make_optimizer

    wl = load_workload("moe", preset="tiny", seed=0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    for native_order in (True, False):
        pol = LRUPolicy()
        pol.native_order = native_order
        mm = dr.MemoryManager(0.5, policy=pol, device="cpu", events="native").attach(model, opt)
        try:
            _train_steps(mm, wl, opt, 3)
            assert mm._native_order is native_order
            assert (pol._native is not None) is native_order
            timeline = mm.timeline()
            assert timeline and {p for _, _, _, p in timeline} >= {"forward", "backward", "optimizer"}
            positions = [j for s, j, _, _ in timeline if s == 2]
            assert positions == list(range(len(positions)))  # every operator of an engaged step, in order
            if native_order:
                sid = next(iter(mm.st))
                assert mm.access_count(sid) == mm._obs.access_count(sid) > 0
        finally:
            mm.detach()
        assert pol._native is None


def test_a_steps_start_tells_the_observers_order_every_held_storage_in_the_tables_order():
    # what on_alloc(sid, -1) of each storage held, in the table's order, makes of the order: each one
    # the most recent in turn, sized as the observer's table says (one call, recency_announce)
    import dynn_runtime as dr
    from dynn_runtime.residency import Status
    from dynn_runtime.workload import load_workload, make_optimizer

    wl = load_workload("moe", preset="tiny", seed=0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(0.5, policy="lru", device="cpu", events="native").attach(model, opt)
    try:
        _train_steps(mm, wl, opt, 3)
        assert mm._native_order
        obs = mm._obs
        held = [sid for sid, s in mm.st.items() if s.status is not Status.ABSENT]
        before = obs.recency_order()
        assert len(held) > 2 and before[-len(held):] != held  # the last step's touches reordered them
        reference = LRUPolicy()
        reference.native_order = False
        reference.on_touches([x for sid in before for x in (TOUCH_ALLOC, sid, -1, obs.nbytes(sid))])
        reference.on_touches([x for sid in held for x in (TOUCH_ALLOC, sid, -1, obs.nbytes(sid))])
        mm._announce()
        after = obs.recency_order()
        assert after[-len(held):] == held
        assert after == reference.order()
    finally:
        mm.detach()


def _train_steps(mm, wl, opt, steps: int) -> None:
    for step in range(steps):
        with mm.step():
            loss = wl.loss(wl.model, wl.make_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
