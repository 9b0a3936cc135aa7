"""The pilot on a network it does not know: the online judge, the per-decision fallback, the validated refit."""

from __future__ import annotations

import numpy as np
import pytest

from dynn_runtime.pilot.adapt import RecallJudge
from dynn_runtime.pilot.config import cached_model, default_weights_path
from dynn_runtime.pilot.training.data import walk
from dynn_runtime.pilot.training.online import OnlineRefit, sampled_window_recall
from dynn_runtime.policies import make_policy
from dynn_runtime.sim import simulate


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from dynn_runtime.trace import read_trace, record

    path = tmp_path_factory.mktemp("adapt") / "moe.jsonl.gz"
    record("moe", path, steps=3, preset="tiny", seed=1)
    return read_trace(path)


@pytest.fixture(scope="module")
def shipped():
    return cached_model(default_weights_path())


@pytest.fixture(scope="module")
def broken(shipped):
    """The shipped model with its output layer zeroed: the same prediction for every storage."""
    m = shipped.copy()
    m.arrays["W3"] = np.zeros_like(m.arrays["W3"])
    return m


def test_the_judge_scores_window_recall_after_the_window_has_run():
    judge = RecallJudge(methods=("a", "b", "c"), window=10, horizon=4)
    sids = np.arange(6)
    # storages 0 and 1 are used next; "a" ranks them first, "b" last, "c" one of each
    judge.decision(0, sids, {"a": np.array([1, 2, 50, 60, 70, 80.0]), "b": np.array([90, 80, 1, 2, 3, 4.0]),
                             "c": np.array([1, 90, 2, 80, 70, 60.0])})
    judge.access(0, 3)
    judge.access(1, 7)
    judge.access(2, 11)  # after the window
    assert judge.recall("a") is None  # not judged before the window has run
    judge.close(11)
    assert (judge.recall("a"), judge.recall("b"), judge.recall("c")) == (1.0, 0.0, 0.5)
    assert judge.choice() == "a"


def test_the_judge_follows_another_predictor_only_when_it_beats_the_first_by_the_margin():
    judge = RecallJudge(methods=("pilot", "replay", "lru"), window=4, horizon=2, margin=0.3)
    sids = np.arange(4)
    good, bad = np.array([1, 2, 9, 9.0]), np.array([9, 9, 1, 2.0])
    for pos in (0, 10):
        judge.decision(pos, sids, {"pilot": bad, "replay": good, "lru": bad})
        judge.access(0, pos + 1)
        judge.access(1, pos + 2)
    judge.close()
    assert judge.recall("pilot") == 0.0 and judge.recall("replay") == 1.0 and judge.choice() == "replay"
    judge.margin = 1.0  # a difference of 1.0 is not more than the margin
    assert judge.choice() == "pilot"


@pytest.mark.parametrize("exact", [True, False], ids=["with-exact-replay", "judge-alone"])
def test_fallback_rescues_a_model_that_predicts_nothing(trace, broken, exact, monkeypatch):
    from dynn_runtime.pilot.adapt import ExactReplay

    if not exact:  # the model side gets nothing from replay's plan: the judge alone must rescue it
        monkeypatch.setattr(ExactReplay, "exact", lambda self, sid: False)
    plain = make_policy("pilot", model=broken, backend="numpy")
    r_plain = simulate(trace, plain, 0.25)
    fb = make_policy("pilot", model=broken, backend="numpy", fallback=True)
    r_fb = simulate(trace, fb, 0.25)
    assert r_plain.feasible and r_fb.feasible
    if not exact:
        # the judge sees the model rank no better than chance and follows replay or lru for most decisions
        assert sum(v for k, v in fb.followed.items() if k != "pilot") > fb.followed.get("pilot", 0)
    assert r_fb.prefetch_hits > r_plain.prefetch_hits and r_fb.stall_time_s < r_plain.stall_time_s


