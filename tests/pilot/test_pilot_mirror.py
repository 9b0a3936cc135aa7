"""Rule 9 of the pilot's features: backward mirrors forward through the autograd nodes.

The recorder (and the live runtime) give each operator its autograd node; the feature state turns
the pairs into a *mirror* (the forward position backward has reached) and, for every storage, the
forward access the mirror passes next. Checked on a hand-built trace where every value is known,
on a recorded one against what really happens next, and against a trace without nodes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dynn_runtime.pilot import kernel as native
from dynn_runtime.pilot.features import CAND_FEATURES, FeatureState
from dynn_runtime.pilot.training.data import walk
from dynn_runtime.pilot.training.evaluate import _spearman
from dynn_runtime.trace.format import Iteration, Op, Storage, Trace

C = {n: i for i, n in enumerate(CAND_FEATURES)}
MIRROR_COLS = [i for n, i in C.items() if "mirror" in n]
BACKENDS = ["numpy"] + (["native"] if native.available() else [])


def _hand_trace(passes: int = 1) -> Trace:
    """Forward: a = f(x) [node 0], b = g(a) [node 1], loss = h(b, a) [node 2]; backward runs the
    nodes in reverse and each allocates the gradient of its forward op's input. ``passes`` > 1:
    forward and backward again in the same step (gradient accumulation), with new storages and nodes."""
    st = {}
    ops = []
    for k in range(passes):
        ops += _hand_pass(st, 10 * k, 3 * k, len(ops))
    it = Iteration(index=0, ops=ops, phase_starts={"forward": 0, "backward": 3})
    header = {"t": "H", "magic": "dynn-trace", "schema": 2, "device": "cpu", "workload": "hand"}
    return Trace(header=header, storages=st, iterations=[it])


def _hand_pass(st: dict, o: int, n: int, at: int) -> list[Op]:

    def s(sid, nbytes, kind="temp", saved=False, pre=False):
        st[sid] = Storage(sid=sid, nbytes=nbytes, dtype="float32", kind=kind, saved=saved, preexisting=pre,
                          alloc_at=(0, 0))
        return sid

    x, a, b, loss = s(o + 1, 64, "input", pre=True), s(o + 2, 64, saved=True), s(o + 3, 64, saved=True), s(o + 4, 4)
    gl, gb, ga, ga2 = s(o + 5, 4), s(o + 6, 64), s(o + 7, 64), s(o + 8, 64)

    def op(name, phase, ins, allocs, node):
        return Op(name=name, idiom=(0,) * 6, phase=phase, module="", inputs=ins, outputs=allocs, writes=(),
                  allocs=allocs, duration_s=1e-6, flops=0, nbytes=0, node=node)

    ops = [
        op("aten::f", "forward", (x,), (a,), n),             # 0
        op("aten::g", "forward", (a,), (b,), n + 1),         # 1
        op("aten::h", "forward", (b, a), (loss,), n + 2),    # 2
        op("aten::ones_like", "backward", (loss,), (gl,), -1),  # 3: no node yet
        op("aten::h_backward", "backward", (gl, b), (gb,), n + 2),  # 4: mirror 2; gb follows b
        op("aten::h_backward", "backward", (gl, b), (ga2,), n + 2),  # 5: a's share, follows a
        op("aten::g_backward", "backward", (gb, a), (ga,), n + 1),  # 6: mirror 1; ga follows a
        op("aten::add", "backward", (ga, ga2), (), n + 1),   # 7
        op("aten::f_backward", "backward", (ga, x), (), n),  # 8: mirror 0
    ]
    for sid, j in ((a, 0), (b, 1), (loss, 2), (gl, 3), (gb, 4), (ga2, 5), (ga, 6)):
        st[sid].alloc_at = (0, at + j)
    return ops


def _rows(trace: Trace, backend: str) -> dict[int, dict[int, np.ndarray]]:
    """Feature rows after every operator: position -> sid -> row."""
    view_tr = trace

    class View:
        def nbytes(self, sid):
            return view_tr.storages[sid].nbytes

        def kind(self, sid):
            return view_tr.storages[sid].kind

        def saved(self, sid):
            return view_tr.storages[sid].saved

    fs = FeatureState(View(), group=1, backend=backend)
    fs.begin_iteration(0, [])
    it = trace.iterations[0]
    out = {}
    for sid, st in trace.storages.items():  # the inputs x are alive at the start, the rest allocated below
        if st.preexisting:
            fs.alloc(sid, -1)
    for j, op in enumerate(it.ops):
        for sid in op.allocs:
            fs.alloc(sid, j)
        fs.op(j, op)
        sids, X, _ = fs.features()
        out[j] = dict(zip(sids.tolist(), X))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_mirror_features_on_a_hand_built_trace(backend):
    rows = _rows(_hand_trace(), backend)
    # forward and the backward operator before the first node: no mirror
    for j in range(4):
        assert all(not r[MIRROR_COLS].any() for r in rows[j].values()), j
    r = rows[4]  # mirror at forward position 2 (node 2)
    x, a, b, gb = r[1], r[2], r[3], r[6]
    # a was accessed at 0, 1, 2: the latest below the mirror is 1 (one operator), not its first
    assert a[C["mirror"]] == 1 and a[C["mirror_final"]] == 0 and a[C["mirror_linked"]] == 0
    assert a[C["log_mirror_span"]] == np.float32(np.log1p(1.0) / 8.0)
    # x only at 0: two operators back, its first (and last) forward access
    assert x[C["mirror_final"]] == 1 and x[C["log_mirror_span"]] == np.float32(np.log1p(2.0) / 8.0)
    # b was accessed at 1 and 2: next at 1, its producer
    assert b[C["mirror_final"]] == 1 and b[C["log_mirror_span"]] == np.float32(np.log1p(1.0) / 8.0)
    # gb is b's gradient: h's inputs are b and a, both 64 bytes; the first of equal size is taken
    assert gb[C["mirror"]] == 1 and gb[C["mirror_linked"]] == 1
    assert gb[C["log_mirror_span"]] == b[C["log_mirror_span"]]
    r = rows[6]  # node 1 (g, forward position 1): ga follows g's input a, next at 0 (its producer f)
    ga = r[7]
    assert ga[C["mirror"]] == 1 and ga[C["mirror_linked"]] == 1 and ga[C["mirror_final"]] == 1
    assert ga[C["log_mirror_span"]] == np.float32(np.log1p(1.0) / 8.0)
    assert r[1][C["mirror_final"]] == 1  # x: next at 0 as well
    r = rows[8]  # node 0: nothing of forward lies below position 0
    assert all(not v[MIRROR_COLS].any() for v in r.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_trace_without_nodes_has_no_mirror_and_the_rest_unchanged(backend, caplog):
    """A trace recorded before schema 2 still works, with a warning that says to re-record it."""
    tr = _hand_trace()
    plain = dataclasses.replace(tr, iterations=[dataclasses.replace(
        tr.iterations[0], ops=[dataclasses.replace(op, node=-1) for op in tr.iterations[0].ops])])
    with_nodes, without = _rows(tr, backend), _rows(plain, backend)
    others = [i for i in range(len(CAND_FEATURES)) if i not in MIRROR_COLS]
    seen = 0
    for j in with_nodes:
        for sid, row in without[j].items():
            assert not row[MIRROR_COLS].any()
            np.testing.assert_array_equal(row[others], with_nodes[j][sid][others])
            seen += with_nodes[j][sid][C["mirror"]] > 0
    assert seen > 0
    warned = [r.getMessage() for r in caplog.records if "autograd node" in r.getMessage()]
    assert len(warned) == 1 and "Re-record" in warned[0]


@pytest.fixture(scope="module")
def tree_trace(tmp_path_factory):
    from dynn_runtime.trace import read_trace, record

    path = tmp_path_factory.mktemp("mirror") / "tree.jsonl.gz"
    record("tree_lstm", path, steps=2, preset="tiny", seed=3)
    return read_trace(path)


def test_recorded_backward_names_the_forward_operator_it_differentiates(tree_trace):
    it = tree_trace.iterations[1]
    fwd = {op.node: op for op in it.ops if op.phase == "forward" and op.node >= 0}
    nodes = [op.node for op in it.ops if op.phase == "forward" and op.node >= 0]
    assert len(nodes) == len(set(nodes)) and len(nodes) > 100  # one node per differentiable op
    bwd = [op for op in it.ops if op.phase == "backward"]
    mapped = [op for op in bwd if op.node in fwd]
    assert len(mapped) >= 0.95 * len(bwd)
    pairs = {(op.name, fwd[op.node].name) for op in mapped}
    assert ("aten::tanh_backward", "aten::tanh") in pairs and ("aten::sigmoid_backward", "aten::sigmoid") in pairs
    for name, of in pairs:  # an elementwise backward always belongs to its own forward op
        if name in ("aten::tanh_backward", "aten::sigmoid_backward"):
            assert of == name.replace("_backward", ""), (name, of)
    assert all(op.node < 0 for op in it.ops if op.phase == "optimizer")


def test_mirror_estimate_orders_backward_next_uses(tree_trace):
    """On a recorded Tree-LSTM, whose backward follows each batch's trees (no earlier iteration says
    how), the mirror covers most storages used again and its estimate ranks their true next uses
    (Spearman's rho, averaged over backward decision points)."""
    rhos, covered, total = [], 0, 0
    opt_start = tree_trace.iterations[1].phase_starts["optimizer"]
    for d in walk(tree_trace, 1, baselines=False):
        if d.ctx[1] != 1.0:  # phase_backward
            continue
        again = d.position + d.dist < opt_start  # used again in backward (inf: never)
        m = (d.X[:, C["mirror"]] > 0) & again
        total += int(again.sum())
        covered += int(m.sum())
        if m.sum() >= 5:
            rhos.append(_spearman(d.X[m, C["log_mirror_est"]].astype(np.float64), d.dist[m]))
    assert covered >= 0.85 * total
    rhos = [r for r in rhos if r is not None]
    print(f"coverage {covered / total:.3f}, rho {np.mean(rhos):.3f} over {len(rhos)} decision points")
    assert np.mean(rhos) > 0.9


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_backward_mirrors_its_own_forward_when_a_step_runs_several(backend):
    """Gradient accumulation (forward, backward, forward, backward in one step): the second backward
    sees its own forward, at the same distances as the first."""
    once, twice = _rows(_hand_trace(1), backend), _rows(_hand_trace(2), backend)
    for j in range(9):
        for sid, row in once[j].items():
            np.testing.assert_array_equal(twice[9 + j][10 + sid][MIRROR_COLS], row[MIRROR_COLS], err_msg=f"{j} {sid}")
    assert any(r[C["mirror"]] for r in twice[13].values())


def test_autograd_nodes_pair_backward_with_forward_and_stay_quiet_without_grad():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dynn_runtime.trace.recorder import AutogradNodes

    class Mode(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.nodes, self.seen = AutogradNodes(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen.append((func.name(), self.nodes()))
            return out

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    mode = Mode()
    with mode:
        y = (x @ w).tanh()
        z = y.detach() * 2  # no node: detached
        loss = y.sum()
        n_fwd = len(mode.seen)
        loss.backward()
        with torch.no_grad():
            (x @ w).tanh()
    fwd, bwd, ng = mode.seen[:n_fwd], mode.seen[n_fwd:-2], mode.seen[-2:]
    made = {name: q for name, q in fwd}
    assert made["aten::mm"] >= 0 and made["aten::tanh"] > made["aten::mm"] and made["aten::sum"] > made["aten::tanh"]
    assert made["aten::mul.Tensor"] == -1 and z.grad_fn is None
    ran = dict(bwd)
    assert ran["aten::tanh_backward"] == made["aten::tanh"]
    assert [q for name, q in bwd if name == "aten::mm"] == [made["aten::mm"]] * 2  # grad of x and of w
    assert all(q == -1 for _, q in ng)


def _pass_through_trace() -> Trace:
    """Forward: a = f(x) [node 0], s = index_add(a, i, src) [node 1], loss = g(s) [node 2], where
    index_add's gradient for ``a`` is its output's gradient itself (no operator runs for it), and
    t = k(s) [node 3] is a side branch. Backward: g's allocates gs; index_add's reads gs (for src's
    gradient) and passes gs on to a; f's reads gs again."""
    st = {}

    def s(sid, nbytes, kind="temp", pre=False):
        st[sid] = Storage(sid=sid, nbytes=nbytes, dtype="float32", kind=kind, saved=False, preexisting=pre,
                          alloc_at=(0, 0))
        return sid

    x, i, src = s(1, 64, "input", pre=True), s(2, 8, "input", pre=True), s(3, 64, "input", pre=True)
    a, sm, loss, gl, gs, gsrc = s(4, 64), s(5, 64), s(6, 4), s(7, 4), s(8, 64), s(9, 64)

    def op(name, phase, ins, allocs, node):
        return Op(name=name, idiom=(0,) * 6, phase=phase, module="", inputs=ins, outputs=allocs, writes=(),
                  allocs=allocs, duration_s=1e-6, flops=0, nbytes=0, node=node)

    ops = [
        op("aten::f", "forward", (x,), (a,), 0),                  # 0
        op("aten::index_add", "forward", (a, i, src), (sm,), 1),  # 1
        op("aten::g", "forward", (sm,), (loss,), 2),              # 2
        op("aten::ones_like", "backward", (loss,), (gl,), -1),    # 3
        op("aten::g_backward", "backward", (gl, sm), (gs,), 2),   # 4: gs follows s
        op("aten::index_select", "backward", (gs, i), (gsrc,), 1),  # 5: mirror 1, s's producer
        op("aten::f_backward", "backward", (gs, x), (), 0),       # 6: gs was passed on to a
    ]
    for sid, j in ((a, 0), (sm, 1), (loss, 2), (gl, 3), (gs, 4), (gsrc, 5)):
        st[sid].alloc_at = (0, j)
    it = Iteration(index=0, ops=ops, phase_starts={"forward": 0, "backward": 3})
    header = {"t": "H", "magic": "dynn-trace", "schema": 2, "device": "cpu", "workload": "hand"}
    return Trace(header=header, storages=st, iterations=[it])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_passed_through_gradient_follows_the_producers_input(backend):
    rows = _rows(_pass_through_trace(), backend)
    gs = rows[4][8]  # mirror 2: gs follows s, accessed at 1 (its producer), one operator back
    assert gs[C["mirror"]] == 1 and gs[C["mirror_linked"]] == 1 and gs[C["mirror_final"]] == 1
    assert gs[C["log_mirror_span"]] == np.float32(np.log1p(1.0) / 8.0)
    # mirror 1: s has no access below it any more; gs now follows index_add's first input of its size
    # (a, not the index i, which is smaller), whose producer f sits one operator back
    gs = rows[5][8]
    assert gs[C["mirror"]] == 1 and gs[C["mirror_linked"]] == 1 and gs[C["mirror_final"]] == 1
    assert gs[C["log_mirror_span"]] == np.float32(np.log1p(1.0) / 8.0)
    # src's gradient ties a (64 bytes, first): the same rule, so it is linked too
    assert rows[5][9][C["mirror"]] == 1
    assert not rows[6][8][MIRROR_COLS].any()  # mirror 0: nothing of forward lies below
