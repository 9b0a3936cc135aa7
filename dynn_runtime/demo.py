"""``make demo`` / ``dynn demo``: the main job on an embedded CPU default.

Trains every zoo family (``tiny`` preset, CPU) for a few steps and reports how dynamic each one
is: how many ATen operators a step runs, how many different operator sequences and shape
signatures the steps produced, how peak memory moved, and what the workload decided each step.
"""

from __future__ import annotations

import argparse

from .memory import format_bytes


def _fact_summary(facts: dict) -> str:
    parts = []
    for k, v in facts.items():
        if isinstance(v, list) and len(v) > 6:
            v = f"[{', '.join(map(str, v[:6]))}, ...]"
        parts.append(f"{k}={v}")
    return "; ".join(parts)


def run(families: list[str] | None = None, steps: int = 4, preset: str = "tiny", seed: int = 0) -> int:
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
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train the zoo on CPU and report how dynamic each network is",
                       description=__doc__)
    p.add_argument("--families", nargs="*", default=None, help="families to run (default: all)")
    p.add_argument("--steps", type=int, default=4, help="steps per family (default 4)")
    p.add_argument("--preset", default="tiny", help="preset (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.set_defaults(func=lambda a: run(a.families, a.steps, a.preset, a.seed))
