"""The pilot's native inference kernel (dynn_runtime/pilot/kernel/) against the numpy reference.

Feature rows and context rows must be equal bit for bit at every decision point of real zoo traces
(full and subset rows, forward and backward, pending external storages); probabilities agree to
float32 rounding; a simulated run takes the same decisions. Without a C compiler these tests skip,
except the fallback tests, which need none.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from pilot_lab import LabPilot

from dynn_runtime.errors import PilotError
from dynn_runtime.pilot import PilotModel
from dynn_runtime.pilot import kernel as native
from dynn_runtime.pilot.features import CAND_FEATURES, N_FINE, FeatureState
from dynn_runtime.pilot.model import _log_bucket_reps
from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.sim import Simulator, simulate, unmanaged_peak
from dynn_runtime.trace.format import Op

C = {n: i for i, n in enumerate(CAND_FEATURES)}
FAMILIES = ("tree_lstm", "skipnet", "varlen")  # tiny recordings: a second or so each


@pytest.fixture(scope="module")
def kernel():
    k = native.kernel()
    if k is None:
        pytest.skip(f"native pilot kernel unavailable here: {native.reason()}")
    return k


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from dynn_runtime.trace import read_trace, record

    d = tmp_path_factory.mktemp("pilot-native")
    out = {}
    for fam in FAMILIES:
        path = d / f"{fam}.jsonl.gz"
        record(fam, path, steps=2, preset="tiny", seed=5)
        out[fam] = read_trace(path)
    return out


@pytest.fixture(scope="module")
def model():
    return PilotModel.init(rng=np.random.default_rng(7))


@pytest.fixture()
def fresh_native(monkeypatch):
    """Environment changes are seen by the kernel loader (which compiles at run time: the kernel
    built at install is not used); the module's state is restored after."""
    native.reset()
    monkeypatch.setenv("DYNN_PILOT_INSTALLED", "0")
    yield monkeypatch
    monkeypatch.undo()
    native.reset()


def _assert_same(a, b, where):
    for name, x, y in zip(("sids", "X", "ctx"), a, b):
        assert x.dtype == y.dtype and x.shape == y.shape, (where, name)
        if not np.array_equal(x, y):
            bad = np.argwhere(x != y)[:5]
            cols = [CAND_FEATURES[c[-1]] for c in bad] if name == "X" else bad.tolist()
            raise AssertionError(f"{where}: {name} differs at {bad.tolist()} ({cols})")


def test_feature_rows_equal_numpy_on_zoo_traces(kernel, traces, model):
    seen = {"points": 0, "rows": 0, "backward": 0, "stack": 0, "ext_by_order": 0, "history": 0}
    where = [""]

    class Check(LabPilot):
        def on_op(self, position, op):
            super().on_op(position, op)
            if self._last_decision != position:
                return
            st = self._state
            live = st.active_slots()
            if not len(live):
                return
            rng = np.random.default_rng(position)
            subsets = [None, live, live[::-1], live[rng.random(len(live)) < 0.3], live[:1],
                       np.resize(live, 2 * len(live) + 1)]  # repeated rows, as decision_cost_curve asks
            for idx in subsets:
                ref = st.features_numpy(idx)
                got = kernel.features(st, idx)
                _assert_same(ref, got, f"{where[0]} position {position} idx {None if idx is None else len(idx)}")
            _, X, ctx = ref
            seen["points"] += 1
            seen["rows"] += len(X)
            seen["backward"] += st.phase == 1
            seen["stack"] += int(X[:, C["on_stack"]].sum() > 0)
            seen["ext_by_order"] += int(X[:, C["ext_by_order"]].sum() > 0)
            seen["history"] += st.expected_length() > 0

    for fam, tr in traces.items():
        where[0] = fam
        pol = Check(model=model, backend="numpy", incremental=False, group=8)
        Simulator(tr, pol, int(unmanaged_peak(tr) * 0.25)).run()
    assert seen["points"] > 100 and seen["rows"] > 5000
    assert seen["backward"] > 10 and seen["stack"] > 10 and seen["history"] > 50
    assert seen["ext_by_order"] > 0, "no pending external storage matched ahead of time"


