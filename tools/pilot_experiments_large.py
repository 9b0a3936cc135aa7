"""The pilot's large-scale experiments (docs/benchmarks.md "Pilot model"): ``large`` does not fit this
machine, so these run on reduced recordings (:data:`LARGE_REDUCED`) and extrapolate.

    python tools/pilot_experiments.py cost_large      # `large` inference share, from reduced recordings
    python tools/pilot_experiments.py governed_large  # the 2% governor on them, at a `large` clock
    python tools/pilot_experiments.py host            # the pilot's host time on the simulator's host timeline

(also ``python tools/pilot_experiments_large.py NAME [FAMILY ...]``). Each writes out/pilot/<name>.json;
the shared helpers and the other experiments are in tools/pilot_experiments.py.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from dynn_runtime.pilot import inference_cost, load_model, zoo_traces
from dynn_runtime.pilot.policy import default_weights_path

sys.path.insert(0, str(Path(__file__).parent))
from pilot_experiments import BUDGETS, FAMS, OUT, _dump  # noqa: E402
from pilot_lab import LabPilot  # noqa: E402

#: `large` does not fit this machine: it is recorded with the batch cut (and, where the model is
#: deep, at two reduced depths d1 < d2 of its depth knob), per family:
#: (overrides at d1, depth knob, d1, d2, full depth, full batch / recorded batch x size ratio).
LARGE_REDUCED = {
    "moe": ({"layers": 1, "batch": 1}, "layers", 1, 2, 12, 32.0),
    "varlen": ({"layers": 2, "batch": 1}, "layers", 2, 4, 24, 32.0),
    "evoformer": ({"blocks": 1, "residues_min": 64, "residues_max": 96}, "blocks", 1, 2, 4, (160 / 80) ** 2),
    "skipnet": ({"batch": 2}, None, 1, 1, 1, 128 / 2),
    "early_exit": ({"batch": 4}, None, 1, 1, 1, 256 / 4),
    "tree_lstm": ({"batch": 64}, None, 1, 1, 1, 2048 / 64),
}


#: `cost`'s best-of-100 one-decision fit, seconds per decision point and per row scored,
#: for when out/pilot/cost.json is missing
MICRO_FIT = (7e-6, 0.49e-6)


def _micro_fit(default=MICRO_FIT):
    """The fit a + b * rows of `cost` ("micro" in out/pilot/cost.json), else ``default``."""
    if (OUT / "cost.json").exists():
        f = json.loads((OUT / "cost.json").read_text()).get("fit", {}).get("micro")
        if f:
            return f["a_s"], f["b_s"]
    return default


#: whole-run cost per decision point, seconds: a + b * rows, the policy's heap upkeep in Python
#: included (fitted over the six small families on a quiet CPU, docs/pilot-lab-notes.md)
WHOLE_RUN_FIT = (40e-6, 0.94e-6)


def cost_large() -> None:
    """`large`, estimated from reduced recordings (LARGE_REDUCED), each simulated whole (the default
    incremental rescoring, budget 1/2). Counted, not timed: decision points scale with depth, rows
    scored per decision point are extrapolated linearly in depth through the two reduced depths (an
    upper bound: on the tiny depth scans they grow more slowly); the h100 iteration is the simulated
    one at d2 scaled by the size ratio and full depth / d2 (operators scale with depth, per-operator
    time with the batch: the h100 profile is compute-bound at `large`). The cost per decision point
    is the best-of-100 one-decision fit a + b * rows of `cost` (out/pilot/cost.json, "micro"; this
    run's own when `cost` has not been run), and WHOLE_RUN_FIT beside it. Counting instead of timing
    whole runs keeps the estimate out of a shared CPU's load. skipnet, early_exit and tree_lstm are
    recorded at full depth (only the batch is cut)."""
    from dynn_runtime.bench import TraceCache
    from dynn_runtime.pilot.training.cost import fit_decision_cost

    model = load_model(default_weights_path())
    cache = TraceCache(".dynn-cache/traces")
    micro = _micro_fit(None)
    rows = []
    for fam in sys.argv[2:] or FAMS:
        over, knob, d1, d2, depth, size_ratio = LARGE_REDUCED[fam]
        t0 = time.time()
        runs = []
        for d in sorted({d1, d2}):
            o = dict(over, **({knob: d} if knob else {}))
            r = inference_cost(cache.get(fam, "large", 0, 2, o), model=model, budget=0.5, repeats=1)
            r.update({"overrides": o, "depth": d})
            runs.append(r)
        r1, r2 = runs[0], runs[-1]
        per_depth = (r2["candidates_mean"] - r1["candidates_mean"]) / (d2 - d1) if d2 > d1 else 0.0
        est_rows = r2["candidates_mean"] + per_depth * (depth - d2)
        est_dec = r2["decisions"] * depth / d2
        est_iter = r2["iteration_time_s"] * size_ratio * depth / d2
        a, b = micro or fit_decision_cost(runs)
        wa, wb = WHOLE_RUN_FIT
        est_inf, est_whole = est_dec * (a + b * est_rows), est_dec * (wa + wb * est_rows)
        rec = {"family": fam, "runs": runs, "depth_knob": knob, "full_depth": depth, "size_ratio": size_ratio,
               "fit": [a, b], "whole_run_fit": [wa, wb], "estimated_large_iteration_s": est_iter,
               "estimated_large_decisions": est_dec, "estimated_large_rows": est_rows,
               "estimated_large_inference_s": est_inf, "estimated_large_share": est_inf / est_iter,
               "estimated_large_share_whole_run": est_whole / est_iter,
               "record_and_measure_s": round(time.time() - t0, 1)}
        rows.append(rec)
        meas = ", ".join(f"depth {r['depth']}: {r['decisions']} decisions x {r['candidates_mean']:.0f} of "
                         f"{r['live_mean']:.0f} rows" for r in runs)
        print(f"{fam:<11} {meas}; est. large (depth {depth}): {est_dec:.0f} x {est_rows:.0f} rows, "
              f"{1e3 * est_inf:.1f} ms of {1e3 * est_iter:.0f} ms = {100 * est_inf / est_iter:.2f}% "
              f"(whole-run fit {100 * est_whole / est_iter:.2f}%)", flush=True)
    _dump("cost_large", {"rows": rows})


def governed_large() -> None:
    """The cost governor (``max_share=0.02``) at `large`, emulated on the reduced recordings of
    LARGE_REDUCED (the deeper of the two for moe, varlen, evoformer): each decision point is charged
    the best-of-100 fit a + b * rows of `cost` (out/pilot/cost.json, "micro"), divided by the size
    ratio, since at `large` every operator is that much longer on the compute-bound h100 profile
    while the decision points and rows stay as counted. Deterministic (nothing is timed). Reports,
    at 1/2, 1/4, 1/8, the simulated iteration over unlimited memory (oracle, pilot, governed pilot,
    and both with prior-only provisional predictions), decision points kept, and the
    inference share of the unmanaged `large` iteration."""
    from dynn_runtime.bench import TraceCache
    from dynn_runtime.sim import Simulator, simulate, unmanaged_peak

    a, b = _micro_fit()
    model = load_model(default_weights_path())

    class Charged(LabPilot):
        ratio = 1.0

        def on_op(self, position, op):
            super().on_op(position, op)
            self._spent = (self.decisions * a + self.candidates * b) / self.ratio

    variants = {"pilot": {}, "governed": {"max_share": 0.02}, "prior": {"provisional": "prior"},
                "prior_governed": {"provisional": "prior", "max_share": 0.02}}
    cache = TraceCache(".dynn-cache/traces")
    rows = []
    for fam in sys.argv[2:] or FAMS:
        over, knob, _, d2, _, ratio = LARGE_REDUCED[fam]
        tr = cache.get(fam, "large", 0, 2, dict(over, **({knob: d2} if knob else {})))
        base = simulate(tr, "none", 1.0).iter_time_s
        peak = unmanaged_peak(tr)
        for frac in BUDGETS:
            o = Simulator(tr, "oracle", max(1, int(peak * frac)), "h100").run()
            rec = {"family": fam, "budget": frac, "oracle": o.iter_time_s / base if o.feasible else None}
            for name, opts in variants.items():
                pol = Charged(model=model, **opts)
                pol.ratio = ratio
                r = Simulator(tr, pol, max(1, int(peak * frac)), "h100").run()
                rec[name] = r.iter_time_s / base if r.feasible else None
                rec[name + "_decisions"] = pol.decisions
                rec[name + "_deferred"] = pol.deferred
                rec[name + "_share"] = (pol.decisions * a + pol.candidates * b) / ratio / base
            rows.append(rec)
            print(f"{fam:<11} {frac:<6} " + " | ".join(
                f"{k} " + (f"{rec[k]:.3f}x" if rec[k] is not None else "OOM")
                + ("" if k == "oracle" else f" ({rec[k + '_decisions']} kept, {100 * rec[k + '_share']:.2f}%)")
                for k in ("oracle", *variants)), flush=True)
    _dump("governed_large", {"fit": [a, b], "rows": rows})


def _timed(cls):
    """``cls`` with every callback timed into ``self.cb_s`` (timer overhead subtracted per call)."""
    pc = time.perf_counter
    t0 = pc()
    for _ in range(100000):
        pc()
    overhead = 2 * (pc() - t0) / 100000

    class Timed(cls):
        cb_s = 0.0

        def victims(self, need_bytes, exclude):
            t0 = pc()
            inner = super().victims(need_bytes, exclude)
            self.cb_s += pc() - t0 - overhead
            while True:
                t0 = pc()
                try:
                    v = next(inner)
                except StopIteration:
                    self.cb_s += pc() - t0 - overhead
                    return
                self.cb_s += pc() - t0 - overhead
                yield v

    def wrapped(base):
        def wrap(self, *args):
            t0 = pc()
            out = base(self, *args)
            self.cb_s += pc() - t0 - overhead
            return out
        return wrap

    for name in ("begin_iteration", "on_alloc", "on_access", "on_free", "on_op", "after_op"):
        setattr(Timed, name, wrapped(getattr(cls, name)))
    Timed.name = cls.name
    return Timed


def _charged(cls, per_op: float):
    """``cls`` charging ``per_op`` host seconds after every operator (for the host timeline)."""

    class Charged(cls):
        def on_op(self, position, op):
            super().on_op(position, op)
            self.host_seconds = getattr(self, "host_seconds", 0.0) + per_op

    Charged.name = cls.name
    return Charged


def host() -> None:
    """The pilot's host time on the simulator's host timeline (dynn_runtime.sim.engine).

    Per family, at `small` (seed 0) and at `large` emulated from the reduced recordings of
    LARGE_REDUCED (the deeper one) on the h100 profile slowed by the size ratio (peak FLOP/s, memory
    and link bandwidth divided by it; the per-operator floor, copy latency and host dispatch kept:
    at `large` an operator's arithmetic and its copies grow, its launch does not). The pilot's
    per-operator host time outside decision points (every callback timed, best of 3, budget 1/2)
    is measured here, the decision points are charged the best-of-100 fit a + b * rows of `cost`
    (out/pilot/cost.json), then each run is simulated with ``host_cost`` (deterministic): inference
    only (a, b, 0) and everything (a, b, c). Replay's per-operator host time is measured the same way
    and charged likewise, for scale. Reports the host seconds over the unmanaged iteration (serial)
    and the iteration time it adds on the host timeline (exposed), at 1/2, 1/4, 1/8."""
    from dynn_runtime.bench import TraceCache
    from dynn_runtime.policies import POLICIES
    from dynn_runtime.sim import get_profile, simulate

    a, b = _micro_fit()
    model = load_model(default_weights_path())
    h100 = get_profile("h100")
    TimedPilot, TimedReplay = _timed(LabPilot), _timed(POLICIES["replay"])

    def per_op(tr, prof, make, repeats):
        best = None
        for _ in range(repeats):
            pol = make()
            r = simulate(tr, pol, 0.5, prof)
            c = (pol.cb_s - getattr(pol, "inference_s", 0.0)) / r.ops
            best = c if best is None else min(best, c)
        return best

    cache = TraceCache(".dynn-cache/traces")
    cases = [("small", tr.header["workload"], tr, h100, 3) for _, tr in zoo_traces(FAMS, ["small"], (0,), 2)]
    for fam in FAMS:
        over, knob, _, d2, _, ratio = LARGE_REDUCED[fam]
        prof = dataclasses.replace(
            h100, name="h100", peak_flops={k: v / ratio for k, v in h100.peak_flops.items()},
            mem_bytes_per_s=h100.mem_bytes_per_s / ratio, h2d_bytes_per_s=h100.h2d_bytes_per_s / ratio,
            d2h_bytes_per_s=h100.d2h_bytes_per_s / ratio)
        cases.append(("large", fam, cache.get(fam, "large", 0, 2, dict(over, **({knob: d2} if knob else {}))), prof, 2))
    rows = []
    for preset, fam, tr, prof, repeats in cases:
        c_pilot = per_op(tr, prof, lambda: TimedPilot(model=model), repeats)
        c_replay = per_op(tr, prof, TimedReplay, repeats)
        base = simulate(tr, "none", 1.0, prof)
        t_base = base.iter_time_s
        for frac in BUDGETS:
            rec = {"preset": preset, "family": fam, "budget": frac, "ops": base.ops, "unmanaged_s": t_base,
                   "per_op_us": {"pilot": 1e6 * c_pilot, "replay": 1e6 * c_replay}, "fit": [a, b]}
            plain = simulate(tr, LabPilot(model=model), frac, prof)
            rec["pilot"] = plain.iter_time_s / t_base if plain.feasible else None
            for name, cost_ in (("inference", (a, b, 0.0)), ("all", (a, b, c_pilot))):
                pol = LabPilot(model=model, host_cost=cost_, worker=False)
                r = simulate(tr, pol, frac, prof, host_timeline=True)
                rec["pilot_" + name] = r.iter_time_s / t_base if r.feasible else None
                rec["serial_" + name] = r.policy_host_s / t_base
                rec["exposed_" + name] = (r.iter_time_s - plain.iter_time_s) / t_base if r.feasible else None
            # the network on a worker thread: this thread gathers the rows and merges the results
            # (charged the policy's HANDOFF_COST); "auto" hands off only where deciding here would hold
            # the device up
            for name, worker, cost_ in (("worker", True, (a, b, 0.0)), ("worker_all", True, (a, b, c_pilot)),
                                        ("auto", "auto", (a, b, 0.0)), ("auto_all", "auto", (a, b, c_pilot))):
                pol = LabPilot(model=model, host_cost=cost_, worker=worker)
                r = simulate(tr, pol, frac, prof, host_timeline=True)
                rec["pilot_" + name] = r.iter_time_s / t_base if r.feasible else None
                rec["serial_" + name] = r.policy_host_s / t_base
                rec["exposed_" + name] = (r.iter_time_s - plain.iter_time_s) / t_base if r.feasible else None
                rec["wait_" + name] = pol.wait_s / t_base
                rec["handoffs_" + name] = [pol.handoffs, pol.decisions]
            wk = simulate(tr, LabPilot(model=model, worker=True), frac, prof)
            rec["pilot_worker_untimed"] = wk.iter_time_s / t_base if wk.feasible else None
            rp = simulate(tr, "replay", frac, prof)
            rph = simulate(tr, _charged(POLICIES["replay"], c_replay)(), frac, prof, host_timeline=True)
            rec["replay"] = rp.iter_time_s / t_base if rp.feasible else None
            rec["replay_host"] = rph.iter_time_s / t_base if rph.feasible else None
            rec["serial_replay"] = rph.policy_host_s / t_base
            rows.append(rec)

            def pct(v):
                return "  OOM" if v is None else f"{100 * v:5.1f}%"
            print(f"{preset:<5} {fam:<11} {frac:<6} per-op host us: pilot {1e6 * c_pilot:5.1f} replay "
                  f"{1e6 * c_replay:5.1f} | inference serial {pct(rec['serial_inference'])} exposed "
                  f"{pct(rec['exposed_inference'])} | all serial {pct(rec['serial_all'])} exposed "
                  f"{pct(rec['exposed_all'])} | worker: inference exposed {pct(rec['exposed_worker'])} "
                  f"(wait {pct(rec['wait_worker'])}), all {pct(rec['exposed_worker_all'])} | auto: inference "
                  f"exposed {pct(rec['exposed_auto'])} ({rec['handoffs_auto'][0]}/{rec['handoffs_auto'][1]} handed "
                  f"off), all {pct(rec['exposed_auto_all'])} | "
                  f"pilot {rec['pilot'] or 0:.3f}x -> {rec['pilot_all'] or 0:.3f}x, "
                  f"replay {rec['replay'] or 0:.3f}x -> {rec['replay_host'] or 0:.3f}x", flush=True)
    _dump("host", {"fit": [a, b], "rows": rows})


if __name__ == "__main__":
    {"cost_large": cost_large, "governed_large": governed_large, "host": host}[sys.argv[1]]()
