"""The pilot live against the pilot on the trace of the same run: where do its features differ?

Runs one workload live under the memory manager with the pilot (``fallback=True``, so that the
judge of :mod:`dynn_runtime.pilot.adapt` measures the model's window recall live and every decision
point builds every candidate's row) and records a trace of the same workload, preset, seed and steps
(the recorder: the inputs are the same, the runs bit-identical). The live run's storages are mapped to
the trace's by walking both operator streams side by side (same operator, same position: inputs,
outputs and allocations zipped); then, at every live decision point that the trace walk
(:func:`dynn_runtime.pilot.training.data.walk`, the rows the simulator and training build) also has:

* the feature columns that differ between the live row and the trace row of the same storage, per
  storage kind (the trace's final kind), and how often;
* the candidates one side has and the other not;
* the model's window recall on the live rows and on the trace rows, over the same decision points and
  the same truth (the trace's next uses), next to the judge's live figure (which also counts the first
  step and every live decision point);
* the kinds and saved flags the pilot was told live at each storage's announcement against the
  trace's.

Not imported by the package (an experiment's tool). Run from the repository root::

    python tools/pilot_live_vs_trace.py moe --steps 4 --json out/pilot/live-vs-trace-moe.json
    python tools/pilot_live_vs_trace.py tools/third_party/moe_lm.py:build --steps 4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

#: a feature value differs when it differs by more than this (the rows are float32)
TOL = 1e-5


def _groups() -> dict[str, list[int]]:
    from dynn_runtime.pilot.features import CAND_FEATURES

    def cols(*prefixes: str) -> list[int]:
        return [i for i, c in enumerate(CAND_FEATURES) if c.startswith(prefixes)]

    return {"kind_saved": cols("kind_", "saved"), "stack": cols("on_stack", "log_stack", "stack_"),
            "mirror": cols("mirror", "log_mirror"),
            "previous": cols("matched", "prev_", "log_prev", "occ_", "log_occ", "ext_by_order"),
            "recency": cols("accessed_this_iter", "log_age", "log_count", "acc_", "age0", "last_"),
            "birth": cols("born", "log_since_birth", "persistent"),
            "idioms": cols("producer_iv", "consumer_iv", "has_producer")}


GROUPS = _groups()


def live_run(workload: str, steps: int, preset: str, seed: int, fraction: float,
             options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The workload under the manager with a probed pilot: per step the operators it was told, the
    kind and saved flag of each storage at its announcement, the rows of each decision point."""
    from dynn_runtime.pilot.policy import PilotPolicy
    from dynn_runtime.runtime.train import train_managed, train_unmanaged

    ref = train_unmanaged(workload, steps=steps, preset=preset, seed=seed)
    cap = int(max(ref.peak_bytes) * fraction)
    pol = PilotPolicy(fallback=True, **(options or {}))
    # per step index (a step is begun once by the runtime; attach may begin one before any step)
    rec: dict[str, Any] = {"ops": defaultdict(list), "decisions": defaultdict(list), "told": defaultdict(dict)}
    cur = {"i": -1}

    orig_begin = pol.begin_iteration

    def begin_iteration(index: int, context: Any = None) -> None:
        cur["i"] = index
        for k in ("ops", "decisions", "told"):
            rec[k].pop(index, None)
        orig_begin(index, context) if context is not None else orig_begin(index)

    pol.begin_iteration = begin_iteration  # type: ignore[method-assign]
    orig_on_op = pol.on_op

    def on_op(position: int, op: Any) -> None:
        rec["ops"][cur["i"]].append(op)
        orig_on_op(position, op)

    pol.on_op = on_op  # type: ignore[method-assign]
    orig_attach = pol.attach

    def attach(view: Any) -> None:
        orig_attach(view)
        state = pol._state
        f_alloc, f_features = state.alloc, state.features

        def alloc(sid: int, position: int) -> tuple[int, str, bool]:
            out = f_alloc(sid, position)
            if cur["i"] >= 0:
                rec["told"][cur["i"]].setdefault(sid, (out[1], out[2], position))
            return out

        def features(idx: Any = None) -> tuple[Any, Any, Any]:
            sids, X, ctx = f_features(idx)
            if cur["i"] >= 0:
                rec["decisions"][cur["i"]].append((state.position, sids.copy(), X.copy(), ctx.copy()))
            return sids, X, ctx

        state.alloc = alloc  # type: ignore[method-assign]
        state.features = features  # type: ignore[method-assign]

    pol.attach = attach  # type: ignore[method-assign]
    r = train_managed(workload, cap, pol, steps=steps, preset=preset, seed=seed)
    rec.update(cap=cap, digest_ok=r.digest == ref.digest, judged=pol.judged_recall, followed=dict(pol.followed),
               hits=r.stats["prefetch_hits"], misses=r.stats["prefetch_misses"], model=pol.model)
    return rec