_STATE_ARRAYS = ("active", "sid", "kind", "saved", "persistent", "log_bytes", "born", "born_phase", "last",
                 "last_phase", "count", "count_phase", "count_phase_of", "acc_phase", "producer_iv", "has_producer",
                 "consumer_iv", "stack_idx", "stack_pos", "announce", "prev", "_hist")


def test_per_operator_update_equals_python_at_every_operator(kernel, traces, model):
    # FeatureState.op's native path (dynn_pilot_op) against the Python one, fed the same notifications:
    # every array, the stack's scalars and the replayed next uses equal after every operator
    seen = {"ops": 0, "replayed": 0, "popped": 0, "matched": 0}
    where = [""]

    class Shadow(PilotPolicy):
        def attach(self, view):
            super().attach(view)
            self.ref = FeatureState(view, group=self._state.group, backend="numpy")

        def begin_iteration(self, index, context):
            super().begin_iteration(index, context)
            self.ref.begin_iteration(index, context.history)

        def on_alloc(self, sid, position):
            super().on_alloc(sid, position)
            self.ref.alloc(sid, position)

        def on_free(self, sid):
            super().on_free(sid)
            self.ref.free(sid)

        def on_op(self, position, op):
            ext = self._state._ext_next
            super().on_op(position, op)
            tick = self.ref.op(position, op)
            a, b = self._state, self.ref
            at = f"{where[0]} operator {position}"
            assert tick == (a._last_decision == position), at
            for name in _STATE_ARRAYS:
                x, y = getattr(a, name), getattr(b, name)
                assert np.array_equal(x, y), f"{at}: {name} differs at {np.argwhere(x != y)[:5].tolist()}"
            assert a.replayed == b.replayed, at
            assert (a._frontier, a._stack_counter, a._anchor, a._ext_next, a._hist_allocs) == \
                   (b._frontier, b._stack_counter, b._anchor, b._ext_next, b._hist_allocs), at
            seen["ops"] += 1
            seen["replayed"] += len(a.replayed)
            seen["popped"] += a.phase == 1 and a._frontier >= 0
            seen["matched"] += a._ext_next > ext

    for fam, tr in traces.items():
        where[0] = fam
        pol = Shadow(model=model, backend="native")
        Simulator(tr, pol, int(unmanaged_peak(tr) * 0.25)).run()
        assert pol._state._kernel is not None
    assert seen["ops"] > 1000 and seen["replayed"] > 1000 and seen["popped"] > 100 and seen["matched"] > 0


class _View:
    def __init__(self, kinds):
        self.kinds = kinds

    def nbytes(self, sid):
        return 4096

    def kind(self, sid):
        return self.kinds[sid][0]

    def saved(self, sid):
        return self.kinds[sid][1]


def _op(name, phase, ins=(), allocs=()):
    return Op(name=name, idiom=(1, 0, 0, 2, 0, 1), phase=phase, module="m", inputs=tuple(ins),
              outputs=tuple(allocs), writes=(), allocs=tuple(allocs), duration_s=0.0, flops=0, nbytes=0)


def _iteration(st, index, history, batch, param, n_ops, first_use, keep_every=1, probe=None):
    """Operators 0..n_ops-1 of one forward: the batch storages alive at the start (announced in
    order; batch[i] first read at first_use[i]), a parameter read by every operator, one saved
    activation produced per operator (only every keep_every-th stays alive). ``probe(position)``
    after each operator."""
    from dynn_runtime.trace.format import Iteration

    it = Iteration(index=index)
    st.begin_iteration(index, history)
    for sid in batch:
        st.alloc(sid, -1)
    acts = []
    for j in range(n_ops):
        a = 100_000 * (index + 1) + j
        st.alloc(a, j)
        ins = [param] + [b for b, u in zip(batch, first_use) if u == j]
        op = _op(f"f{j % 5}", "forward", ins=ins, allocs=(a,))
        it.ops.append(op)
        st.op(j, op)
        if j % keep_every:
            st.free(a)
        else:
            acts.append(a)
        if probe is not None:
            probe(j)
    return it, acts


class _Kinds(dict):
    def __missing__(self, sid):
        return ("activation", True) if sid >= 100_000 else ("input", False)


