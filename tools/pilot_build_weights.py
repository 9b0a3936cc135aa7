"""Train the pilot weights shipped in the package (dynn_runtime/pilot/weights/zoo.npz + zoo.json).

Data: zoo traces recorded on the CPU through the bench's trace cache (recorded if missing):
training = tiny seeds 1-3 (4 steps) + small seed 1 (3 steps), every family; held out = tiny seed 10
(3 steps), small seeds 0 (2 steps, what `dynn bench` simulates) and 10 (3 steps). Training also
holds the families' depth-scaled models (tiny x2 and x4 depth, seeds 1-2, 3 steps): with only tiny and
small the network had never seen iterations of thousands of operators, and on deeper models it
extrapolated its distance features (evoformer at x8 depth: 55% window recall). The held-out record
adds x8 depth (seed 0, what `dynn bench --grid-depth 8` simulates), deeper than any training trace. With --synthetic,
training also uses synthetic dynamic networks (dynn_runtime/pilot/synth.py: seeds 0-63, 4 steps;
training data only, never evaluated as a family), as the shipped weights are (`--synthetic`): they
raise leave-one-family-out recall; the provisional prior is fitted on the zoo rows only
(train.fit_prior). tree_lstm's traces count three times (REPEAT). The provenance record (data, config, metrics on the held-out
traces, date, git commit) is written beside the weights.

    python tools/pilot_build_weights.py --synthetic [--epochs 12] [--out dynn_runtime/pilot/weights]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from dynn_runtime import models
from dynn_runtime.pilot import PilotConfig, evaluate, render_table, save_model, train, zoo_traces
from dynn_runtime.pilot.training.synth import EXTRA_STAGES, GENERATOR_VERSION, SYNTH_FAMILY, synth_traces

TRAIN = [("tiny", (1, 2, 3), 4), ("small", (1,), 3)]
HELD_OUT = [("tiny", (10,), 3), ("small", (0,), 2), ("small", (10,), 3)]
#: synthetic networks (training data only): seeds, steps. 64 since session 15 (32 before): with the
#: per-level-state tree cells, leave-tree_lstm-out recall rose from 80.7% to 84.4% (one seed)
SYNTH = (tuple(range(64)), 4)
#: the synthetic networks' extra stages (synth.EXTRA_STAGES) in the shipped weights' training data:
#: none, so generator 3's networks are generator 2's. With `--synth-extra graph,mod` the pilot is
#: better out of the zoo but regresses the zoo's tree_lstm and the validation cases' simulated time;
#: with LayerDrop too, the zoo regresses further (figures: docs/benchmarks.md, session 21)
SYNTH_EXTRA: tuple[str, ...] = ()
#: families whose training traces count more than once. tree_lstm, whose order of accesses the
#: batch's trees decide, is the hardest family and gave 6.5% of the training rows (evoformer 30%);
#: counted three times its held-out recall rose by 1.5-2 points (seed 2: 93.0 -> 94.7%, same
#: features) while the other families stayed within their seed-to-seed spread
REPEAT = {"tree_lstm": 3}
#: depth-scaled zoo models (``scaled_overrides(..., "depth")``, tiny preset): scales, seeds, steps
TRAIN_DEPTH = ((2, 4), (1, 2), 3)
HELD_OUT_DEPTH = ((8,), (0,), 2)
#: The shipped weights' training seed, chosen on validation data by `python
#: tools/pilot_experiments.py seeds` (out/pilot/seeds.json): seeds 0-3 trained alike, each simulated
#: on the seed-10 traces (`small` and `tiny`, every family, budgets 1/4 and 1/8, the cases oracle can
#: run; never the seed-0 traces the bench and docs report), pilot / oracle iteration time.
SHIPPED_SEED = 0
SEED_SELECTION = {
    "candidates": [0, 1, 2, 3],
    "validation": "seed-10 traces, small and tiny, budgets 1/4 and 1/8 (11 feasible cases), h100 profile",
    "geomean_pilot_over_oracle": {"0": 1.0611, "1": 1.0821, "2": 1.0646, "3": 1.1032},
    "worst_pilot_over_oracle": {"0": 1.411, "1": 1.405, "2": 1.401, "3": 1.506},
    "worst_case": "skipnet tiny seed 10 at 1/4 for every seed (1.40x-1.51x; the code and weights of 8c2d554: 1.40x)",
    "note": "session 15 (103 features, 64 synthetic networks, tree_lstm counted 3x); seed 2 before",
}
#: decision points per training iteration at most (the deepest evoformer iterations are thinned;
#: every tiny and small iteration has fewer)
MAX_DECISIONS = 320


def depth_traces(spec: tuple, cache_dir: str = ".dynn-cache/traces") -> list:
    """The tiny zoo models made deeper (families with a depth knob), recorded on first use."""
    from dynn_runtime.bench.harness import TraceCache, scaled_overrides

    cache = TraceCache(cache_dir)
    scales, seeds, steps = spec
    return [cache.get(fam, "tiny", seed, steps, scaled_overrides(fam, "tiny", k, "depth"))
            for k in scales for seed in seeds for fam in models.FAMILIES if models.family(fam).depth_knob]


def synthetic(cache_dir: str = ".dynn-cache/traces", extra: tuple[str, ...] | None = None) -> list:
    """The synthetic training traces (recorded on first use, then read from the cache); ``extra``:
    the extra stages they may hold (None: :data:`SYNTH_EXTRA`)."""
    return synth_traces(SYNTH[0], steps=SYNTH[1], cache_dir=cache_dir, extra=SYNTH_EXTRA if extra is None else extra)


def training_traces(with_synthetic: bool = True, cache_dir: str = ".dynn-cache/traces",
                    extra: tuple[str, ...] | None = None) -> list:
    """The shipped weights' training traces: the zoo splits, the depth-scaled models, tree_lstm's
    repeats (REPEAT) and, with ``with_synthetic``, the synthetic networks (``extra``: see :func:`synthetic`)."""
    fams = list(models.FAMILIES)
    out = [t for p, seeds, steps in TRAIN for _, t in zoo_traces(fams, [p], seeds, steps, cache_dir)]
    out += depth_traces(TRAIN_DEPTH, cache_dir)
    out += [t for t in out for _ in range(REPEAT.get(t.header.get("workload"), 1) - 1)]
    return out + (synthetic(cache_dir, extra) if with_synthetic else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--out", default="dynn_runtime/pilot/weights")
    ap.add_argument("--cache-dir", default=".dynn-cache/traces")
    ap.add_argument("--every", type=int, default=2, help="evaluate every n-th decision point")
    ap.add_argument("--synthetic", action="store_true",
                    help="add the synthetic networks to the training data (the shipped weights do)")
    ap.add_argument("--seed", type=int, default=SHIPPED_SEED,
                    help=f"initialisation and shuffling seed (default {SHIPPED_SEED}: see SHIPPED_SEED)")
    ap.add_argument("--synth-extra", default=",".join(SYNTH_EXTRA), metavar="KINDS",
                    help=f"comma-separated extra stages of the synthetic networks, among {','.join(EXTRA_STAGES)} "
                         f"(default: {','.join(SYNTH_EXTRA) or 'none'}, the shipped weights')")
    args = ap.parse_args()
    extra = tuple(k for k in args.synth_extra.split(",") if k)
    unknown = set(extra) - set(EXTRA_STAGES)
    if unknown:
        ap.error(f"--synth-extra: {sorted(unknown)} not among {EXTRA_STAGES}")
    fams = list(models.FAMILIES)
    train_tr = training_traces(args.synthetic, args.cache_dir, extra)
    test_tr = [t for p, seeds, steps in HELD_OUT for _, t in zoo_traces(fams, [p], seeds, steps, args.cache_dir)]
    t0 = time.time()
    model, info = train(train_tr, PilotConfig(epochs=args.epochs, seed=args.seed), log=print,
                        max_decisions=MAX_DECISIONS)
    print(f"trained in {time.time() - t0:.1f} s; losses {info['losses']}")
    metrics = evaluate(model, test_tr, every=args.every)
    print(render_table(metrics))
    deeper = evaluate(model, depth_traces(HELD_OUT_DEPTH, args.cache_dir), every=4 * args.every)
    print("deeper than any training trace (tiny, x8 depth):")
    print(render_table(deeper))
    out = Path(args.out)
    model.meta["held_out"] = {k: v.as_dict() for k, v in metrics.items()}
    save_model(model, out / "zoo.npz")
    record = {
        "weights": "zoo.npz",
        "training_data": [{"preset": p, "seeds": list(s), "steps": n, "families": fams} for p, s, n in TRAIN],
        "synthetic_data": ({"workload": SYNTH_FAMILY, "generator": "dynn_runtime/pilot/synth.py",
                            "seeds": list(SYNTH[0]), "steps": SYNTH[1], "evaluated": False,
                            "generator_version": GENERATOR_VERSION, "extra_stages": list(extra)}
                           if args.synthetic else None),
        "repeated_families": REPEAT,
        "held_out_data": [{"preset": p, "seeds": list(s), "steps": n, "families": fams} for p, s, n in HELD_OUT],
        "config": dataclasses.asdict(model.config),
        "held_out_metrics": {k: v.as_dict() for k, v in metrics.items()},
        "depth_data": {"preset": "tiny", "train": {"scales": list(TRAIN_DEPTH[0]), "seeds": list(TRAIN_DEPTH[1]),
                                                   "steps": TRAIN_DEPTH[2]},
                       "held_out": {"scales": list(HELD_OUT_DEPTH[0]), "seeds": list(HELD_OUT_DEPTH[1]),
                                    "steps": HELD_OUT_DEPTH[2]}},
        "held_out_deeper_metrics": {k: v.as_dict() for k, v in deeper.items()},
        "evaluated_every_nth_decision": args.every,
        "command": "python tools/pilot_build_weights.py " + f"--epochs {args.epochs} --seed {args.seed}"
                   + (" --synthetic" if args.synthetic else "")
                   + (f" --synth-extra {','.join(extra)}" if extra != SYNTH_EXTRA else ""),
        "seed_selection": SEED_SELECTION if args.seed == SHIPPED_SEED else None,
        **{k: v for k, v in info.items() if k != "data"},
        "trace_files": [d["path"].split("/")[-1] for d in info["data"]],
    }
    (out / "zoo.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'zoo.npz'} and {out / 'zoo.json'}")


if __name__ == "__main__":
    main()
