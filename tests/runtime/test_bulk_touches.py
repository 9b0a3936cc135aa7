"""A recency policy told in bulk (Policy.on_touches) on the native source decides as with per-operator calls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.policies.base import TOUCH_ACCESS, TOUCH_ALLOC, TOUCH_FREE, Policy, tells_in_bulk
from dynn_runtime.policies.basic import LRUPolicy, NonePolicy, SaveOnCPUPolicy
from dynn_runtime.runtime.events import native_module

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

NATIVE = native_module() is not None


class _Recorded(LRUPolicy):
    """lru that records what it gave up, where, and how it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.moves: list[tuple[int, str, int]] = []
        self.bulk_calls = 0
        self.per_op_calls = 0

    def victims(self, need_bytes, exclude):
        for sid in super().victims(need_bytes, exclude):
            self.moves.append((self.view.position, self.view.phase, sid))
            yield sid

    def on_touches(self, events):
        self.bulk_calls += 1
        super().on_touches(events)

    def on_access(self, sid, position):
        self.per_op_calls += 1
        super().on_access(sid, position)


class _PerOperator(_Recorded):
    reads_operators = True  # the per-operator path: on_operator for each operator


def test_which_policies_are_told_in_bulk():
    assert tells_in_bulk(LRUPolicy) and tells_in_bulk(NonePolicy) and tells_in_bulk(_Recorded)
    assert not tells_in_bulk(Policy) and not tells_in_bulk(_PerOperator)
    assert not tells_in_bulk(SaveOnCPUPolicy)  # decides in after_op

    class Learns(LRUPolicy):  # a subclass that reads each operator is told per operator again
        def on_op(self, position, op):
            pass

    assert not tells_in_bulk(Learns)


def test_default_on_touches_makes_the_per_event_calls_in_order():
    calls = []

    class Spy(Policy):
        def on_access(self, sid, position):
            calls.append(("access", sid, position))

        def on_alloc(self, sid, position):
            calls.append(("alloc", sid, position))

        def on_free(self, sid):
            calls.append(("free", sid))

    Spy().on_touches([TOUCH_ALLOC, 5, 0, 64, TOUCH_ACCESS, 5, 1, 0, TOUCH_FREE, 5, 0, 64, TOUCH_ALLOC, 6, -1, 8])
    assert calls == [("alloc", 5, 0), ("access", 5, 1), ("free", 5), ("alloc", 6, -1)]


def test_lru_on_touches_leaves_the_state_of_the_separate_calls():
    class View:
        def nbytes(self, sid):
            return sizes[sid]

    sizes = {1: 10_000, 2: 1, 3: 50_000, 4: 3}
    events = [TOUCH_ALLOC, 1, -1, 10_000, TOUCH_ALLOC, 2, 0, 1, TOUCH_ACCESS, 1, 0, 0, TOUCH_ALLOC, 3, 1, 50_000,
              TOUCH_ACCESS, 2, 1, 0, TOUCH_FREE, 1, 0, 10_000, TOUCH_ALLOC, 4, 2, 3, TOUCH_ACCESS, 3, 2, 0]
    bulk, single = LRUPolicy(), LRUPolicy()
    for p in (bulk, single):
        p.attach(View())
    bulk.on_touches(events)
    Policy.on_touches(single, events)  # the separate calls
    assert bulk.order() == single.order() == [2, 4, 3]
    assert bulk._small._small == single._small._small == {2, 4}
    assert (bulk._small._live, bulk._small._peak) == (single._small._live, single._small._peak)


