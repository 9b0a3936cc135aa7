"""Shared by the runtime tests: a zoo family trained for a few steps, with or without the manager."""

from __future__ import annotations

import torch

import dynn_runtime as dr
from dynn_runtime.workload import load_workload, make_optimizer


def train_family(family, policy=None, budget=None, steps=3, seed=0, **mm_kw):
    """``steps`` steps of ``family`` (tiny); under a MemoryManager(budget, policy, **mm_kw) when
    ``policy`` is given. Returns the losses, the final parameters and optimizer state, and stats."""
    wl = load_workload(family, preset="tiny", seed=seed)
    torch.manual_seed(seed)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = None
    if policy is not None:
        mm = dr.MemoryManager(budget, policy=policy, device="cpu", **mm_kw).attach(model, opt)
    losses = []
    try:
        for step in range(steps):
            batch = wl.make_batch(step)
            ctx = mm.step() if mm is not None else torch.enable_grad()
            with ctx:
                loss = wl.loss(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        stats = mm.stats() if mm is not None else None
    finally:
        if mm is not None:
            mm.detach()
    state = [t.detach().clone() for t in model.parameters()]
    state += [v.clone() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return losses, state, stats
