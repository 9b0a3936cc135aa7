"""An operator that runs out of device memory inside a step is retried once, after the manager made
room (runtime/oom.py; events.cpp, invariant 11), on both event sources.

There is no out-of-memory error on the CPU, so the tests inject one. ``dynn_oom_py`` below is an
operator registered in Python whose next calls raise ``torch.OutOfMemoryError`` (the Python source
sees that as the caching allocator's error; on the native source a Python kernel's exception is a
Python error, not ``c10::OutOfMemoryError``). The extension's ``dynn_test`` operators throw
``c10::OutOfMemoryError`` from C++ (``_C.arm_test_oom``): ``oom`` reaches the native observer's boxed
fallback, ``oom_unboxed`` an unboxed kernel of the observer's, ``oom_`` writes in place. Each ``oom``
result depends on all of its arguments, so a retry that lost one computes other numbers. The
``oom_random`` operators (and ``dynn_oom_py::oom_random``) draw from their generator first and then
run out: a retry draws the numbers of PyTorch alone only where the generator's state was restored.
The manager's own allocations (fetches, prefetches, the end of a step) run out through
the ``failing_allocations`` fixture (conftest.py).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from dynn_runtime.errors import BudgetError, where_raised
from dynn_runtime.policies.base import Action
from dynn_runtime.policies.basic import LRUPolicy
from dynn_runtime.runtime.events import native_module, no_mode
from dynn_runtime.runtime.manager import MemoryManager
from dynn_runtime.runtime.oom import RANDOM_BY_NAME, UNDECLARED_WRITES, cap_shortfall, oom_request
from dynn_runtime.runtime.steps import Steps

_native = native_module()

_PY_ARMED = [0]
_PY_LIB = torch.library.Library("dynn_oom_py", "DEF")
_PY_LIB.define("oom(Tensor x, Tensor? y=None, int[] dims=[]) -> Tensor")
_PY_LIB.define("oom_(Tensor(a!) x) -> Tensor(a!)")
_PY_LIB.define("oom_random(Tensor x, float p, *, Generator? generator=None) -> Tensor")


def _py_check(name: str) -> None:
    if _PY_ARMED[0] > 0:
        _PY_ARMED[0] -= 1
        raise torch.OutOfMemoryError(f"dynn_oom_py::{name}: out of memory (injected). Tried to allocate 1.00 MiB.")


def _py_oom(x, y=None, dims=()):
    _py_check("oom")
    r = x * 2 if y is None else x + y
    return r.sum(list(dims)) if dims else r


def _py_oom_(x):
    _py_check("oom_")
    return x.mul_(2)


def _py_oom_random(x, p, generator=None):
    keep = torch.empty_like(x).bernoulli_(1 - p, generator=generator)  # draws, then runs out
    _py_check("oom_random")
    return x * keep / (1 - p)


_PY_LIB.impl("oom", _py_oom, "CPU")
_PY_LIB.impl("oom_", _py_oom_, "CPU")
_PY_LIB.impl("oom_random", _py_oom_random, "CPU")


def _py_arm(n: int) -> None:
    _PY_ARMED[0] = n


# (event source, operator family): the Python-registered operators on the Python source only
CASES = [("python", "py")]
if _native is not None:
    _native.arm_test_oom(0)  # registers the dynn_test operators
    CASES += [("python", "boxed"), ("python", "unboxed"), ("native", "boxed"), ("native", "unboxed")]


def _ops(family: str):
    """(the out-of-place operator, the in-place one, arm(n): its next n calls run out of memory)."""
    if family == "py":
        return torch.ops.dynn_oom_py.oom, torch.ops.dynn_oom_py.oom_, _py_arm
    op = torch.ops.dynn_test.oom if family == "boxed" else torch.ops.dynn_test.oom_unboxed
    return op, torch.ops.dynn_test.oom_, _native.arm_test_oom


@pytest.fixture(autouse=True)
def _disarm():
    yield
    _py_arm(0)
    if _native is not None:
        _native.arm_test_oom(0)


def _mm(events: str, model: nn.Module, opt, **kw) -> MemoryManager:
    mm = MemoryManager(64 << 20, policy="lru", device="cpu", events=events, **kw).attach(model, opt)
    assert mm.event_source == events
    return mm


def _train(events: str | None, family: str, ooms: dict[int, int], steps: int = 3):
    """``steps`` steps of a small MLP whose loss adds the ``oom`` operator's result on its activations,
    armed to run out ``ooms[step]`` times in that step; under a manager (a budget far above the peak,
    so that nothing moves unless room is made) when ``events`` is given. Returns the losses, the
    operator's results, the final parameters, and the manager's stats and per-step operator names."""
    op, _, arm = _ops(family)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = _mm(events, model, opt, record_every_op=True, history=steps) if events else None
    losses, outs = [], []
    try:
        for step in range(steps):
            x, y = torch.randn(64, 256), torch.randn(64, 256)
            with mm.step() if mm is not None else contextlib.nullcontext():
                h = model(x)
                arm(ooms.get(step, 0))
                z = op(h.detach(), y, [1])
                loss = h.square().mean() + z.mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            outs.append(z.clone())
        stats = mm.stats() if mm is not None else None
        names = [[o.name for o in it.ops] for it in mm.history] if mm is not None else None
    finally:
        if mm is not None:
            mm.detach()
    return losses, outs, [p.detach().clone() for p in model.parameters()], stats, names


_BASE: dict = {}


def _base(family: str):
    if family not in _BASE:
        _BASE[family] = _train(None, family, {})
    return _BASE[family]


@pytest.mark.parametrize("events,family", CASES)
def test_an_oom_is_retried_once_after_room_is_made_and_gives_the_same_bits(events, family):
    want_losses, want_outs, want_params, _, _ = _base(family)
    losses, outs, params, stats, names = _train(events, family, {1: 1})
    per = stats["per_step"]
    assert [s["oom_retries"] for s in per] == [0, 1, 0] and stats["oom_retries"] == 1
    assert per[0]["evictions"] == 0, "the budget is far above the peak: nothing moves unless room is made"
    assert per[1]["evictions"] > 0 and per[1]["bytes_offloaded"] >= 1 << 20, "room for the failed request"
    for step in names:  # the retried operator is seen and logged once, as if it had run once
        assert sum(n.endswith("::oom") or n.endswith("::oom_unboxed") for n in step) == 1
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))


@pytest.mark.parametrize("events,family", CASES)
def test_a_second_oom_is_a_budget_error_saying_what_to_do(events, family):
    op, _, arm = _ops(family)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _mm(events, model, opt) as mm:
        with pytest.raises(BudgetError) as info, mm.step():
            h = model(torch.randn(64, 256))
            arm(2)
            op(h.detach(), None, [])
        msg = str(info.value)
        assert "::oom" in msg and "ran out of device memory" in msg and "again when retried" in msg
        assert "expandable_segments:True" in msg and "lower the budget" in msg
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        assert mm.steps[-1].oom_retries == 1 and mm.steps[-1].evictions > 0
        with mm.step():  # the manager is between steps and usable
            model(torch.randn(64, 256)).sum().backward()
        assert mm.steps[-1].oom_retries == 0


@pytest.mark.parametrize("events,family", CASES)
def test_an_in_place_oom_is_not_retried(events, family):
    _, op_, arm = _ops(family)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    with _mm(events, model, None) as mm:
        with mm.step():
            t = model(torch.randn(64, 256)).detach()
            want = t.clone()
            arm(1)
            with pytest.raises(torch.OutOfMemoryError):
                op_(t)
            assert torch.equal(t, want), "the failed call computed nothing"
            op_(t)  # the next call runs: the one OOM was taken by the first, and not retried
            assert torch.equal(t, want * 2)
        assert mm.steps[-1].oom_retries == 0 and mm.steps[-1].evictions == 0


@pytest.mark.parametrize("events,family", CASES)
def test_a_failing_room_maker_lets_the_oom_propagate(events, family, monkeypatch):
    """The handler's error is not thrown through the operator (native) and the operator is not
    retried: the OOM propagates, and the handler's error comes with it."""
    op, _, arm = _ops(family)

    def fail(self, *a):
        raise RuntimeError("boom while making room")

    monkeypatch.setattr(MemoryManager, "_room_after_oom", fail)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    with _mm(events, model, None) as mm:
        with pytest.raises(RuntimeError, match="boom while making room") as info, mm.step():
            h = model(torch.randn(64, 256))
            arm(1)
            op(h.detach(), None, [])
        # a retry would have succeeded (one OOM armed): the operator's own OOM is what propagated
        err = info.value
        assert isinstance(err.__context__, torch.OutOfMemoryError) or isinstance(err.__cause__, torch.OutOfMemoryError)


