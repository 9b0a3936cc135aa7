"""Training and evaluation data: recorded traces walked through the same notifications as a policy.

:func:`walk` replays one iteration of a trace through a :class:`~.features.FeatureState` in the
simulator's notification order (storages alive at the start as ``on_alloc(sid, -1)``; per operator
its frees, ``on_alloc``, the accesses, ``on_op``) with no memory pressure, and at every decision
point yields the candidates, their features and what really happened next (the label), together
with what the baselines would have said at that point:

* ``replay``: :class:`~dynn_runtime.policies.nextuse.ReplayPolicy`, driven by the same walk;
* ``lru``: time since last access (across iterations for storages untouched this iteration);
* ``frequency``: accesses so far (this iteration plus the previous one for persistent storages).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...policies.base import IterationContext
from ...policies.nextuse import ReplayPolicy
from ...trace.format import Trace, read_trace
from ..features import CAND_FEATURES, CTX_FEATURES, FeatureState, fine_bucket

__all__ = ["Decision", "walk", "Rows", "build_rows", "zoo_traces", "trace_family", "load_traces"]

_BIG = 1 << 32


class _WalkView:
    """A MemoryView with everything resident: what the walk offers the feature state and replay.

    The walk has no clock, no host thread, no recompute mechanism and does not read the future, so
    those members give the protocol's documented neutral answers."""

    def __init__(self, trace: Trace) -> None:
        self.st = trace.storages
        self.position = -1
        self.phase = "forward"
        self.victim_floor = 0  # no search here passes over small victims
        self.live: set[int] = set()
        self.counts: dict[int, int] = {}
        self.lasts: dict[int, int] = {}

    def nbytes(self, sid: int) -> int:
        return self.st[sid].nbytes

    def kind(self, sid: int) -> str:
        return self.st[sid].kind

    def saved(self, sid: int) -> bool:
        return self.st[sid].saved

    def status(self, sid: int) -> str:
        return "resident" if sid in self.live else "absent"

    def resident(self) -> Iterable[int]:
        return iter(self.live)

    def offloaded(self) -> Iterable[int]:
        return iter(())

    def movable(self, sid: int) -> bool:
        return True

    def evictable(self, sid: int) -> bool:
        return sid in self.live

    def last_access(self, sid: int) -> int:
        return self.lasts.get(sid, -1)

    def access_count(self, sid: int) -> int:
        return self.counts.get(sid, 0)

    def free_bytes(self) -> int:
        return 1 << 62

    def last_access_time(self, sid: int) -> float:
        return 0.0

    def forward_done(self, sid: int) -> bool:
        return False

    def producer_of(self, sid: int) -> int | None:
        return None

    def recomputable(self, sid: int) -> bool:
        return False

    def recompute_cost(self, sid: int) -> float:
        return math.inf

    def next_use(self, sid: int) -> int | None:
        return None

    def now(self) -> float:
        return 0.0

    def host_now(self) -> float | None:
        return None

    def device_slack(self) -> float | None:
        return None

    def copy_seconds(self, nbytes: int, direction: str) -> float | None:
        return None

    def link_backlog(self, direction: str) -> float | None:
        return None


@dataclass
class Decision:
    """One decision point of a walked iteration."""

    position: int
    sids: np.ndarray
    X: np.ndarray
    ctx: np.ndarray
    #: true next-use distance in operators (inf: not again this iteration)
    dist: np.ndarray
    #: baseline predicted distances (inf: not again)
    replay: np.ndarray
    lru: np.ndarray
    freq: np.ndarray
    expected_len: int
    #: in a planned optimizer (:func:`~dynn_runtime.pilot.replay.plan_scores` applies)
    planned: bool = False


def _access_index(ops: Sequence[Any]) -> tuple[dict[int, int], np.ndarray]:
    acc: dict[int, list[int]] = {}
    for j, op in enumerate(ops):
        for sid in {*op.inputs, *op.outputs, *op.writes}:
            acc.setdefault(sid, []).append(j)
    idx: dict[int, int] = {}
    keys: list[int] = []
    for i, (sid, lst) in enumerate(acc.items()):
        idx[sid] = i
        keys.extend(i * _BIG + j for j in lst)
    return idx, np.asarray(keys, dtype=np.int64)


