"""List operators (foreach, fused, GradScaler's unscale) run in slices under a small budget, and
compute the same bits as unmanaged training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dynn_runtime.errors import BudgetError
from dynn_runtime.runtime import lists
from dynn_runtime.runtime.events import resolve
from dynn_runtime.runtime.manager import MemoryManager


def _sources() -> list[str]:
    try:
        return ["python", "native"] if resolve("native")[0] == "native" else ["python"]
    except Exception:  # noqa: BLE001 - the native source is optional
        return ["python"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])


OPTIMIZERS = {
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, foreach=True),
}


def _train(opt_name: str, mm_kwargs: dict | None, steps: int = 3, scaler: bool = False, device: str = "cpu"):
    model = _model().to(device)
    opt = OPTIMIZERS[opt_name](model.parameters())
    mm = MemoryManager(**mm_kwargs).attach(model, opt) if mm_kwargs else None
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    losses = []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(64, 128, generator=g).to(device)
            ctx = mm.step() if mm is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
            with ctx:
                loss = model(x).pow(2).mean()
                if amp is not None:  # GradScaler.unscale_: _amp_foreach_non_finite_check_and_unscale_
                    amp.scale(loss).backward()
                    amp.unscale_(opt)
                else:
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
                if amp is not None:
                    amp.step(opt)
                    amp.update()
                else:
                    opt.step()
                opt.zero_grad(set_to_none=False)  # _foreach_zero_
                losses.append(loss.item())
        split = mm.stats()["list_calls_split"] if mm is not None else 0
    finally:
        if mm is not None:
            mm.detach()
    state = [p.detach().clone() for p in model.parameters()]
    state += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses, state, split


@pytest.mark.parametrize("events", _sources())
@pytest.mark.parametrize("opt_name,scaler", [(n, False) for n in sorted(OPTIMIZERS)] + [("adam-foreach", True)])
def test_list_operators_split_to_fit_and_keep_the_bits(opt_name, scaler, events):
    # parameters 0.53 MB; Adam's _foreach_addcdiv_ reads params, exp_avg and denom (1.6 MB) at once
    budget = 1_200_000
    want_losses, want, _ = _train(opt_name, None, scaler=scaler)
    losses, got, split = _train(opt_name, dict(budget=budget, policy="lru", device="cpu", events=events),
                                scaler=scaler)
    assert split > 0, "no list operator was split: the budget must be below what one of them touches"
    assert losses == want_losses
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("events", _sources())
@pytest.mark.parametrize("opt_name", ["adam-foreach", "adamw-fused"])
def test_a_fraction_is_checked_against_a_list_operators_largest_entry_not_the_whole_call(opt_name, events):
    # At 1/4 of the peak the optimizer's list operators touch more than the budget at once (the
    # measuring step runs them whole), but each entry fits: they run in slices
    want_losses, want, _ = _train(opt_name, None)
    losses, got, split = _train(opt_name, dict(budget=0.25, policy="lru", device="cpu", events=events))
    assert split > 0
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", ["adam-foreach", "adamw-fused"])
def test_a_fraction_below_the_whole_list_call_trains_on_cuda_bit_identically(opt_name):
    from dynn_runtime.runtime.train import deterministic

    with deterministic():  # both sides (cuBLAS reproduces itself only so)
        want_losses, want, _ = _train(opt_name, None, device="cuda")
        losses, got, split = _train(opt_name, dict(budget=0.25, policy="lru", device="cuda"), device="cuda")
    assert split > 0
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("events", _sources())
def test_a_fraction_below_a_list_operators_largest_entry_names_it(events):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))  # one 1 MiB weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    mm = MemoryManager(0.25, policy="lru", device="cpu", events=events).attach(model, opt)
    try:
        with pytest.raises(BudgetError, match=r"one entry of torch\._fused_adamw_'s lists .* touches 4\.0 MiB"):
            with mm.step():
                model(torch.randn(8, 512)).sum().backward()
                opt.step()
    finally:
        mm.detach()


def test_without_splitting_the_same_budget_is_refused(monkeypatch):
    monkeypatch.setattr(lists.ListSplitter, "install", lambda self: None)
    with pytest.raises(BudgetError, match="_foreach_"):
        _train("adam-foreach", dict(budget=1_200_000, policy="lru", device="cpu", events="python"))


def test_wrappers_leave_with_the_last_manager():
    name = "_foreach_add_"
    orig = getattr(torch, name)
    a = MemoryManager(budget=1 << 30, device="cpu", events="python").attach(nn.Linear(2, 2))
    b = MemoryManager(budget=1 << 30, device="cpu", events="python").attach(nn.Linear(2, 2))
    assert getattr(torch, name) is not orig and getattr(torch, name).__wrapped__ is orig
    a.detach()
    assert getattr(torch, name) is not orig
    b.detach()
    assert getattr(torch, name) is orig


def test_split_joins_out_of_place_results_in_order():
    sp = lists.ListSplitter(lambda: 64)
    sp.install()
    try:
        xs = [torch.full((8,), float(i)) for i in range(5)]  # 32 B each: the 160 B call goes in slices
        out = torch._foreach_mul(xs, 2.0)
        norms = torch._foreach_norm(xs)
    finally:
        sp.remove()
    assert sp.calls_split == 2
    assert [o[0].item() for o in out] == [0.0, 2.0, 4.0, 6.0, 8.0]
    assert torch.equal(torch.stack(norms), torch.stack(torch._foreach_norm(xs)))


def test_a_call_is_measured_natively_as_the_python_sum_measures_it(monkeypatch):
    if lists.native_module() is None:
        pytest.skip("the extension is not built")
    xs = [torch.ones(3, 5), torch.ones(4, 6, dtype=torch.float64).t(), nn.Parameter(torch.ones(7, dtype=torch.float16))]
    mixed = [xs[0], 2.0, xs[2]]  # a scalar list's entries count 0, as _nbytes says

    class Sub(torch.Tensor):
        pass

    for args, name in (((xs,), "_foreach_add_"), ((xs, mixed), "_foreach_mul"), ((xs, xs, xs), "_foreach_addcmul_")):
        lists_of = [a for a in args if len(a) == 3]
        want = sum(lists._nbytes(t) for a in lists_of for t in a) + (
            0 if name.endswith("_") else sum(lists._nbytes(t) for t in args[0]))
        assert lists._total_nbytes(name, 3, args) == want
    assert lists._total_nbytes("_foreach_add_", 2, ([xs[0], xs[0].as_subclass(Sub)],)) is None
    # a call that fits goes through whole without the per-entry sum in Python
    monkeypatch.setattr(lists, "_nbytes", lambda t: pytest.fail("summed entry by entry in Python"))
    sp = lists.ListSplitter(lambda: 1 << 20)
    sp.install()
    try:
        out = torch._foreach_mul(xs[:2], 2.0)
    finally:
        sp.remove()
    assert sp.calls_split == 0 and torch.equal(out[0], xs[0] * 2)