def test_pending_externals_and_long_iterations(kernel):
    """Rule 6 ahead of time (ext_by_order), and an iteration that outgrows the kernel's tables."""
    kinds = _Kinds({7: ("param", False)})
    st = FeatureState(_View(kinds), group=16, backend="native")
    st.alloc(7, -1)
    it0, acts = _iteration(st, 0, [], [10, 11, 12], 7, 40, [3, 1, 5])
    for sid in (10, 11, 12, *acts):
        st.free(sid)
    # iteration 1: new batch storages not read yet: each gets the counterpart of the batch storage
    # announced in the same rank (the previous iteration's externals in first-access order: 11, 10, 12)
    it1, acts = _iteration(st, 1, [it0], [20, 21, 22], 7, 30, [35, 39, 38])
    ref = st.features_numpy()
    _assert_same(ref, st.features(), "pending")
    assert ref[1][:, C["ext_by_order"]].sum() == 3
    live = st.active_slots()
    for idx in (live[::2], live[-3:], live[::-1]):
        _assert_same(st.features_numpy(idx), st.features(idx), "pending subset")
    for sid in (20, 21, 22, *acts):
        st.free(sid)
    # iteration 2 runs past the tables sized when it was first asked for features (4096 entries)
    checked = []

    def probe(j):
        if j in (10, 2000, 4500, 6999):
            _assert_same(st.features_numpy(), st.features(), f"long iteration at {j}")
            checked.append(st._native_tab.ntab)

    _, acts = _iteration(st, 2, [it0, it1], [30, 31], 7, 7000, [100, 6500], keep_every=500, probe=probe)
    st.op(7000, _op("b0", "backward", ins=(acts[4],)))
    ref = st.features_numpy()
    _assert_same(ref, st.features(), "backward")
    assert ref[1][:, C["on_stack"]].sum() > 5
    assert checked[0] == 4096 and checked[-1] >= 8192


def test_scores_agree_with_numpy(kernel, traces, model):
    from dynn_runtime.pilot.policy import default_weights_path

    models = [model]
    try:
        models.append(PilotPolicy(weights=default_weights_path()).model)
    except Exception:  # weights being retrained for another feature set
        pass
    n = 0
    class Grab(LabPilot):
        def on_op(self, position, op):
            super().on_op(position, op)
            if self._last_decision == position and len(self._state.active_slots()):
                self.got.append((self._state.features(), self._state.expected_length()))

    for fam, tr in traces.items():
        grab = Grab(model=model, incremental=False)
        grab.got = []
        simulate(tr, grab, 0.25)
        for m in models:
            for (_, X, ctx), n_exp in grab.got:
                P0, e0, k0 = m.score(X, ctx, n_exp, 0.1, backend="numpy")
                P1, e1, k1 = m.score(X, ctx, n_exp, 0.1, backend="native")
                assert P1.dtype == np.float32 and e1.dtype == np.float64
                np.testing.assert_allclose(P1, P0, rtol=1e-4, atol=1e-5)  # exp differs by libm vs numpy SIMD
                np.testing.assert_allclose(e1, e0, rtol=0, atol=1e-4)
                # identical unless numpy's own margin is below float32 rounding
                a0, a1 = P0.argmax(axis=1), P1.argmax(axis=1)
                top = np.sort(P0, axis=1)
                assert np.all((a0 == a1) | (top[:, -1] - top[:, -2] < 1e-5)), fam
                cs = np.cumsum(P0, axis=1)
                near = np.abs(cs - np.float32(0.1)).min(axis=1) < 1e-5
                assert np.all((k0 == k1) | near), fam
                assert np.array_equal(e0, m.expected_log_distance(P0, n_exp))
                n += len(X)
    assert n > 2000


