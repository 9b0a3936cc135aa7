"""Workload hints: the cheap dynamic context a network can expose about its own near future.

A dynamic network often knows, as it runs, something about the next few steps that no earlier
iteration can tell: which lower levels of this batch's trees feed the next level, which experts the
router just picked, whether the next block will be skipped. Two calls let it say so, counted in the
workload's own *steps* (a tree level, a layer, a recycling pass: whatever its loop iterates over)::

    from dynn_runtime import hints

    for level in range(n_levels):
        hints.step()                          # the workload's next step starts
        ...
        hints.next_use(h, c, steps=2)         # h and c are read again two steps from now
        hints.next_use(x, steps=None)         # x is not read again in this pass

What listens: the trace recorder writes hints into the trace (records ``T`` and ``U``, schema 3),
the simulator replays them from it, and the live :class:`~dynn_runtime.runtime.MemoryManager` hands
them to its policy as they come; every policy receives them through
:meth:`~dynn_runtime.policies.Policy.on_hint`. The pilot model turns them into features (:mod:`dynn_runtime.pilot.features`), one input among others: a hint changes no computation, and a
wrong one only costs prediction accuracy. Hints hold for the phase they were given in (the forward
pass, in practice: backward is mirrored from forward by the pilot itself). With nothing listening a
hint costs one function call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from .errors import ConfigError

__all__ = ["Hint", "step", "next_use", "listening"]


@dataclass(frozen=True)
class Hint:
    """One hint, as a policy receives it: ``kind`` ``"step"`` (the workload's next step starts) or
    ``"use"`` (the storages ``sids`` are read again ``steps`` steps from the current one; 0: within
    it; ``None``: not again in this pass)."""

    kind: Literal["step", "use"]
    sids: tuple[int, ...] = ()
    steps: int | None = None


class _Listener(Protocol):
    def _hint_step(self) -> None: ...
    def _hint_use(self, tensors: list[torch.Tensor], steps: int | None) -> None: ...


_listeners: list[_Listener] = []


def listening() -> bool:
    """Whether a recorder or a memory manager receives hints now (a workload may skip computing
    them otherwise)."""
    return bool(_listeners)


def step() -> None:
    """The workload's next step starts (a tree level, a layer, a recycling pass)."""
    for lst in _listeners:
        lst._hint_step()


def next_use(*tensors: Any, steps: int | None) -> None:
    """The storages of ``tensors`` are next read ``steps`` steps from the current one (0: later in
    this step), or, with ``steps=None``, not again in this pass. Non-tensors are ignored."""
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
        raise ConfigError(f"hints: next_use(steps=...) takes an integer >= 0 (steps from the current one) "
                          f"or None (not again in this pass), got {steps!r}.")
    if not _listeners:
        return
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    if ts:
        for lst in _listeners:
            lst._hint_use(ts, steps)


def _listen(obj: _Listener) -> None:
    if obj not in _listeners:
        _listeners.append(obj)


def _stop(obj: _Listener) -> None:
    if obj in _listeners:
        _listeners.remove(obj)
