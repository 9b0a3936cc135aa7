"""The pilot's stack / ordering features on hand-built sequences, and the synthetic training networks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dynn_runtime.pilot.features import CAND_FEATURES, FeatureState
from dynn_runtime.pilot.training.synth import EXTRA_STAGES, STAGES, SynthWorkload, describe, synth_traces
from dynn_runtime.trace.format import Iteration, Op

C = {n: i for i, n in enumerate(CAND_FEATURES)}
IV = (0, 1, 0, 0, 1, 0)


class _View:
    def __init__(self, kinds: dict[int, tuple[str, bool]]) -> None:
        self.kinds = kinds

    def nbytes(self, sid: int) -> int:
        return 1024

    def kind(self, sid: int) -> str:
        return self.kinds[sid][0]

    def saved(self, sid: int) -> bool:
        return self.kinds[sid][1]


def _op(name: str, phase: str, ins=(), allocs=()) -> Op:
    return Op(name=name, idiom=IV, phase=phase, module="m", inputs=tuple(ins), outputs=tuple(allocs), writes=(),
              allocs=tuple(allocs), duration_s=0.0, flops=0, nbytes=0)


def _row(st: FeatureState, sid: int) -> np.ndarray:
    sids, X, _ = st.features()
    return X[list(sids).index(sid)]


def test_stack_span_follows_the_backward_frontier():
    kinds = {i: ("activation", True) for i in (1, 2, 3, 4)}
    st = FeatureState(_View(kinds), group=1)
    st.begin_iteration(0, [])
    pushes = {0: 1, 1: 2, 4: 3, 5: 4}  # position -> saved activation produced there
    for j in range(6):
        sid = pushes.get(j)
        if sid:
            st.alloc(sid, j)
        st.op(j, _op(f"f{j}", "forward", allocs=(sid,) if sid else ()))
    # in forward the span is the forward operators produced after it
    assert np.isclose(np.expm1(_row(st, 1)[C["log_stack_span"]] * 8), 5)
    st.op(6, _op("b", "backward", ins=(3,)))  # backward reads 3 (pushed at 4): the frontier is 4
    r1, r2, r4 = _row(st, 1), _row(st, 2), _row(st, 4)
    assert np.isclose(np.expm1(r1[C["log_stack_span"]] * 8), 4)
    assert np.isclose(np.expm1(r2[C["log_stack_span"]] * 8), 3)
    assert np.isclose(np.expm1(r2[C["log_stack_est"]] * 8), 3 * 1.5, atol=1e-3)  # no history: ratio 1.5
    assert r4[C["stack_overdue"]] == 1 and r2[C["stack_overdue"]] == 0
    assert r2[C["stack_le8"]] == 1 and r2[C["stack_le256"]] == 1


def test_unaccessed_externals_take_counterparts_in_announcement_order():
    kinds = {i: ("input", False) for i in (10, 11, 20, 21)}
    prev = Iteration(index=0)
    prev.ops = [_op("x", "forward"), _op("a", "forward", ins=(10,))] + [_op("pad", "forward") for _ in range(18)] \
        + [_op("b", "forward", ins=(11,))]
    st = FeatureState(_View(kinds), group=1)
    st.begin_iteration(1, [prev])
    st.alloc(20, -1)
    st.alloc(21, -1)
    st.op(0, _op("x", "forward"))
    r20, r21 = _row(st, 20), _row(st, 21)
    assert r20[C["ext_by_order"]] == 1 and r21[C["ext_by_order"]] == 1 and r20[C["matched"]] == 0
    assert r20[C["prev_le8"]] == 1  # counterpart 10: next used 1 operator after the anchor
    assert r21[C["prev_le16"]] == 0 and r21[C["prev_le32"]] == 1  # counterpart 11: 20 operators after


def test_synthetic_networks_are_deterministic_and_varied(tmp_path):
    assert describe(3) == describe(3)
    a, b = SynthWorkload(5), SynthWorkload(5)
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))
    ba, bb = a.make_batch(1), b.make_batch(1)
    assert repr(ba["plan"]) == repr(bb["plan"])
    kinds = [describe(s) for s in range(24)]
    assert {k["trunk"] for k in kinds} == {"mlp", "conv", "tree"}
    assert {s for k in kinds for s in k["stages"]} == {*STAGES, *EXTRA_STAGES}
    assert {k.get("cell") for k in kinds if k["trunk"] == "tree"} == {"levels", "shared"}
    tr = synth_traces([1], steps=3, cache_dir=tmp_path)[0]
    assert tr.header["workload"] == "synthetic"
    lengths = [len(it.ops) for it in tr.iterations]
    assert len(lengths) == 3 and len(set(lengths[1:] + lengths[:1])) > 1  # the structure changes per step
    again = synth_traces([1], steps=3, cache_dir=tmp_path / "again")[0]
    assert [[(o.name, o.module) for o in it.ops] for it in again.iterations] == \
        [[(o.name, o.module) for o in it.ops] for it in tr.iterations]


def _synth_seed(*stages: str) -> int:
    """The first seed whose network has an MLP trunk, ``stages`` and no early exit (every stage runs)."""
    return next(s for s in range(200) if describe(s)["trunk"] == "mlp" and "exit" not in describe(s)["stages"]
                and set(stages) <= set(describe(s)["stages"]))


def test_synthetic_graph_and_token_dropping_stages_vary_per_step(tmp_path):
    # message passing over a graph drawn per step: gathers and scatters whose sizes change from one
    # step to the next; token dropping: a top-k whose k (capacity x a drawn length) changes too
    seed = _synth_seed("graph", "mod")
    tr = synth_traces([seed], steps=3, cache_dir=tmp_path)[0]
    groups = {"gather": ("aten::index_select",), "scatter": ("aten::index_add", "aten::scatter_add"),
              "top-k": ("aten::topk",)}
    sizes: dict[str, list[tuple[int, ...]]] = {g: [] for g in groups}
    for it in tr.iterations:
        for g, names in groups.items():
            ops = [o for o in it.ops if o.name in names and o.phase == "forward"]
            assert ops, f"no {g} op in an iteration of seed {seed}"
            sizes[g].append(tuple(tr.storages[o.outputs[0]].nbytes for o in ops))
    for g, per_step in sizes.items():
        assert len(set(per_step)) > 1, f"the {g} ops' sizes are the same every step: {per_step}"
    w = SynthWorkload(seed)
    a, b = w.make_batch(0), SynthWorkload(seed).make_batch(0)
    k = [kind for kind, _ in w.model.stages].index("graph")
    assert all(torch.equal(a["plan"][k][t], b["plan"][k][t]) for t in ("src", "dst", "owner", "feat"))
    edges = [len(w.make_batch(s)["plan"][k]["src"]) for s in range(4)]
    assert len(set(edges)) > 1


def test_synthetic_layerdrop_updates_a_different_subset_every_step():
    w = SynthWorkload(_synth_seed("layerdrop"))
    k = [kind for kind, _ in w.model.stages].index("layerdrop")
    layers = w.model.stage_mods[k]
    with_grad = []
    for step in range(6):
        w.model.zero_grad(set_to_none=True)
        batch = w.make_batch(step)
        w.loss(w.model, batch).backward()
        ran = batch["plan"][k]
        assert [layer.up.weight.grad is not None for layer in layers] == ran  # a dropped layer runs nothing
        with_grad.append(tuple(ran))
    assert len(set(with_grad)) > 1 and not all(all(r) for r in with_grad)


def test_extra_stages_leave_the_earlier_draws_alone():
    # the extra stages come from a stream of their own: the other stages' kinds and per-step plans
    # are what the seed drew without them
    seed = _synth_seed("mod")
    w = SynthWorkload(seed)
    kinds = [kind for kind, _ in w.model.stages]
    assert [kd for kd in kinds if kd in STAGES] and any(kd in EXTRA_STAGES for kd in kinds)
    w.model.stages = [(kd, n) for kd, n in w.model.stages if kd in STAGES]
    kept = w.make_batch(2)["plan"]
    full = SynthWorkload(seed).make_batch(2)["plan"]
    assert repr(kept) == repr([p for p, kd in zip(full, kinds) if kd in STAGES])


def test_prior_ignores_synthetic_rows_when_real_ones_exist():
    # the provisional prior is a deployment-time default: synthetic rows (training data for the
    # network only) must not move it, unless they are all there is
    import numpy as np

    from dynn_runtime.pilot.training.data import Rows, build_rows, zoo_traces
    from dynn_runtime.pilot.training.synth import SYNTH_FAMILY
    from dynn_runtime.pilot.training.train import fit_prior

    [(_, tr)] = zoo_traces(["moe"], ["tiny"], [1], 4)
    real = build_rows([tr], group=16, per_decision=64, seed=0)
    fake = Rows(X=real.X.copy(), C=real.C.copy(), y=np.full(len(real), real.y.max()),  # everything "not again"
                family=[SYNTH_FAMILY] * len(real))
    both = Rows(X=np.concatenate([real.X, fake.X]), C=np.concatenate([real.C, fake.C]),
                y=np.concatenate([real.y, fake.y]), family=real.family + fake.family)
    assert np.array_equal(fit_prior(both), fit_prior(real))
    assert not np.array_equal(fit_prior(fake), fit_prior(real))  # synthetic only: they are used


def test_occurrences_count_per_phase_so_the_optimizer_stays_aligned():
    # forward runs "mul" three times in the previous step and once in this one (a loop with fewer
    # trips); the optimizer's "mul" on the parameter must still match the previous optimizer's
    kinds = {1: ("param", False), 2: ("opt_state", False)}
    prev = Iteration(index=0)
    prev.ops = ([_op("mul", "forward", ins=(1,)) for _ in range(3)] + [_op("pad", "backward")] * 4
                + [_op("mul", "optimizer", ins=(1,))] + [_op("pad", "optimizer")] * 5
                + [_op("add_", "optimizer", ins=(2,))])
    st = FeatureState(_View(kinds), group=1)
    st.alloc(1, -1)
    st.alloc(2, -1)
    st.begin_iteration(1, [prev])
    ops = [_op("mul", "forward", ins=(1,))] + [_op("pad", "backward")] * 4 + [_op("mul", "optimizer", ins=(1,))]
    for j, op in enumerate(ops):
        st.op(j, op)
    # anchored at the previous optimizer's "mul" (position 7): the state is next used 6 operators on
    assert st._anchor == (len(ops) - 1, 7)
    r2 = _row(st, 2)
    assert np.isclose(np.expm1(r2[C["log_prev_dist"]] * 8), 6, atol=1e-3)
    assert r2[C["prev_le8"]] == 1


def test_replayed_next_use_follows_the_counterparts_occurrences():
    # previous step: the parameter is used at 0, 3 and 9; the activation made at 1 is read at 5
    kinds = {1: ("param", False), 7: ("activation", True), 8: ("activation", True)}
    prev = Iteration(index=0)
    prev.ops = ([_op("mul", "forward", ins=(1,)), _op("make", "forward", allocs=(7,)), _op("pad", "forward"),
                 _op("add", "forward", ins=(1,)), _op("pad", "forward"), _op("read", "forward", ins=(7,))]
                + [_op("pad", "backward")] * 3 + [_op("step", "optimizer", ins=(1,))])
    st = FeatureState(_View(kinds), group=100)
    st.alloc(1, -1)
    st.begin_iteration(1, [prev])
    st.op(0, _op("mul", "forward", ins=(1,)))
    assert st.replayed == {1: 3}  # first access here, the counterpart's second came 3 later
    st.op(1, _op("pad", "forward"))
    assert st.replayed == {}
    st.alloc(8, 2)
    st.op(2, _op("make", "forward", allocs=(8,)))  # matched producer: 8's counterpart is 7, read 4 later
    assert st.replayed == {8: 6}
    st.op(3, _op("add", "forward", ins=(1,)))  # second access, one later than before: gap 6 to the step
    assert st.replayed == {1: 9}
    st.op(4, _op("step", "optimizer", ins=(1,)))  # third access: the counterpart had no fourth
    assert 1 not in st.replayed


def test_tree_batches_group_each_levels_children_by_their_level():
    # a per-level-state cell reads, for each level, the lower levels its nodes' children sit in:
    # every child must be found exactly once, at its own level and position, under its parent
    w = next(SynthWorkload(s) for s in range(64) if describe(s).get("cell") == "levels")
    for step in range(3):
        b = w.make_batch(step)
        nodes = [lv[0].tolist() for lv in b["levels"]]
        level_of = {v: (lv, k) for lv, ns in enumerate(nodes) for k, v in enumerate(ns)}
        seen = []
        for lv, edges in enumerate(b["edges"]):
            _, child, slot = b["levels"][lv]
            want = sorted(zip(child.tolist(), (nodes[lv][k] for k in slot.tolist())))
            got = []
            for lower, cp, pp in edges:
                assert lower < lv
                got += [(nodes[lower][c], nodes[lv][p]) for c, p in zip(cp.tolist(), pp.tolist())]
            assert sorted(got) == want
            seen += [c for c, _ in got]
        assert sorted(seen) == sorted(set(seen)) and len(seen) == len(level_of) - len(b["roots"])
        flat = [v for ns in nodes for v in ns]
        assert [flat[r] for r in b["root_rows"].tolist()] == b["roots"].tolist()


def test_extra_stages_can_be_left_out_of_the_mixture():
    seed = next(s for s in range(200) if {"layerdrop", "graph"} <= set(describe(s)["stages"]))
    full = describe(seed)["stages"]
    some = describe(seed, extra=("graph", "mod"))["stages"]
    assert "layerdrop" not in some and {"graph", "mod"} & set(some)
    assert [k for k in some if k in STAGES] == [k for k in full if k in STAGES]  # the seed's own stages stay
    w = SynthWorkload(seed, extra=("graph", "mod"))
    assert not any(isinstance(m, torch.nn.ModuleList) and len(m) and type(m[0]).__name__ == "_DropLayer"
                   for m in w.model.stage_mods)
    w.loss(w.model, w.make_batch(0)).backward()  # the plan matches the stages that are there
    assert describe(seed, extra=())["stages"] == [k for k in full if k in STAGES]  # generator 2's network
    with pytest.raises(ValueError, match="extra stages"):
        SynthWorkload(seed, extra=("graph", "dropout"))
