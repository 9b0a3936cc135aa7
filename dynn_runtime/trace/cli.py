"""``dynn trace``: record, summarise, plot and export traces."""

from __future__ import annotations

import argparse

from ..memory import format_bytes

_DESCRIPTION = """Record and inspect traces.

  dynn trace WORKLOAD [--preset P] [--steps N] -o FILE   record (same as `dynn trace record ...`)
  dynn trace show FILE                                   summary: ops per phase, bytes by kind, peak, dynamism
  dynn trace plot FILE -o timeline.png                   live memory over time stacked by tensor kind
  dynn trace export FILE --chrome out.json               Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev)
  dynn trace overhead [--families ...] [--preset P]      recording cost: traced / untraced step time

WORKLOAD is a zoo family or path/to/file.py:function. FILE ending in .gz is gzip-compressed."""


def _cmd_plot(a: argparse.Namespace) -> int:
    from . import plot_timeline, read_trace

    print(f"wrote {plot_timeline(read_trace(a.file), a.output)}")
    return 0


def _cmd_export(a: argparse.Namespace) -> int:
    from . import export_chrome, read_trace

    print(f"wrote {export_chrome(read_trace(a.file), a.chrome)}")
    return 0


def _overhead(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .. import models
    from .recorder import measure_overhead

    families = list(models.FAMILIES) if a.families is None else a.families
    rows = [measure_overhead(f, a.preset, a.steps) for f in tqdm(families, desc="overhead", leave=False)]
    print(f"{'family':<11} {'preset':<6} {'untraced s':>10} {'traced s':>9} {'ratio':>6}")
    for r in rows:
        print(f"{r.workload:<11} {r.preset:<6} {r.untraced_s:>10.4f} {r.traced_s:>9.4f} {r.ratio:>6.2f}")
    return 0


def _record(a: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..workload import parse_overrides
    from . import record

    bar = tqdm(total=a.steps, desc=f"trace {a.workload}", unit="iter", disable=a.quiet, leave=False)
    res = record(a.workload, a.output, steps=a.steps, preset=a.preset, seed=a.seed, device=a.device,
                 overrides=parse_overrides(a.set), on_step=lambda _: bar.update(1))
    bar.close()
    size = res.path.stat().st_size
    print(f"wrote {res.path}: {res.iterations} iteration(s), {res.ops} ops, {format_bytes(size)}")
    return 0


def _show(a: argparse.Namespace) -> int:
    import dataclasses
    import json

    from . import read_trace, summarize

    path, as_json = a.file, a.json
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
    from ..workload import add_workload_args

    p = sub.add_parser("trace", help="record, summarise, plot and export traces", description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter, default_subcommand="record")
    ps = p.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    ps.required = True

    r = ps.add_parser("record", help="record a trace of training iterations (the default subcommand)",
                      description="Record a trace of training iterations.")
    add_workload_args(r)
    r.add_argument("--steps", type=int, default=2, help="iterations to record (default 2)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("-o", "--output", required=True, help="trace file (.jsonl or .jsonl.gz)")
    r.add_argument("-q", "--quiet", action="store_true")
    r.set_defaults(func=_record)

    s = ps.add_parser("show", help="summary: ops per phase, bytes by kind, peak, dynamism",
                      description="Summarise a trace: ops per phase, bytes by tensor kind, peak, dynamism.")
    s.add_argument("file")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.set_defaults(func=_show)

    pl = ps.add_parser("plot", help="live memory over time stacked by tensor kind (PNG)",
                       description="Plot live memory over time stacked by tensor kind.")
    pl.add_argument("file")
    pl.add_argument("-o", "--output", required=True, help="PNG file")
    pl.set_defaults(func=_cmd_plot)

    e = ps.add_parser("export", help="Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev)",
                      description="Export a trace for chrome://tracing or ui.perfetto.dev.")
    e.add_argument("file")
    e.add_argument("--chrome", required=True, metavar="OUT.json", help="Chrome/Perfetto JSON output")
    e.set_defaults(func=_cmd_export)

    o = ps.add_parser("overhead", help="recording cost: traced / untraced step time",
                      description="Median step time with and without the recorder, interleaved in one run.")
    o.add_argument("--families", nargs="*", default=None, help="zoo families (default: all)")
    o.add_argument("--preset", default="small")
    o.add_argument("--steps", type=int, default=3)
    o.set_defaults(func=_overhead)
