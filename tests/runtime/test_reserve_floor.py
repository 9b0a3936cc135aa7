"""The room the native source makes ahead of the next operator is not made of tiny moves."""

from __future__ import annotations

import gc

import pytest
import torch

import dynn_runtime as dr
from dynn_runtime.runtime.events import native_module
from dynn_runtime.workload import load_workload, make_optimizer, train_step

pytestmark = pytest.mark.skipif(native_module() is None, reason="dynn_runtime._C is not built")


def _train(floor: bool) -> tuple[list[float], list[dict]]:
    wl = load_workload("evoformer", preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(0.5, policy="lru", device="cpu", events="native")
    mm.reserve_floor = floor
    mm.attach(model, opt)
    losses = []
    gc.collect()
    gc.disable()  # the collector's frees would move with the two runs' allocations
    try:
        for step in range(5):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(step)).item())
        per_step = mm.stats()["per_step"][1:]
    finally:
        gc.enable()
        mm.detach()
    return losses, per_step


def test_the_reserve_passes_over_tiny_victims_and_keeps_the_budget():
    """lru at 1/2 of evoformer `tiny`: with the reserve's floor (Residency.make_room's ``scale``) the
    managed steps evict fewer storages, stay within the budget and train to the same losses."""
    ref_losses, ref = _train(floor=False)
    losses, got = _train(floor=True)
    assert losses == ref_losses
    assert sum(s["evictions"] for s in got) < sum(s["evictions"] for s in ref)
    assert all(s["budget_overshoot_bytes"] == 0 for s in got + ref)
