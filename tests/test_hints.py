"""Workload hints (dynn_runtime.hints): recorded, read back, replayed by the simulator, passed on by
the live runtime, turned into the pilot's rule-10 features, and true on the zoo's Tree-LSTM."""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest
import torch

import dynn_runtime as dr
from dynn_runtime import hints
from dynn_runtime.errors import ConfigError, TraceError
from dynn_runtime.hints import Hint
from dynn_runtime.pilot import kernel as native
from dynn_runtime.pilot.features import CAND_FEATURES, CTX_FEATURES, FeatureState
from dynn_runtime.policies.basic import LRUPolicy
from dynn_runtime.trace import read_trace, record
from dynn_runtime.trace.format import Iteration, Op, Storage, Trace

C = {n: i for i, n in enumerate(CAND_FEATURES)}
HINT_COLS = [i for n, i in C.items() if "hint" in n]
BACKENDS = ["numpy"] + (["native"] if native.available() else [])


@pytest.fixture(scope="module")
def tree_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("hints") / "tree.jsonl.gz"
    record("tree_lstm", path, steps=2, preset="tiny", seed=7)
    return path


def test_bad_steps_are_refused_and_nothing_listens_by_default():
    assert not hints.listening()
    hints.step()  # no listener: nothing happens
    hints.next_use(torch.zeros(2), steps=3)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="integer >= 0"):
            hints.next_use(torch.zeros(2), steps=bad)


def test_recorded_hints_come_back_at_their_positions(tree_trace):
    tr = read_trace(tree_trace)
    assert tr.schema == 3
    for it in tr.iterations:
        kinds = [h.kind for hs in it.hints.values() for h in hs]
        # one step per level plus the output's, and uses naming storages the trace knows
        assert kinds.count("step") >= 3 and kinds.count("use") > kinds.count("step")
        for pos, hs in it.hints.items():
            assert 0 <= pos <= len(it.ops)
            for h in hs:
                assert all(s in tr.storages for s in h.sids)
                assert h.steps is None or h.steps >= 0
    assert not hints.listening()  # the recorder stopped listening when the iteration ended


def _rewrite(src, dst, edit):
    with gzip.open(src, "rt") as f:
        recs = [json.loads(line) for line in f]
    edit(recs)
    with gzip.open(dst, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in recs)


@pytest.mark.parametrize("bad, match", [
    ({"n": -5}, "step count is -5"),
    ({"s": [10 ** 9]}, "used before it is allocated"),
    ({"n": None}, "malformed record"),
])
def test_a_corrupt_hint_record_is_named(tree_trace, tmp_path, bad, match):
    def edit(recs):
        next(r for r in recs if r["t"] == "U").update(bad)

    _rewrite(tree_trace, tmp_path / "bad.jsonl.gz", edit)
    with pytest.raises(TraceError, match=match):
        read_trace(tmp_path / "bad.jsonl.gz")


class _Collect(LRUPolicy):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_op(self, position, op):
        super().on_op(position, op)
        self.seen.append(("op", position))

    def on_hint(self, hint):
        self.seen.append(("hint", hint))


def test_the_simulator_replays_hints_before_their_operator(tree_trace):
    from dynn_runtime.sim import simulate

    tr = read_trace(tree_trace)
    pol = _Collect()
    simulate(tr, pol, budget=0.9, iteration=1)  # below the peak: the policy is in force
    it = tr.iterations[1]
    want = []
    for j in range(len(it.ops)):
        want += [("hint", h) for h in it.hints.get(j, ())]
        want.append(("op", j))
    assert pol.seen == want


def test_hints_leave_the_simulated_host_timeline_alone(tree_trace):
    # rule 8's host clock (host_timeline=True) must not be touched by hint delivery: a policy that
    # ignores hints simulates the same with and without them (the clock was once overwritten)
    from dynn_runtime.sim import simulate

    tr = read_trace(tree_trace)
    bare = Trace(header=tr.header, storages=tr.storages, iterations=[
        dataclasses.replace(it, hints={}) for it in tr.iterations])
    a = simulate(tr, "pilot", 0.5, iteration=1, host_timeline=True)
    b = simulate(bare, "lru", 0.5, iteration=1, host_timeline=True)
    c = simulate(tr, "lru", 0.5, iteration=1, host_timeline=True)
    assert a.feasible and a.iter_time_s > 0
    assert (c.iter_time_s, c.stall_time_s, c.bytes_offloaded) == (b.iter_time_s, b.stall_time_s, b.bytes_offloaded)