def test_kernel_clamps_inputs_like_numpy(kernel, traces, model):
    """Rows and context beyond the training range: the kernel clamps them as PilotModel.logits does."""
    from dynn_runtime.pilot.training.data import walk

    d = next(d for d in walk(next(iter(traces.values())), 1, group=model.config.group) if len(d.sids) > 8)
    model = model.copy()  # with a range, as fit() records it: these rows' own
    a = model.arrays
    a["lo"], a["hi"] = d.X.min(axis=0), d.X.max(axis=0)
    a["lo_ctx"], a["hi_ctx"] = d.ctx - 0.5, d.ctx + 0.5
    lo, hi, lo_ctx, hi_ctx = model.bounds()
    X, ctx = d.X.copy(), d.ctx.copy()
    X[:, ::3] = hi[::3] + 40.0
    X[:, 1::3] = lo[1::3] - 40.0
    ctx[::2] = hi_ctx[::2] + 40.0
    P0, e0, _ = model.score(X, ctx, d.expected_len, 0.1, backend="numpy")
    P1, e1, _ = model.score(X, ctx, d.expected_len, 0.1, backend="native")
    np.testing.assert_allclose(P1, P0, rtol=1e-4, atol=1e-5)  # exp differs by libm vs numpy SIMD
    Pc, _, _ = model.score(np.clip(X, lo, hi), np.clip(ctx, lo_ctx, hi_ctx), d.expected_len, 0.1, backend="native")
    np.testing.assert_array_equal(P1, Pc)
    assert not np.allclose(P1, model.score(d.X, d.ctx, d.expected_len, 0.1, backend="native")[0])


def test_simulated_runs_match_numpy(kernel, traces):
    try:
        PilotPolicy().model  # noqa: B018 (loads the shipped weights)
    except Exception as exc:
        pytest.skip(f"shipped weights unusable here: {exc}")
    for fam, tr in traces.items():
        for budget in (0.5, 0.25):
            runs = {}
            for backend in ("numpy", "native"):
                pol = PilotPolicy(backend=backend)
                res = simulate(tr, pol, budget)
                assert pol.backend == backend
                runs[backend] = (res, pol)
            (r0, p0), (r1, p1) = runs["numpy"], runs["native"]
            assert r0.feasible == r1.feasible, fam
            if r0.feasible:
                assert r1.iter_time_s == pytest.approx(r0.iter_time_s, rel=1e-6), (fam, budget)
            assert (p1.decisions, p1.candidates, p1.live_total) == (p0.decisions, p0.candidates, p0.live_total)


def test_explicit_rows_and_cost_report(kernel, traces, model):
    """decision_cost_curve scores given rows (repeated slots included) through the same kernel, and
    the cost records say which backend ran."""
    from dynn_runtime.pilot.training.cost import decision_cost_curve, fit_decision_cost, inference_cost

    tr = traces["varlen"]
    curves = {b: decision_cost_curve(tr, model=model, sizes=(8, 64), repeats=2, backend=b) for b in ("numpy", "native")}
    for b, c in curves.items():
        assert c["backend"] == b and all(p["backend"] == b for p in c["points"])
    rows = [inference_cost(tr, model=model, budget=0.5, repeats=1, backend=b) for b in ("native", "numpy")]
    assert [r["backend"] for r in rows] == ["native", "numpy"]
    assert rows[0]["decisions"] == rows[1]["decisions"] and rows[0]["candidates_mean"] == rows[1]["candidates_mean"]
    with pytest.raises(ValueError, match="mix backends"):
        fit_decision_cost(rows)
    a, b = fit_decision_cost(curves["native"]["points"] + curves["numpy"]["points"], backend="native")
    assert np.isfinite(a) and np.isfinite(b)


def test_online_refit_uses_the_unfused_path(kernel, traces, model):
    tr = traces["varlen"]
    res = {b: simulate(tr, PilotPolicy(model=model.copy(), online=True, refit_every=1, backend=b), 0.5)
           for b in ("numpy", "native")}
    assert res["native"].iter_time_s == pytest.approx(res["numpy"].iter_time_s, rel=1e-6)


def test_a_model_the_kernel_does_not_take_runs_on_numpy(kernel, traces):
    from dynn_runtime.errors import PolicyError
    from dynn_runtime.pilot import PilotConfig

    wide = PilotModel.init(PilotConfig(hidden=320), rng=np.random.default_rng(1))
    assert not kernel.supports(wide)
    pol = PilotPolicy(model=wide)
    assert simulate(traces["varlen"], pol, 0.5).feasible and pol.backend == "numpy"
    with pytest.raises(PolicyError, match="shape"):
        simulate(traces["varlen"], PilotPolicy(model=wide, backend="native"), 0.5)
    X = np.zeros((3, len(CAND_FEATURES)), np.float32)
    ctx = np.zeros(wide.arrays["W1x"].shape[0], np.float32)
    assert wide.score(X, ctx, 100)[0].shape == (3, N_FINE)  # auto: numpy
    with pytest.raises(PilotError, match="shape"):
        wide.score(X, ctx, 100, backend="native")


