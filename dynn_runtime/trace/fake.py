"""Record GPU-scale traces on a machine without the memory or the time to run them.

A trace needs, per operator, which storages it reads, writes and allocates, their sizes, the
operator's FLOPs and bytes, and when each storage dies. None of that needs the values of the large
tensors: only their shapes. So :func:`record_fake` runs the workload's real training loop under the
ordinary recorder, with :class:`ShapeMode` underneath it:

1. A large tensor (more than ``small_numel`` elements if floating, ``decide_numel`` if integer or
   boolean) is a ``FakeTensor``: it has a shape, a dtype, strides and a storage of the right size,
   and no data; an operator on it costs a shape computation.
2. A small tensor is real. An operator whose inputs are all real runs for real, so every decision a
   network takes from its batch (sequence lengths, masks, crop sizes, tree shapes: the generator's
   draws, host-side or in small tensors) is the one a real run takes.
3. An operator that needs values it does not have (a result whose size is data, such as
   ``nonzero``; a decision, i.e. an integer or boolean result such as ``topk``'s indices or a
   comparison; a write into a real tensor) runs for real, its fake inputs given values drawn from a
   generator seeded by the recording's seed: standard normal (activations, logits), uniform in
   [0, 1) where the operator reads probabilities. So a decision the network takes from a large
   tensor (which experts, which blocks, which samples leave) is the network's own code applied to
   seeded values rather than to trained activations.
4. A draw from an explicit ``torch.Generator`` (the workloads' batches) runs for real whatever its
   size, so the generator's stream, and every later draw from it, is the real run's; it stays real
   up to ``decide_numel`` elements (a batch's masks and noise, which decisions read).

Exact, by construction: operator sequences, shapes, storage sizes and lifetimes, FLOPs and bytes,
wherever no decision reads a value computed from a large tensor (rules 1, 2, 4): ``evoformer``,
``tree_lstm`` and ``varlen`` (at sizes where their batch tensors stay real). Approximate: which
branch a network takes where its decision reads such a value (rule 3: ``moe``'s routing,
``skipnet``'s gates, ``early_exit``'s exits), and so the operators and sizes downstream of it.
Operator durations are not measured (the recorder's ``d`` is the shape computation's); the
simulator projects these traces onto a device profile with its roofline, as it does every CPU
trace. docs/simulator.md ("GPU-scale traces without a GPU") gives the validation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import TraceError
from .format import Trace
from .recorder import RecordResult, record

__all__ = ["ShapeMode", "record_fake", "TraceSummary", "iteration_summary", "DEFAULT_SMALL_NUMEL", "DEFAULT_DECIDE_NUMEL"]

#: floating tensors up to this many elements hold real values (256 KiB of float32): biases, norms'
#: weights, per-sample gates, losses. Real work on them is what a fake recording spends its time on
#: besides the shape computations, so the line is low; decisions read larger tensors through
#: ``decide_numel``.
DEFAULT_SMALL_NUMEL = 1 << 16

#: the largest fake input a decision may read: given seeded values for that one operator (rule 3)
DEFAULT_DECIDE_NUMEL = 1 << 24


def _numel(out: Any) -> int:
    flat, _ = tree_flatten(out)
    return sum(t.numel() for t in flat if isinstance(t, torch.Tensor))


def _mutates_or_aliases(func: Any) -> bool:
    schema = func._schema
    return any(a.alias_info is not None for a in schema.arguments) or any(
        r.alias_info is not None for r in schema.returns
    )


class ShapeMode(TorchDispatchMode):
    """Runs small tensors for real and large ones as shapes (the rules in the module docstring).

    Enter it before the recorder (the recorder, on top of the mode stack, sees each operator first
    and hands it down here). ``seed`` seeds the values given to small results of large inputs.
    """

    def __init__(self, seed: int = 0, small_numel: int = DEFAULT_SMALL_NUMEL,
                 decide_numel: int = DEFAULT_DECIDE_NUMEL) -> None:
        super().__init__()
        if not 1 <= small_numel <= decide_numel:
            raise TraceError(
                f"trace (fake): need 1 <= small_numel <= decide_numel, got {small_numel} and {decide_numel}."
            )
        self.small_numel = small_numel
        self.decide_numel = decide_numel
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.gen = torch.Generator().manual_seed(0x5EED ^ seed)
        self.realized = 0  # operators run on seeded values (rule 3)
        self._probabilities: dict[tuple, torch.Tensor] = {}

    def _fake(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            return self.fake_mode.from_tensor(t)
        return t

    def _seeded(self, t: FakeTensor, nonnegative: bool) -> torch.Tensor:
        """A real tensor shaped like ``t`` with seeded values: standard normal floats (activations,
        logits), or uniform in [0, 1) where the operator reads probabilities; zero integers and
        ``False`` (valid as indices and masks).

        Probabilities of one shape are drawn once and reused: the sampling operator's own
        generator varies its draws, and a Markov chain over a large vocabulary would otherwise
        draw a fresh table per token."""
        key = (tuple(t.shape), tuple(t.stride()), t.dtype)
        if nonnegative and key in self._probabilities:
            return self._probabilities[key]
        real = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        if not t.dtype.is_floating_point:
            return real.zero_()
        if not nonnegative:
            return real.normal_(generator=self.gen)
        self._probabilities[key] = real.uniform_(generator=self.gen)
        return real

    def _run_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run ``func`` for real, its fake inputs given seeded values (rule 3): for an operator whose
        result is a decision (indices, a mask, a count) or lands in a real tensor."""
        nonnegative = func.overloadpacket in _PROBABILITY_OPS

        def real(t: Any) -> Any:
            if not isinstance(t, FakeTensor):
                return t
            if t.numel() > self.decide_numel:
                raise TraceError(
                    f"trace (fake): {func.name()} needs the values of a tensor of shape {tuple(t.shape)} "
                    f"({t.numel()} elements, over decide_numel={self.decide_numel}), which a fake recording "
                    "does not compute. Raise decide_numel, or record on a device that holds the workload."
                )
            return self._seeded(t, nonnegative)

        self.realized += 1
        return func(*tree_map(real, args), **tree_map(real, kwargs))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        has_fake = any(isinstance(t, FakeTensor) for t in flat)
        if not has_fake:
            if isinstance(kwargs.get("generator"), torch.Generator):
                # A generator's draw (rule 4): a batch's masks and noise, which decisions read.
                out = func(*args, **kwargs)
                return out if _mutates_or_aliases(func) else tree_map(self._fake_if_huge, out)
            if any(isinstance(t, torch.Tensor) for t in flat):
                # Real inputs: the real result is the real run's and is bounded by small inputs; a
                # large one becomes fake once made.
                out = func(*args, **kwargs)
                return out if _mutates_or_aliases(func) else tree_map(self._fake_if_large_float, out)
            with self.fake_mode:  # a factory: size it before allocating
                shape_out = func(*args, **kwargs)
            if all(self._stays_real(t) for t in tree_flatten(shape_out)[0] if isinstance(t, torch.Tensor)):
                return func(*args, **kwargs)
            return shape_out
        if func.overloadpacket in _INDEX_OPS:
            args = _masks_as_indices(args)
        writes_real = any(
            a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor)
            and not isinstance(v, FakeTensor)
            for a, v in zip(func._schema.arguments, args)
        )
        if writes_real:
            return self._run_real(func, args, kwargs)
        try:
            with self.fake_mode:
                out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            return self._run_real(func, args, kwargs)  # the result's size or value is data
        if _mutates_or_aliases(func):
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs and _numel(outs) <= self.decide_numel and any(not t.dtype.is_floating_point for t in outs):
            # A decision (indices, a mask): computed by the network's own code on seeded values;
            # its integer results stay real, a large floating one (a pooled map) becomes fake.
            return tree_map(self._fake_if_large_float, self._run_real(func, args, kwargs))
        return out

    def _stays_real(self, t: torch.Tensor) -> bool:
        """Small tensors hold values; so do integers and masks up to ``decide_numel`` (indices, token
        ids), which decisions read."""
        limit = self.small_numel if t.dtype.is_floating_point else self.decide_numel
        return t.numel() <= limit

    def _fake_if_huge(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.numel() > self.decide_numel:
            return self._fake(t)
        return t

    def _fake_if_large_float(self, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and not self._stays_real(t):
            return self._fake(t)
        return t


#: operators that take a list of indices, where a boolean mask stands for its ``nonzero()``
_INDEX_OPS = frozenset({torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_,
                        torch.ops.aten._index_put_impl_})


def _masks_as_indices(args: tuple) -> tuple:
    """``args`` of an indexing operator with each real boolean mask replaced by the integer indices
    of its true elements, one tensor per masked dimension, as PyTorch expands it: the result's size
    is then the mask's count, known without the indexed tensor's values."""
    indices = args[1]
    if not any(isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8)
               and not isinstance(ix, FakeTensor) for ix in indices):
        return args
    out: list[Any] = []
    for ix in indices:
        if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8) and not isinstance(ix, FakeTensor):
            out.extend(ix.nonzero().unbind(1))
        else:
            out.append(ix)
    return (args[0], out, *args[2:])


