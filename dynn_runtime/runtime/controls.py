"""The handles a program holds on a running manager: pin and unpin, offload now, and the
statistics (``stats``, ``timeline``). Mixed into :class:`~dynn_runtime.runtime.MemoryManager`.

State: ``_pinned`` (storage ids the policy may not move), ``steps``, ``_timeline``, and what
:mod:`.storages`, :mod:`.moves` and :mod:`.steps` keep.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..residency import Status
from .events import no_mode
from .steps import StepStats

RESIDENT = Status.RESIDENT

_PHASE_NAMES = ("forward", "backward", "optimizer")
#: where an int64 word's low byte is in its bytes
_LOW_BYTE = 0 if sys.byteorder == "little" else 7
_PHASE_CODE = {name: k for k, name in enumerate(_PHASE_NAMES)}


class OpTimeline:
    """The last ``maxlen`` operators' (step, position, managed device bytes, phase), in flat integer
    arrays: an engaged step adds thousands of entries, and a tuple per entry would be an object per
    operator for Python's cyclic collector to count and scan. Iterating yields the tuples."""

    __slots__ = ("maxlen", "_step", "_pos", "_used", "_phase")

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._step, self._pos, self._used = array("q"), array("q"), array("q")
        self._phase = array("b")

    def append(self, entry: tuple[int, int, int, str]) -> None:
        step, pos, used, phase = entry
        self._step.append(step)
        self._pos.append(pos)
        self._used.append(used)
        self._phase.append(_PHASE_CODE[phase])
        self._trim()

    def extend_words(self, step: int, words: memoryview) -> None:
        """Entries of step ``step`` from (position, used, phase code) triples, a memoryview of int64
        words (the observer's). Copied as bytes: an array extended by an iterable converts each
        item through the argument parser, thousands a step."""
        n = len(words) // 3
        self._step.frombytes(array("q", (step,)).tobytes() * n)
        self._pos.frombytes(words[0::3].tobytes())
        self._used.frombytes(words[1::3].tobytes())
        self._phase.frombytes(words[2::3].tobytes()[_LOW_BYTE::8])  # a code is its word's low byte
        self._trim()

    def _trim(self) -> None:
        # amortised: trimmed only once a quarter over, back to maxlen
        if len(self._pos) > self.maxlen + (self.maxlen >> 2):
            k = len(self._pos) - self.maxlen
            for a in (self._step, self._pos, self._used, self._phase):
                del a[:k]

    def of_step(self, step: int) -> Iterator[tuple[int, int]]:
        """(position, device bytes) of step ``step``'s entries, where they are the last ones kept."""
        steps, k = self._step, len(self._step)
        first = max(0, k - self.maxlen)
        i = k
        while i > first and steps[i - 1] == step:
            i -= 1
        return zip(self._pos[i:k], self._used[i:k])

    def __len__(self) -> int:
        return min(len(self._pos), self.maxlen)

    def __iter__(self) -> Iterator[tuple[int, int, int, str]]:
        k = max(0, len(self._pos) - self.maxlen)
        return zip(self._step[k:], self._pos[k:], self._used[k:], map(_PHASE_NAMES.__getitem__, self._phase[k:]))

class Controls:
    """pin / unpin / offload / stats / timeline."""

    def pin(self, *objs: torch.Tensor | nn.Module) -> int:
        """Keep these tensors, or every parameter and buffer of these modules, on the device for as
        long as the manager is attached: the policy never moves them (one that is away now comes back).
        For storages read outside the dispatcher, where no fault can bring them back: Triton or
        extension kernels, CUDA graphs. Returns the bytes pinned; :meth:`unpin` undoes it."""
        moved = 0
        with no_mode():
            self._drain()
            for t in self._pin_targets(objs):
                sid = self._sid(t)
                if sid is None or sid in self._pinned:
                    continue
                s = self.st[sid]
                if s.status != RESIDENT:
                    self._fetch_now(s, budgeted=True, exclude={sid}, where="pin()")
                self._pinned.add(sid)
                moved += s.nbytes
        return moved

    def unpin(self, *objs: torch.Tensor | nn.Module) -> None:
        """The policy may move these again."""
        with no_mode():
            for t in self._pin_targets(objs):
                sid = self._sid(t)
                if sid is not None:
                    self._pinned.discard(sid)

    @staticmethod
    def _pin_targets(objs: tuple) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for o in objs:
            if isinstance(o, nn.Module):
                out += [*o.parameters(), *o.buffers()]
            elif isinstance(o, torch.Tensor):
                out.append(o)
            else:
                raise ConfigError(f"runtime: pin() takes tensors and modules, got {type(o).__name__}.")
        return out

    def offload(self, *tensors: torch.Tensor) -> int:
        """Move the storages behind ``tensors`` off the device now (they come back on their next
        use). Returns the bytes that left. Tensors the manager does not manage are ignored."""
        moved = 0
        with no_mode():
            self._drain()
            if self._obs is not None:  # operators since the last decision point (a collective's holds)
                self._native_parse(in_step=self._in_step)
            if self._collectives:
                self._release_collectives(wait=False)
            for t in tensors:
                sid = self._sid(t)
                if sid is not None and self._evict(self.st[sid]):
                    moved += self.st[sid].nbytes
        return moved

    def stats(self) -> dict[str, Any]:
        """Totals over the managed steps (a fractional budget's measuring step is in ``per_step`` only)
        and the per-step records (``torch.cuda.memory`` vocabulary)."""
        total = StepStats(step=-1)
        for s in self.steps:
            if s.managed:  # a measuring step ran unmanaged: its peak is the measurement, not a result
                total.add(s)
        out = {k: v for k, v in total.__dict__.items() if k not in ("step", "managed")}
        out.update(
            steps=len(self.steps),
            measuring_steps=sum(1 for s in self.steps if not s.managed),
            budget_bytes=self.budget,
            hard_cap_bytes=self.cap_bytes,
            unmanaged_bytes=self.unmanaged_bytes if self.cap_bytes is not None else None,
            outside_at_cap_bytes=self._outside0 if self.cap_bytes is not None else None,
            cap_headroom_bytes=self.cap_headroom_bytes,
            measured_peak_bytes=self.measured_peak,
            policy=self.policy.name,
            device=str(self.device),
            device_bytes_now=self.used,
            host_bytes_in_use=self.pool.in_use,
            host_bytes_peak=self.pool.peak_in_use,
            host_pinned=self.pool.pinned,
            managed_storages=len(self.st),
            event_source=self.event_source,
            largest_allocation_bytes=self._obs.max_made if self._obs is not None else None,
            # how the native observer learns of deaths (csrc/events.cpp, invariant 9): covered (CPU),
            # heard from the caching allocator (CUDA), else swept for; and the sweeps of its table
            deaths=(None if self._obs is None else "heard" if self._obs.hearing
                    else "covered" if self._obs.cover else "swept"),
            table_sweeps=self._obs.sweeps if self._obs is not None else None,
            event_source_reason=self.event_reason,
            **(self.provider.describe() if self.provider is not None else {"hook_provider": None}),
            hook_stats=self.provider.stats() if self.provider is not None else {},
            list_calls_split=self._lists.calls_split if self._lists is not None else 0,
            per_step=[dict(s.__dict__) for s in self.steps],
        )
        if self.cuda:
            out["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return out

    def timeline(self) -> list[tuple[int, int, int, str]]:
        """(step, operator position, managed device bytes after it, phase) for the last
        ``TIMELINE_ENTRIES`` operators."""
        return list(self._timeline)