def map_storages(live_ops: list[Any], trace_ops: list[Any]) -> tuple[dict[int, int], dict[int, int], dict[str, Any]]:
    """Live sid -> trace sid, and live position -> trace position, from the two operator streams
    aligned by operator name (the longest matching blocks: the observer and the recorder see a few
    operators differently); and what differed (phases, arities, conflicting pairs, unmatched ops)."""
    from difflib import SequenceMatcher

    sm = SequenceMatcher(None, [o.name for o in live_ops], [o.name for o in trace_ops], autojunk=False)
    m: dict[int, int] = {}
    pos: dict[int, int] = {}
    why: dict[str, Any] = {"conflicts": 0, "arity": 0, "phase_differs": [], "unmatched": []}
    for tag, a0, a1, b0, b1 in sm.get_opcodes():
        if tag != "equal":
            why["unmatched"].append((tag, a0, [o.name for o in live_ops[a0:a1]][:4], b0,
                                     [o.name for o in trace_ops[b0:b1]][:4]))
            continue
        for j, k in zip(range(a0, a1), range(b0, b1)):
            a, b = live_ops[j], trace_ops[k]
            pos[j] = k
            if a.phase != b.phase:
                why["phase_differs"].append((j, a.name, a.phase, b.phase))
            for x, y in ((a.inputs, b.inputs), (a.outputs, b.outputs), (a.allocs, b.allocs)):
                if len(x) != len(y):
                    why["arity"] += 1
                for u, v in zip(x, y):
                    if m.setdefault(u, v) != v:
                        why["conflicts"] += 1
    return m, pos, why


def label_mismatches(live: dict[str, Any], trace: Any, iterations: range) -> tuple[int, list[tuple[Any, ...]]]:
    """At the first live decision point of backward and of the optimizer in each of ``iterations``
    (forward has saved all it saves; backward has made every gradient), the labels in the pilot's
    rows (the kind one-hot and the saved flag) against the trace's final ones, for every candidate
    mapped to a trace storage. Returns the candidates compared and the mismatches
    ``(iteration, phase, trace kind, trace saved, live kind, live saved)``."""
    from dynn_runtime.pilot.features import CAND_FEATURES
    from dynn_runtime.trace.format import KINDS

    saved_col = CAND_FEATURES.index("saved")
    compared, bad = 0, []
    for i in iterations:
        ops = live["ops"][i]
        smap, _, _ = map_storages(ops, trace.iterations[i].ops)
        seen: set[str] = set()
        for position, sids, X, _ctx in live["decisions"][i]:
            phase = ops[position].phase
            if phase == "forward" or phase in seen:
                continue
            seen.add(phase)
            for r, sid in enumerate(sids.tolist()):
                t = smap.get(sid)
                if t is None:
                    continue
                st = trace.storages[t]
                kind = KINDS[int(np.argmax(X[r, : len(KINDS)]))]
                saved = bool(X[r, saved_col] > 0)
                compared += 1
                if kind != st.kind or saved != st.saved:
                    bad.append((i, phase, st.kind, st.saved, kind, saved))
    return compared, bad


def _next_uses(ops: list[Any]) -> tuple[dict[int, int], np.ndarray]:
    from dynn_runtime.pilot.training.data import _access_index

    return _access_index(ops)


def _recall(score: np.ndarray, dist: np.ndarray, window: int) -> tuple[int, int]:
    inwin = dist <= window
    k = int(inwin.sum())
    if not k:
        return 0, 0
    top = np.argsort(score, kind="stable")[:k]
    return int(inwin[top].sum()), k


