"""Inference cost of the pilot policy, measured on this CPU, against the simulated iteration time.

:func:`inference_cost` runs the ``pilot`` policy in the simulator on one iteration of a trace under
a budget that makes it engage, and reports the wall time spent in feature building plus inference
per decision point, per iteration, and as a share of the iteration time the simulator projects on
the device profile (the live runtime runs the pilot on the CPU, overlapped with GPU work); and,
apart, the per-operator bookkeeping (feature-state update after every operator).
"""

from __future__ import annotations

import time
from typing import Any

from .._log import logger

__all__ = ["inference_cost"]


def inference_cost(trace: Any, model: Any = None, budget: float = 0.25, profile: str = "h100",
                   repeats: int = 3, group: int | None = None) -> dict[str, Any]:
    """Per-decision and per-iteration pilot cost on ``trace``'s last iteration (best of ``repeats``)."""
    from ..sim import Simulator, simulate, unmanaged_peak
    from .policy import PilotPolicy

    ref = simulate(trace, "none", 1.0, profile)
    budget_bytes = max(1, int(unmanaged_peak(trace) * budget))
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        pol = PilotPolicy(model=model, group=group) if model is not None else PilotPolicy(group=group)
        sim = Simulator(trace, pol, budget_bytes, profile)
        t0 = time.perf_counter()
        res = sim.run()
        if not res.feasible:
            logger.warning("pilot: cost run infeasible on %s: %s", trace.header.get("workload"), res.reason)
        wall = time.perf_counter() - t0
        rec = {
            "decisions": pol.decisions,
            "inference_s": pol.inference_s,
            "bookkeeping_s": pol.bookkeeping_s,
            "per_decision_us": 1e6 * pol.inference_s / max(pol.decisions, 1),
            "candidates_mean": pol.candidates / max(pol.decisions, 1),
            "sim_wall_s": wall,
        }
        if best is None or rec["inference_s"] < best["inference_s"]:
            best = rec
    assert best is not None
    it_s = ref.iter_time_s
    best.update({
        "workload": trace.header.get("workload"), "preset": trace.header.get("preset"),
        "ops": len(trace.iterations[-1].ops), "profile": profile,
        "iteration_time_s": it_s, "budget_fraction": budget, "group": pol.decision_every if group is None else group,
        "fraction_of_iteration": best["inference_s"] / it_s if it_s else None,
        "fraction_with_bookkeeping": (best["inference_s"] + best["bookkeeping_s"]) / it_s if it_s else None,
    })
    return best
