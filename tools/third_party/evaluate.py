"""The pilot on networks nobody on this project wrote: trace metrics, live prefetch quality, steps to recover.

For each network of this folder (each a ``file.py:build`` workload, evaluation only), on ``--device``
(``cpu`` by default, or ``cuda``), under deterministic algorithms (so that on a GPU bit identity is
judged on the manager alone):

1. **Cap.** The same steps under the manager with nothing to move (policy ``none``, no budget): the
   largest step's peak of the managed storages, PyTorch alone's peak counted as the manager counts
   (:func:`managed_peak`); the cap is ``--fraction`` of it (:func:`cap_bytes`; bytes, so that every
   step, the first included, runs under it). Not the allocator's peak: on CUDA that also holds what
   the manager never manages (cuBLAS workspaces, one per handle and stream, megabytes each; the
   allocator's rounding), at ``tiny`` several times the managed bytes, so that a cap taken from it
   can leave nothing to move. PyTorch alone runs for ``--steps`` steps before and again after the
   methods: the reference for bit identity, and the mean of the two runs' median step times (the
   first step left out) is what each method's median step time is divided by (``step x alone``).
2. **Live.** The same steps under the memory manager at that cap, per method: ``pilot (shipped)``,
   ``pilot (fallback)`` (per decision point, replay's or lru's predictions while their recent window
   recall beats the model's; the model's side takes replay's where its plan has held exactly), ``pilot (adapted)`` (the fallback and the model refit online on the
   run's own accesses every step, swapped in when it beats the model in use on the latest step),
   ``replay`` and ``lru``. Per step: prefetch hits, misses, stall seconds, late fetches (asynchronous
   copies: the fetches the compute stream waited for; the stall is those waits, timed on the GPU),
   bytes moved; per run the median step time. The table gives stalls in milliseconds.
3. **Steps to recover.** For each pilot variant, the least ``s`` such that over steps ``s..end`` its
   prefetch hit rate is at least the better of replay's and lru's (``None``: not within the run);
   and the same also requiring its stall time to be at most the smaller of theirs (on the CPU the
   stall is the wall time of synchronous copies on a shared machine: noisy; on a GPU the compute
   stream's timed waits for copies).
4. **Trace metrics.** A trace of ``--trace-steps`` steps: window recall of the shipped pilot, replay
   and lru over iterations 1..; and of the pilot refit online on the trace's own iterations (the
   same :class:`~dynn_runtime.pilot.training.online.OnlineRefit` the policy uses, synchronous), over
   the iterations after its first validated refit.
5. **Simulated.** The trace's last iteration at ``--fraction`` of its unmanaged peak on the ``h100``
   profile, per method but the adapted one (a refit needs iterations the simulator does not run):
   prefetch hits, misses, stall time, the modelled counterpart of the CPU's noisy wall times.
   ``--no-trace`` leaves 4 and 5 out (they run on the CPU whatever ``--device`` is: a GPU lease
   spends its minutes on 1-3).

``--optimizer foreach`` trains every network with multi-tensor Adam (``multi_tensor.py``), the
optimizer torch picks by default for CUDA parameters, so that the CPU runs the optimizer a GPU run
does; ``default`` (the default) leaves torch's choice for the device.

``--candidate W.npz`` evaluates other weights beside the shipped ones: the methods ``candidate``,
``candidate (fallback)`` and ``candidate (adapted)``, each run right after its shipped counterpart.
``--rounds 2`` runs every method twice per network, the second time in the reverse order, so that
each method's stall time is paired in time with every other's on a shared machine (counts and
stalls are summed over the rounds; steps to recover is the worse round's). ``--methods`` runs only
the methods named (steps to recover needs replay or lru among them).

Writes JSON (``--json``) and prints the markdown rows of docs/pilot.md's table. Needs the networks'
packages (``transformers``, ``torch-geometric``; see docs/pilot.md, "Networks outside the zoo").
Run from the repository root::

    python tools/third_party/evaluate.py --fraction 0.25 --steps 8 --json out/third_party/eval.json
    python tools/third_party/evaluate.py --candidate mine.npz --rounds 2 --json out/third_party/cand.json
    python tools/third_party/evaluate.py --device cuda --steps 4 --no-trace --json out/third_party/gpu.json
    python tools/third_party/evaluate.py --networks dynamic_gnn --fraction 0.5 --steps 5 --no-trace \
        --methods "pilot (fallback)" replay lru --json out/third_party/gnn-half.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NETWORKS = {
    "moe_lm": "transformers Mixtral MoE causal LM (top-2 of 4 experts, lengths drawn per step)",
    "layerdrop_audio": "transformers wav2vec 2.0, LayerDrop 0.4 (stochastic depth), audio lengths drawn per step",
    "dynamic_gnn": "PyG GAT/GCN over random graphs drawn per step",
}
#: method -> (policy, options)
METHODS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "pilot (shipped)": ("pilot", None),
    "pilot (fallback)": ("pilot", {"fallback": True}),
    "pilot (adapted)": ("pilot", {"fallback": True, "online": True, "refit_every": 1}),
    "replay": ("replay", None),
    "lru": ("lru", None),
}
BASELINES = ("replay", "lru")
#: the pilot variants that ``--candidate`` repeats with the candidate weights, named with this prefix
CANDIDATE = "candidate"


def methods(candidate: str | None = None) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """The methods to run, in order: :data:`METHODS`, and with ``candidate`` (a weights file) each
    pilot variant again with those weights right after it."""
    if candidate is None:
        return dict(METHODS)
    out: dict[str, tuple[str, dict[str, Any] | None]] = {}
    for name, (policy, options) in METHODS.items():
        out[name] = (policy, options)
        if policy == "pilot":
            variant = "" if name == "pilot (shipped)" else name[len("pilot"):]
            out[CANDIDATE + variant] = (policy, {**(options or {}), "weights": candidate})
    return out


#: --optimizer: the workloads' own (Adam as torch picks it for the device: one parameter at a time on the
#: CPU, multi-tensor on CUDA), or multi-tensor Adam on every device (multi_tensor.py)
OPTIMIZERS = ("default", "foreach")


def _spec(name: str, optimizer: str = "default") -> str:
    if optimizer == "foreach":
        return f"{HERE / 'multi_tensor.py'}:{name}"
    return f"{HERE / (name + '.py')}:build"


def managed_peak(spec: str, steps: int, device: str = "cpu") -> int:
    """PyTorch alone's largest step peak as the manager counts device bytes: ``spec`` trained for
    ``steps`` steps under a manager that moves nothing (policy ``none``, no budget), the largest
    per-step peak of the storages it manages. The same on every device (on the CPU within a few
    percent of the bytes allocated, on CUDA without the allocator's own bytes), so a fraction of it
    means the same there."""
    from dynn_runtime.runtime.train import UNLIMITED, train_managed

    return train_managed(spec, UNLIMITED, "none", steps=steps, preset="tiny", device=device).max_managed_peak()


def cap_bytes(peak: int, fraction: float) -> int:
    """The evaluation's cap: ``fraction`` (in (0, 1]) of ``peak`` (:func:`managed_peak`), in bytes.

    >>> cap_bytes(4 << 20, 0.25)
    1048576
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"evaluate: the cap is a fraction in (0, 1] of PyTorch alone's peak, got {fraction}; "
                         "pass --fraction 0.25 for a quarter.")
    if peak <= 0:
        raise ValueError(f"evaluate: PyTorch alone's managed peak is {peak} bytes; the network allocated nothing "
                         "on the device the manager could count.")
    return max(1, int(peak * fraction))


