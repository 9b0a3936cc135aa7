"""``make demo`` / ``dynn demo``: the main job on an embedded CPU default.

Trains every zoo family (``tiny`` preset, CPU) for a few steps and reports how dynamic each one
is: how many ATen operators a step runs, how many different operator sequences and shape
signatures the steps produced, how peak memory moved, and what the workload decided each step.

Then trains one of them (``moe``) under the memory manager within 1/8 of its unmanaged peak, next
to the same steps on PyTorch alone: what the runtime moved, its peak against the budget, the time,
whether the final parameters are bit-identical, and a memory timeline PNG.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from .memory import format_bytes

#: the family the demo trains under the manager: at 1/8 of its peak on `tiny` every operator still fits
#: (tree_lstm, skipnet, early_exit and varlen have an operator larger than 1/8; evoformer fits but runs
#: ~16k operators a step, which makes the demo slow)
MANAGED_FAMILY = "moe"


def _fact_summary(facts: dict) -> str:
    parts = []
    for k, v in facts.items():
        if isinstance(v, list) and len(v) > 6:
            v = f"[{', '.join(map(str, v[:6]))}, ...]"
        parts.append(f"{k}={v}")
    return "; ".join(parts)


def run(families: list[str] | None = None, steps: int = 4, preset: str = "tiny", seed: int = 0,
        managed: bool = True, budget: str = "1/8", policy: str = "lru",
        timeline: str = "out/demo/memory_timeline.png") -> int:
    from tqdm import tqdm

    from . import models
    from .dynamism import dynamism_report

    names = families or list(models.FAMILIES)
    reports = []
    for name in tqdm(names, desc="demo: training the zoo", unit="family", leave=False):
        wl = models.build(name, preset=preset, seed=seed)
        reports.append(dynamism_report(name, wl, steps=steps, seed=seed))

    print(f"dynn-runtime demo: {len(names)} dynamic networks, preset {preset!r}, {steps} training steps each, CPU\n")
    hdr = f"{'family':<11} {'ops/step':>11} {'op seqs':>7} {'shapes':>6} {'peak memory / step':>22}  {'loss first -> last':>20}"
    print(hdr)
    print("-" * len(hdr))
    for r in reports:
        ops = f"{r.ops_min}-{r.ops_max}" if r.ops_min != r.ops_max else f"{r.ops_min}"
        peak = f"{format_bytes(r.peak_min)} - {format_bytes(r.peak_max)}"
        print(f"{r.workload:<11} {ops:>11} {r.distinct_op_sequences:>4}/{r.steps} {r.distinct_signatures:>3}/{r.steps}"
              f" {peak:>22}  {r.losses[0]:>8.4f} -> {r.losses[-1]:.4f}")
    print("\nWhat each network decided, step by step:")
    for r in reports:
        print(f"  {r.workload}:")
        for i, f in enumerate(r.facts):
            print(f"    step {i}: {_fact_summary(f)}")
    static = [r.workload for r in reports if r.distinct_signatures == 1]
    print("\n'op seqs' counts distinct operator sequences and 'shapes' distinct (operator, shape) signatures "
          "among the steps:\na static network scores 1 on both; trace-and-replay memory managers assume it does.")
    if static:
        print(f"warning: {', '.join(static)} ran identically on every step")
    if managed:
        print()
        res = managed_demo(MANAGED_FAMILY, budget=budget, policy=policy, steps=steps, preset=preset, seed=seed,
                           timeline=timeline)
        print_managed_demo(res)
        return 0 if res["bit_identical"] else 1
    return 0


def managed_demo(family: str = MANAGED_FAMILY, budget: str = "1/8", policy: str = "lru", steps: int = 4,
                 preset: str = "tiny", seed: int = 0,
                 timeline: str | Path | None = "out/demo/memory_timeline.png") -> dict[str, Any]:
    """Train ``family`` on the CPU under the memory manager (``budget`` of its unmanaged peak, measured on
    the first step) and the same steps on PyTorch alone, plus once with the manager only accounting
    (unlimited budget, nothing moved: the unmanaged curve of the timeline and the bookkeeping cost).
    Writes the timeline PNG if ``timeline`` is given; returns the three runs and the verdicts."""
    import torch

    from .runtime.train import accounting_run, compare_unmanaged, train_managed

    common = dict(steps=steps, preset=preset, seed=seed, device="cpu")
    # one intra-op thread for the three runs: a tiny model gains nothing from more, and on a busy machine
    # OpenMP's spinning threads slow a step down many times over, which would make the times compared noise
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = train_managed(family, budget, policy, **common)
        cmp = compare_unmanaged(run)
        acct = accounting_run(family, **common)
    finally:
        torch.set_num_threads(threads)
    path = None
    if timeline is not None:
        from .runtime.plots import plot_memory_timeline

        path = plot_memory_timeline(run, timeline, reference=acct, title=(
            f"{family} ({preset}) on the CPU under the memory manager: policy {policy}, budget {budget} "
            "of the first step's peak"))
    return {"managed": run, "unmanaged": cmp.unmanaged, "accounting": acct, "comparison": cmp,
            "bit_identical": cmp.losses_identical and cmp.params_identical, "timeline": path,
            "budget": budget, "policy": policy}


def print_managed_demo(res: dict[str, Any]) -> None:
    run, plain, acct, cmp = res["managed"], res["unmanaged"], res["accounting"], res["comparison"]
    st = run.stats or {}
    b = run.budget_bytes or 0
    peak = run.max_managed_peak()
    unmanaged_peak = max(acct.peak_bytes[1:] or acct.peak_bytes)
    print(f"Memory manager: {run.workload} ({run.preset}) on the CPU, policy {res['policy']}, {run.steps} steps, "
          f"budget {res['budget']} of the unmanaged peak")
    measured = st.get("measured_peak_bytes") or run.peak_bytes[0]
    print(f"(the first step runs unmanaged and measures the peak: {format_bytes(run.peak_bytes[0])}, and "
          f"{format_bytes(measured)} with the optimizer state it made, which later steps hold from their start "
          f"-> budget {format_bytes(b)}; on the CPU the budget is logical: offloaded storages are truly released "
          "and restored)\n")
    t_plain, t_run, t_acct = (plain.median_step_seconds(), run.median_step_seconds(), acct.median_step_seconds())
    over = "within it" if peak <= b else f"over by {format_bytes(peak - b)}, {100 * (peak - b) / b:.1f}%"
    rows = [
        ("peak device bytes", format_bytes(unmanaged_peak), f"{format_bytes(peak)}  (budget {format_bytes(b)}: {over})"),
        ("median step time", f"{t_plain:.4f} s", f"{t_run:.4f} s  ({t_run / t_plain:.1f}x)"),
        ("bytes offloaded", "-", f"{format_bytes(st.get('bytes_offloaded', 0))}  ({st.get('evictions', 0)} evictions)"),
        ("bytes prefetched", "-", f"{format_bytes(st.get('bytes_prefetched', 0))}  "
                                  f"({st.get('prefetch_hits', 0)} used in time)"),
        ("fetched on demand", "-", f"{format_bytes(st.get('bytes_fetched_on_demand', 0))}  "
                                   f"({st.get('prefetch_misses', 0)} stalls, {st.get('stall_seconds', 0):.3f} s)"),
        ("host memory peak", "-", format_bytes(st.get("host_bytes_peak", 0))),
    ]
    print(f"{'':<20} {'PyTorch alone':>14}   under the manager")
    for name, a, m in rows:
        print(f"{name:<20} {a:>14}   {m}")
    if res["bit_identical"]:
        print("\nfinal parameters, buffers and optimizer state: bit-identical to PyTorch alone (and every loss)")
    else:
        print(f"\nfinal state NOT bit-identical to PyTorch alone: {', '.join(cmp.differing[:5]) or 'losses'} differ")
    print(f"bookkeeping alone (the manager with an unlimited budget, nothing moved): median step {t_acct:.4f} s "
          f"({t_acct / t_plain:.1f}x PyTorch alone)")
    print("peak device bytes: the manager's count of the device storages it sees (parameters, gradients, optimizer "
          "state, activations, inputs), max over the steps after the first")
    if res["timeline"] is not None:
        print(f"memory timeline: {res['timeline']}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the zoo on CPU and report how dynamic each network is",
                       description=__doc__)
    p.add_argument("--families", nargs="*", default=None, help="families to run (default: all)")
    p.add_argument("--steps", type=int, default=4, help="steps per family (default 4)")
    p.add_argument("--preset", default="tiny", help="preset (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--budget", default="1/8", help="budget of the memory-manager part (default 1/8)")
    p.add_argument("--policy", default="lru", help="policy of the memory-manager part (default lru)")
    p.add_argument("--timeline", default="out/demo/memory_timeline.png", metavar="PNG",
                   help="memory timeline PNG (default out/demo/memory_timeline.png)")
    p.add_argument("--no-managed", dest="managed", action="store_false",
                   help="skip training under the memory manager")
    p.set_defaults(func=lambda a: run(a.families, a.steps, a.preset, a.seed, a.managed, a.budget, a.policy,
                                      a.timeline))
