"""lru told in bulk (``Policy.on_touches``) against lru told per operator, on the native event source.

Usage: ``python tools/recency_bulk_pair.py FAMILY[,FAMILY...] [STEPS] [FRACTION]`` (``small`` presets;
a family may be ``examples/my_workload.py:build``). One native manager may be attached per process, so
the runs go one after another in one process, in the order bulk, per-operator, PyTorch alone,
per-operator, bulk; the per-operator side is lru with ``reads_operators = True``. Prints, per side, the
median thread CPU time of a step (the first two steps of each run left out: the measuring step and the
first managed one), its ratio to PyTorch alone, the garbage collections per step by generation, the
tracked objects each step left, whether the losses are PyTorch alone's, and the manager's counts.
"""

from __future__ import annotations

import gc
import sys
import time

import torch

import dynn_runtime as dr
from dynn_runtime.policies.basic import LRUPolicy
from dynn_runtime.workload import load_workload, make_optimizer


class PerOperator(LRUPolicy):
    reads_operators = True


_COLLECTIONS = [0, 0, 0]


def _count(phase: str, info: dict) -> None:
    if phase == "start":
        _COLLECTIONS[info["generation"]] += 1


def run(family: str, policy: LRUPolicy | None, steps: int, fraction: float) -> dict:
    wl = load_workload(family, preset="small", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = None
    if policy is not None:
        mm = dr.MemoryManager(fraction, policy=policy, device="cpu", events="native").attach(model, opt)
    out: dict = {"times": [], "gc": [], "objects": [], "losses": [], "counts": ""}
    for step in range(steps):
        batch = wl.make_batch(step)
        g0, n0 = list(_COLLECTIONS), len(gc.get_objects())
        t0 = time.thread_time()
        with mm.step() if mm is not None else torch.enable_grad():
            loss = wl.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if step >= 2:
            out["times"].append(time.thread_time() - t0)
            out["gc"].append(tuple(a - b for a, b in zip(_COLLECTIONS, g0)))
            out["objects"].append(len(gc.get_objects()) - n0)
        out["losses"].append(loss.item())
    if mm is not None:
        per_step = mm.stats()["per_step"][2:]
        out["counts"] = (f"evictions {sum(s['evictions'] for s in per_step)}, "
                         f"decision points {sum(s['decision_points'] for s in per_step)}, "
                         f"policy ms/step {1e3 * sum(s['policy_seconds'] for s in per_step) / len(per_step):.1f}")
        mm.detach()
    return out


def main() -> None:
    families = sys.argv[1].split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    fraction = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    torch.set_num_threads(1)
    gc.callbacks.append(_count)
    make = {"bulk": LRUPolicy, "per_op": PerOperator, "alone": lambda: None}
    for family in families:
        runs: dict[str, list[dict]] = {"bulk": [], "per_op": [], "alone": []}
        for side in ("bulk", "per_op", "alone", "per_op", "bulk"):
            runs[side].append(run(family, make[side](), steps, fraction))

        def median(xs: list[float]) -> float:
            return sorted(xs)[len(xs) // 2]

        alone = median([t for r in runs["alone"] for t in r["times"]])
        for side, rs in runs.items():
            t = median([t for r in rs for t in r["times"]])
            same = all(r["losses"] == runs["alone"][0]["losses"] for r in rs)
            print(f"{family} {side}: median step CPU {t * 1e3:.1f} ms = {t / alone:.2f}x alone; collections "
                  f"(gen 0, 1, 2) per step {rs[0]['gc']}; tracked objects left per step {rs[0]['objects']}; "
                  f"losses PyTorch alone's: {same}; {rs[0]['counts']}")


if __name__ == "__main__":
    main()