def test_the_kernel_built_at_install_is_used_only_for_its_own_source(kernel, fresh_native, tmp_path):
    fresh_native.delenv("DYNN_PILOT_INSTALLED")
    if native._installed() is None:
        pytest.skip("the package was installed without building the pilot's kernel")
    assert native.available() and "built at install" in native.reason()
    assert len(native.SOURCES) > 1
    for i, unit in enumerate(native.SOURCES):  # any unit edited since install
        (tmp_path / unit.name).write_bytes(unit.read_bytes() + b"\n")
        edited = (*native.SOURCES[:i], tmp_path / unit.name, *native.SOURCES[i + 1:])
        with fresh_native.context() as m:
            m.setattr(native, "SOURCES", edited)
            assert native._installed() is None, unit.name
    (tmp_path / "internal.h").write_bytes(native.INTERNAL_HEADER.read_bytes() + b"\n")
    fresh_native.setattr(native, "INTERNAL_HEADER", tmp_path / "internal.h")
    assert native._installed() is None


def test_the_install_stamp_hashes_every_unit_as_cmake_does():
    """CMakeLists.txt compiles and hashes the units the loader compiles and hashes, in the same order."""
    import re

    cmake = (Path(__file__).parents[2] / "CMakeLists.txt").read_text()
    units = re.search(r"set\(DYNN_KERNEL_SOURCES ([^)]*)\)", cmake).group(1).split()
    files = re.search(r"set\(DYNN_KERNEL_FILES ([^)]*)\)", cmake).group(1).split()
    assert units == [p.name for p in native.SOURCES]
    assert files == ["${DYNN_KERNEL_SOURCES}", native.INTERNAL_HEADER.name, native.HEADER.name]


def test_compiled_once_per_cache_key(kernel, fresh_native, tmp_path):
    fresh_native.setenv("DYNN_CACHE_DIR", str(tmp_path))
    assert native.available(), native.reason()
    built = sorted(tmp_path.glob("pilot_native-*.so"))
    assert len(built) == 1 and str(built[0]) in native.reason()
    assert not list(tmp_path.glob("*.tmp"))
    stamp = built[0].stat().st_mtime_ns
    native.reset()
    assert native.available() and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@pytest.mark.skipif(os.name != "posix", reason="the stand-in compiler is a shell script")
def test_compiler_refusing_march_native_and_a_broken_cache(kernel, fresh_native, tmp_path):
    """A compiler that refuses -march=native gets the portable flags (and is not asked again); a
    cached library that does not load is rebuilt."""
    import shlex
    import shutil

    real = shutil.which("cc") or shutil.which("gcc")
    if real is None:
        pytest.skip("no cc on PATH")
    log = tmp_path / "calls.log"
    cc = tmp_path / "picky-cc"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n'
                  'for a in "$@"; do if [ "$a" = "-march=native" ]; then echo "picky-cc: no -march" >&2; exit 1; fi; done\n'
                  f'exec {shlex.quote(real)} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    fresh_native.setenv("CC", str(cc))
    fresh_native.setenv("DYNN_CACHE_DIR", str(tmp_path / "cache"))
    assert native.available(), native.reason()
    assert "-march=native" not in native.reason()
    assert len(list((tmp_path / "cache").glob("*.failed"))) == 1
    compiles = [ln for ln in log.read_text().splitlines() if "-o" in ln.split()]
    assert len(compiles) == 2
    native.reset()
    assert native.available()
    assert [ln for ln in log.read_text().splitlines() if "-o" in ln.split()] == compiles  # nothing rebuilt
    # a cache holding a file of the library's name that is no library (a library this process has
    # loaded must not be overwritten: its pages are mapped)
    (lib,) = (tmp_path / "cache").glob("*.so")
    (marker,) = (tmp_path / "cache").glob("*.failed")
    other = tmp_path / "cache2"
    other.mkdir()
    (other / lib.name).write_bytes(b"not a library")
    (other / marker.name).write_text(marker.read_text())
    fresh_native.setenv("DYNN_CACHE_DIR", str(other))
    native.reset()
    assert native.available(), native.reason()
    assert str(other / lib.name) in native.reason()
    assert len([ln for ln in log.read_text().splitlines() if "-o" in ln.split()]) == 3


