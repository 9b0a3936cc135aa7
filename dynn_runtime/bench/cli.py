"""``dynn bench``: every policy on every zoo family under shrinking budgets, simulated; plots and tables."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ..budget import Budget
from ..errors import BudgetError, ConfigError

_DESCRIPTION = """Benchmark the memory policies in the simulator.

Records a trace per family (cached in .dynn-cache/traces/), simulates each policy at each budget
(a fraction of the peak under `none`) on a device profile, and scans each family's size knob upward
for the largest model each policy trains within the x1 peak at <= 1.5x the unlimited-memory time.
Writes a JSON results file, a markdown table beside it, and PNG plots into --out; prints the table.

With --real, measures the live memory manager instead (dynn_runtime.bench.real): per family, the
iteration time of each policy at a cap of --cap of the unlimited peak (CUDA: a hard cap with
torch.cuda.set_per_process_memory_fraction) against unlimited memory, save_on_cpu(pin_memory=True)
and torch.utils.checkpoint per repeated block; the largest size each trains under a fixed cap
against PyTorch alone; and the simulator's prediction from a trace recorded on the same device.
--device cpu runs it with a logical budget (exercises the code; the figures need a GPU).

The simulated grid charges the live manager's own host cost (the simulator's host cost: seconds per
operator, per decision point and per storage moved, measured by --overhead) to every policy that runs in the manager;
--host-cost none turns it off, a number sets it. The results file says which was used.

