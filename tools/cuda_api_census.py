"""CUDA runtime calls per training step, managed against PyTorch alone (torch.profiler's census).

Usage: ``python tools/cuda_api_census.py FAMILY[,FAMILY...] [--config lru@0.5] [--steps 6] [--warm 3]
[--preset small]``.

On the GPU the nothing-moved and the moving steps are host-bound, and a driver call costs the host
microseconds: this counts the calls a step makes and the host time they take. Each family trains
``warm + steps`` steps alone and then ``warm + steps`` under a manager (native events; a
configuration is a policy name with ``@F`` a budget of F of the measured peak); the last ``steps``
of each run under ``torch.profiler`` (CPU and CUDA activities). Prints, per CUDA runtime call (a
profiler event whose name starts with ``cuda``), the calls per step and host microseconds per step
of each side, and the managed side's evictions and fetches per step, so a call's count can be read
per move. The profiler slows every operator; its counts are exact, its times are only a guide.
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import dynn_runtime as dr
from dynn_runtime.workload import load_workload, make_optimizer, to_device, train_step


def _census(run_steps, cuda: bool) -> tuple[collections.Counter, collections.Counter]:
    counts: collections.Counter = collections.Counter()
    micros: collections.Counter = collections.Counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        run_steps()
    for ev in prof.key_averages():
        if ev.key.startswith("cuda"):
            counts[ev.key] += ev.count
            micros[ev.key] += ev.cpu_time_total
    return counts, micros


def run(family: str, config: str, steps: int, warm: int, preset: str, device: str) -> None:
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    policy, _, frac = config.partition("@")
    budget = float(frac) if frac else 1 << 50
    sides = {}
    moves = {}
    for side in ("alone", "managed"):
        torch.manual_seed(0)
        wl = load_workload(family, preset=preset, seed=0)
        model = wl.model.to(dev)
        opt = make_optimizer(wl, model.parameters())
        batches = [to_device(wl.make_batch(s), dev) for s in range(warm + steps)]
        mm = None
        if side == "managed":
            mm = dr.MemoryManager(budget, policy=policy, device=device, events="native")
            mm.attach(model, opt)

        def one(batch, mm=mm, wl=wl, model=model, opt=opt) -> None:
            if mm is None:
                train_step(wl, model, opt, batch)
            else:
                with mm.step():
                    train_step(wl, model, opt, batch)

        for b in batches[:warm]:
            one(b)
        if cuda:
            torch.cuda.synchronize()

        def measured(batches=batches, one=one) -> None:
            for b in batches[warm:]:
                one(b)
            if cuda:
                torch.cuda.synchronize()

        sides[side] = _census(measured, cuda)
        if mm is not None:
            last = mm.stats()["per_step"][-steps:]
            moves = {k: sum(s[k] for s in last) / steps
                     for k in ("evictions", "prefetch_misses", "late_fetches", "ops", "decision_points")}
            mm.detach()
    print(f"{family} {config}: per step (last {steps} of {warm + steps}); managed: "
          + ", ".join(f"{k} {v:.1f}" for k, v in moves.items()))
    (ac, at), (mc, mt) = sides["alone"], sides["managed"]
    names = sorted(set(ac) | set(mc), key=lambda k: -(mt[k] - at[k]))
    print("| call | alone calls | managed calls | alone us | managed us | extra us |")
    print("|---|---:|---:|---:|---:|---:|")
    for k in names:
        print(f"| {k} | {ac[k] / steps:.1f} | {mc[k] / steps:.1f} | {at[k] / steps:.0f} | {mt[k] / steps:.0f} "
              f"| {(mt[k] - at[k]) / steps:+.0f} |")
    print(f"| all | {sum(ac.values()) / steps:.1f} | {sum(mc.values()) / steps:.1f} | "
          f"{sum(at.values()) / steps:.0f} | {sum(mt.values()) / steps:.0f} | "
          f"{(sum(mt.values()) - sum(at.values())) / steps:+.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families")
    ap.add_argument("--config", default="lru@0.5")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the tool (no CUDA call to count)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("cuda_api_census: needs a CUDA device (--device cpu for a dry run)")
    for family in args.families.split(","):
        run(family, args.config, args.steps, args.warm, args.preset, args.device)


if __name__ == "__main__":
    main()