def test_the_request_is_read_from_the_allocators_message():
    msg = ("CUDA out of memory. Tried to allocate 16.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which "
           "129.83 MiB is allowed; 104.74 MiB allocated by PyTorch, 15.26 MiB reserved but unallocated.")
    assert oom_request(msg) == 16 << 20
    assert oom_request("Tried to allocate 512 bytes.") == 512
    assert oom_request("Tried to allocate 1.50 GiB.") == 3 << 29
    assert oom_request("out of memory") is None


@pytest.mark.parametrize("events", [e for e in ("python", "native") if e == "python" or _native is not None])
def test_a_demand_fetch_that_runs_out_is_retried_after_room_is_made(events, failing_allocations):
    left = failing_allocations
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    with _mm(events, model, None) as mm:
        with mm.step():
            h = model(torch.randn(64, 256))
            want = h.detach().clone()
            assert mm.offload(h) > 0
            left[0] = 1
            got = h.detach() + 0.0  # brings h back: its allocation runs out once
            assert left[0] == 0 and torch.equal(got, want)
        st = mm.steps[-1]
        assert st.oom_retries == 1 and st.evictions >= 2, "the offload, and room for the failed request"


@pytest.mark.parametrize("events", [e for e in ("python", "native") if e == "python" or _native is not None])
def test_a_demand_fetch_that_runs_out_twice_is_a_budget_error(events, failing_allocations):
    """On the native source the fetch runs in the fault handler, whose error is kept: the operator
    then raises instead of reading the empty storage (events.cpp, invariant 12), and the step ends
    with the kept error, said as the retry's BudgetError."""
    left = failing_allocations
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    with _mm(events, model, None) as mm:
        with pytest.raises(BudgetError, match=r"\(fetching a 64.0 KiB \w+ back\) ran out of device memory") as info, mm.step():
            h = model(torch.randn(64, 256))
            assert mm.offload(h) > 0
            left[0] = 2
            h.detach() + 0.0
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        assert mm.steps[-1].oom_retries == 1
        if events == "native":
            assert "did not run" in str(info.value.__context__) and "could not bring it back" in str(info.value.__context__)


