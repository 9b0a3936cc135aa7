"""An operator that runs out of device memory inside a step is retried once, after the manager made
room (runtime/oom.py; events.cpp, invariant 11), on both event sources.

There is no out-of-memory error on the CPU, so the tests inject one. ``dynn_oom_py`` below is an
operator registered in Python whose next calls raise ``torch.OutOfMemoryError`` (the Python source
sees that as the caching allocator's error; on the native source a Python kernel's exception is a
Python error, not ``c10::OutOfMemoryError``). The extension's ``dynn_test`` operators throw
``c10::OutOfMemoryError`` from C++ (``_C.arm_test_oom``): ``oom`` reaches the native observer's boxed
fallback, ``oom_unboxed`` an unboxed kernel of the observer's, ``oom_`` writes in place. Each ``oom``
result depends on all of its arguments, so a retry that lost one computes other numbers.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dynn_runtime.errors import BudgetError
from dynn_runtime.runtime.copies import SyncCopies
from dynn_runtime.runtime.events import native_module
from dynn_runtime.runtime.manager import MemoryManager
from dynn_runtime.runtime.oom import oom_request

_native = native_module()

_PY_ARMED = [0]
_PY_LIB = torch.library.Library("dynn_oom_py", "DEF")
_PY_LIB.define("oom(Tensor x, Tensor? y=None, int[] dims=[]) -> Tensor")
_PY_LIB.define("oom_(Tensor(a!) x) -> Tensor(a!)")


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


_PY_LIB.impl("oom", _py_oom, "CPU")
_PY_LIB.impl("oom_", _py_oom_, "CPU")


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


def _failing_allocations(monkeypatch) -> list[int]:
    """The CPU copy engine's allocation for a fetch raises the allocator's OOM while ``left[0] > 0``."""
    real = SyncCopies.allocate
    left = [0]

    def allocate(self, st, nbytes):
        if left[0] > 0:
            left[0] -= 1
            raise torch.OutOfMemoryError(f"out of memory (injected). Tried to allocate {nbytes} bytes.")
        return real(self, st, nbytes)

    monkeypatch.setattr(SyncCopies, "allocate", allocate)
    return left


@pytest.mark.parametrize("events", [e for e in ("python", "native") if e == "python" or _native is not None])
def test_a_demand_fetch_that_runs_out_is_retried_after_room_is_made(events, monkeypatch):
    left = _failing_allocations(monkeypatch)
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


def test_a_demand_fetch_that_runs_out_twice_is_a_budget_error(monkeypatch):
    """(Python source: on the native one a fetch is made in the fault handler, whose error is kept.)"""
    left = _failing_allocations(monkeypatch)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    with _mm("python", model, None) as mm:
        with pytest.raises(BudgetError, match=r"\(fetching a 64.0 KiB \w+ back\) ran out of device memory") as info, mm.step():
            h = model(torch.randn(64, 256))
            assert mm.offload(h) > 0
            left[0] = 2
            h.detach() + 0.0
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
        assert mm.steps[-1].oom_retries == 1