def test_the_live_runtime_passes_hints_to_its_policy():
    """Under the memory manager the Tree-LSTM's hints reach the policy as it runs, naming the storages
    the operators then read: the output's step hints every level's hidden state, all read by the
    concatenation that follows."""
    from dynn_runtime.workload import load_workload, make_optimizer

    wl = load_workload("tree_lstm", preset="tiny", seed=0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    pol = _Collect()
    # record_every_op: a step that fits needs no decision, and the native source would not list its operators
    mm = dr.MemoryManager(1 << 40, policy=pol, device="cpu", record_every_op=True).attach(model, opt)
    try:
        with mm.step():
            wl.loss(model, wl.make_batch(0)).backward()
            opt.step()
    finally:
        mm.detach()
    assert not hints.listening()
    steps = [h for k, h in pol.seen if k == "hint" and h.kind == "step"]
    b = wl.make_batch(0)
    assert len(steps) == 2 * len(b.levels) + sum(len(e) for e in b.edges) + 1  # the forward's fine steps
    ops = mm.history[-1].ops
    cat = next(op for op in ops if op.name == "aten::cat")
    told = {s for k, h in pol.seen if k == "hint" and h.kind == "use" for s in h.sids}
    assert set(cat.inputs) <= told


def _step_of(it: Iteration) -> list[int]:
    """The workload step each operator of ``it`` ran in (0 before the first step mark)."""
    out, step = [], 0
    for j in range(len(it.ops)):
        step += sum(h.kind == "step" for h in it.hints.get(j, ()))
        out.append(step)
    return out


def _check_hints_true(tr: Trace) -> int:
    """Assert that every storage hinted for step k is next read in forward in step k, and that one
    hinted "not again" is not read again in forward; returns how many hinted storages were checked."""
    checked = 0
    for it in tr.iterations:
        step_of = _step_of(it)
        fwd_end = it.phase_starts["backward"]
        step = 0
        for j in range(fwd_end + 1):
            for h in it.hints.get(j, ()):
                if h.kind == "step":
                    step += 1
                    continue
                for sid in h.sids:
                    nxt = next((k for k in range(j, fwd_end) if sid in it.ops[k].inputs), None)
                    if h.steps is None:
                        assert nxt is None, (sid, j)
                    else:
                        assert nxt is not None and step_of[nxt] == step + h.steps, (sid, j, h)
                    checked += 1
    return checked


def test_the_tree_lstm_hints_are_true(tree_trace):
    assert _check_hints_true(read_trace(tree_trace)) > 100


def test_the_synthetic_networks_hints_are_true(tmp_path):
    """The synthetic training networks that hint (a tree trunk of each cell, recycling, skip and
    exit stages, LayerDrop stages, an image trunk whose skip blocks cannot all run) tell the truth: the
    pilot learns from them what a hint is worth."""
    from dynn_runtime.pilot.training.synth import SynthNet, describe, synth_traces

    # conv: moe, skip, recycle, exit; tree (levels); conv: exit, skip, layerdrop; tree (shared); tree
    # (shared): layerdrop first
    seeds = [4, 5, 8, 24, 37]
    assert all(SynthNet(s).tell for s in seeds) and describe(37)["stages"][0] == "layerdrop"
    assert {describe(s).get("cell") for s in seeds} == {None, "levels", "shared"}
    for seed, tr in zip(seeds, synth_traces(seeds, steps=2, cache_dir=tmp_path)):
        assert _check_hints_true(tr) > 20, seed


def _hand_trace() -> Trace:
    """Forward of 8 operators over 3 workload steps; p is hinted at step 2, q "not again", then
    backward reads p."""
    st = {sid: Storage(sid=sid, nbytes=64, dtype="float32", kind="temp", preexisting=True, alloc_at=(0, 0))
          for sid in (1, 2, 3)}
    p, q, r = 1, 2, 3

    def op(name, phase, ins):
        return Op(name=name, idiom=(0,) * 6, phase=phase, module="", inputs=ins, outputs=(), writes=(),
                  allocs=(), duration_s=1e-6, flops=0, nbytes=0)

    ops = [op("aten::a", "forward", (r,)) for _ in range(7)] + [op("aten::a", "forward", (p,)),
                                                                 op("aten::b", "backward", (p, q))]
    h = {
        0: [Hint("use", (p,), 2), Hint("use", (q,), None)],
        1: [Hint("step")],  # step 1 starts at op 1
        4: [Hint("step")],  # step 2 at op 4: three operators per step
        7: [Hint("step")],  # step 3: p's step is over
    }
    it = Iteration(index=0, ops=ops, phase_starts={"forward": 0, "backward": 8}, hints=h)
    header = {"t": "H", "magic": "dynn-trace", "schema": 3, "device": "cpu", "workload": "hand"}
    return Trace(header=header, storages=st, iterations=[it])


def _rows(trace: Trace, backend: str) -> dict[int, tuple[dict[int, np.ndarray], np.ndarray]]:
    class View:
        def nbytes(self, sid):
            return 64

        def kind(self, sid):
            return "temp"

        def saved(self, sid):
            return False

    fs = FeatureState(View(), group=1, backend=backend)
    fs.begin_iteration(0, [])
    it = trace.iterations[0]
    for sid in trace.storages:
        fs.alloc(sid, -1)
    out = {}
    for j, op in enumerate(it.ops):
        for h in it.hints.get(j, ()):
            fs.hint(h)
        fs.op(j, op)
        sids, X, ctx = fs.features()
        out[j] = (dict(zip(sids.tolist(), X)), ctx)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_hint_features_on_a_hand_built_trace(backend):
    rows = _rows(_hand_trace(), backend)
    hx = CTX_FEATURES.index("hints")

    def est(row):
        return round(float(np.expm1(row[C["log_hint_est"]] * 8.0)))

    r, ctx = rows[0]  # step 0, p hinted for step 2; no completed step: one operator per step so far
    assert ctx[hx] == 1
    assert r[1][C["hinted"]] == 1 and r[1][C["log_hint_steps"]] == np.float32(np.log1p(np.float32(2)) / 4.0)
    assert est(r[1]) == 2 - 1  # 2 steps x 1 - 1 operator run in this step
    assert r[2][C["hint_done"]] == 1 and not r[2][C["hinted"]] and not r[3][HINT_COLS].any()
    r, _ = rows[2]  # step 1 (op 1 on): still no completed step; its own 2 operators so far
    assert est(r[1]) == 1 * 2 - 2
    r, _ = rows[5]  # step 2 (op 4 on), one completed step of 3 operators: due now
    assert r[1][C["log_hint_steps"]] == 0 and est(r[1]) == 0 and r[1][C["hint_le8"]] == 1
    r, _ = rows[7]  # step 3: p's step ended, its hint expired; q's "not again" holds
    assert not r[1][HINT_COLS].any() and r[2][C["hint_done"]] == 1
    r, _ = rows[8]  # backward: every hint is over
    assert not any(v[HINT_COLS].any() for v in r.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hinted_storage_read_in_its_step_is_marked_read(backend):
    # p is hinted for step 1 (ops 1-3) and read at op 2: "already read" from op 2 to the step's end
    tr = _hand_trace()
    it = tr.iterations[0]
    p, r = 1, 3
    it.ops = [dataclasses.replace(it.ops[0], inputs=(p,) if j == 2 else (r,)) for j in range(5)]
    it.phase_starts = {"forward": 0}
    it.hints = {0: [Hint("use", (p,), 1)], 1: [Hint("step")], 4: [Hint("step")]}
    rows = _rows(tr, backend)
    assert [rows[j][0][p][C["hint_read"]] for j in range(4)] == [0, 0, 1, 1]
    assert rows[1][0][p][C["hinted"]] == 1 and rows[3][0][p][C["hinted"]] == 1
    assert not rows[4][0][p][HINT_COLS].any()  # the next step: the hint expired


def test_without_hints_the_columns_are_zero(tree_trace):
    from dynn_runtime.pilot.training.data import walk

    tr = read_trace(tree_trace)
    plain = Trace(header=tr.header, storages=tr.storages, iterations=[
        Iteration(index=it.index, ops=it.ops, frees=it.frees, pre_allocs=it.pre_allocs,
                  phase_starts=it.phase_starts) for it in tr.iterations])
    hx = CTX_FEATURES.index("hints")
    n_hinted = 0
    for (d, dp) in zip(walk(tr, 1, baselines=False), walk(plain, 1, baselines=False)):
        assert not dp.X[:, HINT_COLS].any() and dp.ctx[hx] == 0
        others = [i for i in range(len(CAND_FEATURES)) if i not in HINT_COLS]
        np.testing.assert_array_equal(d.X[:, others], dp.X[:, others])
        n_hinted += int(d.X[:, C["hinted"]].sum())
    assert n_hinted > 0


@pytest.mark.parametrize("events", ["python", "native"])
def test_the_live_runtime_listens_only_for_a_policy_that_reads_hints(events):
    """A hint costs a storage lookup per tensor: a manager whose policy has no ``on_hint`` (lru)
    does not listen, one whose policy has (or that records every operator) does."""
    from dynn_runtime.runtime import events as ev
    from dynn_runtime.workload import load_workload, make_optimizer

    if events == "native" and ev.native_module() is None:
        pytest.skip("the native event source is not built")
    wl = load_workload("tree_lstm", preset="tiny", seed=0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    for policy, every_op, listens in (("lru", False, False), (_Collect(), False, True), ("lru", True, True)):
        mm = dr.MemoryManager(1 << 40, policy=policy, device="cpu", events=events,
                              record_every_op=every_op).attach(model, opt)
        try:
            with mm.step():
                assert hints.listening() is listens
                wl.loss(model, wl.make_batch(0)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            mm.detach()
        assert not hints.listening()
        assert bool(mm.history[-1].hints) is listens
