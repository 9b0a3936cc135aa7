"""The live manager's budget: reading it, and the CUDA allocator's hard cap around it.

A budget is bytes, a size string, or a fraction of the unmanaged peak measured in the first step
(:meth:`MemoryManager._end_step`). With ``hard_cap`` the caching allocator is capped too
(``torch.cuda.set_per_process_memory_fraction``): the cap is the manager's share on top of what the
process held outside the managed storages when it was set, and the storages' budget is the cap less
what grows outside them and less a headroom for what the allocator holds beyond the storages
(``CAP_HEADROOM`` until a managed step has measured it).

The headroom's invariant: after each step, it is at least what the allocator held beyond the
storages at its peak (x1.25, plus one small segment), and at least the headroom of a step in which
the allocator ran out under the cap plus what it lacked then (:func:`~.oom.cap_shortfall`: its
request, a whole new segment, and the free space in segments that live blocks keep, which is
fragmentation the allocated bytes do not show; raised so to at most half the cap). So fragmentation
and segment rounding are counted where they have made the allocator run out, and only there:
``max_memory_reserved`` is no measure of them (the allocator keeps freed segments cached up to the
cap, and gives them back before it runs out), and counting every free split block would lower the
budget of runs that fit. ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` removes most of both
(segments grow and shrink by pages); the manager does not switch it itself, since the setting is the
whole process's.

State: ``budget``, ``_budget_spec``, ``cap_bytes``, ``unmanaged_bytes``, ``_outside0``,
``cap_headroom_bytes``, ``_cap_short``.
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

    def _measuring_now(self) -> bool:
        """Whether a step that measures the peak runs (the list wrappers keep its largest entry)."""
        return self._in_step and self._measuring

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
        self.unmanaged_bytes = grown
        self.budget = max(1, cap - grown - self._cap_room())

    def _cap_room(self) -> int:
        """The headroom in effect: measured, or ``CAP_HEADROOM`` before any measurement."""
        fixed, frac = self.CAP_HEADROOM
        return self.cap_headroom_bytes if self.cap_headroom_bytes is not None else max(fixed, int(self.cap_bytes * frac))

    def _measure_cap_headroom(self, ok: bool) -> None:
        """After a managed step under the cap (the module docstring's invariant): what the allocator
        peaked at beyond the storages (a step that completed), and what it lacked where it ran out
        (``_cap_short``, a failed step too)."""
        fixed, _ = self.CAP_HEADROOM
        room = self._cap_room()
        measured = None
        if ok:
            peak = torch.cuda.max_memory_allocated(self.device)
            beyond = peak - (self._outside0 + self.unmanaged_bytes + self._cur.peak_device_bytes)
            measured = max(fixed, int(max(0, beyond) * 1.25) + (2 << 20))
        self.cap_headroom_bytes = self._next_cap_headroom(room, measured, self._cap_short)
        self._cap_short = 0

    def _next_cap_headroom(self, room: int, measured: int | None, short: int) -> int:
        """The headroom after a step that ran with ``room``: ``measured`` (None: not measured, the step
        failed), raised to ``room`` + ``short`` x1.25 (at most half the cap) where the allocator ran
        out ``short`` bytes short."""
        new = room if measured is None else measured
        if short > 0:
            new = max(new, min(room + int(short * 1.25), self.cap_bytes // 2))
        return new
