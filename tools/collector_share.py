"""Python's cyclic collector in managed steps: its seconds per step, full collections, with the step's
records in it or out of it.

    python tools/collector_share.py FAMILY [STEPS] [--policy pilot|lru|none] [--keep-tracked] [--budget F]

One manager (``small`` preset, native source, budget far above the peak: nothing moves; ``--budget F``:
F of the peak the first step measures), two warm-up
steps, then STEPS steps timed (thread CPU time) with a ``gc.callbacks`` clock: the collector's
seconds per step (all generations, and the full collections alone), the collections of each
generation, and the collector's microseconds per operator. ``--keep-tracked`` sets the manager's
``untrack_history = False`` (the step's ``Op`` records and per-position lists left in the collector),
for a comparison in consecutive processes. ``--record`` makes the manager with ``record_every_op``
(a history for lru and none too). Full collections are rare events: take 20 steps or more.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

import dynn_runtime as dr
from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.workload import load_workload, make_optimizer, train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("steps", nargs="?", type=int, default=24)
    ap.add_argument("--policy", default="pilot", choices=["pilot", "lru", "none"])
    ap.add_argument("--keep-tracked", action="store_true")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--budget", default=None, help="a fraction of the peak (0.5, 1/2); default: far above it")
    args = ap.parse_args()
    torch.set_num_threads(1)
    wl = load_workload(args.family, preset="small", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    policy = PilotPolicy(backend="native") if args.policy == "pilot" else args.policy
    budget = 1 << 50 if args.budget is None else args.budget
    mm = dr.MemoryManager(budget, policy=policy, device="cpu", events="native",
                          record_every_op=args.record).attach(model, opt)
    mm.untrack_history = not args.keep_tracked
    clock = {"t": 0.0, "full_t": 0.0, "n": [0, 0, 0], "t0": 0.0}

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            clock["t0"] = time.thread_time()
            return
        dt = time.thread_time() - clock["t0"]
        clock["t"] += dt
        clock["n"][info["generation"]] += 1
        if info["generation"] == 2:
            clock["full_t"] += dt

    try:
        for i in range(2):
            with mm.step():
                train_step(wl, model, opt, wl.make_batch(i))
        gc.callbacks.append(callback)
        t0, ops = time.thread_time(), 0
        for i in range(args.steps):
            with mm.step():
                train_step(wl, model, opt, wl.make_batch(2 + i))
            ops += mm.steps[-1].ops
        dt = time.thread_time() - t0
    finally:
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)
        mm.detach()
    n = args.steps
    print(f"{args.family} {args.policy} untrack_history={not args.keep_tracked}: {dt / n * 1e3:.1f} ms/step, "
          f"collector {clock['t'] / n * 1e3:.1f} ms/step (full {clock['full_t'] / n * 1e3:.1f}), collections by "
          f"generation {clock['n']} in {n} steps, {clock['t'] / max(ops, 1) * 1e6:.2f} us/op")


if __name__ == "__main__":
    main()