With --overhead, measures what the live manager costs on the host against PyTorch alone
(dynn_runtime.bench.overhead): small ATen operators per policy and event source; every zoo family
and examples/my_workload.py:build with a budget above the peak (none, lru, pilot) and lru at 1/2
with where the time goes; the pilot's cost per decision point. Prints a markdown table, writes
--json (default DIR/overhead.json, DIR from --out); --write-calibration stores the figures the simulator
charges in dynn_runtime/sim/host_cost.json, per device (--device cpu, the default, or cuda: the simulator's
GPU profiles charge a GPU's figures where they were measured)."""


def _budgets(text: str) -> list[float]:
    try:
        return [Budget.parse_fraction(item, "bench") for item in text.replace(" ", "").split(",") if item]
    except BudgetError as exc:
        raise argparse.ArgumentTypeError(f"{exc} --budgets takes comma-separated fractions like 1,0.5,0.25 "
                                         "or 1,1/2,1/4.") from None


def _scales(text: str) -> list[float]:
    from fractions import Fraction

    try:
        out = [float(Fraction(item)) for item in text.replace(" ", "").split(",") if item]
    except (ValueError, ZeroDivisionError):
        out = []
    if not out or any(v <= 0 for v in out):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive multiples like 1/2,1,2,4; got {text!r}.")
    return out


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="simulate every policy on every family under shrinking budgets",
                       description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=[], metavar="FAMILY",
                   help="zoo families, path/to/file.py:function workloads or recorded trace files (*.jsonl.gz) "
                        "(default: every zoo family)")
    p.add_argument("--policies", nargs="+", default=[], metavar="POLICY",
                   help="policies (default: every registered policy the simulator can run)")
    p.add_argument("--budgets", type=_budgets, default=None, metavar="F,F,...",
                   help="budget fractions of the peak under none (default 1,0.5,0.25,0.125,0.0625; "
                        "--quick: down to 0.125)")
    p.add_argument("--device-profile", default="h100", help="device profile: h100, h200, a100, v100 (default h100)")
    p.add_argument("--preset", default=None, help="preset of the budget grid (default small; --quick: tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    p.add_argument("--steps", type=int, default=None,
                   help="iterations recorded per trace, >= 2 (default 2); --real: steps per run (default 5, --quick 3)")
    p.add_argument("--quick", action="store_true",
                   help="tiny preset, budgets down to 1/8, max-size scales up to 8 (a few minutes)")
    p.add_argument("--max-scale", type=int, default=None,
                   help="largest size-knob multiple of the max-size scan (default 64; --quick: 8; 0 skips it)")
    p.add_argument("--max-size-preset", default="tiny", help="preset the max-size scan scales (default tiny)")
    p.add_argument("--grid-depth", type=int, default=1, metavar="N",
                   help="multiply each family's depth (layers, blocks) by N for the budget grid (default 1)")
    p.add_argument("--max-size-knob", default="size", choices=("size", "depth"),
                   help="what the max-size scan multiplies: size (batch, residues; default) or depth (layers, blocks)")
    p.add_argument("--overhead-limit", type=float, default=1.5, metavar="X",
                   help="a scale is trainable at <= X times the unlimited-memory time (default 1.5)")
    p.add_argument("--json", default=None, metavar="OUT.json",
                   help="results file (default OUT/bench-<profile>-<preset>-<date>.json)")
    p.add_argument("--out", default="out/bench", metavar="DIR", help="output directory (default out/bench)")
    p.add_argument("--cache-dir", default=".dynn-cache/traces", help="trace cache (default .dynn-cache/traces)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--host-cost", default="calibrated", metavar="calibrated|none|S[,S[,S]]",
                   help="the live manager's host cost charged in the simulated grid (the simulator's host cost): the shipped "
                        "calibration (default), none, or seconds per operator[,per decision point[,per "
                        "storage moved]]")
    p.add_argument("--host-source", default="auto", choices=("auto", "python", "native"),
                   help="which event source's calibration is charged (default auto: native where measured)")
    o = p.add_argument_group("--overhead: the live manager's host cost against PyTorch alone")
    o.add_argument("--overhead", action="store_true", help="measure the manager's host cost (--device: cpu or cuda)")
    o.add_argument("--reps", type=int, default=None, help="--overhead: operator microbenchmark repetitions "
                   "(default 41, --quick 9)")
    o.add_argument("--events", nargs="+", default=[], choices=("python", "native"), metavar="SOURCE",
                   help="--overhead: event sources (default: every one this build runs)")
    o.add_argument("--write-calibration", nargs="?", const="", default=None, metavar="PATH",
                   help="--overhead: write the simulator's host-cost calibration (default "
                        "dynn_runtime/sim/host_cost.json)")
    g = p.add_argument_group("--real: the live memory manager, measured")
    g.add_argument("--real", action="store_true", help="measure the live manager instead of simulating")
    g.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="--real: device (default cuda); --overhead: where the manager runs (default cpu; cuda "
                        "measures the GPU's host cost, calibrated under devices.cuda)")
    g.add_argument("--cap", type=_budgets, default=None, metavar="F",
                   help="--real: the cap as a fraction of the unlimited peak (default 1/8)")
    g.add_argument("--no-hard-cap", dest="hard_cap", action="store_false",
                   help="--real on CUDA: logical budget only, no set_per_process_memory_fraction")
    g.add_argument("--no-predict", dest="predict", action="store_false",
                   help="--real: skip the simulator's prediction (no trace recorded)")
    s = p.add_argument_group("--scale: max trainable size and budgets at GPU scale (shape-only traces)")
    s.add_argument("--scale", action="store_true",
                   help="record each family at --preset (default large) without its values and find the largest "
                        "size knob each policy trains on the profile's memory (dynn_runtime.bench.scale)")
    s.add_argument("--knob-scales", type=_scales, default=None, metavar="S,S,...",
                   help="--scale: multiples of the preset's size knob (default 1/4,1/2,1,2,4,8,16,32)")
    s.add_argument("--capacity-gb", type=float, default=None, metavar="GB",
                   help="--scale: device capacity in GB (default the profile's memory)")
    p.set_defaults(func=_cmd_bench)


def _write_partial(cfg: object) -> object:
    """Where ``dynn bench --scale`` keeps the results so far: ``<json>.partial`` (or in ``--out``)."""
    import json

    from ..results import strict_json

    target = Path(cfg.json_path or Path(cfg.out_dir) / "scale-partial.json")
    path = target.with_name(target.name + ".partial")

    def write(report: object) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(strict_json(report.to_json()), indent=1))

    return write


