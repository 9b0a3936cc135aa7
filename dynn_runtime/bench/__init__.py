"""Benchmark harness: every policy on every zoo family under shrinking memory budgets, simulated.

``dynn bench`` records traces (cached), replays them in the simulator against each registered
policy at budgets that are fractions of the unmanaged peak, and scans each family's size knob
upward to find the largest model each policy trains within a fixed device capacity (the
"N times larger training" figure). It writes a JSON results file, a markdown table and PNG plots.

>>> import tempfile
>>> from dynn_runtime.bench import BenchConfig, run_bench, render_markdown
>>> d = tempfile.mkdtemp()
>>> cfg = BenchConfig(families=["varlen"], policies=["none", "lru"], budgets=[1.0, 0.5], preset="tiny",
...                   max_scale=2, cache_dir=d + "/cache", out_dir=d + "/out")
>>> report = run_bench(cfg, progress=False)
>>> [r["overhead"] for r in report.results if r["policy"] == "none" and r["budget_fraction"] == 1.0]
[1.0]
>>> "varlen" in render_markdown(report)
True
"""

from .harness import BenchConfig, BenchReport, TraceCache, run_bench, scaled_overrides
from .report import render_markdown, write_outputs

__all__ = [
    "BenchConfig",
    "BenchReport",
    "TraceCache",
    "run_bench",
    "write_outputs",
    "render_markdown",
    "scaled_overrides",
]
