"""When the caching allocator runs out inside an operator: room is made and the operator retried once.

The manager's count of device bytes is not the allocator's: an evicted block is released
stream-ordered (copies.py), so the allocator keeps it until its copy has read it, and blocks are cut
from segments that one live block keeps reserved. Under a hard cap, or on a full device, an
operator can therefore run out (``torch.OutOfMemoryError``) while the manager's count says it fits.
Both event sources catch that at the operator (the Python source in ``_dispatch``, the native one
in ``events.cpp``, invariant 11) for an operator that writes none of its arguments (its failed
attempt changed nothing the program sees), in a step. A random operator (:func:`draws`) may have
drawn before it ran out: the state of the generator it draws from (the one it was given, else the
managed device's default) is saved before it runs and restored before the retry, so the retry draws
what the first attempt would have and training stays bit-identical. Room is made
(:meth:`OutOfMemory._room_after_oom`): what the operator does not read is evicted, enough for the
failed request plus what is in use over the budget (all of it where the allocator's message says it
had the request's bytes free but in pieces, :func:`fragmented`); then the copies are waited for, so that the
evicted blocks are free, and the allocator's cached blocks are given back, so that the retry can
cut a new segment. The operator then runs once more; if it runs out again, the error propagates
and the step turns it into a :class:`~dynn_runtime.errors.BudgetError` that says what to change
(:meth:`OutOfMemory._oom_error`). Retries are counted in ``StepStats.oom_retries``.

State: ``_oom_evicted``, ``_oom_failed`` (and ``_cap_short``, budget.py's).
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any

import torch

from ..errors import BudgetError
from ..memory import format_bytes

__all__ = ["OutOfMemory", "RANDOM_BY_NAME", "UNDECLARED_WRITES", "cap_shortfall", "draws", "fragmented", "oom_request", "retryable"]

#: operators that draw from the default generator without a ``Generator`` argument (events.cpp's
#: ``random_by_name`` lists the same; a test checks it)
RANDOM_BY_NAME = frozenset({
    "aten::native_dropout", "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
})

_REQUEST = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB)")
_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_SIZE = r"([0-9.]+) (bytes|KiB|MiB|GiB)"
_ALLOWED = re.compile(_SIZE + r" (?:is )?allowed")
_ALLOCATED = re.compile(_SIZE + r" (?:is )?allocated by PyTorch")
_UNALLOCATED = re.compile(_SIZE + r" (?:is )?reserved (?:by PyTorch )?but unallocated")


def _size(m: re.Match | None) -> int | None:
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def oom_request(message: str) -> int | None:
    """The bytes the failed allocation asked for, from the caching allocator's message; None where
    the message does not say."""
    m = _REQUEST.search(message)
    return None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])


def cap_shortfall(message: str) -> int | None:
    """How many bytes the caching allocator lacked under its cap (``set_per_process_memory_fraction``),
    from its out-of-memory message: the request (the segment it would cut) plus what it held (allocated,
    and reserved but unallocated: free space in segments that live blocks keep, which it cannot give
    back) less what the cap allows. None where the message does not say (no cap, another format)."""
    req, allowed = oom_request(message), _size(_ALLOWED.search(message))
    allocated, unallocated = _size(_ALLOCATED.search(message)), _size(_UNALLOCATED.search(message))
    if None in (req, allowed, allocated, unallocated):
        return None
    return max(0, req + allocated + unallocated - allowed)


def fragmented(message: str, request: int) -> bool:
    """Whether the caching allocator's out-of-memory ``message`` says it held at least ``request``
    bytes free in segments that live blocks keep (reserved but unallocated): the bytes were there,
    not in one piece. Evicting the request's worth then frees blocks scattered over such segments,
    and emptying the cache gives none of them back; only segments left with no live block are."""
    unallocated = _size(_UNALLOCATED.search(message))
    return unallocated is not None and unallocated >= request > 0


#: schema argument indices an operator writes in place although its schema does not mark them: the
#: batch norms update the running statistics they are given in training mode (csrc/events.cpp's
#: ``undeclared_writes`` says the same)
UNDECLARED_WRITES = {name: (3, 4) for name in ("aten::native_batch_norm", "aten::cudnn_batch_norm",
                                               "aten::miopen_batch_norm")}


@functools.lru_cache(maxsize=4096)
def retryable(func: Any) -> bool:
    """Whether an out-of-memory error of operator ``func`` may be retried: it writes none of its
    arguments (in place, out=, or :data:`UNDECLARED_WRITES`; events.cpp, invariant 11). A random one
    is retried with its generator's state restored (:func:`draws`)."""
    return (func._schema.name not in UNDECLARED_WRITES
            and not any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments))