#: operators whose floating inputs are probabilities: seeded values for them are uniform in [0, 1)
_PROBABILITY_OPS = frozenset({
    torch.ops.aten.multinomial, torch.ops.aten.bernoulli, torch.ops.aten.binary_cross_entropy,
    torch.ops.aten.binary_cross_entropy_backward,
})


def record_fake(
    workload: str | Any,
    path: str | Path,
    steps: int = 1,
    preset: str = "tiny",
    seed: int = 0,
    overrides: dict | None = None,
    small_numel: int = DEFAULT_SMALL_NUMEL,
    decide_numel: int = DEFAULT_DECIDE_NUMEL,
) -> RecordResult:
    """Record ``workload`` like :func:`dynn_runtime.trace.record`, building and training it under
    :class:`ShapeMode` so that its large tensors hold no data (the module docstring). The header's
    ``values`` field is ``"fake"`` and ``small_numel`` says where real values stop."""
    from ..workload import load_workload, workload_name

    mode = ShapeMode(seed=seed, small_numel=small_numel, decide_numel=decide_numel)
    with mode:
        wl = load_workload(workload, preset=preset, seed=seed, **(overrides or {})) if isinstance(
            workload, str) else workload
        extra: dict[str, Any] = {"values": "fake", "small_numel": small_numel}
        if isinstance(workload, str):
            extra["workload"] = workload_name(workload)
        return record(wl, path, steps=steps, preset=preset, seed=seed, header_extra=extra)


@dataclass(frozen=True)
class TraceSummary:
    """What a fake recording must reproduce of a real one (one iteration)."""

    ops: int
    """Operators recorded."""
    storage_bytes: int
    """Bytes of every storage the iteration holds at its start or allocates."""
    peak_bytes: int
    """Most bytes live at once with everything resident (the simulator's ``none`` peak)."""
    flops: int
    """FLOPs of the iteration's operators (what the roofline projects)."""

    def relative_error(self, real: TraceSummary) -> dict[str, float]:
        """``self / real - 1`` per field (0 where both are 0)."""
        out = {}
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(real, f.name)
            out[f.name] = (a / b - 1) if b else (0.0 if a == 0 else math.inf)
        return out


def iteration_summary(trace: Trace, iteration: int = -1) -> TraceSummary:
    """The :class:`TraceSummary` of one iteration of ``trace``."""
    it = trace.iterations[iteration]
    sids = set(it.live_at_start(trace))
    for op in it.ops:
        sids.update(op.allocs)
    return TraceSummary(
        ops=len(it.ops),
        storage_bytes=sum(trace.storages[s].nbytes for s in sids),
        peak_bytes=it.footprint_peak(trace),
        flops=sum(op.flops for op in it.ops),
    )
