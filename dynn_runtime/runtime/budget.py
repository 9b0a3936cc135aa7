"""The live manager's budget: reading it, and the CUDA allocator's hard cap around it.

A budget is bytes, a size string, or a fraction of the unmanaged peak measured in the first step
(:meth:`MemoryManager._end_step`). With ``hard_cap`` the caching allocator is capped too
(``torch.cuda.set_per_process_memory_fraction``): the cap is the manager's share on top of what the
process held outside the managed storages when it was set, and the storages' budget is the cap less
what grows outside them and less a headroom for the allocator's own rounding (``CAP_HEADROOM``,
measured after the first managed step).

State: ``budget``, ``_budget_spec``, ``cap_bytes``, ``unmanaged_bytes``, ``_outside0``,
``cap_headroom_bytes``.
"""

from __future__ import annotations

import torch

from ..budget import Budget as MemoryBudget
from .devicemem import device_baseline
from .events import no_mode


class Budget:
    """Parsing the budget; the hard cap; the list operators' slice limit."""

    #: hard_cap: of the cap, what the managed storages leave to what the allocator holds beyond them
    #: (temporaries inside operators, rounding): (bytes, fraction of the cap), the larger applies,
    #: until a managed step has measured it (the allocator's peak over the storages' peak, x1.25).
    CAP_HEADROOM = (8 << 20, 0.25)

    @staticmethod
    def _parse_budget(budget: int | str | float) -> int | None:
        """Bytes, or None for a fraction of the peak (measured in the first step)."""
        return MemoryBudget.parse(budget, "runtime").bytes

    @property
    def budget_fraction(self) -> float | None:
        spec = self._budget_spec
        return None if spec is None else MemoryBudget.parse(spec, "runtime").fraction

    def _list_limit(self) -> int | None:
        """The most bytes one list operator (``_foreach_*``, fused optimizers) may touch in one call:
        half the budget, so a slice and what must stay resident fit together (lists.py)."""
        if self.budget is None or self._measure_step:
            return None
        return max(1, self.budget // 2)

    def _apply_hard_cap(self) -> None:
        """Cap the caching allocator: the budget is this manager's share of the device, on top of what
        the process held outside the managed storages when the cap was set. The storages get the
        budget less what grows outside them since (cuBLAS workspaces of new streams) and less
        ``CAP_HEADROOM`` for the allocator's rounding and segments that one live block keeps reserved."""
        if self.cap_bytes is None:
            self.cap_bytes = self.budget
            with no_mode():
                self._outside0 = max(0, device_baseline(self.device) - self.used)
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (self.cap_bytes + self._outside0) / total), self.device)
        self._fit_to_cap()

    def _fit_to_cap(self) -> None:
        cap = self.cap_bytes
        grown = max(0, torch.cuda.memory_allocated(self.device) - self.used - self._outside0)
        fixed, frac = self.CAP_HEADROOM
        self.unmanaged_bytes = grown
        room = self.cap_headroom_bytes if self.cap_headroom_bytes is not None else max(fixed, int(cap * frac))
        self.budget = max(1, cap - grown - room)

    def _measure_cap_headroom(self) -> None:
        """After a managed step under the cap: what the allocator peaked at beyond the storages."""
        peak = torch.cuda.max_memory_allocated(self.device)
        beyond = peak - (self._outside0 + self.unmanaged_bytes + self._cur.peak_device_bytes)
        fixed, _ = self.CAP_HEADROOM
        self.cap_headroom_bytes = max(fixed, int(max(0, beyond) * 1.25) + (2 << 20))
