"""The pilot model's measured figures (docs/pilot.md, docs/benchmarks.md "Pilot model").

    python tools/pilot_experiments.py metrics   # held-out metrics vs replay / recency / frequency
    python tools/pilot_experiments.py lofo      # leave-one-family-out (reduced training settings)
    python tools/pilot_experiments.py cost      # inference cost per decision point vs h100 iteration time
    python tools/pilot_experiments.py shift     # online refit when the input distribution shifts mid-run

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
    shift_experiment,
    train,
    zoo_traces,
)
from dynn_runtime.pilot.policy import default_weights_path

sys.path.insert(0, str(Path(__file__).parent))
from pilot_build_weights import HELD_OUT, TRAIN  # noqa: E402

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
    _dump("metrics", {"weights": str(default_weights_path()), "held_out": HELD_OUT, "wall_s": time.time() - t0,
                      "families": {k: v.as_dict() for k, v in m.items()}})


def lofo() -> None:
    cfg = PilotConfig(epochs=6, candidates_per_decision=32)
    train_tr, test_tr = _traces(TRAIN), _traces(HELD_OUT)
    res = {}
    for fam in FAMS:
        t0 = time.time()
        model, info = train(train_tr, cfg, exclude_families=[fam])
        m = evaluate(model, [t for t in test_tr if t.header["workload"] == fam])[fam]
        res[fam] = {"methods": m.methods, "train_rows": info["rows"], "wall_s": round(time.time() - t0, 1)}
        p, r = m.methods["pilot"], m.methods["replay"]
        print(f"{fam:<11} left out: pilot recall {100 * p['window_recall']:.1f}% acc {100 * p['bucket_accuracy']:.1f}% "
              f"rho {p['rank_correlation']:.3f} | replay recall {100 * r['window_recall']:.1f}% "
              f"({res[fam]['wall_s']} s)", flush=True)
    _dump("lofo", {"config": dataclasses.asdict(cfg), "train": TRAIN, "held_out": HELD_OUT, "results": res})


def cost() -> None:
    model = load_model(default_weights_path())
    rows = []
    for preset, seeds, steps in (("small", (0,), 2), ("tiny", (10,), 3)):
        for _, tr in zoo_traces(FAMS, [preset], seeds, steps):
            for group in (32,):
                r = inference_cost(tr, model=model, repeats=3, group=group)
                r["group"] = group
                rows.append(r)
                print(f"{r['workload']:<11} {preset:<6} G={group:<3} {r['decisions']:>4} decisions "
                      f"{r['candidates_mean']:>6.0f} cands {r['per_decision_us']:>7.0f} us/decision "
                      f"{1e3 * r['inference_s']:>7.2f} ms/iter vs {1e3 * r['iteration_time_s']:.2f} ms (h100) "
                      f"= {100 * r['fraction_of_iteration']:.1f}%; + per-op bookkeeping "
                      f"{1e3 * r['bookkeeping_s']:.2f} ms = {100 * r['fraction_with_bookkeeping']:.1f}%", flush=True)
    _dump("cost", {"rows": rows, "numpy": np.__version__})


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
    from dynn_runtime.trace import read_trace, record

    model = load_model(default_weights_path())
    cases = [
        ("tree_lstm", dict(mean_nodes=40.0, max_nodes=128)),
        ("evoformer", dict(min_recycles=3, max_recycles=4, residues_min=24, residues_max=32)),
        ("varlen", dict(median_len=40, length_sigma=0.4)),
    ]
    out = {}
    for fam, changes in cases:
        path = Path(".dynn-cache/traces") / f"shift-{fam}-tiny-seed20-steps12.jsonl.gz"
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


#: `large` does not fit this machine: record it with the batch (and depth) cut, and scale the
#: simulated iteration time back up by the batch (x depth) ratio; decision points and candidates
#: per decision point scale with depth (not with the batch), so the inference estimate is
#: decisions * depth * (a + b * candidates * depth).
LARGE_REDUCED = {
    "moe": ({"layers": 2, "batch": 1}, 32 * 12 / (1 * 2), 12 / 2),
    "varlen": ({"layers": 2, "batch": 1}, 32 * 24 / (1 * 2), 24 / 2),
    "skipnet": ({"batch": 2}, 128 / 2, 1.0),
    "early_exit": ({"batch": 4}, 256 / 4, 1.0),
    "tree_lstm": ({"batch": 64}, 2048 / 64, 1.0),
    "evoformer": ({"blocks": 1, "residues_min": 64, "residues_max": 96}, 4 * (160 / 80) ** 2, 4.0),
}


def cost_large() -> None:
    from dynn_runtime.bench import TraceCache

    model = load_model(default_weights_path())
    cache = TraceCache(".dynn-cache/traces")
    rows = []
    for fam in sys.argv[2:] or FAMS:
        over, time_ratio, depth_ratio = LARGE_REDUCED[fam]
        t0 = time.time()
        tr = cache.get(fam, "large", 0, 2, over)
        r = inference_cost(tr, model=model, repeats=2)
        est_iter = r["iteration_time_s"] * time_ratio
        # decision points and candidates per decision both grow with depth: per decision point the
        # cost is a + b * candidates (fitted on the small/tiny runs of `cost`: a = 209 us, b = 0.66 us)
        est_inf = r["decisions"] * depth_ratio * (209e-6 + 0.66e-6 * r["candidates_mean"] * depth_ratio)
        r.update({"overrides": over, "time_ratio": time_ratio, "depth_ratio": depth_ratio,
                  "estimated_large_iteration_s": est_iter, "estimated_large_inference_s": est_inf,
                  "estimated_large_share": est_inf / est_iter, "record_and_measure_s": round(time.time() - t0, 1)})
        rows.append(r)
        print(f"{fam:<11} reduced {over}: {r['decisions']} decisions x {r['per_decision_us']:.0f} us, "
              f"iteration {1e3 * r['iteration_time_s']:.1f} ms (h100); est. large: {1e3 * est_inf:.1f} ms of "
              f"{1e3 * est_iter:.0f} ms = {100 * est_inf / est_iter:.2f}%", flush=True)
        _dump("cost_large", {"rows": rows})


if __name__ == "__main__":
    names = sys.argv[1:2] or ["metrics", "lofo", "cost", "shift"]
    for name in names:
        {"metrics": metrics, "lofo": lofo, "cost": cost, "shift": shift, "cost_large": cost_large}[name]()