def test_fallback_keeps_a_good_model(trace, shipped):
    fb = make_policy("pilot", model=shipped, backend="numpy", fallback=True)
    simulate(trace, fb, 0.25)
    assert fb.followed.get("pilot", 0) > sum(v for k, v in fb.followed.items() if k != "pilot")
    assert fb.judged_recall["pilot"] > 0.9 and fb.judged_recall["pilot"] > fb.judged_recall["lru"]
    assert make_policy("pilot", model=shipped).judged_recall == {}


def _observe(refit, model, trace, i):
    for d in walk(trace, i, group=model.config.group, baselines=False):
        refit.observe(d.position, d.sids, d.X, d.ctx)


def test_a_refit_is_swapped_in_only_when_it_beats_the_model_in_use_on_the_latest_iteration(trace, shipped, broken):
    refit = OnlineRefit(broken.copy(), refit_every=100)
    refit._candidate = shipped.copy()  # a candidate far better than the model in use
    _observe(refit, broken, trace, 1)
    assert refit.end_iteration(trace.iterations[:2]) is not None and refit.swaps == 1
    new, old = refit.last_validation
    assert new > old
    refit._candidate = broken.copy()  # now a far worse one
    _observe(refit, shipped, trace, 2)
    assert refit.end_iteration(trace.iterations[:3]) is None and refit.rejected == 1
    assert refit.model.arrays["W3"].any()  # still the good one


def test_background_refit_becomes_a_candidate_validated_at_a_later_iteration(trace, shipped):
    refit = OnlineRefit(shipped.copy(), refit_every=1, epochs=1, background=True)
    _observe(refit, shipped, trace, 1)
    assert refit.end_iteration(trace.iterations[:2]) is None and refit.refits == 1
    refit._candidate.result(timeout=120)  # the refit runs on its thread while training goes on
    _observe(refit, shipped, trace, 2)
    refit.end_iteration(trace.iterations[:3])
    assert refit.swaps + refit.rejected == 1 and refit.last_validation is not None


def test_sampled_window_recall_separates_a_good_model_from_a_blind_one(trace, shipped, broken):
    refit = OnlineRefit(shipped.copy(), refit_every=100)
    _observe(refit, shipped, trace, 1)
    refit.end_iteration(trace.iterations[:2])
    groups = [(X, C[0], y) for X, C, y in zip(refit._X, refit._C, refit._y)]
    assert sampled_window_recall(shipped, groups) > sampled_window_recall(broken, groups) + 0.2


class _Plan:
    """A stand-in for ReplayPolicy's plan: per storage, its match's positions in the previous iteration."""

    def __init__(self, plan):
        self._plan = plan

    def plan(self, sid):
        return self._plan.get(sid)


def test_exact_replay_holds_while_the_plan_has_held_to_the_operator():
    from types import SimpleNamespace

    from dynn_runtime.pilot.adapt import ExactReplay

    ops = [SimpleNamespace(name=f"op{j}", module="m") for j in range(6)]
    ex = ExactReplay(_Plan({1: [0, 2, 5], 2: [1, 4], 3: [3]}))
    ex.begin_iteration(ops)
    ex.alloc(2, 1)  # born where its match was
    ex.alloc(4, 2)  # replay has no match for it
    for sid, j in ((1, 0), (1, 2), (2, 4), (3, 4)):  # storage 3 is accessed one operator off its plan
        ex.access(sid, j)
    for j in range(5):
        ex.op(j, ops[j])
    assert [ex.exact(s) for s in (1, 2, 3, 4)] == [True, True, False, False]
    ex.op(5, SimpleNamespace(name="other", module="m"))  # the sequence leaves the previous iteration's
    assert not ex.in_sync and not ex.exact(1)
    ex.begin_iteration([])  # no previous iteration: nothing is on plan
    assert not ex.in_sync


STATIC = '''
import torch
from torch import nn


class Static:
    def __init__(self, preset):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def make_batch(self, step):
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(8, 16, generator=g)}

    def loss(self, model, batch):
        return model(batch["x"]).square().mean()


def build(preset):
    return Static(preset)
'''


