"""A third-party graph network over graphs that change every step as a dynn-runtime workload:
``tools/third_party/dynamic_gnn.py:build``.

PyTorch Geometric's ``GATConv`` and ``GCNConv`` layers (gather and scatter over the edge list),
randomly initialised, on a batch of random graphs whose count, node counts and edges are drawn per
step (nodes of a graph link to nearby nodes with a probability drawn per graph), then mean pooling
and graph regression. Evaluation only: never in the pilot's training data. Needs ``pip install
torch-geometric`` (no torch dependency; docs/pilot.md, "Networks outside the zoo").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: preset -> (hidden width, layers, graphs per batch at most, nodes per graph at most)
PRESETS = {"tiny": (32, 10, 8, 40), "small": (128, 10, 32, 200)}
FEATURES = 8


class GraphNet(nn.Module):
    def __init__(self, hidden: int, layers: int) -> None:
        super().__init__()
        from torch_geometric.nn import GATConv, GCNConv

        self.inp = nn.Linear(FEATURES, hidden)
        self.convs = nn.ModuleList(GATConv(hidden, hidden // 4, heads=4) if i % 2 == 0 else GCNConv(hidden, hidden)
                                   for i in range(layers))
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, graph: torch.Tensor, n_graphs: int) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        h = torch.relu(self.inp(x))
        for conv in self.convs:
            h = h + torch.relu(conv(h, edge_index))
        return self.out(global_mean_pool(h, graph, size=n_graphs))


class DynamicGNN:
    def __init__(self, preset: str) -> None:
        if preset not in PRESETS:
            raise ValueError(f"dynamic_gnn: preset {preset!r} is not one of {', '.join(PRESETS)}.")
        hidden, layers, self.max_graphs, self.max_nodes = PRESETS[preset]
        torch.manual_seed(0)
        self.model = GraphNet(hidden, layers)

    def make_batch(self, step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(3000 + step)
        n_graphs = int(torch.randint(2, self.max_graphs + 1, (1,), generator=g))
        xs, edges, owner, offset = [], [], [], 0
        for i in range(n_graphs):
            n = int(torch.randint(4, self.max_nodes + 1, (1,), generator=g))
            p = float(torch.rand((), generator=g)) * 0.3 + 0.05
            near = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs() <= 3
            adj = (torch.rand(n, n, generator=g) < p) | near
            adj.fill_diagonal_(False)
            edges.append(adj.nonzero().t() + offset)
            xs.append(torch.randn(n, FEATURES, generator=g))
            owner.append(torch.full((n,), i, dtype=torch.long))
            offset += n
        x = torch.cat(xs)
        y = torch.stack([c[:, 0].mean() for c in xs])[:, None]
        return {"x": x, "edge_index": torch.cat(edges, dim=1), "graph": torch.cat(owner), "n_graphs": n_graphs,
                "y": y}

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        pred = model(batch["x"], batch["edge_index"], batch["graph"], batch["n_graphs"])
        return nn.functional.mse_loss(pred, batch["y"])


def build(preset: str) -> DynamicGNN:
    return DynamicGNN(preset)
