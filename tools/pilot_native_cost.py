"""Pilot inference cost, numpy reference vs the native kernel (dynn_runtime/pilot/kernel/), in one process.

    python tools/pilot_native_cost.py [FAMILY ...] [--repeats N] [--variants incremental,full]

Per family (small preset, seed 0, the bench's traces as in `tools/pilot_experiments.py cost`):

* one decision point (the first past the middle of the last iteration) timed best-of-100 at 16..1024
  rows, both backends (`decision_cost_curve`), and its least-squares fit `a + b * rows`;
* whole runs of the pilot policy at budget 1/2 (`inference_cost`), the backends alternating, best of
  `--repeats` each: decision points, rows scored, inference seconds, and whether the simulated
  iteration is the same.

A shared, noisy CPU is why the backends alternate and the best of several runs is kept. Writes
out/pilot/native_cost.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dynn_runtime import models
from dynn_runtime.pilot import kernel as native
from dynn_runtime.pilot import load_model, zoo_traces
from dynn_runtime.pilot.policy import default_weights_path
from dynn_runtime.pilot.training.cost import decision_cost_curve, fit_decision_cost, inference_cost

sys.path.insert(0, str(Path(__file__).parent))
from pilot_lab import LabPilot  # noqa: E402

OUT = Path("out/pilot")
BACKENDS = ("numpy", "native")
VARIANTS = {"incremental": {}, "full": {"incremental": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(models.FAMILIES))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variants", default="incremental")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"native kernel unavailable: {native.reason()}")
    print(f"kernel: {native.reason()}", flush=True)
    model = load_model(default_weights_path())
    variants = [v for v in args.variants.split(",") if v]
    curves, runs = [], []
    for _, tr in zoo_traces(args.families, ["small"], (0,), 2):
        fam = tr.header["workload"]
        for b in BACKENDS:
            c = decision_cost_curve(tr, model=model, backend=b)
            curves.append(c)
            print(f"{fam:<11} {b:<6} one decision point, best of 100: " + ", ".join(
                f"{p['candidates_mean']} rows {p['per_decision_us']:.1f} us" for p in c["points"])
                + f"  -> {1e6 * c['a_s']:.1f} us + {1e6 * c['b_s']:.3f} us/row", flush=True)
        for variant in variants:
            best: dict[str, dict] = {}
            for _ in range(args.repeats):
                for b in BACKENDS:
                    t0 = time.perf_counter()
                    r = inference_cost(tr, model=model, budget=0.5, repeats=1, backend=b, policy=LabPilot,
                                       **VARIANTS[variant])
                    r["wall_s"] = time.perf_counter() - t0
                    if b not in best or r["inference_s"] < best[b]["inference_s"]:
                        best[b] = r
            for b in BACKENDS:
                best[b]["variant"] = variant
                runs.append(best[b])
            n, c = best["numpy"], best["native"]
            same = n["sim_iteration_s"] == c["sim_iteration_s"]
            print(f"{fam:<11} {variant:<11} {n['decisions']:>4} decisions, {n['candidates_mean']:>6.1f} rows/decision: "
                  f"numpy {1e3 * n['inference_s']:7.2f} ms ({n['per_decision_us']:6.1f} us/decision), "
                  f"native {1e3 * c['inference_s']:7.2f} ms ({c['per_decision_us']:6.1f} us/decision) "
                  f"= {n['inference_s'] / c['inference_s']:.1f}x; same simulated iteration: {same}", flush=True)
    fits = {"micro": {b: fit_decision_cost([p for c in curves for p in c["points"]], backend=b) for b in BACKENDS}}
    for variant in variants:
        fits[variant] = {b: fit_decision_cost([r for r in runs if r["variant"] == variant], backend=b) for b in BACKENDS}
    for name, per in fits.items():
        print(f"{name:<11} " + "; ".join(f"{b}: {1e6 * a:.1f} us + {1e6 * s:.3f} us/row" for b, (a, s) in per.items()))
    print("\n| family | variant | decisions | rows/decision | numpy ms | native ms | speed-up |\n|---|---|---|---|---|---|---|")
    for n, c in zip(runs[::2], runs[1::2]):
        print(f"| {n['workload']} | {n['variant']} | {n['decisions']} | {n['candidates_mean']:.1f} | "
              f"{1e3 * n['inference_s']:.2f} | {1e3 * c['inference_s']:.2f} | {n['inference_s'] / c['inference_s']:.1f}x |")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "native_cost.json").write_text(json.dumps({
        "kernel": native.reason(), "curves": curves, "runs": runs,
        "fit": {k: {b: {"a_s": a, "b_s": s} for b, (a, s) in v.items()} for k, v in fits.items()},
    }, indent=1, default=str) + "\n")
    print(f"wrote {OUT / 'native_cost.json'}")


if __name__ == "__main__":
    main()
