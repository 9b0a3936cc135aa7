"""A user's own dynamic network, brought to dynn-runtime as ``examples/my_workload.py:build``.

An MLP whose depth is decided per batch by the data (a stand-in for any early-exit or
dynamic-depth model) and whose batch size changes from step to step.
"""

import torch
from torch import nn


class DynamicDepthMLP(nn.Module):
    def __init__(self, width: int, max_depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(max_depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.layers[:depth]:  # how many layers run depends on the batch
            h = h + torch.relu(layer(h))
        return self.out(h)


class MyWorkload:
    def __init__(self, preset: str) -> None:
        width, self.max_depth = {"tiny": (16, 4), "small": (256, 12), "large": (4096, 48)}[preset]
        torch.manual_seed(0)
        self.model = DynamicDepthMLP(width, self.max_depth)

    def make_batch(self, step: int):
        g = torch.Generator().manual_seed(step)  # seeded: the same step gives the same batch
        n = int(torch.randint(4, 64, (1,), generator=g))
        depth = int(torch.randint(1, self.max_depth + 1, (1,), generator=g))
        x = torch.randn(n, 8, generator=g)
        return {"x": x, "y": x.sum(dim=1, keepdim=True), "depth": depth}

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch["x"], batch["depth"]), batch["y"])

    def optimizer(self, params):  # optional; Adam(lr=1e-3) otherwise
        return torch.optim.Adam(params, lr=1e-4)  # deep and unnormalised: a smaller step stays finite


def build(preset: str) -> MyWorkload:
    return MyWorkload(preset)