def _next_after(idx: dict[int, int], keys: np.ndarray, sids: np.ndarray, pos: int) -> np.ndarray:
    out = np.full(len(sids), np.inf)
    if not len(keys):
        return out
    ii = np.array([idx.get(int(s), -1) for s in sids], dtype=np.int64)
    have = ii >= 0
    k = np.searchsorted(keys, ii * _BIG + pos, side="right")
    kk = np.minimum(k, len(keys) - 1)
    ok = have & (k < len(keys)) & ((keys[kk] // _BIG) == ii)
    out[ok] = (keys[kk][ok] % _BIG) - pos
    return out


def walk(trace: Trace, iteration: int, group: int = 16, baselines: bool = True,
         every: int = 1) -> Iterator[Decision]:
    """Yield the decision points of ``trace.iterations[iteration]`` (history: the ones before it).

    ``every``: keep every n-th decision point only (evaluation of long traces).
    """
    it = trace.iterations[iteration]
    history = trace.iterations[:iteration]
    view = _WalkView(trace)
    state = FeatureState(view, group=group)
    state.begin_iteration(it.index, history)
    replay = None
    if baselines:
        replay = ReplayPolicy()
        replay.attach(view)
        replay.begin_iteration(it.index, IterationContext(history=history))
    cur_idx, cur_keys = _access_index(it.ops)
    prev_last: dict[int, int] = {}
    prev_count: dict[int, int] = {}
    prev_len = 0
    if history:
        prev = history[-1]
        prev_len = len(prev.ops)
        for j, op in enumerate(prev.ops):
            for sid in {*op.inputs, *op.outputs, *op.writes}:
                prev_last[sid] = j
                prev_count[sid] = prev_count.get(sid, 0) + 1
    persistent: set[int] = set()
    for sid in it.live_at_start(trace):
        view.live.add(sid)
        persistent.add(sid)
        state.alloc(sid, -1)
        if replay is not None:
            replay.on_alloc(sid, -1)
    n_dec = 0
    for j, op in enumerate(it.ops):
        view.position = j
        view.phase = op.phase
        for sid in it.frees.get(j, ()):
            view.live.discard(sid)
            state.free(sid)
            if replay is not None:
                replay.on_free(sid)
        for h in it.hints.get(j, ()):
            state.hint(h)
        for sid in op.allocs:
            view.live.add(sid)
            state.alloc(sid, j)
            if replay is not None:
                replay.on_alloc(sid, j)
        for sid in {*op.inputs, *op.outputs, *op.writes}:
            view.lasts[sid] = j
            view.counts[sid] = view.counts.get(sid, 0) + 1
        decide = state.op(j, op)
        if not decide:
            continue
        n_dec += 1
        if (n_dec - 1) % every:
            continue
        sids, X, ctx = state.features()
        dist = _next_after(cur_idx, cur_keys, sids, j)
        if baselines:
            rp = np.array([replay.predict(int(s)) for s in sids], dtype=object)
            rp = np.array([np.inf if v is None else float(v) - j for v in rp], dtype=np.float64)
            lru = np.empty(len(sids))
            freq = np.empty(len(sids))
            for i, s in enumerate(sids.tolist()):
                last = view.lasts.get(s)
                c = view.counts.get(s, 0)
                if s in persistent:
                    c += prev_count.get(s, 0)
                if last is not None:
                    lru[i] = j - last
                elif s in prev_last:
                    lru[i] = j + 1 + (prev_len - prev_last[s])
                else:
                    lru[i] = j + 1 + prev_len + 1
                span = j + 1 + (prev_len if s in persistent else 0)
                freq[i] = span / c if c else np.inf
            # a persistent storage that replay says is needed next iteration is "not again" here
            rp = np.where(np.isfinite(rp) & (rp > len(it.ops) - j), np.inf, rp)
        else:
            rp = lru = freq = np.zeros(len(sids))
        yield Decision(position=j, sids=sids, X=X, ctx=ctx, dist=dist, replay=rp, lru=lru, freq=freq,
                       expected_len=state.expected_length(), planned=state.in_plan())


@dataclass
class Rows:
    """Training rows: candidate features, their decision's context, fine-bucket labels, and origin."""

    X: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CAND_FEATURES)), np.float32))
    C: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CTX_FEATURES)), np.float32))
    y: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    family: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.y)


def build_rows(traces: Iterable[Trace], group: int = 16, per_decision: int = 96, seed: int = 0,
               first_iteration: bool = True, max_decisions: int | None = None) -> Rows:
    """Sample ``per_decision`` candidates per decision point of every iteration of every trace.

    The first iteration (no history) is included when ``first_iteration``: the policy meets it too.
    ``max_decisions``: from an iteration with more decision points than this (about ``ops / group``),
    keep every n-th only, so that a few very long iterations do not outweigh the rest.
    """
    rng = np.random.default_rng(seed)
    xs, cs, ys, fams = [], [], [], []
    for tr in traces:
        fam = trace_family(tr)
        start = 0 if first_iteration else 1
        for i in range(start, len(tr.iterations)):
            every = 1
            if max_decisions:
                every = max(1, -(-len(tr.iterations[i].ops) // (group * max_decisions)))
            for d in walk(tr, i, group=group, baselines=False, every=every):
                n = len(d.sids)
                if not n:
                    continue
                take = rng.choice(n, size=min(n, per_decision), replace=False) if n > per_decision else np.arange(n)
                xs.append(d.X[take])
                cs.append(np.broadcast_to(d.ctx, (len(take), len(d.ctx))))
                ys.append(fine_bucket(d.dist[take]))
                fams.extend([fam] * len(take))
    if not xs:
        return Rows()
    return Rows(X=np.concatenate(xs).astype(np.float32), C=np.concatenate(cs).astype(np.float32),
                y=np.concatenate(ys), family=fams)


def trace_family(trace: Trace) -> str:
    """The workload a trace was recorded from (zoo family name, or the user's ``file.py:function``)."""
    return str(trace.header.get("workload", "?"))


def load_traces(paths: Iterable[str | Path]) -> list[Trace]:
    """Read trace files; directories are searched for ``*.jsonl.gz`` / ``*.jsonl``."""
    out = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files = sorted([*p.glob("*.jsonl.gz"), *p.glob("*.jsonl")])
        else:
            files = [p]
        out.extend(read_trace(f) for f in files)
    return out


def zoo_traces(families: Sequence[str], presets: Sequence[str], seeds: Sequence[int], steps: int,
               cache_dir: str | Path = ".dynn-cache/traces") -> list[tuple[str, Trace]]:
    """Record (or reuse from the trace cache) one trace per family x preset x seed."""
    from ...trace import TraceCache

    cache = TraceCache(cache_dir)
    out = []
    for seed in seeds:
        for preset in presets:
            for fam in families:
                tr = cache.get(fam, preset, seed, steps)
                out.append((str(cache.path(fam, preset, seed, steps)), tr))
    return out