# ---- random operators: the generator's state is restored for the retry ----------------------------

def _random_op(family: str):
    if family == "py":
        return torch.ops.dynn_oom_py.oom_random, _py_arm
    op = torch.ops.dynn_test.oom_random if family == "boxed" else torch.ops.dynn_test.oom_random_unboxed
    return op, _native.arm_test_oom


def _train_random(events: str | None, family: str, ooms: dict[int, int], generator: bool, steps: int = 3):
    """As :func:`_train`, with a random operator (dropout-like) on the activations, drawing from the
    default generator or from one of its own, armed to run out ``ooms[step]`` times."""
    op, arm = _random_op(family)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7) if generator else None
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = _mm(events, model, opt) if events else None
    outs = []
    try:
        for step in range(steps):
            x = torch.randn(64, 256)
            with mm.step() if mm is not None else contextlib.nullcontext():
                h = model(x)
                arm(ooms.get(step, 0))
                z = op(h.detach(), 0.3, generator=gen)
                loss = (h * z).mean() + torch.rand(()).item() * 0  # the default generator draws on after it
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            outs.append(z.clone())
        retries = mm.stats()["oom_retries"] if mm is not None else 0
    finally:
        if mm is not None:
            mm.detach()
    return outs, [p.detach().clone() for p in model.parameters()], torch.randn(4), retries


