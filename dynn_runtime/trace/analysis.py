"""What a trace says: per-phase op counts, bytes by kind, the live-memory timeline, and how much
the operator sequence changes between iterations; plus the PNG timeline and Chrome/Perfetto export."""

from __future__ import annotations

import difflib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .._plot import pyplot, save_png
from .format import KINDS, PHASES, Trace

__all__ = ["Timeline", "live_timeline", "summarize", "TraceSummary", "plot_timeline", "export_chrome"]

#: kinds as drawn and summed in reports (inputs and buffers are shown with temporaries' neighbours)
PLOT_KINDS = ("param", "buffer", "opt_state", "grad", "activation", "input", "temp")


@dataclass
class Timeline:
    """Live bytes per kind after every op of the trace, in global op order."""

    #: live[k][j] = bytes of kind k alive after global op j
    live: dict[str, list[int]]
    #: global op index where each (iteration, phase) starts
    marks: list[tuple[int, int, str]]
    total: list[int]

    @property
    def peak(self) -> int:
        return max(self.total) if self.total else 0


def live_timeline(trace: Trace) -> Timeline:
    """Replay allocations and frees; a storage counts under its final kind from its alloc to its free.

    Storages alive before the first op (parameters, the batch) count from the start.
    """
    live = {k: 0 for k in KINDS}
    series: dict[str, list[int]] = {k: [] for k in KINDS}
    total: list[int] = []
    marks: list[tuple[int, int, str]] = []
    g = 0
    st = trace.storages
    for it in trace.iterations:
        starts = {v: k for k, v in it.phase_starts.items()}
        allocs_at: dict[int, list[int]] = {}
        for s in st.values():
            if s.alloc_at is not None and s.alloc_at[0] == it.index:
                allocs_at.setdefault(s.alloc_at[1], []).append(s.sid)
        for j in range(len(it.ops) + 1):
            for sid in it.frees.get(j, ()):
                live[st[sid].kind] -= st[sid].nbytes
            if j == len(it.ops):
                break
            if j in starts:
                marks.append((g, it.index, starts[j]))
            for sid in allocs_at.get(j, ()):
                live[st[sid].kind] += st[sid].nbytes
            # storages the op itself allocated were registered before its record: already counted
            for k in KINDS:
                series[k].append(live[k])
            total.append(sum(live.values()))
            g += 1
    return Timeline(live=series, marks=marks, total=total)


@dataclass
class TraceSummary:
    workload: str
    preset: str
    device: str
    torch: str
    iterations: int
    ops_per_phase: list[dict[str, int]]
    bytes_by_kind: dict[str, int]
    count_by_kind: dict[str, int]
    peak_live_bytes: int
    peak_per_iteration: list[int]
    #: similarity (difflib ratio) of each iteration's op-name sequence to the previous iteration's
    sequence_similarity: list[float]
    distinct_ops: int
    top_ops: list[tuple[str, int]] = field(default_factory=list)


def summarize(trace: Trace) -> TraceSummary:
    h = trace.header
    per_phase = []
    names = Counter()
    for it in trace.iterations:
        c = Counter(op.phase for op in it.ops)
        per_phase.append({p: c.get(p, 0) for p in PHASES})
        names.update(op.name for op in it.ops)
    by_kind = {k: 0 for k in KINDS}
    cnt = {k: 0 for k in KINDS}
    for s in trace.storages.values():
        by_kind[s.kind] += s.nbytes
        cnt[s.kind] += 1
    tl = live_timeline(trace)
    peaks, g = [], 0
    for it in trace.iterations:
        n = len(it.ops)
        peaks.append(max(tl.total[g : g + n]) if n else 0)
        g += n
    sims = []
    for a, b in zip(trace.iterations, trace.iterations[1:]):
        sa, sb = [op.name for op in a.ops], [op.name for op in b.ops]
        sims.append(difflib.SequenceMatcher(a=sa, b=sb, autojunk=False).ratio() if sa or sb else 1.0)
    return TraceSummary(
        workload=h.get("workload", "?"), preset=h.get("preset", "?"), device=h.get("device", "?"),
        torch=h.get("torch", "?"), iterations=len(trace.iterations), ops_per_phase=per_phase,
        bytes_by_kind=by_kind, count_by_kind=cnt, peak_live_bytes=tl.peak, peak_per_iteration=peaks,
        sequence_similarity=sims, distinct_ops=len(names), top_ops=names.most_common(8),
    )


