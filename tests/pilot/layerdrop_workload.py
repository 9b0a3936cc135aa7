"""A tiny LayerDrop network for the pilot's optimizer-plan tests (``layerdrop_workload.py:build``):
six residual linear layers, each skipped per step by a seeded draw, trained with single-tensor
Adam, so the optimizer updates a different subset of the parameters every step."""

from __future__ import annotations

import torch
from torch import nn

#: which layers run, per step: every layer skipped in some step, some skipped two steps running
PLAN = [(1, 1, 0, 1, 0, 1), (1, 0, 1, 1, 0, 0), (0, 1, 1, 0, 1, 1), (1, 0, 0, 1, 1, 1),
        (1, 1, 1, 0, 0, 1), (0, 1, 0, 1, 1, 0), (1, 0, 1, 1, 1, 0)]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.head = nn.Linear(16, 2)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        run = PLAN[self.step % len(PLAN)]
        for on, layer in zip(run, self.layers):
            if on:
                x = x + torch.relu(layer(x))
        return self.head(x)


class LayerDrop:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = Net()

    def make_batch(self, step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(4, 16, generator=g), "y": torch.randint(0, 2, (4,), generator=g), "step": step}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        model.step = batch["step"]
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def optimizer(self, params):
        return torch.optim.Adam(params, lr=1e-3, foreach=False)


def build(preset: str = "tiny") -> LayerDrop:
    return LayerDrop()