# ---- fallback: no C compiler needed -------------------------------------------------------------

@pytest.mark.parametrize("how", ["env", "missing", "failing"])
def test_fallback_to_numpy(fresh_native, tmp_path, traces, model, how):
    fresh_native.setenv("DYNN_CACHE_DIR", str(tmp_path / "cache"))
    fresh_native.delenv("DYNN_PILOT_NATIVE", raising=False)  # each case sets its own cause
    if how == "env":
        fresh_native.setenv("DYNN_PILOT_NATIVE", "0")
        expect = "DYNN_PILOT_NATIVE=0"
    elif how == "missing":
        fresh_native.setenv("CC", str(tmp_path / "nonexistent-cc"))
        expect = "no usable C compiler"
    else:
        if os.name != "posix":
            pytest.skip("the stand-in compiler is a shell script")
        cc = tmp_path / "broken-cc"
        cc.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo broken-cc 1.0; exit 0; fi\n'
                      'echo "broken-cc: cannot compile" >&2\nexit 1\n')
        cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
        fresh_native.setenv("CC", str(cc))
        expect = "cannot compile"
    assert not native.available()
    assert expect in native.reason()
    assert native.resolve(None) == "numpy"
    with pytest.raises(PilotError, match="not available"):
        native.resolve("native")
    with pytest.raises(PilotError):
        PilotPolicy(model=model, backend="native").attach(_View({}))
    pol = PilotPolicy(model=model)
    res = simulate(traces["varlen"], pol, 0.5)
    assert res.feasible and pol.backend == "numpy" and pol.decisions > 0
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.so"))


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend"):
        native.resolve("cuda")


def test_log_bucket_reps_pointer_is_stable():
    # the policy hands the kernel the address of this cached array once per iteration
    assert _log_bucket_reps(123) is _log_bucket_reps(123)


