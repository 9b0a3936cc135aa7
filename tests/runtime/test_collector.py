"""What the native event source keeps per operator in a step is out of Python's cyclic collector
(``csrc/collector.cpp``): the history's ``Op`` records and the lists of frees, first-seen storages and
hints at its positions, which hold only atomic values, and nothing else."""

from __future__ import annotations

import gc
import weakref
from dataclasses import fields

import pytest
import torch

import dynn_runtime as dr
from dynn_runtime.hints import Hint
from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.runtime.events import native_module
from dynn_runtime.trace.format import Op
from dynn_runtime.workload import load_workload, make_optimizer, train_step

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native event source is not built")


def _atomic(v) -> bool:
    if isinstance(v, tuple):
        return all(_atomic(x) for x in v)
    return v is None or type(v) in (str, int, float, bool)


def test_untrack_records_takes_only_the_exact_type_from_start():
    c = native_module()

    class Sub(Op):
        pass

    def op(i):
        return Op("aten::add", (1,), "forward", "", (i,), (i + 1,), (), (), 0.0, 0, 0)

    seq = [op(0), op(1), Sub("aten::mul", (2,), "forward", "", (), (), (), (), 0.0, 0, 0), op(3), [1, 2]]
    assert all(gc.is_tracked(x) for x in seq)
    assert c.untrack_records(seq, 1, Op) == 2
    assert [gc.is_tracked(x) for x in seq] == [True, False, True, False, True]
    assert c.untrack_records(seq, 0, Op) == 1  # what is untracked already is not counted again
    assert seq[1] == op(1)  # still the same record


def test_untrack_lists_takes_integer_lists_and_the_given_records_in_the_key_range():
    c = native_module()
    h = Hint("use", (3, 4), 1)
    table = {0: [1, 2], 1: [3, [4]], 2: [h, 5], 3: [6], 7: [8], 9: (1,)}
    assert gc.is_tracked(h)
    n = c.untrack_lists(table, 0, 8, Hint)
    assert n == 5  # [1, 2], the hint, [h, 5], [6], [8]
    assert not gc.is_tracked(table[0]) and not gc.is_tracked(h) and not gc.is_tracked(table[2])
    assert not gc.is_tracked(table[3]) and not gc.is_tracked(table[7])
    assert gc.is_tracked(table[1]) and gc.is_tracked(table[1][1])  # holds a container: left alone
    assert c.untrack_lists({0: [Hint("step")]}, 0, 0) == 0  # no item type given: a list of records stays
    assert c.untrack_lists({}, 0, 10**6) == 0


def test_untrack_lists_reads_the_range_or_the_table_whichever_is_shorter():
    """A range shorter than the table is looked up key by key; a longer one is met by walking the
    table: both untrack exactly the lists whose keys are in the range."""
    c = native_module()
    table = {k: [k] for k in range(-3, 100)}
    table["x"] = [1]  # not a position: never in a range
    assert c.untrack_lists(table, 10, 12) == 3  # 3 keys looked up, of 104
    assert [k for k, v in table.items() if not gc.is_tracked(v)] == [10, 11, 12]
    assert c.untrack_lists(table, 0, 10**6) == 97  # the table walked: 0..99 less the three done
    assert [k for k, v in table.items() if gc.is_tracked(v)] == [-3, -2, -1, "x"]
    assert c.untrack_lists(table, 5, 4) == 0  # an empty range


def _train(policy, steps: int = 3, **kw):
    torch.manual_seed(0)
    wl = load_workload("tree_lstm", preset="tiny", seed=0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(1 << 40, policy=policy, device="cpu", events="native", **kw).attach(model, opt)
    losses = []
    try:
        for i in range(steps):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(i)).detach().clone())
    finally:
        mm.detach()
    return mm, losses


@pytest.mark.parametrize("policy", ["pilot", "record"])
def test_a_step_history_is_out_of_the_collector_and_still_holds_its_records(policy):
    if policy == "pilot":
        mm, _ = _train(PilotPolicy(backend="native", defer_idle=False))  # every step told
    else:
        mm, _ = _train("lru", record_every_op=True)
    assert mm.history
    for it in mm.history:
        assert it.ops and not any(gc.is_tracked(op) for op in it.ops)
        for op in it.ops[:: max(1, len(it.ops) // 50)]:  # the invariant untracking rests on
            assert all(_atomic(getattr(op, f.name)) for f in fields(op))
        for table in (it.frees, it.pre_allocs, it.hints):
            for lst in table.values():
                assert not gc.is_tracked(lst)
        hints = [h for lst in it.hints.values() for h in lst]
        assert hints and not any(gc.is_tracked(h) for h in hints)  # tree_lstm gives hints every level
    # untracked records are still freed once what holds them goes (the manager and its policy)
    probe = weakref.ref(mm.history[0].ops[0])
    del mm, it, op, table, lst, hints
    gc.collect()
    assert probe() is None


def test_the_pilots_forward_log_reaches_backward_out_of_the_collector(monkeypatch):
    """The (position, operator) pairs the pilot logs through forward for its backward mirror live
    until backward starts: the walk (``kernel/pack.c``) and the Python paths
    (``MirrorState._log_forward``) make them untracked, so young collections do not promote a pair
    per forward operator to the oldest generation."""
    from dynn_runtime.pilot.features import FeatureState
    from dynn_runtime.pilot.kernel import pack_module

    if pack_module() is None:
        pytest.skip("the pilot's pack module is not built")
    seen: list[tuple[int, int]] = []  # per backward start: (pairs, pairs still tracked)
    build = FeatureState._build_mirror

    def spy(self):
        seen.append((len(self._fwd_log), sum(gc.is_tracked(e) for e in self._fwd_log)))
        return build(self)

    monkeypatch.setattr(FeatureState, "_build_mirror", spy)
    _train(PilotPolicy(backend="native", defer_idle=False))
    told = seen[1:]  # the first step measures; the pilot is told from the second
    assert told and all(n > 50 for n, _ in told)
    assert all(tracked == 0 for _, tracked in told), seen


def test_training_with_the_records_untracked_gives_pytorch_alone_losses():
    _, managed = _train(PilotPolicy(backend="native", defer_idle=False))
    torch.manual_seed(0)
    wl = load_workload("tree_lstm", preset="tiny", seed=0)
    opt = make_optimizer(wl, wl.model.parameters())
    alone = [train_step(wl, wl.model, opt, wl.make_batch(i)).detach().clone() for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(managed, alone))