def test_fallback_takes_replay_where_its_plan_is_exact(tmp_path, broken):
    """On a network whose steps run the same operators, every storage replay has a match for stays
    on plan, and the fallback's model side predicts those at replay's positions (a blind model
    ranks them no better than chance)."""
    from dynn_runtime.trace import read_trace, record

    (tmp_path / "static.py").write_text(STATIC)
    path = tmp_path / "static.jsonl.gz"
    record(f"{tmp_path / 'static.py'}:build", path, steps=3)
    trace = read_trace(path)
    fb = make_policy("pilot", model=broken, backend="numpy", fallback=True)
    checked = []
    follow = fb._follow

    def spy(position, sids, pilot):
        out = follow(position, sids, pilot)
        assert fb._exact.in_sync
        for sid, v in zip(sids.tolist(), fb._judge._pending[-1].scores["pilot"].tolist()):
            if fb._exact.exact(sid):
                r = fb._shadow.predict(sid)
                assert v == (np.inf if r is None else r)
                checked.append(sid)
        return out

    fb._follow = spy
    assert simulate(trace, fb, 0.5).feasible
    assert len(set(checked)) > 10


def test_exact_replay_trusts_what_was_alive_at_the_start_for_the_operators_just_ahead():
    """A storage alive at the start (told with position -1) is matched by identity: on plan for a next
    use within ``near`` operators, before where the last iteration fell out of step, and until an
    access falls off its match's positions."""
    from types import SimpleNamespace

    from dynn_runtime.pilot.adapt import ExactReplay

    ops = [SimpleNamespace(name=f"op{j}", module="m") for j in range(12)]
    ex = ExactReplay(_Plan({5: [3, 9], 6: [11], 7: [2, 4], 8: [6], 9: [5]}), near=4)
    ex.begin_iteration(ops)  # the previous iteration had nothing to compare with
    for sid in (5, 6, 7, 8):
        ex.alloc(sid, -1)
    ex.op(0, ops[0])
    ex.op(1, ops[1])
    assert [ex.exact(s) for s in (5, 6, 7, 8)] == [True, False, True, False]  # next use 3, 11, 2, 6: near is 4
    ex.access(7, 3)  # one operator off its match's 2
    for j in range(2, 6):
        ex.op(j, ops[j])
    assert [ex.exact(s) for s in (5, 7, 8)] == [True, False, True]  # 5's next is 9, 8's is 6; 7 is off plan
    ex.op(6, SimpleNamespace(name="other", module="m"))  # this iteration falls out of step at 6
    assert not ex.exact(8)
    ex.begin_iteration(ops)  # the next one: in step, but trusted only below 6
    for sid in (8, 9):
        ex.alloc(sid, -1)
    for j in range(4):
        ex.op(j, ops[j])
    assert [ex.exact(8), ex.exact(9)] == [False, True]  # next use 6 and 5, both near: 6 is where the last one left


def test_a_background_refit_ends_with_the_run():
    """The online refit's thread completes and ends at detach: it does not go on competing with what
    runs after the manager (a next run, another method's timing)."""
    import threading

    from dynn_runtime.runtime.train import train_managed

    pol = make_policy("pilot", online=True, refit_every=1)
    r = train_managed("moe", 0.5, pol, steps=3)
    assert r.stats["bytes_offloaded"] > 0 and pol._refit.refits >= 1
    assert not [t for t in threading.enumerate() if t.name.startswith("dynn-pilot")]


def test_exact_replay_takes_in_place_and_out_of_place_variants_as_the_same_operator():
    from types import SimpleNamespace

    from dynn_runtime.pilot.adapt import ExactReplay, op_key

    assert op_key("aten::add_.Tensor", "fc") == op_key("aten::add.Tensor", "fc")
    assert op_key("aten::__and__.Tensor", "") != op_key("aten::__and_.Tensor", "")
    prev = [SimpleNamespace(name=n, module="m") for n in ("aten::mm", "aten::add_.Tensor", "aten::t")]
    ex = ExactReplay(_Plan({}))
    ex.begin_iteration(prev)
    for j, name in enumerate(("aten::mm", "aten::add.Tensor", "aten::t")):
        ex.op(j, SimpleNamespace(name=name, module="m"))
    assert ex.in_sync
    ex.op(3, SimpleNamespace(name="aten::mm", module="other"))
    assert not ex.in_sync