def test_the_policy_tables_addresses_follow_the_arrays_given():
    import pickle

    from dynn_runtime.pilot.kernel.tables import PolicyTable

    pt = PolicyTable(np.zeros(3), 0.5, 1.0)
    a, b = np.zeros(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    assert pt.address_of("skip", a) == a.ctypes.data == pt.address_of("skip", a)
    assert pt.address_of("skip", b) == b.ctypes.data != a.ctypes.data  # a grown array: its own address
    assert pt.address_of("away", a) == a.ctypes.data
    assert (pt.score_addr, pt.sids_addr) == (pt.score_out.ctypes.data, pt.sids_out.ctypes.data)
    pt.grow(512)
    assert (pt.score_addr, pt.sids_addr) == (pt.score_out.ctypes.data, pt.sids_out.ctypes.data)
    clone = pickle.loads(pickle.dumps(pt))  # addresses do not survive pickling: none is carried over
    assert clone._addrs == {} and clone.score_addr == clone.score_out.ctypes.data


def test_rows_out_of_range_raise(kernel):
    st = FeatureState(_View(_Kinds({7: ("param", False)})), backend="native")
    st.alloc(7, -1)
    st.op(0, _op("f", "forward", ins=(7,)))
    assert st.features(np.array([st.slot_of(7)]))[0].tolist() == [7]
    with pytest.raises(IndexError):
        st.features(np.array([st._cap]))


def _heapq_reference_pop(items, st):
    """heapq's pop with NextUsePolicy's staleness (a freed storage, or a key that is not its current
    prediction; NaN: undecided, returned), for comparison with NativeHeap.pop."""
    import heapq

    while items:
        key, sid = heapq.heappop(items)
        s = st.slot_of(sid)
        if s is None:
            continue
        v = float(st.pred[s])
        if v == v and key != -v:
            continue
        return key, sid
    return None


def test_native_eviction_heap_pops_what_heapq_pops(kernel):
    """NativeHeap (PilotPolicy's eviction heap in C) pops the same (key, sid) sequence as heapq over
    the same pushes, skipping the same stale entries (freed, reused slot, repredicted), with ties on
    the key broken by sid; staged pushes count in len; compaction keeps one valid entry per storage;
    the heap survives pickling."""
    import heapq
    import pickle

    rng = np.random.default_rng(3)
    kinds = _Kinds()
    st = FeatureState(_View(kinds), group=16, backend="native")
    for sid in range(40):
        st.alloc(100_000 + sid, 0)
    live = [100_000 + i for i in range(40)]
    heap, ref = kernel.new_heap(), []
    next_sid = 100_040
    popped = 0
    for step in range(3000):
        r = rng.random()
        if r < 0.45 and live:  # a new prediction for a live storage (ties on purpose: few distinct keys)
            sid = live[rng.integers(len(live))]
            v = float(rng.integers(0, 12)) if rng.random() < 0.9 else float("inf")
            s = st.slot_of(sid)
            st.pred[s] = v
            heap.push(-v, sid, s)
            heapq.heappush(ref, (-v, sid))
        elif r < 0.5 and live:  # freed; its slot is reused by the next allocation
            sid = live.pop(rng.integers(len(live)))
            st.free(sid)
        elif r < 0.55:
            st.alloc(next_sid, 0)
            st.pred[st.slot_of(next_sid)] = np.nan  # undecided: Python's call, so returned
            live.append(next_sid)
            heap.push(-1.0, next_sid, st.slot_of(next_sid))
            heapq.heappush(ref, (-1.0, next_sid))
            next_sid += 1
        elif r < 0.97:
            got = heap.pop(kernel.table(st).addr)
            want = _heapq_reference_pop(ref, st)
            assert (None if got is None else got[:2]) == want, step
            if got is not None:
                assert got[2] == st.slot_of(got[1])
                popped += 1
        else:
            heap.compact(kernel.table(st).addr, len(st.pred))
            # PilotPolicy._compact's rule: the entries that match their storage's prediction, once each
            want = {(k, s) for k, s in ref if st.slot_of(s) is not None and k == -st.pred[st.slot_of(s)]}
            got = [(k, s) for k, s, _ in heap.entries()]
            assert len(got) == len(set(got)) and set(got) == want, step
            ref = sorted(want)
    assert popped > 500
    clone = pickle.loads(pickle.dumps(heap))
    assert len(clone) == len(heap) and sorted(clone.entries()) == sorted(heap.entries())


def test_the_checked_in_header_is_what_the_feature_table_generates():
    """pilot_kernel.h is generated from the one feature table (layout.py) and the ABI table (abi.py):
    a feature added there and not regenerated fails here."""
    from dynn_runtime.pilot import layout
    from dynn_runtime.pilot.kernel import abi

    assert abi.write_header(check=True), "run `python -m dynn_runtime.pilot.kernel.abi`"
    text = abi.HEADER.read_text()
    assert f"#define NF {len(layout.CAND_FEATURES)}" in text and f"#define NC {len(layout.CTX_FEATURES)}" in text
    col = 0
    for group, cols in layout.CAND_TABLE:
        assert f"    F_{group.upper()} = {col}," in text
        col += len(cols)
    assert f"#define STATE_WORDS {abi.STATE.words}" in text


def test_a_header_edited_since_install_is_not_the_installed_kernel(kernel, fresh_native, tmp_path):
    fresh_native.delenv("DYNN_PILOT_INSTALLED")
    if native._installed() is None:
        pytest.skip("the package was installed without building the pilot's kernel")
    (tmp_path / "pilot_kernel.h").write_bytes(native.HEADER.read_bytes() + b"\n")
    fresh_native.setattr(native, "HEADER", tmp_path / "pilot_kernel.h")
    assert native._installed() is None


def test_the_ctypes_structures_match_the_abi_table():
    import ctypes

    from dynn_runtime.pilot.kernel import abi

    for s in abi.STRUCTS:
        assert ctypes.sizeof(s.ctypes()) == 8 * s.words