def compare(workload: str, steps: int, preset: str, seed: int, fraction: float,
            options: dict[str, Any] | None = None) -> dict[str, Any]:
    from dynn_runtime.pilot.features import CAND_FEATURES, CTX_FEATURES
    from dynn_runtime.pilot.training.data import _next_after, walk
    from dynn_runtime.pilot.training.evaluate import WINDOW_OPS
    from dynn_runtime.trace import read_trace, record

    t0 = time.perf_counter()
    live = live_run(workload, steps, preset, seed, fraction, options)
    model = live.pop("model")
    group = model.config.group  # the trace metric's decision points
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl.gz"
        record(workload, path, steps=steps, preset=preset, seed=seed)
        trace = read_trace(path)
    kinds = {sid: s.kind for sid, s in trace.storages.items()}
    saved = {sid: s.saved for sid, s in trace.storages.items()}
    out: dict[str, Any] = {"workload": workload, "steps": steps, "preset": preset, "seed": seed,
                           "fraction": fraction, "cap": live["cap"], "bit_identical": live["digest_ok"],
                           "judged_live_recall": live["judged"], "followed": live["followed"],
                           "hits": live["hits"], "misses": live["misses"], "iterations": []}
    col_diff: dict[str, Counter] = defaultdict(Counter)  # kind -> column -> rows differing
    rows_by_kind: Counter = Counter()
    ctx_diff: Counter = Counter()
    told_vs_trace: Counter = Counter()
    tot = {"live_rows": [0, 0], "trace_rows": [0, 0], "trace_rows_all": [0, 0], "trace_group": [0, 0]}
    n_dec = 0
    for i in range(min(steps, len(trace.iterations))):
        tr_it = trace.iterations[i]
        per_it: dict[str, list[int]] = {}
        smap, pmap, why = map_storages(live["ops"][i], tr_it.ops)
        row: dict[str, Any] = {"iteration": i, "live_ops": len(live["ops"][i]), "trace_ops": len(tr_it.ops),
                               "ops_aligned": len(pmap), "mapped": len(smap), "mapping": why}
        # what the pilot was told at announcement against the trace's final kind and saved flag
        for sid, (k, sv, pos) in live["told"][i].items():
            t = smap.get(sid)
            if t is None:
                told_vs_trace["unmapped"] += 1
                continue
            key = (f"{k}->{kinds[t]}" if k != kinds[t] else "kind ok") + (
                f", saved {sv}->{saved[t]}" if bool(sv) != bool(saved[t]) else "")
            told_vs_trace[(key, "at start" if pos < 0 else "born in step")] += 1
        # the trace walk at the live decision points' aligned positions (every operator is one there)
        want = {pmap[p] for p, *_ in live["decisions"][i] if p in pmap}
        trace_dec = {d.position: d for d in walk(trace, i, group=1, baselines=False) if d.position in want}
        if i >= 1:
            for d in walk(trace, i, group=group, baselines=False):
                if len(d.sids):
                    P = model.probs(d.X, d.ctx)
                    h, k = _recall(model.expected_log_distance(P, d.expected_len), d.dist, WINDOW_OPS)
                    tot["trace_group"][0] += h
                    tot["trace_group"][1] += k
        # the live rows against the live run's own next uses, at every live decision point (the judge's
        # view; "judge": its scores, a storage predicted never used again this iteration ranked last)
        lidx, lkeys = _next_uses(live["ops"][i])
        for position, sids, X, ctx in live["decisions"][i]:
            if not len(sids):
                continue
            P = model.probs(X, ctx)
            el = model.expected_log_distance(P, max(len(live["ops"].get(i - 1, ())), 0))
            ldist = _next_after(lidx, lkeys, sids, position)
            judge = el.copy()
            judge[(P.argmax(axis=1) == P.shape[1] - 1) & (X[:, :3].sum(axis=1) == 0)] = np.inf
            for key, score in (("live_all", el), ("live_all_judge", judge)):
                h, k = _recall(score, ldist, WINDOW_OPS)
                phase = live["ops"][i][position].phase
                for kk in (key, f"{key}_{phase}"):
                    per_it.setdefault(kk, [0, 0])
                    per_it[kk][0] += h
                    per_it[kk][1] += k
                    allk = f"{kk}{'' if i else '_first'}"
                    tot.setdefault(allk, [0, 0])
                    tot[allk][0] += h
                    tot[allk][1] += k
        it_tot = {"live_rows": [0, 0], "trace_rows": [0, 0], "trace_rows_all": [0, 0]}
        for position, sids, X, ctx in live["decisions"][i]:
            d = trace_dec.get(pmap.get(position, -1))
            if d is None:
                continue
            n_dec += 1
            tpos = {int(s): r for r, s in enumerate(d.sids)}
            li, ti = [], []
            for r, s in enumerate(sids.tolist()):
                t = smap.get(s)
                if t is not None and t in tpos:
                    li.append(r)
                    ti.append(tpos[t])
            if not li:
                continue
            li_a, ti_a = np.asarray(li), np.asarray(ti)
            XL, XT = X[li_a], d.X[ti_a]
            diff = np.abs(XL - XT) > TOL
            for r in range(len(li)):
                kd = kinds[int(d.sids[ti[r]])]
                rows_by_kind[kd] += 1
                for c in np.flatnonzero(diff[r]):
                    col_diff[kd][CAND_FEATURES[c]] += 1
            for c in np.flatnonzero(np.abs(ctx.reshape(-1) - d.ctx.reshape(-1)) > TOL):
                ctx_diff[CTX_FEATURES[c]] += 1
            dist = d.dist[ti_a]
            el = model.expected_log_distance
            PL = model.probs(XL, ctx)
            PT = model.probs(XT, d.ctx)
            for gname, cols in GROUPS.items():  # the trace rows with one group of columns as live saw them
                XG = XT.copy()
                XG[:, cols] = XL[:, cols]
                h, k = _recall(el(model.probs(XG, d.ctx), d.expected_len), dist, WINDOW_OPS)
                key = f"trace_rows_with_live_{gname}"
                it_tot.setdefault(key, [0, 0])
                it_tot[key][0] += h
                it_tot[key][1] += k
            for key, score, dd in (("live_rows", el(PL, d.expected_len), dist),
                                   ("trace_rows", el(PT, d.expected_len), dist),
                                   ("trace_rows_all", el(model.probs(d.X, d.ctx), d.expected_len), d.dist)):
                h, k = _recall(score, dd, WINDOW_OPS)
                it_tot[key][0] += h
                it_tot[key][1] += k
            row.setdefault("live_only", 0)
            row["live_only"] += len(sids) - len(li)
            row.setdefault("trace_only", 0)
            row["trace_only"] += len(d.sids) - len(li)
        for key, (h, k) in [*it_tot.items(), *per_it.items()]:
            row[f"recall_{key}"] = h / k if k else None
            if i >= 1 and key in it_tot:
                tot.setdefault(key, [0, 0])
                tot[key][0] += h
                tot[key][1] += k
        out["iterations"].append(row)
    out["decision_points_compared"] = n_dec
    out["recall"] = {key: (h / k if k else None) for key, (h, k) in tot.items()}
    out["rows_by_kind"] = dict(rows_by_kind)
    out["column_differs"] = {kd: {c: f"{n} ({100 * n / rows_by_kind[kd]:.1f}%)" for c, n in cnt.most_common(12)}
                             for kd, cnt in col_diff.items()}
    out["context_differs"] = dict(ctx_diff.most_common(12))
    out["told_vs_trace"] = {f"{k[0]} ({k[1]})" if isinstance(k, tuple) else k: n
                            for k, n in told_vs_trace.most_common()}
    compared, bad = label_mismatches(live, trace, range(1, min(steps, len(trace.iterations))))
    out["labels_at_phase_starts"] = {"compared": compared, "mismatched": len(bad),
                                     "by_kind": dict(Counter(f"{b[2]} saved={b[3]}: told {b[4]} saved={b[5]}"
                                                             for b in bad))}
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", help="a zoo family or path/to/file.py:function")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fraction", type=float, default=0.25, help="cap as a fraction of the largest step's peak")
    p.add_argument("--json", help="write the report here")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    out = compare(args.workload, args.steps, args.preset, args.seed, args.fraction)
    text = json.dumps(out, indent=1, default=str)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
