"""``dynn pilot``: train and evaluate the pilot model, measure its inference cost."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_DESCRIPTION = """The pilot model: learned prediction of tensor accesses (see docs/pilot.md).

  dynn pilot train --traces T.jsonl.gz [DIR ...] -o pilot.npz     train on recorded traces
  dynn pilot eval pilot.npz --traces ... [--json]                  per-family metrics vs baselines
  dynn pilot cost [pilot.npz] --traces ...                         inference cost per decision point

Record traces with `dynn trace WORKLOAD --steps 3 -o FILE` (held-out data: other seeds)."""


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pilot", help="train / evaluate the pilot model (learned access prediction)",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ps = p.add_subparsers(dest="pilot_command", metavar="SUBCOMMAND")
    ps.required = True

    t = ps.add_parser("train", help="train on recorded traces", description="Train a pilot model on traces.")
    t.add_argument("--traces", nargs="+", required=True, metavar="PATH", help="trace files or directories")
    t.add_argument("-o", "--output", required=True, metavar="FILE", help="weights file to write (.npz)")
    t.add_argument("--epochs", type=int, default=None, help="training epochs (default 12)")
    t.add_argument("--group", type=int, default=None, help="operators per decision point (default 16)")
    t.add_argument("--hidden", type=int, default=None, help="hidden width (default 64)")
    t.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    t.add_argument("--exclude", nargs="*", default=[], metavar="WORKLOAD",
                   help="leave these workloads out (leave-one-family-out)")
    t.add_argument("--json", action="store_true", help="print the provenance record as JSON")
    t.set_defaults(func=_cmd_train)

    e = ps.add_parser("eval", help="metrics per family against replay, recency and frequency",
                      description="Evaluate a pilot model on (held-out) traces: bucket accuracy, window "
                                  "recall and rank correlation per family, with the baselines on the same data.")
    e.add_argument("weights", help="weights file (.npz); 'shipped' for the package's own")
    e.add_argument("--traces", nargs="+", required=True, metavar="PATH", help="trace files or directories")
    e.add_argument("--every", type=int, default=1, help="evaluate every n-th decision point (default 1)")
    e.add_argument("--json", action="store_true", help="print JSON instead of a table")
    e.set_defaults(func=_cmd_eval)

    c = ps.add_parser("cost", help="inference cost per decision point vs the simulated iteration time",
                      description="Run the pilot policy in the simulator and time its feature building and "
                                  "inference on this CPU.")
    c.add_argument("weights", nargs="?", default="shipped", help="weights file (default: shipped)")
    c.add_argument("--traces", nargs="+", required=True, metavar="PATH", help="trace files or directories")
    c.add_argument("--device-profile", default="h100", help="device profile (default h100)")
    c.add_argument("--backend", choices=("auto", "native", "numpy"), default="auto",
                   help="inference path: the native C kernel, the numpy reference, or auto (native when "
                        "a C compiler is available; default)")
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(func=_cmd_cost)


def _weights(arg: str) -> Path:
    from .policy import default_weights_path

    return default_weights_path() if arg == "shipped" else Path(arg)


def _cmd_train(args: argparse.Namespace) -> int:
    from .model import PilotConfig, save_model
    from .training.train import train

    cfg = PilotConfig(seed=args.seed)
    for name in ("epochs", "group", "hidden"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    model, info = train(args.traces, cfg, exclude_families=args.exclude,
                        log=lambda msg: print(msg, file=sys.stderr))
    path = save_model(model, args.output)
    if args.json:
        print(json.dumps({"weights": str(path), **info}, indent=1))
    else:
        print(f"wrote {path}: {info['n_params']} parameters, {info['rows']} rows from "
              f"{len(info['data'])} trace(s) ({', '.join(info['families'])}); final loss {info['losses'][-1]:.4f}; "
              f"{info['train_s']:.1f} s")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from .model import load_model
    from .training.data import load_traces
    from .training.evaluate import evaluate, render_table

    path = _weights(args.weights)
    model = load_model(path)
    metrics = evaluate(model, load_traces(args.traces), every=args.every)
    if args.json:
        print(json.dumps({"weights": str(path), "group": model.config.group,
                          "families": {k: v.as_dict() for k, v in metrics.items()}}, indent=1))
    else:
        print(f"weights {path} (group {model.config.group} operators; window = 4 groups)")
        print(render_table(metrics))
    return 0


def _cmd_cost(args: argparse.Namespace) -> int:
    from .model import load_model
    from .training.cost import inference_cost
    from .training.data import load_traces

    model = load_model(_weights(args.weights))
    backend = None if args.backend == "auto" else args.backend
    rows = [inference_cost(tr, model=model, profile=args.device_profile, backend=backend)
            for tr in load_traces(args.traces)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'workload':<12} {'preset':<7} {'ops':>6} {'decisions':>9} {'cands':>6} {'us/decision':>11} "
          f"{'ms/iter':>8} {'iter ms (' + args.device_profile + ')':>15} {'share':>7} {'backend':>8}")
    for r in rows:
        print(f"{r['workload']:<12} {r['preset']:<7} {r['ops']:>6} {r['decisions']:>9} {r['candidates_mean']:>6.0f} "
              f"{r['per_decision_us']:>11.0f} {1e3 * r['inference_s']:>8.2f} {1e3 * r['iteration_time_s']:>15.2f} "
              f"{100 * r['fraction_of_iteration']:>6.1f}% {r['backend']:>8}")
    return 0