_COLORS = {"param": "#4c72b0", "buffer": "#8172b3", "opt_state": "#937860", "grad": "#dd8452",
           "activation": "#55a868", "input": "#da8bc3", "temp": "#c44e52"}


def plot_timeline(trace: Trace, out: str | Path, title: str | None = None) -> Path:
    """Stacked live memory by tensor kind over the op sequence, with phase and iteration marks."""
    plt = pyplot()
    tl = live_timeline(trace)
    x = list(range(len(tl.total)))
    kinds = [k for k in PLOT_KINDS if any(tl.live[k])]
    fig, ax = plt.subplots(figsize=(12, 5), dpi=110)
    scale, unit = _unit(tl.peak)
    ax.stackplot(x, *[[v / scale for v in tl.live[k]] for k in kinds], labels=kinds,
                 colors=[_COLORS[k] for k in kinds], alpha=0.9, linewidth=0)
    ymax = tl.peak / scale * 1.12 if tl.peak else 1
    ax.set_ylim(0, ymax)
    for g, it, phase in tl.marks:
        ax.axvline(g, color="black" if phase == "forward" else "grey", lw=1.0 if phase == "forward" else 0.6,
                   ls="-" if phase == "forward" else "--")
        label = f"it {it}" if phase == "forward" else phase[:3]
        ax.text(g, ymax * (0.97 if phase == "forward" else 0.92), f" {label}", fontsize=7, va="top")
    h = trace.header
    ax.set_title(title or f"live memory by tensor kind: {h.get('workload')} ({h.get('preset')}), "
                 f"{len(trace.iterations)} iteration(s), device {h.get('device')}; peak {tl.peak / scale:.1f} {unit}")
    ax.set_xlabel("operator index (forward | backward | optimizer marked)")
    ax.set_ylabel(f"live {unit}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, ncol=len(kinds), frameon=False)
    ax.set_xlim(0, max(1, len(x) - 1))
    return save_png(fig, out)


def _unit(peak: int) -> tuple[float, str]:
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if peak >= scale:
            return float(scale), unit
    return 1.0, "B"


def export_chrome(trace: Trace, out: str | Path) -> Path:
    """Chrome/Perfetto trace: one slice per op (thread per phase), memory counters per kind."""
    events: list[dict] = []
    tl = live_timeline(trace)
    tids = {p: i + 1 for i, p in enumerate(PHASES)}
    for p, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": p}})
    ts, g = 0.0, 0
    for it in trace.iterations:
        it_start = ts
        for op in it.ops:
            dur = max(op.duration_s * 1e6, 0.01)
            events.append({"name": op.name, "ph": "X", "ts": round(ts, 3), "dur": round(dur, 3), "pid": 1,
                           "tid": tids[op.phase], "args": {"module": op.module, "idiom": list(op.idiom),
                                                           "inputs": list(op.inputs), "outputs": list(op.outputs),
                                                           "flops": op.flops}})
            events.append({"name": "live bytes", "ph": "C", "ts": round(ts, 3), "pid": 1,
                           "args": {k: tl.live[k][g] for k in PLOT_KINDS}})
            ts += dur
            g += 1
        events.append({"name": f"iteration {it.index}", "ph": "X", "ts": round(it_start, 3),
                       "dur": round(ts - it_start, 3), "pid": 1, "tid": 0, "args": it.facts})
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": trace.header}))
    return out
