"""The trace format: one JSON record per line, optionally gzip-compressed (``*.gz``).

See ``docs/trace-format.md`` for the full description. In short: a header record, then per
iteration an iteration mark, phase marks, and interleaved operator (``O``), allocation (``A``),
kind (``K``), saved-for-backward (``S``), free (``F``) and workload-hint (``T``: next step, ``U``:
next use; :mod:`dynn_runtime.hints`) records in the order they happened.
Operator and module names are interned (``D`` and ``M`` records) to keep files small.

The reader validates as it goes and raises :class:`TraceError` naming the file, the line and
what was wrong (truncated, not JSON, a record before the header, a newer schema, an unknown
storage id).
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import TraceError
from ..hints import Hint

__all__ = [
    "SCHEMA_VERSION",
    "KINDS",
    "PHASES",
    "TraceWriter",
    "iter_records",
    "read_trace",
    "Trace",
    "Iteration",
    "Op",
    "Storage",
]

SCHEMA_VERSION = 3
MAGIC = "dynn-trace"

#: Tensor kinds, most specific first. A storage's kind only moves up this list.
KINDS = ("param", "buffer", "opt_state", "grad", "activation", "input", "temp")
_RANK = {k: i for i, k in enumerate(KINDS)}
PHASES = ("forward", "backward", "optimizer")


def stronger_kind(old: str, new: str) -> str:
    """The more specific of two kinds (``param`` beats ``grad`` beats ``temp`` ...)."""
    return new if _RANK[new] < _RANK[old] else old


class TraceWriter:
    """Streams records to ``path``; gzip when the name ends in ``.gz``."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        raw: IO[bytes] = gzip.open(self.path, "wb", compresslevel=6) if self.path.suffix == ".gz" else open(
            self.path, "wb"
        )
        self._f = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")

    def write(self, rec: dict) -> None:
        self._f.write(json.dumps(rec, separators=(",", ":")))
        self._f.write("\n")

    def write_many(self, recs: list[dict]) -> None:
        dumps = json.dumps
        self._f.write("".join(dumps(r, separators=(",", ":")) + "\n" for r in recs))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _open_text(path: Path) -> IO[str]:
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, record)`` from a trace file, header first; validates framing and schema."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace: {str(p)!r} does not exist. Record one with `dynn trace WORKLOAD -o FILE`.")
    lineno = 0
    try:
        with _open_text(p) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.endswith("\n"):
                    raise TraceError(
                        f"trace: {p}: line {lineno} is truncated (no end of line): the file was cut short "
                        "while being written. Re-record it."
                    )
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"trace: {p}: line {lineno} is not valid JSON ({exc.msg} at column "
                                     f"{exc.colno}): the file is corrupt. Re-record it.") from None
                if not isinstance(rec, dict) or "t" not in rec:
                    raise TraceError(f"trace: {p}: line {lineno} is not a trace record (no 't' field).")
                if lineno == 1:
                    _check_header(p, rec)
                yield lineno, rec
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise TraceError(
            f"trace: {p}: compressed stream is truncated or corrupt after line {lineno} "
            f"({type(exc).__name__}: {exc}). Re-record it."
        ) from None
    if lineno == 0:
        raise TraceError(f"trace: {p} is empty: expected a header record on line 1.")


def _check_header(p: Path, rec: dict) -> None:
    if rec.get("t") != "H" or rec.get("magic") != MAGIC:
        raise TraceError(f"trace: {p}: line 1 is not a dynn trace header (expected magic {MAGIC!r}).")
    v = rec.get("schema")
    if not isinstance(v, int):
        raise TraceError(f"trace: {p}: header has no integer schema version.")
    if v > SCHEMA_VERSION:
        raise TraceError(
            f"trace: {p}: schema version {v} is newer than this dynn-runtime supports ({SCHEMA_VERSION}). "
            "Upgrade dynn-runtime, or re-record the trace with this version."
        )
    if v < 1:
        raise TraceError(f"trace: {p}: schema version {v} is not a valid version.")