@pytest.mark.parametrize("generator", [False, True], ids=["default-generator", "own-generator"])
@pytest.mark.parametrize("events,family", CASES)
def test_a_random_operator_that_runs_out_is_retried_with_its_generator_restored(events, family, generator):
    """The operator draws before it runs out: without the generator's state put back, the retry
    draws other numbers (and the default generator's later draws shift too)."""
    want_outs, want_params, want_next, _ = _train_random(None, family, {}, generator)
    outs, params, after, retries = _train_random(events, family, {1: 1}, generator)
    assert retries == 1
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    assert torch.equal(after, want_next), "the default generator's state after the run is PyTorch alone's"


class _DrawThenRunOut(torch.utils._python_dispatch.TorchDispatchMode):
    """Below the manager's dispatch mode: the next ``armed`` calls of ``target`` run (and draw) and then
    raise the allocator's out-of-memory error, as a kernel that ran out after drawing would."""

    def __init__(self, target) -> None:
        super().__init__()
        self.target, self.armed = target, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        metas = any(isinstance(a, torch.Tensor) and a.is_meta for a in args)  # the manager's size estimate
        if func is self.target and self.armed > 0 and not metas:
            self.armed -= 1
            raise torch.OutOfMemoryError("out of memory (injected after drawing). Tried to allocate 1.00 MiB.")
        return out


@pytest.mark.parametrize("which", ["native_dropout", "multinomial"])
def test_real_random_operators_retried_after_running_out_give_pytorchs_bits(which):
    """aten::native_dropout (draws from the default generator, no Generator argument) and
    aten::multinomial (a Generator argument): run out once after drawing, retried (Python source, where
    a mode below the manager's can make a real operator run out) with the same numbers as PyTorch alone."""
    target = torch.ops.aten.native_dropout.default if which == "native_dropout" else torch.ops.aten.multinomial.default

    def run(managed: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        inject = _DrawThenRunOut(target)
        with inject:
            mm = _mm("python", model, opt) if managed else None
            got = []
            try:
                for _ in range(3):
                    x = torch.randn(32, 64)
                    with mm.step() if mm is not None else contextlib.nullcontext():
                        h = model(x)
                        inject.armed = 1 if managed else 0
                        if which == "native_dropout":
                            r = torch.ops.aten.native_dropout(h, 0.4, True)[0]
                        else:
                            r = torch.multinomial(h.detach().softmax(-1), 8, replacement=True).float().mean() * h
                        r.square().mean().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                    got.append(r.detach().clone())
                retries = mm.stats()["oom_retries"] if mm is not None else 0
            finally:
                if mm is not None:
                    mm.detach()
        return got, [p.detach().clone() for p in model.parameters()], retries

    want, want_params, _ = run(False)
    got, params, retries = run(True)
    assert retries == 3
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))


def test_the_random_operator_lists_agree():
    """oom.py's RANDOM_BY_NAME and events.cpp's random_by_name name the same operators."""
    src = (Path(__file__).parents[2] / "dynn_runtime" / "csrc" / "events.cpp").read_text()
    body = src[src.index("static bool random_by_name"):]
    body = body[:body.index("}")]
    assert set(re.findall(r'"(aten::\w+)"', body)) == set(RANDOM_BY_NAME)


