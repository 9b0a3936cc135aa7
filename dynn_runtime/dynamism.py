"""How dynamic is a workload? Per-step operator signatures and a short report.

A step's *signature* is the sequence of ATen operators it runs (forward, backward and optimizer)
with the shapes of their outputs. Two steps of a static network have equal signatures; a dynamic
network's differ. This is the cheap measurement the demo prints and the zoo tests assert on; the
trace recorder (:mod:`dynn_runtime.trace`) records far more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .memory import LiveBytes
from .workload import make_optimizer, to_device, train_step

__all__ = ["OpSignature", "step_signatures", "DynamismReport", "dynamism_report"]


class OpSignature(TorchDispatchMode):
    """Records ``(operator, output shapes)`` for every ATen call under the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        shapes = tuple(tuple(t.shape) for t in flat if isinstance(t, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


@dataclass
class StepRecord:
    loss: float
    ops: list[tuple[str, tuple]]
    peak_bytes: int
    facts: dict = field(default_factory=dict)


def step_signatures(wl: Any, steps: int, seed: int = 0, device: str = "cpu") -> list[StepRecord]:
    """Train ``steps`` steps and record each step's operator signature, peak bytes and facts."""
    torch.manual_seed(seed)
    model = wl.model.to(device)
    opt = make_optimizer(wl, model.parameters())
    out = []
    for step in range(steps):
        batch = to_device(wl.make_batch(step), device)
        with LiveBytes(device) as mem, OpSignature() as sig:
            loss = train_step(wl, model, opt, batch)
        facts = wl.step_facts() if callable(getattr(wl, "step_facts", None)) else {}
        out.append(StepRecord(float(loss.detach()), sig.ops, mem.peak_bytes, facts))
    return out


@dataclass
class DynamismReport:
    workload: str
    steps: int
    ops_min: int
    ops_max: int
    distinct_signatures: int
    distinct_op_sequences: int
    peak_min: int
    peak_max: int
    losses: list[float]
    facts: list[dict]


def dynamism_report(name: str, wl: Any, steps: int = 4, seed: int = 0) -> DynamismReport:
    recs = step_signatures(wl, steps, seed=seed)
    counts = [len(r.ops) for r in recs]
    peaks = [r.peak_bytes for r in recs]
    return DynamismReport(
        workload=name,
        steps=steps,
        ops_min=min(counts),
        ops_max=max(counts),
        distinct_signatures=len({tuple(r.ops) for r in recs}),
        distinct_op_sequences=len({tuple(op for op, _ in r.ops) for r in recs}),
        peak_min=min(peaks),
        peak_max=max(peaks),
        losses=[r.loss for r in recs],
        facts=[r.facts for r in recs],
    )