def _cmd_scale(args: argparse.Namespace) -> int:
    from .scale import ScaleConfig, render_scale_markdown, run_scale, write_scale_outputs

    kw = {}
    if args.knob_scales:
        kw["knob_scales"] = list(args.knob_scales)
    if args.budgets:
        kw["budgets"] = list(args.budgets)
    cfg = ScaleConfig(
        families=list(args.families), policies=list(args.policies), preset=args.preset or "large",
        device_profile=args.device_profile, seed=args.seed, steps=args.steps or 2, host_cost=args.host_cost,
        capacity_bytes=int(args.capacity_gb * 1e9) if args.capacity_gb else None, cache_dir=args.cache_dir,
        out_dir=args.out, json_path=args.json, **kw,
    )
    cfg.resolved()  # validate before any work
    t0 = time.perf_counter()
    say = None if args.quiet else (lambda text: print(f"dynn bench --scale: {text}", file=sys.stderr, flush=True))
    report = run_scale(cfg, progress=say, partial=_write_partial(cfg))
    paths = write_scale_outputs(report)
    print(render_scale_markdown(report))
    print(f"wrote {paths['json']}, {paths['markdown']} and {len(paths['plots'])} plot(s); "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_real(args: argparse.Namespace) -> int:
    from .real import RealBenchConfig, run_real_bench
    from .real_report import render_real_markdown, write_real_outputs

    if args.cap is not None and len(args.cap) != 1:
        raise ConfigError(f"bench: --cap takes one fraction, e.g. 1/8; got {len(args.cap)}.")
    cfg = RealBenchConfig(
        families=list(args.families), policies=list(args.policies),
        fraction=args.cap[0] if args.cap else 0.125, device=args.device or "cuda", preset=args.preset, steps=args.steps,
        seed=args.seed, quick=args.quick, max_scale=args.max_scale, hard_cap=args.hard_cap, simulate=args.predict,
        device_profile=args.device_profile if args.device_profile != "h100" else None,
        out_dir=args.out, json_path=args.json,
    )
    cfg.resolved()  # validate before any work
    t0 = time.perf_counter()
    say = None if args.quiet else (lambda text: print(f"dynn bench --real: {text}", file=sys.stderr, flush=True))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dynn: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    log = logging.getLogger("dynn_runtime")
    log.addHandler(handler)
    try:
        report = run_real_bench(cfg, progress=say)
    finally:
        log.removeHandler(handler)
    paths = write_real_outputs(report)
    print(render_real_markdown(report))
    print(f"wrote {paths['json']} and {paths['markdown']}; {time.perf_counter() - t0:.1f} s")
    return 0


def _cmd_overhead(args: argparse.Namespace) -> int:
    from .overhead import (
        OverheadConfig,
        render_overhead_markdown,
        run_overhead,
        write_calibration,
        write_overhead,
    )

    cfg = OverheadConfig(
        workloads=list(args.families), policies=list(args.policies) or ["none", "lru", "pilot"],
        sources=list(args.events), preset=args.preset, steps=args.steps, reps=args.reps, seed=args.seed,
        quick=args.quick, json_path=args.json or str(Path(args.out) / "overhead.json"), device=args.device or "cpu",
    )
    cfg.validate()
    t0 = time.perf_counter()
    report = run_overhead(cfg, progress=not args.quiet)
    paths = write_overhead(report)
    print(render_overhead_markdown(report))
    print(f"wrote {paths['json']} and {paths['markdown']}; {time.perf_counter() - t0:.1f} s")
    if args.write_calibration is not None:
        path = write_calibration(report, args.write_calibration or None)
        print(f"wrote the host-cost calibration ({', '.join(report.calibration)}, measured on {cfg.device}) to {path}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .harness import BenchConfig, run_bench
    from .report import render_markdown, write_outputs

    if args.real:
        return _cmd_real(args)
    if args.overhead:
        return _cmd_overhead(args)
    if args.scale:
        return _cmd_scale(args)
    if args.steps is None:
        args.steps = 2

    if args.budgets is not None and not args.budgets:
        raise ConfigError("bench: --budgets is empty; expected fractions like 1,0.5,0.25.")
    cfg = BenchConfig(
        families=list(args.families), policies=list(args.policies), budgets=args.budgets,
        preset=args.preset, seed=args.seed, steps=args.steps, device_profile=args.device_profile,
        quick=args.quick, max_scale=args.max_scale, max_size_preset=args.max_size_preset,
        grid_depth=args.grid_depth, max_size_knob=args.max_size_knob, overhead_limit=args.overhead_limit,
        out_dir=args.out, json_path=args.json, cache_dir=args.cache_dir,
        host_cost=args.host_cost, host_source=args.host_source,
    )
    cfg.resolved()  # validate before any work
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dynn: %(levelname)s: %(message)s"))
    handler.setLevel(logging.WARNING)
    log = logging.getLogger("dynn_runtime")
    log.addHandler(handler)
    t0 = time.perf_counter()
    try:
        report = run_bench(cfg, progress=not args.quiet)
    finally:
        log.removeHandler(handler)
    paths = write_outputs(report)
    print(render_markdown(report))
    m = report.meta
    print(f"wrote {paths['json']}, {paths['markdown']} and {len(paths['plots'])} plot(s) in {report.config.out_dir}")
    print(f"traces: {m['traces_recorded']} recorded, {m['traces_reused']} from the cache; "
          f"{time.perf_counter() - t0:.1f} s")
    return 0
