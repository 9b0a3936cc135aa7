"""Trace recorder and reader: every ATen operator of training iterations, at storage level.

>>> import tempfile, os
>>> from dynn_runtime.trace import record, read_trace
>>> path = os.path.join(tempfile.mkdtemp(), "moe.jsonl.gz")
>>> _ = record("moe", path, steps=2, preset="tiny")
>>> trace = read_trace(path)
>>> len(trace.iterations), trace.header["workload"]
(2, 'moe')
"""

from .analysis import Timeline, TraceSummary, export_chrome, live_timeline, plot_timeline, summarize
from .cache import TraceCache
from .format import (
    KINDS,
    PHASES,
    SCHEMA_VERSION,
    Iteration,
    Op,
    Storage,
    Trace,
    TraceWriter,
    iter_records,
    read_trace,
)
from .recorder import RecordResult, TraceRecorder, record

__all__ = [
    "SCHEMA_VERSION", "KINDS", "PHASES",
    "record", "RecordResult", "TraceRecorder",
    "read_trace", "iter_records", "TraceWriter", "Trace", "Iteration", "Op", "Storage", "TraceCache",
    "summarize", "TraceSummary", "live_timeline", "Timeline", "plot_timeline", "export_chrome",
]
