"""The trace cache: one file per (workload, preset, seed, steps, overrides, schema), re-recorded when bad."""

from __future__ import annotations

import logging

from dynn_runtime.trace import SCHEMA_VERSION, TraceCache


def test_key_names_what_produced_the_trace(tmp_path):
    c = TraceCache(tmp_path)
    a = c.path("moe", "tiny", 0, 2, {"batch": 16})
    assert a.parent == tmp_path
    assert len({a, c.path("moe", "tiny", 0, 2, {"batch": 32}), c.path("moe", "tiny", 1, 2, {"batch": 16}),
                c.path("moe", "tiny", 0, 3, {"batch": 16}), c.path("moe", "small", 0, 2, {"batch": 16})}) == 5
    assert c.path("moe", "tiny", 0, 2) == c.path("moe", "tiny", 0, 2, {})
    assert c.path("moe", "tiny", 0, 2).name == f"moe-tiny-seed0-steps2-base-v{SCHEMA_VERSION}.jsonl.gz"


def test_records_once_then_reuses_and_rerecords_a_bad_file(tmp_path, caplog):
    c = TraceCache(tmp_path / "cache")
    first = c.get("varlen", "tiny", 0, 2)
    assert (c.recorded, c.reused) == (1, 0) and len(first.iterations) == 2
    again = c.get("varlen", "tiny", 0, 2)
    assert (c.recorded, c.reused) == (1, 1)
    assert [len(i.ops) for i in again.iterations] == [len(i.ops) for i in first.iterations]
    path = c.path("varlen", "tiny", 0, 2)
    path.write_bytes(path.read_bytes()[:200])  # cut short mid-stream
    with caplog.at_level(logging.WARNING, logger="dynn_runtime"):
        c.get("varlen", "tiny", 0, 2)
    assert (c.recorded, c.reused) == (2, 1) and "recording it again" in caplog.text
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind


def test_bench_re_exports_it():
    from dynn_runtime import bench
    from dynn_runtime.bench import harness

    assert bench.TraceCache is harness.TraceCache is TraceCache
