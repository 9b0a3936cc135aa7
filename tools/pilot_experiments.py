"""The pilot model's measured figures (docs/pilot.md, docs/benchmarks.md "Pilot model").

    python tools/pilot_experiments.py metrics   # held-out metrics vs replay / recency / frequency
    python tools/pilot_experiments.py lofo      # leave-one-family-out (reduced training settings;
                                                # --seeds 0,1,2: one model per training seed)
    python tools/pilot_experiments.py cost      # inference cost per decision point vs h100 iteration time
    python tools/pilot_experiments.py shift     # online refit when the input distribution shifts mid-run
    python tools/pilot_experiments.py cost_large      # `large` inference share, from reduced recordings
    python tools/pilot_experiments.py governed_large  # the 2% governor on them, at a `large` clock
    python tools/pilot_experiments.py host      # the pilot's host time on the simulator's host timeline
                                                # (these three: tools/pilot_experiments_large.py)
    python tools/pilot_experiments.py seeds [--candidates 0,1,2,3]   # choose the shipped training seed

Each writes out/pilot/<name>.json (and prints a markdown table). Traces come from the bench's trace
cache (.dynn-cache/traces), recorded if missing; the data split is tools/pilot_build_weights.py's.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from dynn_runtime import models
from dynn_runtime.pilot import (
    PilotConfig,
    evaluate,
    inference_cost,
    load_model,
    render_table,
    save_model,
    shift_experiment,
    train,
    zoo_traces,
)
from dynn_runtime.pilot.policy import default_weights_path

sys.path.insert(0, str(Path(__file__).parent))
from pilot_build_weights import (  # noqa: E402
    HELD_OUT,
    HELD_OUT_DEPTH,
    MAX_DECISIONS,
    REPEAT,
    SYNTH,
    TRAIN,
    TRAIN_DEPTH,
    depth_traces,
    synthetic,
    training_traces,
)
from pilot_lab import LabPilot  # noqa: E402

OUT = Path("out/pilot")
FAMS = list(models.FAMILIES)


def _traces(spec, fams=FAMS):
    return [t for p, seeds, steps in spec for _, t in zoo_traces(fams, [p], seeds, steps)]


def _dump(name: str, obj) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(obj, indent=1) + "\n")
    print(f"wrote {OUT / (name + '.json')}")


def metrics() -> None:
    model = load_model(default_weights_path())
    t0 = time.time()
    m = evaluate(model, _traces(HELD_OUT))
    print(render_table(m))
    deeper = evaluate(model, depth_traces(HELD_OUT_DEPTH), every=4)
    print("deeper than any training trace (tiny, x8 depth, every 4th decision point):")
    print(render_table(deeper))
    _dump("metrics", {"weights": str(default_weights_path()), "held_out": HELD_OUT, "wall_s": time.time() - t0,
                      "families": {k: v.as_dict() for k, v in m.items()},
                      "held_out_deeper": HELD_OUT_DEPTH, "deeper": {k: v.as_dict() for k, v in deeper.items()}})


def _synth_extra() -> tuple[str, ...] | None:
    """``--synth-extra graph,mod``: the synthetic networks' extra stages (None: the shipped recipe's)."""
    if "--synth-extra" not in sys.argv:
        return None
    return tuple(k for k in sys.argv[sys.argv.index("--synth-extra") + 1].split(",") if k)


def lofo() -> None:
    from dynn_runtime.pilot.model import fit
    from dynn_runtime.pilot.training.data import Rows, build_rows, trace_family
    from dynn_runtime.pilot.training.train import fit_prior

    cfg = PilotConfig(epochs=6, candidates_per_decision=32)
    # the zoo minus the left-out family, plus the synthetic networks (never a left-out family);
    # rows are built once per family (what train() does for the traces it is given) and reused
    # `lofo --no-synthetic`: the zoo minus the left-out family only (the shipped weights' recipe)
    with_synth = "--no-synthetic" not in sys.argv
    # `lofo --synth-extra graph,mod`: the synthetic networks with those extra stages (default: the shipped recipe's)
    extra = _synth_extra()
    train_tr = _traces(TRAIN) + depth_traces(TRAIN_DEPTH) + (synthetic(extra=extra) if with_synth else [])
    test_tr = _traces(HELD_OUT)
    rows = {}
    for i, name in enumerate(dict.fromkeys(trace_family(t) for t in train_tr)):
        rows[name] = build_rows([t for t in train_tr if trace_family(t) == name], group=cfg.group,
                                per_decision=cfg.candidates_per_decision, seed=cfg.seed + i,
                                max_decisions=MAX_DECISIONS)
    # one left-out model's recall moves by several points with the training seed alone (early_exit:
    # 78-88% over three seeds), so `--seeds` trains one per seed and reports the spread
    seeds = [cfg.seed]
    if "--seeds" in sys.argv:
        seeds = [int(x) for x in sys.argv[sys.argv.index("--seeds") + 1].split(",")]
    res = {}
    for fam in FAMS:
        rs = [r for name, r in rows.items() if name != fam for _ in range(REPEAT.get(name, 1))]
        data = Rows(X=np.concatenate([r.X for r in rs]), C=np.concatenate([r.C for r in rs]),
                    y=np.concatenate([r.y for r in rs]), family=[f for r in rs for f in r.family])
        per_seed = {}
        for seed in seeds:
            t0 = time.time()
            model, _ = fit(data.X, data.C, data.y, dataclasses.replace(cfg, seed=seed))
            model.arrays["prior"] = fit_prior(data)
            m = evaluate(model, [t for t in test_tr if t.header["workload"] == fam], every=2)[fam]
            per_seed[seed] = {"methods": m.methods, "wall_s": round(time.time() - t0, 1)}
            p, r = m.methods["pilot"], m.methods["replay"]
            print(f"{fam:<11} left out, seed {seed}: pilot recall {100 * p['window_recall']:.1f}% "
                  f"acc {100 * p['bucket_accuracy']:.1f}% rho {p['rank_correlation']:.3f} | replay recall "
                  f"{100 * r['window_recall']:.1f}% ({per_seed[seed]['wall_s']} s)", flush=True)
        recalls = [v["methods"]["pilot"]["window_recall"] for v in per_seed.values()]
        res[fam] = {"methods": per_seed[seeds[0]]["methods"], "train_rows": len(data), "seeds": per_seed,
                    "window_recall_mean": float(np.mean(recalls)), "window_recall_min": float(np.min(recalls)),
                    "window_recall_max": float(np.max(recalls))}
        if len(seeds) > 1:
            print(f"{fam:<11} left out: pilot recall mean {100 * np.mean(recalls):.1f}% "
                  f"(min {100 * np.min(recalls):.1f}, max {100 * np.max(recalls):.1f}) over seeds {seeds}", flush=True)
    _dump("lofo" if with_synth else "lofo_zoo_only", {
                   "config": dataclasses.asdict(cfg), "train": TRAIN, "train_depth": TRAIN_DEPTH,
                   "synthetic": {"seeds": list(SYNTH[0]), "steps": SYNTH[1], "extra_stages": extra} if with_synth else None,
                   "repeated_families": REPEAT, "held_out": HELD_OUT, "evaluated_every_nth_decision": 2, "training_seeds": seeds,
                   "results": res})


#: the pilot variants the cost experiments compare: every live storage rescored at every decision
#: point (the former default), incremental rescoring (the default), incremental under the cost governor
VARIANTS = {"full": {"incremental": False}, "incremental": {}, "governed": {"max_share": 0.02}}
BUDGETS = (0.5, 0.25, 0.125)


def cost() -> None:
    """Per family at `small` (seed 0, the bench's traces): decision points, rows scored per decision,
    us per decision, inference share of the h100 iteration, for each variant (best of 3, budget 1/2:
    feasible on every family);
    then the simulated iteration time at 1/2, 1/4, 1/8 of each variant against the oracle."""
    from dynn_runtime.pilot.training.cost import decision_cost_curve, fit_decision_cost
    from dynn_runtime.sim import simulate

    model = load_model(default_weights_path())
    rows, sims, curves = [], [], []
    for _, tr in zoo_traces(FAMS, ["small"], (0,), 2):
        fam = tr.header["workload"]
        c = decision_cost_curve(tr, model=model)
        curves.append(c)
        print(f"{fam:<11} one decision point, best of 100: " + ", ".join(
            f"{p['candidates_mean']} rows {p['per_decision_us']:.0f} us" for p in c["points"]), flush=True)
        for name, opts in VARIANTS.items():
            r = inference_cost(tr, model=model, budget=0.5, repeats=3, policy=LabPilot, **opts)
            r["variant"] = name
            rows.append(r)
            print(f"{fam:<11} {name:<11} {r['decisions']:>4} decisions ({r['deferred']} deferred) "
                  f"{r['candidates_mean']:>5.0f} of {r['live_mean']:>5.0f} rows {r['per_decision_us']:>6.0f} us/decision "
                  f"{1e3 * r['inference_s']:>7.2f} ms vs {1e3 * r['iteration_time_s']:.2f} ms (h100) "
                  f"= {100 * r['fraction_of_iteration']:.1f}% (of the simulated 1/2 run: "
                  f"{100 * (r['fraction_of_simulated'] or 0):.1f}%); bookkeeping {1e3 * r['bookkeeping_s']:.2f} ms",
                  flush=True)
        base = simulate(tr, "none", 1.0).iter_time_s
        for b in BUDGETS:
            rec = {"workload": fam, "budget": b}
            o = simulate(tr, "oracle", b)
            rec["oracle"] = o.iter_time_s / base if o.feasible else None
            for name, opts in VARIANTS.items():
                pol = LabPilot(model=model, **opts)
                res = simulate(tr, pol, b)
                rec[name] = res.iter_time_s / base if res.feasible else None
                rec[name + "_rows"] = pol.candidates / max(pol.decisions, 1)
                rec[name + "_decisions"] = pol.decisions
            sims.append(rec)
            print(f"{fam:<11} {b:<6} " + " ".join(
                f"{k} {rec[k]:.3f}x" if rec[k] is not None else f"{k} OOM" for k in ("oracle", *VARIANTS)), flush=True)
    fits = {name: fit_decision_cost([r for r in rows if r["variant"] == name]) for name in VARIANTS}
    # whole runs on a shared CPU are load-sensitive; one decision point timed best-of-100 is less so
    fits["micro"] = fit_decision_cost([p for c in curves for p in c["points"]])
    for name, (a, b) in fits.items():
        print(f"{name}: per decision point ~ {1e6 * a:.0f} us + {1e6 * b:.2f} us per row scored")
    _dump("cost", {"rows": rows, "sim": sims, "curves": curves,
                   "fit": {k: {"a_s": a, "b_s": b} for k, (a, b) in fits.items()}, "numpy": np.__version__})


class _Shifted:
    """A zoo workload whose batches switch to another config of the same family at step ``at``."""

    def __init__(self, family: str, preset: str, at: int, seed: int, **changes) -> None:
        self.a = models.build(family, preset=preset, seed=seed)
        self.b_config = dataclasses.replace(self.a.config, **changes)
        self.at = at
        self.family = family
        self.model = self.a.model
        self.config = self.a.config

    def make_batch(self, step: int):
        self.a.config = self.b_config if step >= self.at else self.config
        return self.a.make_batch(step)

    def loss(self, model, batch):
        return self.a.loss(model, batch)

    def optimizer(self, params):
        return self.a.optimizer(params)

    def step_facts(self):
        return self.a.step_facts()


def shift() -> None:
    from dynn_runtime.trace import SCHEMA_VERSION, read_trace, record

    model = load_model(default_weights_path())
    cases = [
        ("tree_lstm", dict(mean_nodes=40.0, max_nodes=128)),
        ("evoformer", dict(min_recycles=3, max_recycles=4, residues_min=24, residues_max=32)),
        ("varlen", dict(median_len=40, length_sigma=0.4)),
    ]
    out = {}
    for fam, changes in cases:
        path = Path(".dynn-cache/traces") / f"shift-{fam}-tiny-seed20-steps12-v{SCHEMA_VERSION}.jsonl.gz"
        if not path.exists():
            tmp = path.with_name(".tmp-" + path.name)
            record(_Shifted(fam, "tiny", 4, 20, **changes), tmp, steps=12, preset="tiny", seed=20)
            tmp.rename(path)
        tr = read_trace(path)
        for every in (1, 2):
            res = shift_experiment(model, tr, shift_at=4, refit_every=every)
            s = res.summary()
            s["changes"] = changes
            s["per_iteration"] = {"static": res.static, "online": res.online}
            out[f"{fam}/refit_every={every}"] = s
            a = s["after_shift"]
            print(f"{fam:<10} refit every {every}: after the shift recall static {100 * a['static']['window_recall']:.1f}% "
                  f"-> online {100 * a['online']['window_recall']:.1f}%, accuracy "
                  f"{100 * a['static']['bucket_accuracy']:.1f}% -> {100 * a['online']['bucket_accuracy']:.1f}% "
                  f"({s['refits']} refits)", flush=True)
    _dump("shift", out)


#: the seed selection's validation cases: seed-10 traces (never the seed-0 traces the bench and the
#: docs report), both presets, every family, these budgets; cases oracle cannot run are skipped
VALIDATION = ((("small", (10,), 3), ("tiny", (10,), 3)), (0.25, 0.125))


def seeds() -> None:
    """Train the shipped recipe once per candidate seed and simulate each on the validation cases:
    pilot over oracle iteration time (h100 profile), geometric mean and worst. The seed with the
    lowest geometric mean is the one to ship (``SHIPPED_SEED`` in pilot_build_weights.py)."""
    from dynn_runtime.sim import simulate

    cands = [0, 1, 2, 3]
    if "--candidates" in sys.argv:
        cands = [int(x) for x in sys.argv[sys.argv.index("--candidates") + 1].split(",")]
    specs, budgets = VALIDATION
    val = _traces(specs)
    train_tr = training_traces(extra=_synth_extra())
    oracle = {}
    for i, t in enumerate(val):
        for b in budgets:
            r = simulate(t, "oracle", b)
            if r.feasible:
                oracle[(i, b)] = r.iter_time_s
    res = {}
    for seed in cands:
        t0 = time.time()
        model, _ = train(train_tr, PilotConfig(seed=seed), max_decisions=MAX_DECISIONS)
        path = save_model(model, OUT / f"seed{seed}.npz")
        ratios = {}
        for (i, b), t_or in oracle.items():
            r = simulate(val[i], "pilot", b, policy_options={"weights": str(path)})
            ratios[f"{Path(val[i].path).name}@{b}"] = r.iter_time_s / t_or if r.feasible else float("inf")
        v = np.array(list(ratios.values()))
        res[seed] = {"geomean": float(np.exp(np.log(v).mean())), "worst": float(v.max()), "cases": ratios,
                     "wall_s": round(time.time() - t0, 1)}
        print(f"seed {seed}: pilot / oracle geomean {res[seed]['geomean']:.4f}, worst {res[seed]['worst']:.3f} "
              f"over {len(v)} cases ({res[seed]['wall_s']} s)", flush=True)
    best = min(res, key=lambda k: res[k]["geomean"])
    print(f"lowest geometric mean: seed {best}")
    _dump("seeds", {"validation": {"traces": specs, "budgets": budgets, "profile": "h100"},
                    "candidates": cands, "results": res, "best": best})


LARGE = ("cost_large", "governed_large", "host")


if __name__ == "__main__":
    names = sys.argv[1:2] or ["metrics", "lofo", "cost", "shift"]
    for name in names:
        if name in LARGE:  # pilot_experiments_large imports this module's helpers, so not at the top
            import pilot_experiments_large

            getattr(pilot_experiments_large, name)()
            continue
        {"metrics": metrics, "lofo": lofo, "cost": cost, "shift": shift, "seeds": seeds}[name]()