@dataclass
class Storage:
    """One tensor storage over its whole life in the trace."""

    sid: int
    nbytes: int
    dtype: str
    kind: str
    name: str = ""
    device: str = ""
    #: existed before the recorder first saw it (parameters, the batch, optimizer state of earlier steps)
    preexisting: bool = False
    saved: bool = False
    #: (iteration, position in that iteration's op list) of the allocation and the free; None if never
    alloc_at: tuple[int, int] | None = None
    free_at: tuple[int, int] | None = None


@dataclass
class Op:
    """One ATen operator call."""

    name: str
    idiom: tuple[int, ...]
    phase: str
    module: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    writes: tuple[int, ...]
    #: storages this op allocated (a subset of ``outputs``)
    allocs: tuple[int, ...]
    duration_s: float
    flops: int
    #: bytes of the tensor arguments and results (as tensors, not storages)
    nbytes: int
    #: autograd node (sequence number): in forward the node this op created, in backward the node
    #: that ran it; -1: none (no grad, an op that is not differentiable, or a trace without it)
    node: int = -1


@dataclass
class Iteration:
    index: int
    ops: list[Op] = field(default_factory=list)
    #: ``frees[k]`` lists storages freed after op k-1 and before op k (``frees[len(ops)]``: after the last)
    frees: dict[int, list[int]] = field(default_factory=dict)
    #: ``pre_allocs[k]`` lists storages first seen (pre-existing) just before op k
    pre_allocs: dict[int, list[int]] = field(default_factory=dict)
    phase_starts: dict[str, int] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    #: ``hints[k]`` lists the workload's hints (:class:`~dynn_runtime.hints.Hint`) given after op k-1
    #: and before op k, in order
    hints: dict[int, list[Any]] = field(default_factory=dict)

    def footprint_peak(self, trace: Trace) -> int:
        """Most bytes of live storages at once in this iteration (everything resident: PyTorch
        alone), by walking its allocations and frees: the simulator's ``none`` peak without the
        simulation (it counts the same storages)."""
        sizes = trace.storages
        live = sum(sizes[sid].nbytes for sid in self.live_at_start(trace))
        peak = live
        frees = self.frees
        for j, op in enumerate(self.ops):
            for sid in frees.get(j, ()):
                live -= sizes[sid].nbytes
            for sid in op.allocs:
                live += sizes[sid].nbytes
            if live > peak:
                peak = live
        return peak

    def live_at_start(self, trace: Trace) -> list[int]:
        """Storages alive when this iteration's first op runs: allocated in an earlier iteration, or
        pre-existing (parameters, the batch) and first seen in this one; and not freed before it."""
        idx = self.index
        out = []
        for s in trace.storages.values():
            if s.alloc_at is None:
                continue
            born = s.alloc_at[0] < idx or (s.alloc_at[0] == idx and s.preexisting)
            if born and (s.free_at is None or s.free_at[0] >= idx):
                out.append(s.sid)
        return out


@dataclass
class Trace:
    header: dict
    storages: dict[int, Storage]
    iterations: list[Iteration]
    path: str = ""

    @property
    def schema(self) -> int:
        return int(self.header["schema"])

    def op_names(self, iteration: int) -> list[str]:
        return [op.name for op in self.iterations[iteration].ops]