def _rate(h: int, m: int) -> float | None:
    return h / (h + m) if h + m else None


def steps_to_recover(per_step: dict[str, list[dict[str, Any]]], method: str, stalls: bool = False) -> int | None:
    """The least step ``s`` from which ``method``'s hit rate over steps ``s..`` is at least the better
    baseline's (``stalls``: and its stall time at most the smaller baseline's); None when no such step
    before the steps where nothing more was needed back (they say nothing)."""
    def tot(m: str, s: int) -> tuple[int, int, float]:
        rows = per_step[m][s:]
        return (sum(r["prefetch_hits"] for r in rows), sum(r["prefetch_misses"] for r in rows),
                sum(r["stall_seconds"] for r in rows))

    for s in range(len(per_step[method])):
        h, m, st = tot(method, s)
        if not h + m:
            break  # nothing was needed back from here on: no evidence either way
        base = [tot(b, s) for b in BASELINES if b in per_step]
        if not base:
            return None  # no baseline ran: nothing to recover to
        best_rate = max((_rate(bh, bm) or 0.0) for bh, bm, _ in base)
        best_stall = min(bs for _, _, bs in base)
        if (_rate(h, m) or 0.0) >= best_rate and (not stalls or st <= best_stall):
            return s
    return None


def _one_run(name: str, spec: str, cap: int, method: str, policy: str, options: dict[str, Any] | None,
             steps: int, ref_digest: str, device: str = "cpu") -> dict[str, Any]:
    from dynn_runtime.policies import make_policy
    from dynn_runtime.runtime.train import train_managed

    t0 = time.perf_counter()
    pol = make_policy(policy, **(options or {}))
    r = train_managed(spec, cap, pol, steps=steps, preset="tiny", device=device)
    st = r.stats
    rows = [{k: s[k] for k in ("prefetch_hits", "prefetch_misses", "stall_seconds", "late_fetches", "bytes_offloaded",
                               "bytes_prefetched", "bytes_fetched_on_demand")} for s in st["per_step"]]
    out = {
        "prefetch_hits": st["prefetch_hits"], "prefetch_misses": st["prefetch_misses"],
        "hit_rate": _rate(st["prefetch_hits"], st["prefetch_misses"]), "stall_seconds": st["stall_seconds"],
        "late_fetches": st["late_fetches"],
        "bytes_moved": st["bytes_offloaded"] + st["bytes_prefetched"] + st["bytes_fetched_on_demand"],
        "bit_identical": r.digest == ref_digest, "wall_s": time.perf_counter() - t0, "per_step": rows,
        "step_s": r.median_step_seconds(),
    }
    if policy == "pilot" and pol.judged_recall:  # the fallback's judge: recall of each predictor, live
        out["live_window_recall"] = pol.judged_recall
        out["followed"] = dict(pol.followed)
    print(f"  {name} {method}: {st['prefetch_hits']} / {st['prefetch_misses']}, stalls {_stall(out)}, "
          f"step {out['step_s'] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return out


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's rounds as one record: counts, stalls and bytes summed; every round kept."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for k in ("prefetch_hits", "prefetch_misses", "stall_seconds", "late_fetches", "bytes_moved", "wall_s"):
        out[k] = sum(r.get(k, 0) for r in runs)
    for k in ("step_s", "step_ratio"):  # a time per step: the median over the rounds
        vals = sorted(r[k] for r in runs if r.get(k) is not None)
        out[k] = vals[len(vals) // 2] if vals else None
    out["hit_rate"] = _rate(out["prefetch_hits"], out["prefetch_misses"])
    out["bit_identical"] = all(r["bit_identical"] for r in runs)
    out["rounds"] = runs
    return out


def live(name: str, fraction: float, steps: int, candidate: str | None = None, rounds: int = 1,
         device: str = "cpu", only: list[str] | None = None, optimizer: str = "default") -> dict[str, Any]:
    from dynn_runtime.runtime.train import deterministic, train_unmanaged

    spec = _spec(name, optimizer)
    todo = methods(candidate)
    if only is not None:
        unknown = sorted(set(only) - set(todo))
        if unknown:
            raise ValueError(f"evaluate: no method {', '.join(map(repr, unknown))}; the methods are "
                             f"{', '.join(map(repr, todo))}.")
        todo = {k: v for k, v in todo.items() if k in only}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in todo}
    with deterministic():  # on any device: the CPU runs the path a GPU does
        ref = train_unmanaged(spec, steps=steps, preset="tiny", device=device)
        peak = managed_peak(spec, steps, device)
        cap = cap_bytes(peak, fraction)
        for k in range(rounds):
            order = list(todo) if k % 2 == 0 else list(reversed(todo))  # pairs every method with every other in time
            for method in order:
                policy, options = todo[method]
                runs[method].append(_one_run(name, spec, cap, method, policy, options, steps, ref.digest, device))
        # PyTorch alone again after the methods: its step time is the mean of the runs before and after,
        # so that a drift of the machine over the runs (warm-up, other load) weighs on both sides
        again = train_unmanaged(spec, steps=steps, preset="tiny", device=device)
    alone = [ref.median_step_seconds(), again.median_step_seconds()]
    ref_step_s = sum(alone) / 2
    for run in (r for rs in runs.values() for r in rs):
        run["step_ratio"] = run["step_s"] / ref_step_s if ref_step_s else None
    # peak_bytes: the cap's basis; unmanaged_peak_bytes: PyTorch alone's own count (CUDA: the allocator's
    # max_memory_allocated above the process's bytes before the run; the CPU: bytes allocated)
    out: dict[str, Any] = {"cap_bytes": cap, "peak_bytes": peak, "unmanaged_peak_bytes": max(ref.peak_bytes),
                           "rounds": rounds, "device": device, "optimizer": optimizer,
                           "alone_step_s": ref_step_s, "alone_step_s_before_after": alone, "methods": {}}
    for method in todo:
        out["methods"][method] = _combine(runs[method])
    for method in todo:
        if todo[method][0] == "pilot":
            for key, stalls in (("steps_to_recover", False), ("steps_to_recover_with_stalls", True)):
                per_round = [steps_to_recover({m: runs[m][k]["per_step"] for m in todo}, method, stalls)
                             for k in range(rounds)]
                out["methods"][method][key] = None if None in per_round else max(per_round)
    return out


def _recall_and_adapted(trace: Any, model: Any) -> dict[str, Any]:
    """Window recall of ``model`` (and replay, lru) on ``trace``, and of the model refit online on the
    trace's own iterations over the iterations after its first validated swap."""
    import numpy as np

    from dynn_runtime.bench.quality import window_recall
    from dynn_runtime.pilot.training.online import OnlineRefit, _iteration_metrics

    recall = window_recall(trace, model)
    refit = OnlineRefit(model.copy(), refit_every=1)
    current, per_iter, first = refit.model, [], None
    for i in range(1, len(trace.iterations)):
        per_iter.append(_iteration_metrics(current, trace, i, refit)["window_recall"])
        new = refit.end_iteration(trace.iterations[: i + 1])
        if new is not None:
            current = new
            first = i if first is None else first
    adapted = [r for k, r in enumerate(per_iter, start=1) if first is not None and k > first and r is not None]
    return {"window_recall": recall, "adapted_window_recall": float(np.mean(adapted)) if adapted else None,
            "adapted_per_iteration": per_iter, "first_swap_after_iteration": first,
            "refits": refit.refits, "swaps": refit.swaps, "rejected": refit.rejected}


def trace_metrics(name: str, trace_steps: int, out_dir: Path, fraction: float,
                  candidate: str | None = None, optimizer: str = "default") -> dict[str, Any]:
    from dynn_runtime.pilot.config import cached_model, default_weights_path
    from dynn_runtime.trace import read_trace, record

    tag = "" if optimizer == "default" else f"-{optimizer}"
    path = out_dir / f"{name}{tag}-tiny-seed0-steps{trace_steps}.jsonl.gz"
    if not path.exists():
        record(_spec(name, optimizer), path, steps=trace_steps, preset="tiny", seed=0)
    trace = read_trace(path)
    out = {"trace": str(path), **_recall_and_adapted(trace, cached_model(default_weights_path()))}
    if candidate is not None:
        out[CANDIDATE] = _recall_and_adapted(trace, cached_model(Path(candidate)))
    from dynn_runtime.bench.quality import sim_quality
    from dynn_runtime.policies import make_policy
    from dynn_runtime.sim import simulate

    simulated = {}
    for method, (policy, options) in methods(candidate).items():
        if options and options.get("online"):
            continue
        r = simulate(trace, make_policy(policy, **(options or {})), fraction, "h100")
        simulated[method] = {"feasible": r.feasible, "iter_time_s": r.iter_time_s if r.feasible else None,
                             **sim_quality(r.as_dict())}
    out["simulated"] = simulated
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _sim(r: dict[str, Any] | None) -> str:
    if r is None:
        return "- | -"
    if not r["feasible"]:
        return "OOM | "
    return f"{r['prefetch_hits']} / {r['prefetch_misses']} | {r['stall_seconds'] * 1e3:.3f} ms"


def _stall(m: dict[str, Any]) -> str:
    """Stall time in milliseconds (a GPU's timed waits add up to well under one), and where copies
    are asynchronous the fetches that were late (``StepStats.late_fetches``)."""
    late = m.get("late_fetches")
    return f"{m['stall_seconds'] * 1e3:.3f} ms" + (f" ({late} late)" if late else "")


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def table(results: dict[str, Any]) -> str:
    lines = ["| network | method | window recall | hits / misses | hit rate | stalls | bytes moved "
             "| steps to recover (hit rate / and stalls) | step x alone | bit-identical | simulated hits / misses "
             "| simulated stalls |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name, res in results.items():
        tr = res.get("trace") or {"window_recall": {}, "adapted_window_recall": None}
        rec, cand = tr["window_recall"], tr.get(CANDIDATE, {})
        for method, m in res["live"]["methods"].items():
            wr = {"pilot (shipped)": rec.get("pilot"), "replay": rec.get("replay"), "lru": rec.get("lru"),
                  "pilot (adapted)": tr["adapted_window_recall"],
                  CANDIDATE: cand.get("window_recall", {}).get("pilot"),
                  f"{CANDIDATE} (adapted)": cand.get("adapted_window_recall")}.get(method)
            rec_s = " / ".join("not reached" if m.get(k) is None else str(m[k])
                               for k in ("steps_to_recover", "steps_to_recover_with_stalls"))
            pilot = method.startswith(("pilot", CANDIDATE))
            lines.append(f"| {name} | {method} | {_pct(wr)} | {m['prefetch_hits']} / {m['prefetch_misses']} | "
                         f"{_pct(m['hit_rate'])} | {_stall(m)} | {m['bytes_moved'] / 2**20:.1f} MiB | "
                         f"{rec_s if pilot else ''} | {_ratio(m.get('step_ratio'))} | "
                         f"{'yes' if m['bit_identical'] else 'NO'} | {_sim(tr.get('simulated', {}).get(method))} |")
    return "\n".join(lines) + "\n"


def rescore(path: str) -> dict[str, Any]:
    """A results file's steps to recover computed again from its per-step counts (and the table)."""
    data = json.loads(Path(path).read_text())
    for res in data["results"].values():
        methods = res["live"]["methods"]
        per_step = {k: v["per_step"] for k, v in methods.items()}
        if res["live"].get("rounds", 1) > 1:
            continue  # per-round figures: kept as computed
        for k, v in methods.items():
            if k.startswith(("pilot", CANDIDATE)):
                v["steps_to_recover"] = steps_to_recover(per_step, k)
                v["steps_to_recover_with_stalls"] = steps_to_recover(per_step, k, stalls=True)
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    p.add_argument("--fraction", type=float, default=0.25,
                   help="cap as a fraction of the largest step's peak of the managed storages")
    p.add_argument("--steps", type=int, default=8, help="live steps per run")
    p.add_argument("--trace-steps", type=int, default=5, help="iterations of the recorded trace")
    p.add_argument("--json", default="out/third_party/eval.json")
    p.add_argument("--table", metavar="JSON", help="print the table of an earlier results file (nothing runs)")
    p.add_argument("--candidate", metavar="WEIGHTS", help="also evaluate these weights (methods 'candidate ...')")
    p.add_argument("--methods", nargs="+", metavar="METHOD",
                   help="run only these methods (names as in the table, e.g. 'pilot (fallback)' replay lru)")
    p.add_argument("--rounds", type=int, default=1, help="runs per method, alternating the order (paired stalls)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the live runs train (default cpu)")
    p.add_argument("--optimizer", default="default", choices=OPTIMIZERS,
                   help="default: Adam as torch picks it for the device (one parameter at a time on the CPU, "
                        "multi-tensor on CUDA); foreach: multi-tensor Adam on every device (the GPU's on the CPU)")
    p.add_argument("--no-trace", dest="trace", action="store_false",
                   help="skip the recorded trace's metrics and the simulation (CPU work; the live runs only)")
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        p.error(f"--fraction {args.fraction}: the cap is a fraction in (0, 1] of PyTorch alone's peak (0.25: a quarter)")
    if args.methods:
        unknown = sorted(set(args.methods) - set(methods(args.candidate)))
        if unknown:
            p.error(f"--methods: no method {', '.join(map(repr, unknown))}; the methods are "
                    f"{', '.join(map(repr, methods(args.candidate)))}")
    if args.table:
        print(table(rescore(args.table)["results"]))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here; run on the CPU (--device cpu) or where a GPU is")
    torch.set_num_threads(1)  # tiny models; and the development machine is shared
    out_dir = Path(args.json).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for name in args.networks:
        print(f"{name}: {NETWORKS[name]}", file=sys.stderr, flush=True)
        results[name] = {"description": NETWORKS[name],
                         "trace": (trace_metrics(name, args.trace_steps, out_dir, args.fraction, args.candidate,
                                                 args.optimizer) if args.trace else None),
                         "live": live(name, args.fraction, args.steps, args.candidate, args.rounds, args.device,
                                      args.methods, args.optimizer)}
    data = {"config": vars(args), "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__,
            "results": results}
    Path(args.json).write_text(json.dumps(data, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