@pytest.mark.parametrize("seed", range(40))
def test_lru_told_a_batch_of_allocations_at_once_leaves_the_state_of_the_separate_calls(seed):
    """What the program holds, announced when a step starts, takes lru's whole-list path
    (``_allocs_at_once``): after a random history, the same order, sizes, classes and footprint."""
    import random

    rng = random.Random(seed)
    sizes: dict[int, int] = {}

    class View:
        def nbytes(self, sid):
            return sizes[sid]

    history = []
    for pos in range(rng.randint(0, 30)):
        sid, nb = rng.randint(1, 40), rng.choice([1, 8, 100, 10**4, 10**6, 10**7])
        history += [rng.choice([TOUCH_ALLOC, TOUCH_ACCESS, TOUCH_FREE]), sid, pos, nb]
    held = []
    for sid in rng.sample(range(1, 60), rng.randint(1, 25)):
        held += [TOUCH_ALLOC, sid, -1, rng.choice([1, 100, 10**4, 10**6, 10**8])]
    bulk, single = LRUPolicy(), LRUPolicy()
    for p in (bulk, single):
        p.attach(View())
        for i in range(0, len(history), 4):
            if history[i] == TOUCH_ALLOC:
                sizes[history[i + 1]] = history[i + 3]
        Policy.on_touches(p, history)  # the separate calls
    for i in range(0, len(held), 4):
        sizes[held[i + 1]] = held[i + 3]
    Policy.on_touches(single, held)
    bulk.on_touches(held)
    a, b = bulk._small, single._small
    assert bulk.order() == single.order()
    assert [bulk._recency.tier_order(k) for k in (0, 1)] == [single._recency.tier_order(k) for k in (0, 1)]
    assert (a._bytes, a._small, a._live, a._peak) == (b._bytes, b._small, b._live, b._peak)
    assert bulk.order() and bulk.order()[-len(held) // 4:] == held[1::4]


@pytest.mark.skipif(not NATIVE, reason="the native event source is not built")
@pytest.mark.parametrize("fraction", [0.5, 0.25])
@pytest.mark.parametrize("family", ["tree_lstm", "moe", "early_exit", "evoformer"])
def test_bulk_and_per_operator_make_the_same_moves_and_losses(family, fraction):
    base_losses, base_state, _ = train_family(family)
    if family in ("tree_lstm", "early_exit"):  # their smallest budgets are 0.6 and 0.4 of the peak (test_manager)
        fraction = max(fraction, 0.6)
    runs = {}
    for cls in (_Recorded, _PerOperator):
        pol = cls()
        losses, state, stats = train_family(family, pol, fraction, events="native")
        assert stats["event_source"] == "native"
        assert losses == base_losses  # PyTorch alone's, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(state, base_state, strict=True))
        runs[cls] = (pol, losses, state, stats)
    bulk, per_op = runs[_Recorded][0], runs[_PerOperator][0]
    assert bulk.bulk_calls > 0 and bulk.per_op_calls == 0  # the bulk path ran
    assert per_op.bulk_calls == 0 and per_op.per_op_calls > 0
    assert bulk.moves and bulk.moves == per_op.moves
    keys = ("evictions", "bytes_offloaded", "bytes_fetched_on_demand", "faults", "decision_points")
    for a, b in zip(runs[_Recorded][3]["per_step"], runs[_PerOperator][3]["per_step"]):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


@pytest.mark.skipif(not NATIVE, reason="the native event source is not built")
def test_bulk_keeps_the_timeline_frees_and_counts_of_the_per_operator_path():
    import dynn_runtime as dr
    from dynn_runtime.workload import load_workload, make_optimizer

    seen = {}
    for cls in (_Recorded, _PerOperator):
        wl = load_workload("moe", preset="tiny", seed=0)
        torch.manual_seed(0)
        model = wl.model
        opt = make_optimizer(wl, model.parameters())
        mm = dr.MemoryManager(0.5, policy=cls(), device="cpu", events="native").attach(model, opt)
        try:
            for step in range(3):
                with mm.step():
                    loss = wl.loss(model, wl.make_batch(step))
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            counts = sorted((sid, s.count, s.last_access) for sid, s in mm.st.items())
        finally:
            mm.detach()
        last = mm.history[-1]
        seen[cls] = (mm.timeline(), last.frees, last.pre_allocs, len(last.ops), counts, mm.policy.bulk_calls)
    bulk, per_op = seen[_Recorded], seen[_PerOperator]
    assert bulk[5] > 0 and per_op[5] == 0
    assert bulk[0] == per_op[0] and len(bulk[0]) > 0  # every operator of the engaged steps, with its bytes
    # frees and pre-existing allocations by position (a sweep finds deaths in the order of the observer's
    # table, keyed by storage address: that order differs between any two runs)
    assert {p: sorted(x) for p, x in bulk[1].items()} == {p: sorted(x) for p, x in per_op[1].items()}
    assert bulk[2] == per_op[2]
    assert bulk[4] == per_op[4]  # the storages the table keeps, their access counts and last accesses
    assert bulk[3] == 0 < per_op[3]  # no Op records: history lists operators only with record_every_op
