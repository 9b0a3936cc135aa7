"""What one simulated iteration reports (:class:`SimResult`): times, bytes moved, peaks, counts."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["SimResult"]


@dataclass
class SimResult:
    """Outcome of simulating one iteration."""

    policy: str
    budget_bytes: int
    profile: str
    feasible: bool
    reason: str
    iter_time_s: float
    compute_time_s: float
    stall_time_s: float
    recompute_time_s: float
    bytes_offloaded: int
    bytes_fetched: int
    peak_bytes: int
    unmanaged_peak_bytes: int
    decisions: int
    evictions: int
    recomputed_ops: int
    prefetch_hits: int
    prefetch_misses: int
    ops: int
    managed: bool
    #: host timeline (``host_timeline``): device time spent waiting for the host to issue an operator
    host_wait_s: float = 0.0
    #: host timeline: the policy's own host seconds over the iteration (its :attr:`Policy.host_seconds`)
    policy_host_s: float = 0.0
    #: host cost: policy consultations that moved memory (``victims()`` calls, ``after_op()`` with actions)
    decision_points: int = 0
    #: host cost: storages moved (evictions, prefetches issued, demand fetches)
    moves: int = 0
    #: host cost: the manager's host seconds charged (:meth:`HostCost.charge` of the counts above)
    host_cost_s: float = 0.0
    #: host cost: where the charge's figures come from (``python``, ``native``, ``model``); empty: none charged
    host_cost_source: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
