"""The pilot policy with its experiment-only switches (not shipped; tools and tests import it).

    sys.path.insert(0, "tools"); from pilot_lab import LabPilot
    LabPilot(model=m, worker=True, worker_cost=(0.0, 0.0))      # every decision point on the worker
    LabPilot(incremental=False)                                  # rescore every live storage
    LabPilot(provisional="prior")                                # no replayed provisional predictions

:class:`LabPilotConfig` adds to :class:`~dynn_runtime.pilot.policy.PilotPolicyConfig` the switches
that exist only to measure alternatives (docs/pilot-lab-notes.md): forcing the worker, full
rescoring, the prior-only provisional prediction, an injected timer, and the modelled worker's and
hand-off's costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dynn_runtime.errors import PolicyError
from dynn_runtime.pilot.policy import PilotPolicy, PilotPolicyConfig
from dynn_runtime.pilot.scheduling import seconds

__all__ = ["LabPilot", "LabPilotConfig"]


@dataclass(kw_only=True)
class LabPilotConfig(PilotPolicyConfig):
    """:class:`PilotPolicyConfig` plus the experiment switches."""

    incremental: bool = True
    """False: every decision point rescores every live storage."""
    provisional: str = "replay"
    """``"prior"``: provisional predictions from the prior table only, no replayed next use."""
    timer: Any = None
    """A clock (seconds, called with no argument) for the measured time; None: ``time.perf_counter``."""
    worker_cost: tuple[float, float] | None = None
    """The modelled worker's seconds per decision point and per row; None: ``WORKER_COST``."""
    handoff_cost: tuple[float, float] | None = None
    """The issuing thread's seconds per handed-off decision point and per row; None: ``HANDOFF_COST``."""

    #: True: every decision point goes to the worker (native backend, no online refit)
    workers: ClassVar[tuple[Any, ...]] = ("auto", False, True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.provisional not in ("replay", "prior"):
            raise PolicyError(f"policies: pilot provisional must be 'replay' or 'prior', got {self.provisional!r}.")
        self.worker_cost = seconds(self.worker_cost, "worker_cost", ("per decision point", "per row scored"))
        self.handoff_cost = seconds(self.handoff_cost, "handoff_cost", ("per decision point", "per row handed off"))


class LabPilot(PilotPolicy):
    """:class:`PilotPolicy` under a :class:`LabPilotConfig` (not registered: built directly)."""

    Config = LabPilotConfig

    def __init__(self, config: LabPilotConfig | None = None, /, **options: Any) -> None:
        super().__init__(config, **options)
        cfg = self.config
        self.incremental = bool(cfg.incremental)
        self.replay_provisional = cfg.provisional == "replay"
        if cfg.timer is not None:
            self._timer = cfg.timer
        if cfg.worker_cost is not None:
            self.worker_cost = cfg.worker_cost
        if cfg.handoff_cost is not None:
            self.handoff_cost = cfg.handoff_cost

    def attach(self, view: Any) -> None:
        forced = self.worker is True
        super().attach(view)
        if forced and not self.worker:
            from dynn_runtime._log import logger
            from dynn_runtime.pilot import kernel

            logger.info("pilot: worker=True needs the native kernel and no online refit; deciding on the "
                        "issuing thread (%s)", "online refit" if self._online else kernel.reason())

    def _hand_off(self, m: int, full: bool) -> bool:
        return self.worker is True or super()._hand_off(m, full)
