"""Trace recorder and reader: round trip, storage identity, live bytes, kinds, corruption errors."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch import nn

from dynn_runtime import models
from dynn_runtime.errors import TraceError
from dynn_runtime.trace import (
    SCHEMA_VERSION,
    TraceRecorder,
    TraceWriter,
    export_chrome,
    live_timeline,
    plot_timeline,
    read_trace,
    record,
    summarize,
)
from dynn_runtime.trace.format import MAGIC


def _write_custom(path, model, body):
    """Record one hand-written iteration: body(rec) runs the ops under phases."""
    rec = TraceRecorder(model)
    with TraceWriter(path) as w:
        w.write({"t": "H", "magic": MAGIC, "schema": SCHEMA_VERSION, "device": "cpu", "workload": "hand"})
        rec.begin_iteration(0)
        try:
            body(rec)
        finally:
            w.write_many(rec.end_iteration())
    return read_trace(path)


def test_storage_identity_views_and_inplace(tmp_path):
    model = nn.Linear(4, 4, bias=False)
    keep = {}

    def body(rec):
        with rec.phase("forward"):
            a = torch.ones(8, 8)            # op 0: alloc A (256 B)
            v = a.view(64)                  # op 1: view of A
            v.mul_(2)                       # op 2: in-place on A through the view
            t = a.t()                       # op 3: transpose view of A
            b = t.contiguous()              # op 4: new storage B
            c = b[2:5].clone()              # op 5: slice view of B, op 6: clone -> C (3*8*4 = 96 B)
            keep.update(a=a, b=b, c=c)
            del v, t

    tr = _write_custom(tmp_path / "h.jsonl", model, body)
    ops = tr.iterations[0].ops
    names = [o.name for o in ops]
    assert names == ["aten::ones", "aten::view", "aten::mul_.Tensor", "aten::t", "aten::clone", "aten::slice.Tensor",
                     "aten::clone"], names
    sid_a = ops[0].outputs[0]
    assert ops[0].allocs == (sid_a,)
    assert ops[1].inputs == (sid_a,) and ops[1].outputs == (sid_a,) and ops[1].allocs == ()
    assert ops[2].writes == (sid_a,) and ops[2].outputs == (sid_a,)
    assert ops[3].outputs == (sid_a,)
    sid_b = ops[4].outputs[0]
    assert sid_b != sid_a and ops[4].inputs == (sid_a,) and ops[4].allocs == (sid_b,)
    assert ops[5].inputs == (sid_b,) and ops[5].outputs == (sid_b,)
    sid_c = ops[6].outputs[0]
    assert len({sid_a, sid_b, sid_c}) == 3
    st = tr.storages
    assert (st[sid_a].nbytes, st[sid_b].nbytes, st[sid_c].nbytes) == (256, 256, 96)
    # the weight is registered up front as a parameter with its name
    w = [s for s in st.values() if s.kind == "param"]
    assert [s.name for s in w] == ["weight"] and w[0].nbytes == 64


def test_live_bytes_against_hand_computation(tmp_path):
    model = nn.Linear(2, 2, bias=False)  # 16 B parameter

    def body(rec):
        with rec.phase("forward"):
            x = torch.zeros(100)        # +400 -> 416
            y = x + 1                   # +400 -> 816
            del x                       # -400 -> 416 (freed before the next op)
            z = torch.zeros(50)         # +200 -> 616
            del y, z                    # -600 -> 16
            torch.zeros(10)             # +40, then freed at once (result dropped)

    tr = _write_custom(tmp_path / "h.jsonl", model, body)
    tl = live_timeline(tr)
    assert tl.total == [416, 816, 616, 56]
    assert tl.peak == 816
    assert tl.live["param"] == [16, 16, 16, 16]


def test_kinds_phases_and_modules(tmp_path):
    path = tmp_path / "skip.jsonl.gz"
    res = record("skipnet", path, steps=2, preset="tiny")
    tr = read_trace(path)
    assert len(tr.iterations) == 2 and res.ops == sum(len(i.ops) for i in tr.iterations)
    kinds = {s.kind for s in tr.storages.values()}
    assert {"param", "buffer", "grad", "opt_state", "activation", "input", "temp"} <= kinds
    it = tr.iterations[0]
    assert list(it.phase_starts) == ["forward", "backward", "optimizer"]
    f, b, o = it.phase_starts["forward"], it.phase_starts["backward"], it.phase_starts["optimizer"]
    assert f == 0 < b < o < len(it.ops)
    assert {op.phase for op in it.ops[:b]} == {"forward"}
    # forward ops are attributed to the module running them, backward ops to the module that created the node
    convs_f = [op.module for op in it.ops[:b] if op.name == "aten::convolution"]
    assert convs_f and all(m.startswith(("stem", "stages.")) for m in convs_f)
    convs_b = [op.module for op in it.ops[b:o] if op.name == "aten::convolution_backward"]
    assert convs_b and all(m.startswith(("stem", "stages.")) for m in convs_b)
    # gradients live until the optimizer is done; every grad storage is freed by zero_grad(set_to_none)
    grads = [s for s in tr.storages.values() if s.kind == "grad"]
    assert grads and all(s.free_at is not None and s.alloc_at[1] >= b for s in grads)
    # optimizer state and parameters persist across iterations under the same ids
    params = [s for s in tr.storages.values() if s.kind == "param"]
    p_sid = params[0].sid
    assert any(p_sid in op.inputs + op.outputs for op in tr.iterations[1].ops)
    assert all(s.free_at is None for s in params)
    # saved activations are freed during backward
    acts = [s for s in tr.storages.values() if s.kind == "activation" and s.alloc_at[0] == 0]
    assert acts and all(s.saved for s in acts)
    assert all(s.free_at is not None and b <= s.free_at[1] <= o for s in acts if s.free_at[0] == 0)
    # every op carries the idiom vector of its operator and a duration
    assert all(len(op.idiom) == 6 for op in it.ops)
    assert sum(op.duration_s for op in it.ops) > 0
    assert any(op.flops > 0 for op in it.ops if op.name == "aten::convolution")


def test_header_and_iteration_facts(tmp_path):
    path = tmp_path / "moe.jsonl"
    record("moe", path, steps=2, preset="tiny", seed=5, overrides={"experts": 3})
    tr = read_trace(path)
    h = tr.header
    assert h["schema"] == SCHEMA_VERSION and h["workload"] == "moe" and h["seed"] == 5
    assert h["config"]["experts"] == 3 and h["torch"] == torch.__version__ and h["device"] == "cpu"
    assert "tokens_per_expert" in tr.iterations[0].facts


def test_round_trip_matches_recorded_ops(tmp_path):
    """What the reader returns equals what the recorder saw, op by op (independent dispatch log)."""
    from dynn_runtime.dynamism import step_signatures

    path = tmp_path / "varlen.jsonl"
    record("varlen", path, steps=2, preset="tiny")
    tr = read_trace(path)
    sigs = step_signatures(models.build("varlen", "tiny"), steps=2)
    for it, sig in zip(tr.iterations, sigs):
        expected = [n for n, _ in sig.ops if n not in ("aten.detach.default", "aten.lift_fresh.default")]
        got = [op.name.replace("::", ".") for op in it.ops]
        got = [g if "." in g.split(".", 1)[1] else g + ".default" for g in got]
        assert got == expected


def test_multi_iteration_sequences_differ_for_dynamic_nets(tmp_path):
    path = tmp_path / "tree.jsonl.gz"
    record("tree_lstm", path, steps=3, preset="tiny")
    s = summarize(read_trace(path))
    assert len(s.sequence_similarity) == 2 and all(x < 1.0 for x in s.sequence_similarity)
    assert s.peak_live_bytes > 0 and sum(s.ops_per_phase[0].values()) > 0


# ---- bad files -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("t") / "early.jsonl"
    record("early_exit", path, steps=1, preset="tiny")
    return path


def test_truncated_plain_file(good_trace, tmp_path):
    data = good_trace.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"line \d+ is (truncated|not valid JSON)|no end record"):
        read_trace(cut)


def test_cut_between_lines_is_truncated(good_trace, tmp_path):
    """A cut that lands exactly on a line boundary leaves only valid lines: the missing end record tells."""
    lines = good_trace.read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[: len(lines) // 2]))
    with pytest.raises(TraceError, match=r"ends at line \d+ inside iteration 0 \(no end record\)"):
        read_trace(cut)


def test_truncated_gzip_file(good_trace, tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(good_trace.read_bytes()))
    read_trace(gz)  # intact gzip reads
    data = gz.read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(TraceError, match="truncated or corrupt|no end record"):
        read_trace(cut)


def test_corrupted_line_names_line(good_trace, tmp_path):
    lines = good_trace.read_text().splitlines(keepends=True)
    lines[5] = '{"t": "O", oops\n'
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines))
    with pytest.raises(TraceError, match="line 6 is not valid JSON"):
        read_trace(bad)


def test_dangling_storage_names_line(good_trace, tmp_path):
    lines = good_trace.read_text().splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if line.startswith('{"t":"O"'))
    rec = json.loads(lines[i])
    rec["i"] = [999999]
    lines[i] = json.dumps(rec) + "\n"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(lines))
    with pytest.raises(TraceError, match=rf"line {i + 1}: storage 999999 is used before it is allocated"):
        read_trace(bad)


def test_newer_schema_rejected(good_trace, tmp_path):
    lines = good_trace.read_text().splitlines(keepends=True)
    h = json.loads(lines[0])
    h["schema"] = SCHEMA_VERSION + 1
    lines[0] = json.dumps(h) + "\n"
    newer = tmp_path / "newer.jsonl"
    newer.write_text("".join(lines))
    with pytest.raises(TraceError, match=f"schema version {SCHEMA_VERSION + 1} is newer.*Upgrade dynn-runtime"):
        read_trace(newer)


def test_not_a_trace(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"t": "O"}\n')
    with pytest.raises(TraceError, match="not a dynn trace header"):
        read_trace(p)
    p.write_text("")
    with pytest.raises(TraceError, match="empty"):
        read_trace(p)
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")


# ---- views for people ----------------------------------------------------------------------------

def test_plot_and_chrome_export(good_trace, tmp_path):
    png = plot_timeline(read_trace(good_trace), tmp_path / "tl.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = export_chrome(read_trace(good_trace), tmp_path / "c.json")
    ev = json.loads(out.read_text())["traceEvents"]
    slices = [e for e in ev if e["ph"] == "X" and e["tid"] > 0]
    assert len(slices) == len(read_trace(good_trace).iterations[0].ops)
    assert all(e["dur"] > 0 for e in slices) and any(e["ph"] == "C" for e in ev)


def test_cli_record_show_plot_export(tmp_path, capsys):
    from dynn_runtime.cli import main

    f = tmp_path / "e.jsonl.gz"
    assert main(["trace", "evoformer", "--preset", "tiny", "--steps", "2", "-o", str(f), "-q"]) == 0
    assert main(["trace", "show", str(f)]) == 0
    out = capsys.readouterr().out
    assert "ops per phase" in out and "peak live bytes" in out and "similarity" in out
    assert main(["trace", "plot", str(f), "-o", str(tmp_path / "p.png")]) == 0
    assert main(["trace", "export", str(f), "--chrome", str(tmp_path / "c.json")]) == 0
    (tmp_path / "bad.jsonl").write_text("nope\n")
    assert main(["trace", "show", str(tmp_path / "bad.jsonl")]) == 2
    assert "line 1 is not valid JSON" in capsys.readouterr().err


def test_an_iterations_nodes_do_not_depend_on_what_ran_before_it():
    """An operator that makes no autograd node records none (no "q"), also as an iteration's first
    after autograd work outside it; two iterations of the same ops record the same relative nodes."""
    model = nn.Linear(4, 4)
    rec = TraceRecorder(model)
    x = torch.randn(2, 4)
    its = []
    for i in range(2):
        (torch.ones(2, requires_grad=True) * 3).sum().backward()  # nodes made outside the iteration
        rec.begin_iteration(i)
        try:
            with rec.phase("forward"):
                x2 = x * 1.0  # makes no node
                loss = model(x2).sum()
            with rec.phase("backward"):
                loss.backward()
        finally:
            ops = [r for r in rec.end_iteration() if r.get("t") == "O"]
        model.zero_grad(set_to_none=True)
        its.append(ops)
    assert "q" not in its[0][0]
    rel = []
    for ops in its:
        base = min(r["q"] for r in ops if "q" in r)
        rel.append([r.get("q", -1) - base if "q" in r else -1 for r in ops])
    assert rel[0] == rel[1] and any(q >= 0 for q in rel[0])
