"""``dynn trace``: record, summarise, plot and export traces."""

from __future__ import annotations

import argparse

from ..memory import format_bytes

_SUB = ("record", "show", "plot", "export", "overhead")

_DESCRIPTION = """Record and inspect traces.

  dynn trace WORKLOAD [--preset P] [--steps N] -o FILE   record (same as `dynn trace record ...`)
  dynn trace show FILE                                   summary: ops per phase, bytes by kind, peak, dynamism
  dynn trace plot FILE -o timeline.png                   live memory over time stacked by tensor kind
  dynn trace export FILE --chrome out.json               Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev)
  dynn trace overhead [--families ...] [--preset P]      recording cost: traced / untraced step time

WORKLOAD is a zoo family or path/to/file.py:function. FILE ending in .gz is gzip-compressed."""


def _record_parser() -> argparse.ArgumentParser:
    from ..cli import add_workload_args

    p = argparse.ArgumentParser(prog="dynn trace [record]", description="Record a trace of training iterations.")
    add_workload_args(p)
    p.add_argument("--steps", type=int, default=2, help="iterations to record (default 2)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("-o", "--output", required=True, help="trace file (.jsonl or .jsonl.gz)")
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def _run(args: argparse.Namespace) -> int:
    argv = list(args.rest)
    if not argv or argv[0] in ("-h", "--help"):
        print(_DESCRIPTION)
        return 0 if argv else 2
    cmd = argv.pop(0) if argv[0] in _SUB else "record"
    if cmd == "record":
        return _record(_record_parser().parse_args(argv))
    if cmd == "overhead":
        return _overhead(argv)
    p = argparse.ArgumentParser(prog=f"dynn trace {cmd}")
    p.add_argument("file")
    if cmd == "plot":
        p.add_argument("-o", "--output", required=True, help="PNG file")
        a = p.parse_args(argv)
        from . import plot_timeline, read_trace

        print(f"wrote {plot_timeline(read_trace(a.file), a.output)}")
        return 0
    if cmd == "export":
        p.add_argument("--chrome", required=True, metavar="OUT.json", help="Chrome/Perfetto JSON output")
        a = p.parse_args(argv)
        from . import export_chrome, read_trace

        print(f"wrote {export_chrome(read_trace(a.file), a.chrome)}")
        return 0
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    a = p.parse_args(argv)
    return _show(a.file, a.json)


def _overhead(argv: list[str]) -> int:
    from tqdm import tqdm

    from .. import models
    from .recorder import measure_overhead

    p = argparse.ArgumentParser(prog="dynn trace overhead",
                                description="Median step time with and without the recorder, interleaved in one run.")
    p.add_argument("--families", nargs="*", default=list(models.FAMILIES))
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    rows = [measure_overhead(f, a.preset, a.steps) for f in tqdm(a.families, desc="overhead", leave=False)]
    print(f"{'family':<11} {'preset':<6} {'untraced s':>10} {'traced s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r.workload:<11} {r.preset:<6} {r.untraced_s:>10.4f} {r.traced_s:>9.4f} {r.ratio:>6.2f}")
    return 0


def _record(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..cli import _parse_overrides
    from . import record

    bar = tqdm(total=a.steps, desc=f"trace {a.workload}", unit="iter", disable=a.quiet, leave=False)
    res = record(a.workload, a.output, steps=a.steps, preset=a.preset, seed=a.seed, device=a.device,
                 overrides=_parse_overrides(a.set), on_step=lambda _: bar.update(1))
    bar.close()
    size = res.path.stat().st_size
    print(f"wrote {res.path}: {res.iterations} iteration(s), {res.ops} ops, {format_bytes(size)}")
    return 0


def _show(path: str, as_json: bool) -> int:
    import dataclasses
    import json

    from . import read_trace, summarize

    s = summarize(read_trace(path))
    if as_json:
        print(json.dumps(dataclasses.asdict(s), indent=1))
        return 0
    print(f"{path}: {s.workload} ({s.preset}) on {s.device}, torch {s.torch}, {s.iterations} iteration(s)")
    print("ops per phase:")
    for i, (ph, peak) in enumerate(zip(s.ops_per_phase, s.peak_per_iteration)):
        print(f"  iteration {i}: " + ", ".join(f"{k} {v}" for k, v in ph.items())
              + f"; total {sum(ph.values())}; peak live {format_bytes(peak)}")
    print("bytes by tensor kind (storages over the whole trace):")
    for k, b in s.bytes_by_kind.items():
        if s.count_by_kind[k]:
            print(f"  {k:<10} {format_bytes(b):>10} in {s.count_by_kind[k]} storages")
    print(f"peak live bytes: {format_bytes(s.peak_live_bytes)}")
    if s.sequence_similarity:
        sims = ", ".join(f"{x:.3f}" for x in s.sequence_similarity)
        print(f"op-sequence similarity to the previous iteration (1.0 = identical): {sims}")
    print(f"distinct operators: {s.distinct_ops}; most frequent: "
          + ", ".join(f"{n} x{c}" for n, c in s.top_ops[:5]))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record, summarise, plot and export traces", description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_run)
