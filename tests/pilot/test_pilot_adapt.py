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


def test_fallback_rescues_a_model_that_predicts_nothing(trace, broken):
    plain = make_policy("pilot", model=broken, backend="numpy")
    r_plain = simulate(trace, plain, 0.25)
    fb = make_policy("pilot", model=broken, backend="numpy", fallback=True)
    r_fb = simulate(trace, fb, 0.25)
    assert r_plain.feasible and r_fb.feasible
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