# a batch large enough that the optimizer's lists fit the runtime's limit for one list operator
# whole (half the budget; lists.py), as in step 0: the same operators every step
FOREACH = STATIC.replace("randn(8, 16", "randn(512, 16") + '''

def build_foreach(preset):
    wl = Static(preset)
    wl.optimizer = lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True)
    return wl
'''


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop-adam", "multi-tensor-adam"])
def test_the_fallback_stays_in_step_through_the_optimizer_after_its_state_was_made(tmp_path, foreach):
    """The step after the optimizer made its state runs the same operators less the state's
    creations: replay's timeline leaves those out, so the fallback's plan stays exact through that
    step's optimizer (a multi-tensor optimizer's first operator reads every state at once)."""
    from dynn_runtime.runtime.train import train_managed

    (tmp_path / "static.py").write_text(FOREACH)
    fb = make_policy("pilot", backend="numpy", fallback=True)
    steps: list[list[bool]] = []  # per iteration, whether the plan was in step after each operator
    begin, op = fb.begin_iteration, fb.on_op

    def spy_begin(index, context):
        begin(index, context)
        steps.append([])

    def spy_op(position, o):
        op(position, o)
        steps[-1].append(fb._exact.in_sync)

    fb.begin_iteration, fb.on_op = spy_begin, spy_op
    spec = f"{tmp_path / 'static.py'}:{'build_foreach' if foreach else 'build'}"
    r = train_managed(spec, 0.75, fb, steps=3)
    assert r.stats["bytes_offloaded"] > 0
    made, after = steps[-2:]  # steps 1 and 2 (the first step, which made the state, is not told per operator)
    assert made and all(made) and after and all(after)


def test_the_judge_forgets_the_first_iteration(tmp_path):
    """What the judge saw in the first iteration (replay without a plan, the model without an
    alignment) is not carried into the next one; later iterations' records are."""
    from dynn_runtime.runtime.train import train_managed

    judge = RecallJudge(methods=("pilot", "lru"), window=4, horizon=2)
    judge.decision(0, np.arange(2), {"pilot": np.array([9, 1.0]), "lru": np.array([1, 9.0])})
    judge.access(0, 1)
    judge.close()
    assert judge.choice() == "lru"
    judge.forget()
    assert judge.recall("lru") is None and judge.choice() == "pilot" and judge.totals["lru"] == [1, 1]

    (tmp_path / "static.py").write_text(FOREACH)
    fb = make_policy("pilot", backend="numpy", fallback=True)
    seen: list[tuple[int, bool]] = []  # per iteration start: history length, recent records kept
    begin = fb.begin_iteration

    def spy(index, context):
        begin(index, context)
        seen.append((len(context.history), fb._judge.recall("pilot") is not None))

    fb.begin_iteration = spy
    train_managed(f"{tmp_path / 'static.py'}:build", 0.75, fb, steps=4)
    assert (1, False) in seen and (2, True) in seen


def test_the_refit_runs_on_one_blas_thread_and_the_caller_keeps_its_own(monkeypatch):
    """The online refit's small products run on one OpenBLAS thread (more only take the training
    thread's cores); the thread's own count is back after it. Skipped where numpy's BLAS is not an
    OpenBLAS with per-thread counts."""
    from dynn_runtime.pilot import blas
    from dynn_runtime.pilot.training import online

    set_local = blas._set_local()
    if set_local is None:
        pytest.skip("numpy's BLAS has no openblas_set_num_threads_local")

    def count() -> int:
        n = set_local(1)
        set_local(n)
        return n

    seen = []

    def fake_fit(X, C, y, init, epochs):
        seen.append(count())
        return init, []

    monkeypatch.setattr(online, "fit", fake_fit)
    original = set_local(2)
    try:
        online._refit("model", None, None, None, 1)
        assert seen == [1] and count() == 2
    finally:
        set_local(original)
