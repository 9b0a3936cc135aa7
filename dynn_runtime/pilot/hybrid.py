"""``hybrid``: the pilot's predicted next uses order the victims; each leaves by recompute or copy,
whichever costs the compute stream less (:class:`~dynn_runtime.policies.hybrid.RecomputeOrCopy`).

Registered lazily under ``hybrid`` (the policy interface does not import the pilot). Simulator only,
as ``dtr``: the live manager does not rematerialise operators.
"""

from __future__ import annotations

from ..policies.base import register
from ..policies.hybrid import RecomputeOrCopy
from .policy import PilotPolicy

__all__ = ["HybridPilotPolicy"]


@register
class HybridPilotPolicy(RecomputeOrCopy, PilotPolicy):
    """The pilot's order and prefetch; per victim, recompute when cheaper than the copy, else offload."""

    name = "hybrid"
    description = "pilot's order; per victim recompute when cheaper than the copy, else offload"
    #: the live manager would run the pilot's bookkeeping and inference for it: charged as the pilot
    host_cost_as = "pilot"