@functools.lru_cache(maxsize=4096)
def draws(func: Any) -> tuple[bool, str, int]:
    """Whether operator ``func`` draws random numbers, and from which generator: (draws, the name and
    index of its ``Generator`` argument, or ("", -1) where it draws from the default generator)."""
    for i, a in enumerate(func._schema.arguments):
        if "Generator" in str(a.type):
            return True, a.name, i
    return func.name() in RANDOM_BY_NAME, "", -1


class OutOfMemory:
    """Room after an operator ran out of device memory, and the step's error when its retry did too."""

    def _rng_before(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, Any] | None:
        """Before random operator ``func`` runs in a step (Python source): its generator and that
        generator's state, restored before a retry (:meth:`_rng_restore`); None for an operator that
        draws nothing or is not retried (it writes)."""
        random, name, index = draws(func)
        if not random or not retryable(func):
            return None
        gen = None
        if name:
            gen = kwargs[name] if name in kwargs else args[index] if index < len(args) else None
        if gen is None:
            gen = torch.cuda.default_generators[self.device.index] if self.cuda else torch.default_generator
        return gen, gen.get_state()

    @staticmethod
    def _rng_restore(saved: tuple[Any, Any] | None) -> None:
        if saved is not None:
            saved[0].set_state(saved[1])

    def _room_after_oom(self, message: str, exclude: set[int], where: object, fallback: int) -> None:
        """Operator ``where`` ran out of device memory (``message``, the allocator's); it reads
        ``exclude``. Evicts enough for the failed request (``fallback`` bytes where the message does not
        say) plus what is in use over the budget, waits for the copies (the evicted blocks are then
        free) and empties the allocator's cache. The host waits here: this is not the hot path."""
        self._cur.oom_retries += 1
        request = oom_request(message) or fallback
        before = self.used
        if self.cap_bytes is not None and self.budget is not None:
            # under the hard cap: what the allocator lacked beyond the storages' overshoot, which the
            # headroom of the next steps takes on (budget.py, _measure_cap_headroom)
            short = (cap_shortfall(message) or 0) - max(0, before - self.budget)
            self._cap_short = max(self._cap_short, short)
        if not self._measure_step and self.budget is not None:
            need = request + max(0, self.budget - before)
            if fragmented(message, request):
                need = self.budget  # everything it does not read: only emptied segments are given back
            with contextlib.suppress(BudgetError):  # whatever moved is room; the retry decides
                self.make_room(need, exclude, f"{where}, after it ran out of device memory")
        self._sync()
        if self.cuda:
            torch.cuda.empty_cache()
        self._oom_evicted = max(0, before - self.used)

    def _oom_retry_failed(self, message: str, where: object) -> None:
        """The retry of ``where`` ran out again: the step's error says so (:meth:`_oom_error`)."""
        if not self._oom_failed:
            self._oom_failed = (where, message.strip().splitlines()[0] if message.strip() else "", self._oom_evicted)

    def _oom_error(self) -> BudgetError | None:
        """The step's error for an out-of-memory error that a retry did not cure, or None where the
        manager did not retry it (it propagates unchanged)."""
        if not self._oom_failed:
            return None
        where, first, evicted = self._oom_failed
        self._oom_failed = ()
        said = f" ({first})" if first else ""
        if self.cap_bytes is not None:
            advice = (f"The hard cap ({format_bytes(self.cap_bytes)}) leaves the caching allocator too little beyond "
                      f"the managed storages' budget ({format_bytes(self.budget or 0)}): raise the cap (a larger "
                      "budget, in bytes or as a larger fraction), or drop hard_cap=True")
        else:
            advice = ("The device itself is full: lower the budget (or its fraction) so that what the manager "
                      "keeps resident leaves room for what it does not manage")
        return BudgetError(
            f"runtime: {where} ran out of device memory{said}, and again when retried after the manager made "
            f"room for it ({format_bytes(evicted)} evicted, the copies waited for, the allocator's cache emptied). "
            f"{advice}; or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, so that partly used segments "
            "strand less of it.")
