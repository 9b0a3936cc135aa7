"""Inference cost of the pilot policy, measured on this CPU, against the simulated iteration time.

:func:`inference_cost` runs the ``pilot`` policy in the simulator on one iteration of a trace under
a budget that makes it engage, and reports the wall time spent in feature building plus inference
per decision point, per iteration, and as a share of the iteration time the simulator projects on
the device profile (the live runtime runs the pilot on the CPU, overlapped with GPU work); and,
apart, the per-operator bookkeeping (feature-state update after every operator). ``options`` go to
the policy (``policy``: :class:`~dynn_runtime.pilot.policy.PilotPolicy` or a subclass, such as
tools/pilot_lab.py's with ``incremental=False`` for full rescoring; ``max_share=0.02`` for the cost
governor), so the variants are measured the same way.

``backend`` picks the inference path (``"native"``: the C kernel, :mod:`dynn_runtime.pilot.kernel`; ``"numpy"``: the
reference; None: native when available) and every record says which one ran, so both can be
measured in one process; :func:`fit_decision_cost` fits one backend at a time.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from ..._log import logger

__all__ = ["inference_cost", "fit_decision_cost", "decision_cost_curve"]


def inference_cost(trace: Any, model: Any = None, budget: float = 0.25, profile: str = "h100",
                   repeats: int = 3, group: int | None = None, backend: str | None = None,
                   policy: type | None = None, **options: Any) -> dict[str, Any]:
    """Per-decision and per-iteration pilot cost on ``trace``'s last iteration (best of ``repeats``).

    ``fraction_of_iteration`` is against the unmanaged iteration time (no memory limit), as the
    issue's target is stated; ``fraction_of_simulated`` against this run's own simulated time
    (stalls included), which is the clock the governor (``max_share``) holds the share under.
    """
    from ...sim import Simulator, simulate, unmanaged_peak
    from ..policy import PilotPolicy

    ref = simulate(trace, "none", 1.0, profile)
    budget_bytes = max(1, int(unmanaged_peak(trace) * budget))
    best: dict[str, Any] | None = None
    for _ in range(repeats):
        pol = (policy or PilotPolicy)(model=model, group=group, backend=backend, **options)
        sim = Simulator(trace, pol, budget_bytes, profile)
        t0 = time.perf_counter()
        res = sim.run()
        if not res.feasible:
            logger.warning("pilot: cost run infeasible on %s: %s", trace.header.get("workload"), res.reason)
        wall = time.perf_counter() - t0
        n = max(pol.decisions, 1)
        rec = {
            "backend": pol.backend,
            "decisions": pol.decisions,
            "deferred": pol.deferred,
            "deferred_idle": pol.deferred_idle,  # put off while nothing read them (before the first victim search)
            "catch_ups": pol.catch_ups,
            "inference_s": pol.inference_s,
            "bookkeeping_s": pol.bookkeeping_s,
            "per_decision_us": 1e6 * pol.inference_s / n,
            "candidates_mean": pol.candidates / n,  # rows scored per decision point
            "live_mean": pol.live_total / n,        # live storages per decision point
            "sim_wall_s": wall,
            "feasible": res.feasible,
            "sim_iteration_s": res.iter_time_s,
        }
        if best is None or rec["inference_s"] < best["inference_s"]:
            best = rec
    assert best is not None
    it_s = ref.iter_time_s
    sim_s = best["sim_iteration_s"]
    best.update({
        "workload": trace.header.get("workload"), "preset": trace.header.get("preset"),
        "ops": len(trace.iterations[-1].ops), "profile": profile, "options": options,
        "iteration_time_s": it_s, "budget_fraction": budget, "group": pol.decision_every if group is None else group,
        "slowdown": sim_s / it_s if it_s and best["feasible"] else None,
        "fraction_of_iteration": best["inference_s"] / it_s if it_s else None,
        "fraction_of_simulated": best["inference_s"] / sim_s if best["feasible"] and sim_s else None,
        "fraction_with_bookkeeping": (best["inference_s"] + best["bookkeeping_s"]) / it_s if it_s else None,
    })
    return best


def fit_decision_cost(rows: list[dict[str, Any]], backend: str | None = None) -> tuple[float, float]:
    """Least-squares ``(a, b)`` in seconds of ``per decision point = a + b * rows scored``.

    ``backend``: fit only the records of that backend; without it the records must not mix backends.
    """
    if backend is not None:
        rows = [r for r in rows if r.get("backend") == backend]
    elif len({r.get("backend") for r in rows}) > 1:
        raise ValueError("fit_decision_cost: the records mix backends "
                         f"{sorted({str(r.get('backend')) for r in rows})}; pass backend=")
    x = np.asarray([r["candidates_mean"] for r in rows], dtype=np.float64)
    y = np.asarray([r["per_decision_us"] * 1e-6 for r in rows], dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0:
        return (float(y.mean()) if len(y) else 0.0), 0.0
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def decision_cost_curve(trace: Any, model: Any = None, sizes: tuple[int, ...] = (16, 64, 128, 256, 512, 1024),
                        repeats: int = 100, budget: float = 0.5, profile: str = "h100",
                        backend: str | None = None) -> dict[str, Any]:
    """Seconds to score ``k`` rows at one decision point (features, model, predictions, cache and heap
    updates), best of ``repeats`` per size, at the first decision point past the middle of
    ``trace``'s last iteration; and the least-squares ``a + b * k`` over the sizes. Best-of-many on
    one decision point is robust to a shared CPU's load, where whole-run timings are not."""
    from ...sim import Simulator, unmanaged_peak
    from ..policy import PilotPolicy

    class _Stop(Exception):
        pass

    half = len(trace.iterations[-1].ops) // 2

    class _Capture(PilotPolicy):
        incremental = False  # every live storage is a row at the captured decision point
        def on_op(self, position: int, op: Any) -> None:
            super().on_op(position, op)
            if position >= half and self._last_decision == position:
                raise _Stop

    pol = _Capture(model=model, backend=backend)
    try:
        Simulator(trace, pol, max(1, int(unmanaged_peak(trace) * budget)), profile).run()
    except _Stop:
        pass
    state = pol._state
    live = state.active_slots()
    pos = state.position
    points = []
    for k in sizes:
        rows = np.resize(live, k)  # more rows than live storages: slots repeat (same cost per row)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            pol._score(rows, pos, len(live))
            best = min(best, time.perf_counter() - t0)
        points.append({"candidates_mean": k, "per_decision_us": 1e6 * best, "backend": pol.backend})
    a, b = fit_decision_cost(points)
    return {"workload": trace.header.get("workload"), "backend": pol.backend, "live": len(live), "position": pos, "points": points,
            "a_s": a, "b_s": b}