def test_the_undeclared_write_lists_agree():
    """oom.py's UNDECLARED_WRITES and events.cpp's undeclared_writes name the same operators and
    argument indices."""
    src = (Path(__file__).parents[2] / "dynn_runtime" / "csrc" / "events.cpp").read_text()
    body = src[src.index("static std::vector<int> undeclared_writes"):]
    body = body[:body.index("return {};")]
    indices = tuple(int(i) for i in re.search(r"return \{([\d, ]+)\};", body).group(1).split(","))
    assert {name: indices for name in re.findall(r'"(aten::\w+)"', body)} == UNDECLARED_WRITES


# ---- the manager's own allocations: prefetches and the end of a step ------------------------------

class _Prefetcher(LRUPolicy):
    """lru that asks, after every operator, to prefetch the storages in ``wanted``."""

    def __init__(self) -> None:
        super().__init__()
        self.wanted: list[int] = []

    def after_op(self, position: int) -> list[Action]:
        return [Action("prefetch", sid) for sid in self.wanted]


_SOURCES = [e for e in ("python", "native") if e == "python" or _native is not None]


@pytest.mark.parametrize("events", _SOURCES)
def test_a_prefetch_that_runs_out_is_dropped_and_its_storage_fetched_on_demand(events, failing_allocations):
    left = failing_allocations
    pol = _Prefetcher()
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    mm = MemoryManager(64 << 20, policy=pol, device="cpu", events=events, decide_every=1).attach(model)
    try:
        with mm.step():
            a = model(torch.randn(64, 256)).detach() * 1.0
            b = a * 2.0
            want_a, want_b = a.clone(), b.clone()
            assert mm.offload(a, b) > 0
            pol.wanted = [mm._sid(a), mm._sid(b)]
            left[0] = 1
            c = torch.ones(8) * 3.0  # operators: the policy asks for both prefetches; the first runs out
            c = c + 1.0
            assert left[0] == 0
            st = mm._cur
            assert st.prefetches_dropped == 1 and st.bytes_prefetched == 0, "no other prefetch in this step"
            assert mm.st[pol.wanted[0]].status == "host" and mm.st[pol.wanted[1]].status == "host"
            pol.wanted = []
            assert torch.equal(a + 0.0, want_a) and torch.equal(b + 0.0, want_b)  # fetched on demand
        with mm.step():  # a new step prefetches again
            d = b * 3.0
            want_d = d.clone()
            assert mm.offload(d) > 0
            pol.wanted = [mm._sid(d)]
            c = c + 1.0
            assert mm._cur.bytes_prefetched > 0 and mm._cur.prefetches_dropped == 0
            pol.wanted = []
            assert torch.equal(d + 0.0, want_d)
    finally:
        mm.detach()


