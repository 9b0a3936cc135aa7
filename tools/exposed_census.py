"""Which storages the native observer cannot learn the deaths of without walking its table, and why.

Usage: ``python tools/exposed_census.py [FAMILY[@BUDGET] ...] [--steps N] [--device cuda]``
(``small`` presets; default ``moe varlen@0.5 evoformer``; no budget: far above the peak).

Trains each family under lru with the native event source and, at the end of every module's
forward, reads ``Observer.exposed_entries()`` (csrc/events.cpp, invariant 9). Prints per step the
table's walks (``table_sweeps``) and the mean number of exposed entries per sample, by reason:
``unseen`` (not heard since registered or moved), ``shared`` (two live storages over one address),
``not the allocator's``, ``dead`` (waiting for a walk), ``unheard`` (hearing off: every CPU observer
that covers, and a CUDA build that cannot hear).
"""

from __future__ import annotations

import argparse
import collections
import copy

import torch

import dynn_runtime as dr
from dynn_runtime.workload import load_workload, make_optimizer, to_device, train_step


def census(family: str, budget: float | int, steps: int, device: str) -> None:
    torch.manual_seed(0)
    wl = load_workload(family, preset="small", seed=0)
    model = copy.deepcopy(wl.model).to(device)
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(budget, policy="lru", device=device, events="native")
    mm.attach(model, opt)
    obs = mm._obs
    print(f"{family}: budget {budget}, hearing {obs.hearing}, covering {obs.cover}", flush=True)
    why: collections.Counter = collections.Counter()
    samples = [0]

    def sample(mod, inp, out) -> None:
        samples[0] += 1
        why.update(w for _, w in obs.exposed_entries())

    handles = [m.register_forward_hook(sample) for m in model.modules()]
    try:
        for s in range(steps):
            batch = to_device(wl.make_batch(s), torch.device(device))
            with mm.step():
                train_step(wl, model, opt, batch)
            per = {k: round(v / max(1, samples[0]), 1) for k, v in sorted(why.items())}
            st = mm.stats()["per_step"][-1]
            print(f"  step {s}: sweeps {st['table_sweeps']} ({st['ops']} operators), exposed per sample {per or 0}",
                  flush=True)
            why.clear()
            samples[0] = 0
    finally:
        for h in handles:
            h.remove()
        mm.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", default=["moe", "varlen@0.5", "evoformer"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    for spec in a.families:
        family, _, frac = spec.partition("@")
        census(family, float(frac) if frac else 1 << 40, a.steps, a.device)


if __name__ == "__main__":
    main()
