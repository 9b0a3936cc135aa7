"""Train the pilot weights shipped in the package (dynn_runtime/pilot/weights/zoo.npz + zoo.json).

Data: zoo traces recorded on the CPU through the bench's trace cache (recorded if missing):
training = tiny seeds 1-3 (4 steps) + small seed 1 (3 steps), every family; held out = tiny seed 10
(3 steps), small seeds 0 (2 steps, what `dynn bench` simulates) and 10 (3 steps). With --synthetic,
training also uses synthetic dynamic networks (dynn_runtime/pilot/synth.py: seeds 0-31, 4 steps;
training data only, never evaluated as a family), as the shipped weights are (`--synthetic`): they
raise leave-one-family-out recall; the provisional prior is fitted on the zoo rows only
(train.fit_prior). The provenance record (data, config, metrics on the held-out
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
from dynn_runtime.pilot.synth import SYNTH_FAMILY, synth_traces

TRAIN = [("tiny", (1, 2, 3), 4), ("small", (1,), 3)]
HELD_OUT = [("tiny", (10,), 3), ("small", (0,), 2), ("small", (10,), 3)]
#: synthetic networks (training data only): seeds, steps
SYNTH = (tuple(range(32)), 4)


def synthetic(cache_dir: str = ".dynn-cache/traces") -> list:
    """The synthetic training traces (recorded on first use, then read from the cache)."""
    return synth_traces(SYNTH[0], steps=SYNTH[1], cache_dir=cache_dir)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--out", default="dynn_runtime/pilot/weights")
    ap.add_argument("--cache-dir", default=".dynn-cache/traces")
    ap.add_argument("--every", type=int, default=2, help="evaluate every n-th decision point")
    ap.add_argument("--synthetic", action="store_true",
                    help="add the synthetic networks to the training data (the shipped weights do)")
    args = ap.parse_args()
    fams = list(models.FAMILIES)
    train_tr = [t for p, seeds, steps in TRAIN for _, t in zoo_traces(fams, [p], seeds, steps, args.cache_dir)]
    if args.synthetic:
        train_tr += synthetic(args.cache_dir)
    test_tr = [t for p, seeds, steps in HELD_OUT for _, t in zoo_traces(fams, [p], seeds, steps, args.cache_dir)]
    t0 = time.time()
    model, info = train(train_tr, PilotConfig(epochs=args.epochs), log=print)
    print(f"trained in {time.time() - t0:.1f} s; losses {info['losses']}")
    metrics = evaluate(model, test_tr, every=args.every)
    print(render_table(metrics))
    out = Path(args.out)
    model.meta["held_out"] = {k: v.as_dict() for k, v in metrics.items()}
    save_model(model, out / "zoo.npz")
    record = {
        "weights": "zoo.npz",
        "training_data": [{"preset": p, "seeds": list(s), "steps": n, "families": fams} for p, s, n in TRAIN],
        "synthetic_data": ({"workload": SYNTH_FAMILY, "generator": "dynn_runtime/pilot/synth.py",
                            "seeds": list(SYNTH[0]), "steps": SYNTH[1], "evaluated": False}
                           if args.synthetic else None),
        "held_out_data": [{"preset": p, "seeds": list(s), "steps": n, "families": fams} for p, s, n in HELD_OUT],
        "config": dataclasses.asdict(model.config),
        "held_out_metrics": {k: v.as_dict() for k, v in metrics.items()},
        "evaluated_every_nth_decision": args.every,
        "command": "python tools/pilot_build_weights.py " + f"--epochs {args.epochs}"
                   + (" --synthetic" if args.synthetic else ""),
        **{k: v for k, v in info.items() if k != "data"},
        "trace_files": [d["path"].split("/")[-1] for d in info["data"]],
    }
    (out / "zoo.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'zoo.npz'} and {out / 'zoo.json'}")


if __name__ == "__main__":
    main()
