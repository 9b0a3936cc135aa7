"""The calibration of the simulator's host cost from a ``dynn bench --overhead`` run.

:func:`calibration_from` turns an :class:`~dynn_runtime.bench.overhead.OverheadReport` into the
per-event-source figures :mod:`dynn_runtime.sim.hostcost` charges (``per_op_s``, ``per_decision_s``,
``per_move_s``, the pilot's own terms); :func:`write_calibration` stores them in
:data:`~dynn_runtime.sim.hostcost.CALIBRATION_PATH`.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from .overhead import OverheadReport

__all__ = ["calibration_from", "write_calibration", "UNCHARGED", "ZOO_AND_EXAMPLE"]

#: the workloads of measurement 2: the zoo and the README's own example
ZOO_AND_EXAMPLE = ("moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen", "examples/my_workload.py:build")

# ---- the calibration of the simulator's host cost ------------------------------------------------------

def _fit_pilot(recs: list[dict[str, Any]], lru: dict[str, dict[str, Any]]) -> list[float]:
    """The pilot's ``host_cost`` (seconds per decision point, per row scored, per operator):
    inference = a * decisions + b * rows (least squares over the workloads, a and b >= 0; one
    workload or a negative term: a = inference / decisions, b = 0); per operator, the median over the
    workloads of (pilot step - lru step - inference) / operators: its feature state and notifications."""
    import numpy as np

    recs = [r for r in recs if r["pilot_decisions"]]
    if not recs:
        return [0.0, 0.0, 0.0]
    d, c, inf = (np.asarray([r[k] for r in recs], dtype=float)
                 for k in ("pilot_decisions", "pilot_candidates", "pilot_inference_s"))
    a, b = float(inf.sum() / d.sum()), 0.0
    if len(recs) > 1:
        sol, *_ = np.linalg.lstsq(np.stack([d, c], axis=1), inf, rcond=None)
        if sol.min() >= 0:
            a, b = float(sol[0]), float(sol[1])
    per_op = [(r["managed_s"] - lru[r["workload"]]["managed_s"] - r["pilot_inference_s"]) / max(r["ops"], 1)
              for r in recs if r["workload"] in lru]
    if not per_op:
        per_op = [r["pilot_bookkeeping_s"] / max(r["pilot_ops"], 1) for r in recs]
    return [a, b, max(0.0, float(np.median(per_op)))]


def calibration_from(report: OverheadReport) -> dict[str, Any]:
    """Per event source measured: the figures :func:`~dynn_runtime.sim.hostcost.host_cost_for` reads."""
    out: dict[str, Any] = {}
    zoo = set(ZOO_AND_EXAMPLE[:-1])
    for source in report.config.sources:
        recs = [r for r in report.workloads if r["source"] == source and r["source_used"] == source]
        fam = [r for r in recs if r["spec"] in zoo] or recs
        above = {r["workload"]: r for r in fam if r["policy"] == "lru" and r["budget"] == "above peak"}
        half = {r["workload"]: r for r in fam if r["policy"] == "lru" and r["budget"] != "above peak"}
        per_op = [r["extra_s"] / max(r["ops"], 1) for r in above.values()]
        paired = {w: (max(0.0, h["extra_over_above_s"]), h["decision_points"], h["moves"]) for w, h in half.items()
                  if h.get("extra_over_above_s") is not None and h["decision_points"]}
        moved = sum(m for _, _, m in paired.values())
        per_move = sum(e for e, _, _ in paired.values()) / moved if moved else 0.0
        micro = [m for m in report.micro if m["source"] == source and m["source_used"] == source]
        if not per_op:
            continue
        # its cost per decision point where they run: every one run above the peak (as shipped it defers
        # them there, and the simulator charges the ones it runs under a budget)
        from .overhead import EVERY_POINT

        pilot = ([r for r in fam if r["policy"] == "pilot" and r["budget"] == EVERY_POINT]
                 or [r for r in fam if r["policy"] == "pilot" and r["budget"] == "above peak"])
        pilot_fit = _fit_pilot(pilot, above)
        out[source] = {
            "per_op_s": max(0.0, statistics.median(per_op)),
            # on the Python path the policy is consulted after every operator (in per_op_s) and what
            # memory pressure adds scales with the storages moved: charged per move, not per consultation
            "per_decision_s": 0.0,
            "per_move_s": per_move,
            "per_decision_s_if_alone": (sum(e for e, _, _ in paired.values())
                                        / max(1, sum(d for _, d, _ in paired.values()))),
            "per_op_s_micro": {m["policy"]: m["overhead_us_per_op"] * 1e-6 for m in micro},
            "per_op_s_by_family": {w: v for w, v in zip(above, per_op)},
            "half_extra_s_decision_points_moves_by_family": paired,
            # the pilot's per-operator term goes to its per_op_s (charged even where the simulator runs none below the peak);
            # its host_cost model keeps the inference at its decision points
            "policy_per_op_s": {"pilot": pilot_fit[2]} if pilot else {},
            "policy_options": {"pilot": {"host_cost": [pilot_fit[0], pilot_fit[1], 0.0]}} if pilot else {},
            "measured": {"date": report.meta["date"], **report.meta["machine"], "threads": report.config.threads,
                         "preset": report.config.preset, "steps": report.config.steps},
        }
    return out


#: policies the simulator does not charge: they stand for mechanisms other than the manager
UNCHARGED = {
    "none": "PyTorch alone: no manager",
    "save_on_cpu": "torch.autograd.graph.save_on_cpu: saved-tensor hooks, no per-operator events",
    "checkpoint": "torch.utils.checkpoint: module wrappers, no per-operator events",
    "uvm": "CUDA unified memory: the hardware faults, no host bookkeeping",
    "dtr": "a simulator-only baseline standing for its own runtime, not measured here",
}


def write_calibration(report: OverheadReport, path: str | Path | None = None) -> Path:
    """Merge ``report``'s calibration into the calibration file, under the device it was measured on
    (the CPU's under ``sources``, a GPU's under ``devices.cuda``); figures of the other device, and of
    sources not measured now, are kept."""
    from ..sim.hostcost import CALIBRATION_PATH, CALIBRATION_SCHEMA, load_calibration

    p = Path(path) if path is not None else CALIBRATION_PATH
    data: dict[str, Any] = {"schema": CALIBRATION_SCHEMA, "uncharged": dict(UNCHARGED), "sources": {}}
    if p.is_file():
        try:
            old = load_calibration(p)
        except ConfigError:
            old = {}  # not a calibration of this schema: measured again from scratch
        data["sources"].update(old.get("sources", {}))
        if old.get("devices"):
            data["devices"] = {d: dict(v) for d, v in old["devices"].items()}
    if not report.calibration:
        raise ConfigError("bench: no event source produced a calibration (no zoo family measured with lru); "
                          "run `dynn bench --overhead` with the zoo families.")
    device = report.config.device
    if device == "cpu":
        data["sources"].update(report.calibration)
    else:
        data.setdefault("devices", {}).setdefault(device, {}).update(report.calibration)
    data["note"] = ("Host seconds of the live MemoryManager over PyTorch alone, measured by `dynn bench --overhead "
                    "--write-calibration`: with the manager on the CPU under 'sources', on a GPU under "
                    "'devices.cuda' (`--device cuda`); read by dynn_runtime.sim.hostcost (the simulator's host cost).")
    p.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    return p