def read_trace(path: str | Path) -> Trace:
    """Read a whole trace into memory (streaming: one pass over :func:`iter_records`)."""
    header: dict = {}
    storages: dict[int, Storage] = {}
    iterations: list[Iteration] = []
    opdefs: dict[int, tuple[str, tuple[int, ...]]] = {}
    mods: dict[int, str] = {0: ""}
    it: Iteration | None = None
    ended = True  # the last iteration seen has its end record
    last_line = 0
    phase = "forward"
    p = str(path)

    def need_iter(lineno: int) -> Iteration:
        if it is None:
            raise TraceError(f"trace: {p}: line {lineno}: record before the first iteration mark ('I').")
        return it

    def storage(lineno: int, sid: int) -> Storage:
        try:
            return storages[sid]
        except KeyError:
            raise TraceError(f"trace: {p}: line {lineno}: storage {sid} is used before it is allocated.") from None

    for lineno, rec in iter_records(path):
        t = rec["t"]
        try:
            if t == "H":
                header = rec
            elif t == "I":
                it = Iteration(index=int(rec["i"]), facts=rec.get("facts", {}))
                iterations.append(it)
                ended = False
            elif t == "P":
                phase = rec["p"]
                if phase not in PHASES:
                    raise TraceError(f"trace: {p}: line {lineno}: unknown phase {phase!r}; expected one of {PHASES}.")
                cur = need_iter(lineno)
                cur.phase_starts[phase] = len(cur.ops)
            elif t == "D":
                opdefs[int(rec["o"])] = (rec["name"], tuple(rec["iv"]))
            elif t == "M":
                mods[int(rec["m"])] = rec["path"]
            elif t == "A":
                cur = need_iter(lineno)
                sid = int(rec["s"])
                st = Storage(sid=sid, nbytes=int(rec["b"]), dtype=rec["dt"], kind=rec["k"], name=rec.get("n", ""),
                             device=rec.get("dev", header.get("device", "")), preexisting=bool(rec.get("pre")),
                             alloc_at=(cur.index, len(cur.ops)))
                if st.kind not in KINDS:
                    raise TraceError(f"trace: {p}: line {lineno}: unknown tensor kind {st.kind!r}.")
                storages[sid] = st
                if st.preexisting:
                    cur.pre_allocs.setdefault(len(cur.ops), []).append(sid)
            elif t == "O":
                cur = need_iter(lineno)
                name, iv = opdefs[int(rec["o"])]
                ins = tuple(rec.get("i", ()))
                outs = tuple(rec.get("x", ()))
                for sid in ins + outs:
                    storage(lineno, sid)
                cur.ops.append(Op(
                    name=name, idiom=iv, phase=phase, module=mods[int(rec.get("m", 0))], inputs=ins, outputs=outs,
                    writes=tuple(rec.get("w", ())), allocs=tuple(rec.get("a", ())),
                    duration_s=float(rec.get("d", 0.0)) * 1e-6, flops=int(rec.get("f", 0)),
                    nbytes=int(rec.get("by", 0)), node=int(rec.get("q", -1)),
                ))
            elif t == "K":
                st = storage(lineno, int(rec["s"]))
                if rec["k"] not in KINDS:
                    raise TraceError(f"trace: {p}: line {lineno}: unknown tensor kind {rec['k']!r}.")
                st.kind = stronger_kind(st.kind, rec["k"])
            elif t == "S":
                st = storage(lineno, int(rec["s"]))
                st.saved = True
                if st.kind == "temp":
                    st.kind = "activation"
            elif t == "F":
                cur = need_iter(lineno)
                st = storage(lineno, int(rec["s"]))
                st.free_at = (cur.index, len(cur.ops))
                cur.frees.setdefault(len(cur.ops), []).append(st.sid)
            elif t == "T":
                cur = need_iter(lineno)
                cur.hints.setdefault(len(cur.ops), []).append(Hint("step"))
            elif t == "U":
                cur = need_iter(lineno)
                sids = tuple(int(v) for v in rec["s"])
                for sid in sids:
                    storage(lineno, sid)
                n = int(rec["n"])
                if n < -1:
                    raise TraceError(f"trace: {p}: line {lineno}: a next-use hint's step count is {n}; "
                                     "expected >= 0, or -1 for 'not again in this pass'.")
                cur.hints.setdefault(len(cur.ops), []).append(Hint("use", sids, None if n < 0 else n))
            elif t == "E":
                # what the step decided is only known once it ran: the end record carries it
                need_iter(lineno).facts.update(rec.get("facts", {}))
                ended = True
            else:
                raise TraceError(f"trace: {p}: line {lineno}: unknown record type {t!r}.")
        except KeyError as exc:
            raise TraceError(f"trace: {p}: line {lineno}: record of type {t!r} lacks field {exc.args[0]!r} "
                             "or names an undefined operator/module id.") from None
        except (TypeError, ValueError) as exc:
            raise TraceError(f"trace: {p}: line {lineno}: malformed record of type {t!r} ({exc}).") from None
        last_line = lineno
    if not ended:
        raise TraceError(
            f"trace: {p}: the file ends at line {last_line} inside iteration {iterations[-1].index} (no end "
            "record): it was cut short while being written. Re-record it."
        )
    if not iterations:
        raise TraceError(f"trace: {p}: no iteration records: the file holds a header only.")
    return Trace(header=header, storages=storages, iterations=iterations, path=p)