@pytest.mark.parametrize("events", _SOURCES)
def test_what_a_step_made_and_the_program_keeps_is_brought_back_and_stays_put_from_a_successful_end(events):
    """A storage made in a step and still held at its end comes back to the device and may not move
    any more; after a failed step it stays movable (and where it is) until a later step ends well,
    which brings it back. Tensors made in earlier steps are left as they were."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    with _mm(events, model, None) as mm:
        with mm.step():
            early = model(torch.randn(8, 64)).detach() * 1.0
        with mm.step():
            kept = model(torch.randn(8, 64)).detach() * 1.0
            want = kept.clone()
            assert mm.offload(kept) > 0
        s = mm.st[mm._sid(kept)]
        assert s.status == "resident" and not s.movable
        assert mm.offload(kept) == 0 and mm.offload(early) == 0
        with pytest.raises(RuntimeError, match="inside the step"):
            with mm.step():
                failed = model(torch.randn(8, 64)).detach() * 1.0
                failed_want = failed.clone()
                assert mm.offload(failed) > 0
                raise RuntimeError("inside the step")
        f = mm.st[mm._sid(failed)]
        assert f.status == "host" and f.movable  # a failed step leaves it where it is, movable
        with mm.step():
            model(torch.randn(8, 64)).sum()
        assert f.status == "resident" and not f.movable
        assert mm.offload(failed) == 0
        assert torch.equal(kept, want) and torch.equal(failed, failed_want)


@pytest.mark.parametrize("events", _SOURCES)
def test_a_fetch_back_at_the_end_of_a_step_that_runs_out_leaves_the_storage_on_the_host(events, failing_allocations):
    """What the program holds comes back at the step's end; where the allocator runs out for it, also
    once room was made, it stays on the host (its copy valid) and comes back at its next access, and
    the step ends without an error."""
    left = failing_allocations
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    with _mm(events, model, None) as mm:
        with mm.step():
            kept = model(torch.randn(64, 256)).detach() * 1.0
            want = kept.clone()
            assert mm.offload(kept) > 0
            left[0] = 2  # the fetch back and its retry
        st = mm.steps[-1]
        assert left[0] == 0 and st.left_on_host == 1 and st.oom_retries == 1
        s = mm.st[mm._sid(kept)]
        assert s.status == "host" and s.host_valid
        assert torch.equal(kept + 0.0, want)  # its next access brings it back
        assert s.status == "resident"


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))


@pytest.mark.parametrize("events", _SOURCES)
def test_a_failed_step_raises_its_own_error_and_leaves_what_is_away_on_the_host(events, monkeypatch, failing_allocations):
    """A step fails with a BudgetError while the program (the failed step's frames) holds activations
    that are away; the allocator would run out bringing them back. The user gets the BudgetError, not
    an out-of-memory error of the step's end; they stay on the host, and training goes on, with a
    larger budget, bit for bit as PyTorch alone."""
    left = failing_allocations
    end = Steps._end_step

    def end_step(self, ok):  # the allocator is full from here on: any fetch-back runs out
        left[0] = 10**6
        return end(self, ok)

    model, ref = _mlp(), _mlp()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = [torch.randn(512, 256) for _ in range(3)]
    params = sum(p.nbytes for p in model.parameters())
    mm = MemoryManager(params + (2 << 20), policy="lru", device="cpu", events=events).attach(model, opt)
    try:
        monkeypatch.setattr(Steps, "_end_step", end_step)
        with pytest.raises(BudgetError, match="smaller than what one operator needs") as info, mm.step():
            h = model(xs[0])
            torch.cat([h] * 64)  # reads h and makes 64 times it: more than the budget
        monkeypatch.setattr(Steps, "_end_step", end)
        left[0] = 0
        assert not isinstance(info.value, torch.OutOfMemoryError)
        away = [s for s in mm.st.values() if s.kind in ("activation", "temp") and s.status == "host"]
        assert away and all(s.host_valid for s in away), "the failed step's activations stay on the host"
        assert "aten::cat" in str(info.value)
        if events == "native":  # raised in a handler, kept without its traceback: where is in a note
            assert "raised in a native event handler at dynn_runtime/runtime/native_source.py" in where_raised(info.value)
        del h, info
        mm.budget = 1 << 40
        ref(xs[0])
        for x in xs[1:]:
            with mm.step():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            ref(x).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    finally:
        mm.detach()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


# ---- under a hard cap: what the allocator lacked, and where a failure came from -------------------

def test_the_cap_shortfall_is_read_from_the_allocators_message():
    msg = ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 139.81 GiB of which "
           "139.00 GiB is free. Including non-PyTorch memory, this process has 130.00 MiB memory in use. 129.83 MiB "
           "allowed; Of the allocated memory 117.17 MiB is allocated by PyTorch, and 2.83 MiB is reserved by "
           "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
    def mib(v):
        return int(v * (1 << 20))

    assert cap_shortfall(msg) == mib(20) + mib(117.17) + mib(2.83) - mib(129.83)
    brief = "Tried to allocate 2.00 MiB ... 102.14 MiB allowed; 96.51 MiB allocated by PyTorch, 5.49 MiB reserved but unallocated"
    assert cap_shortfall(brief) == mib(2) + mib(96.51) + mib(5.49) - mib(102.14)
    assert cap_shortfall("CUDA out of memory. Tried to allocate 2.00 MiB.") is None  # no cap in the message


def test_the_cap_headroom_takes_on_what_the_allocator_lacked():
    mm = MemoryManager(100 << 20, policy="lru", device="cpu")
    mm.cap_bytes = 100 << 20
    room = mm._cap_room()
    assert room == 25 << 20  # a quarter of the cap until measured
    assert mm._next_cap_headroom(room, 10 << 20, 0) == 10 << 20  # measured, no shortfall: as measured
    assert mm._next_cap_headroom(room, 10 << 20, 8 << 20) == room + (10 << 20)  # room + 1.25 x the shortfall
    assert mm._next_cap_headroom(room, None, 8 << 20) == room + (10 << 20)  # a failed step learns it too
    assert mm._next_cap_headroom(room, None, 0) == room
    assert mm._next_cap_headroom(room, None, 200 << 20) == 50 << 20  # at most half the cap


def test_where_a_failure_came_from_names_the_frames_and_the_errors_it_was_raised_from_or_during():
    def inner():
        raise BudgetError("runtime: the first error")

    def during():
        try:
            inner()
        except BudgetError:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB.")  # noqa: B904

    def chained():
        try:
            inner()
        except BudgetError as exc:
            raise RuntimeError("second") from exc

    with pytest.raises(torch.OutOfMemoryError) as info:
        during()
    text = where_raised(info.value)
    assert text.startswith("at tests/runtime/test_oom.py:") and " during" in text
    assert "during BudgetError: runtime: the first error (at tests/runtime/test_oom.py:" in text and "inner" in text
    with pytest.raises(RuntimeError) as info:
        chained()
    assert "from BudgetError: runtime: the first error" in where_raised(info.value)


def _frag(request_mib: float, unallocated_mib: float) -> str:
    return (f"CUDA out of memory. Tried to allocate {request_mib:.2f} MiB. 142.79 MiB allowed; Of the allocated memory "
            f"89.65 MiB is allocated by PyTorch, and {unallocated_mib:.2f} MiB is reserved by PyTorch but unallocated.")


@pytest.mark.parametrize("events", ["python", "native"])
@pytest.mark.parametrize("pieces", [False, True])
def test_room_after_an_oom_is_everything_the_operator_does_not_read_where_the_free_bytes_are_in_pieces(
        events, pieces, monkeypatch):
    """The allocator had the request's bytes free, in segments live blocks keep (reserved but
    unallocated): evicting the request's worth would free more scattered blocks, and emptying the
    cache gives back only whole segments, so the retry gets everything the operator does not read.
    Without that, the request's worth plus what is over the budget, as before."""
    if events == "native" and _native is None:
        pytest.skip("the native event source is not built")
    monkeypatch.setenv("DYNN_EVENTS", events)
    mm = MemoryManager(64 << 20, policy="lru", device="cpu")
    mm.attach(nn.Linear(4, 4))
    try:
        with mm.step():
            xs = [torch.ones(1 << 18) * i for i in range(8)]  # 1 MiB each, movable (made in the step)
            sids = [mm._sid(x) for x in xs]
            keep = {sids[0]}  # what the operator reads
            with no_mode():  # as the sources' handlers run it: the manager's own copies unobserved
                mm._room_after_oom(_frag(2, 8 if pieces else 0.5), keep, "operator test", 0)
            away = [sid for sid in sids if mm.st[sid].status._value_ != "resident"]
            assert sids[0] not in away
            assert len(away) == (7 if pieces else 2)
    finally:
        mm.detach()
    assert mm.stats()["oom_retries"] == 1


def test_fragmentation_is_read_from_the_allocators_message():
    from dynn_runtime.runtime.oom import fragmented

    assert fragmented(_frag(16, 42.35), 16 << 20) and not fragmented(_frag(16, 0.93), 16 << 20)
    assert not fragmented("CUDA out of memory. Tried to allocate 2.00 MiB.", 2 << 20)  # the message does not say
