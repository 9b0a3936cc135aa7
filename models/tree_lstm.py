"""``tree_lstm``: child-sum Tree-LSTM over trees whose shape changes with every sample.

Stands for the Tree-LSTM of Tai, Socher and Manning (ACL 2015) on dependency parses (SST, SICK),
and, more generally, recursive networks whose computation graph is the input's structure.

What is dynamic: every sample is a random dependency tree (sentence length log-normal, as in real
corpora; each word attaches to the previous word or to a random earlier one), so the number of
nodes, the depth, and the fan-in of each node change per batch. Nodes are batched level by level
(all nodes of the same height across the batch run together), so the number of steps, the size of
each step and which earlier levels feed it are all decided by the data. Labels are per node: the
sign of a subtree's "sentiment" (word polarities summed, flipped under negation words), so every
node is trained as in SST.

What it tells the memory manager (:mod:`dynn_runtime.hints`): the batch's trees say, before any
level runs, which lower levels each level reads. The forward's steps are fine (per level: its
start, one step per lower level feeding it, the cell update; then the output), so each level's
states, index tensors and input projections, the recurrent weights and the output layer are hinted
with the exact step that reads them next.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dynn_runtime import hints

from ._common import Family, ZooWorkload, positive_ints, require


@dataclass(kw_only=True)
class TreeLSTMConfig:
    """Configuration of the ``tree_lstm`` family."""

    vocab: int = 50
    """Vocabulary size."""
    embed: int = 16
    """Word embedding width."""
    hidden: int = 32
    """Tree-LSTM state width."""
    classes: int = 3
    """Sentiment classes per node (negative, neutral, positive)."""
    batch: int = 8
    """Trees per batch."""
    mean_nodes: float = 12.0
    """Median tree size (words per sentence); sizes are log-normal around it."""
    size_sigma: float = 0.5
    """Log-normal spread of tree sizes."""
    max_nodes: int = 64
    """Largest tree."""

    def validate(self) -> None:
        positive_ints(self, "tree_lstm", "vocab", "embed", "hidden", "batch", "max_nodes")
        require(isinstance(self.classes, int) and self.classes >= 2, "tree_lstm", "classes", "an integer >= 2",
                self.classes)
        require(self.mean_nodes >= 2, "tree_lstm", "mean_nodes", ">= 2", self.mean_nodes)
        require(self.size_sigma >= 0, "tree_lstm", "size_sigma", ">= 0", self.size_sigma)
        require(self.max_nodes >= 2, "tree_lstm", "max_nodes", ">= 2", self.max_nodes)
        require(self.vocab >= 4, "tree_lstm", "vocab", ">= 4", self.vocab)


@dataclass
class TreeBatch:
    """A batch of trees, flattened and grouped by height (leaves are height 0).

    ``levels[h]`` holds the global ids of the nodes of height h; ``edges[h]`` lists, for each lower
    level l feeding level h, ``(l, child_pos, parent_pos)`` with positions inside those levels.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    levels: list[torch.Tensor]
    edges: list[list[tuple[int, torch.Tensor, torch.Tensor]]]
    sizes: list[int]


class ChildSumTreeLSTM(nn.Module):
    def __init__(self, cfg: TreeLSTMConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.hidden = h
        self.embed = nn.Embedding(cfg.vocab, cfg.embed)
        self.w = nn.Linear(cfg.embed, 4 * h)  # input parts of i, o, u and f
        self.u_iou = nn.Linear(h, 3 * h, bias=False)
        self.u_f = nn.Linear(h, h, bias=False)
        self.out = nn.Linear(h, cfg.classes)

    def forward(self, batch: TreeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return logits of every node in level order, and the labels in the same order."""
        h_dim = self.hidden
        n = len(batch.levels)
        plan = _StepPlan(batch.edges)
        tell = hints.listening()
        if tell:  # which step reads what is known from the batch before any level runs
            for level, edges in enumerate(batch.edges):
                plan.tell(plan.start[level], batch.levels[level])
                for j, (_, cp, pp) in enumerate(edges):
                    plan.tell(plan.edge[level][j], cp, pp)
            plan.tell(plan.cell[0], self.u_iou.weight)
            plan.tell(plan.next_edge(), self.u_f.weight)
            plan.tell(plan.final, *self.out.parameters())
        wx_all = self.w(self.embed(batch.tokens))
        if tell:
            plan.tell(plan.start[0], wx_all)
        hs: list[torch.Tensor] = []
        cs: list[torch.Tensor] = []
        for level, (nodes, edges) in enumerate(zip(batch.levels, batch.edges)):
            plan.step()  # the level's start
            wx = wx_all.index_select(0, nodes)
            wx_iou, wx_f = wx[:, : 3 * h_dim], wx[:, 3 * h_dim :]
            h_sum = wx.new_zeros(nodes.numel(), h_dim)
            fc_sum = wx.new_zeros(nodes.numel(), h_dim)
            if tell:
                plan.tell(plan.start[level + 1] if level + 1 < n else None, wx_all)
                plan.tell(plan.edge[level][0] if edges else plan.cell[level], wx)
            for j, (lower, child_pos, parent_pos) in enumerate(edges):
                plan.step()  # one step per lower level feeding this one
                h_k = hs[lower].index_select(0, child_pos)
                c_k = cs[lower].index_select(0, child_pos)
                h_sum = h_sum.index_add(0, parent_pos, h_k)
                f_k = torch.sigmoid(wx_f.index_select(0, parent_pos) + self.u_f(h_k))
                fc_sum = fc_sum.index_add(0, parent_pos, f_k * c_k)
                if tell:
                    plan.tell_states(lower, hs[lower], cs[lower])
                    plan.tell(None, child_pos, parent_pos)
                    plan.tell(plan.next_edge(), self.u_f.weight)
                    plan.tell(plan.edge[level][j + 1] if j + 1 < len(edges) else plan.cell[level], wx)
            plan.step()  # the cell update
            i, o, u = (wx_iou + self.u_iou(h_sum)).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u) + fc_sum
            hs.append(torch.sigmoid(o) * torch.tanh(c))
            cs.append(c)
            if tell:
                plan.tell_states(level, hs[level], cs[level])
                plan.tell(plan.final, nodes)  # read again by the labels' gather at the end
                plan.tell(plan.cell[level + 1] if level + 1 < n else None, self.u_iou.weight)
                plan.tell(None, wx)
        plan.step()  # the output
        logits = self.out(torch.cat(hs, dim=0))
        labels = batch.labels.index_select(0, torch.cat(batch.levels))
        return logits, labels


class _StepPlan:
    """The forward's workload steps (:mod:`dynn_runtime.hints`), numbered from 1 as ``step()`` marks
    them: per level a start (gather the level's inputs), one step per lower level feeding it, and
    the cell update; then the output. Fine steps of a few operators each make a hinted step an
    accurate distance; the batch's edges give every step's number before the forward runs."""

    def __init__(self, edges: list[list[tuple[int, torch.Tensor, torch.Tensor]]]) -> None:
        self.start: list[int] = []
        self.edge: list[list[int]] = []
        self.cell: list[int] = []
        self.readers: list[list[int]] = [[] for _ in edges]  # per level: the steps that read its states
        k = 0
        for level_edges in edges:
            self.start.append(k + 1)
            self.edge.append(list(range(k + 2, k + 2 + len(level_edges))))
            for (lower, _, _), at in zip(level_edges, self.edge[-1]):
                self.readers[lower].append(at)
            k += 2 + len(level_edges)
            self.cell.append(k)
        self.final = k + 1
        self._edges = [at for e in self.edge for at in e]
        self.cur = 0

    def step(self) -> None:
        self.cur += 1
        hints.step()

    def next_edge(self) -> int | None:
        """The next step (after the current one) that reads ``u_f``: any lower-level step."""
        i = bisect.bisect_right(self._edges, self.cur)  # the edge steps ascend
        return self._edges[i] if i < len(self._edges) else None

    def tell(self, at: int | None, *tensors: torch.Tensor) -> None:
        """Say that ``tensors`` are next read in step ``at`` (``None``: not again in this pass)."""
        hints.next_use(*tensors, steps=None if at is None else at - self.cur)

    def tell_states(self, level: int, h: torch.Tensor, c: torch.Tensor) -> None:
        """Hint a level's states with the next step that reads them: ``h`` is also read by the
        output, ``c`` by nothing after its last reader."""
        nxt = next((at for at in self.readers[level] if at > self.cur), None)
        self.tell(self.final if nxt is None else nxt, h)
        self.tell(nxt, c)


def random_tree(gen: torch.Generator, n: int) -> list[int]:
    """Parents of a random dependency tree with ``n`` nodes (node 0 is the root)."""
    parents = [-1]
    for i in range(1, n):
        if i == 1 or float(torch.rand((), generator=gen)) < 0.5:
            parents.append(i - 1)  # chain-like: right-branching attachment
        else:
            parents.append(int(torch.randint(0, i, (), generator=gen)))
    return parents


class TreeLSTMWorkload(ZooWorkload):
    def _batch(self, gen: torch.Generator, step: int) -> TreeBatch:
        cfg: TreeLSTMConfig = self.config
        polarity, negators = self.extras["polarity"], self.extras["negators"]
        all_tokens, all_labels, all_heights, all_parents, sizes = [], [], [], [], []
        offset = 0
        for _ in range(cfg.batch):
            z = float(torch.randn((), generator=gen))
            n = int(min(cfg.max_nodes, max(2, round(math.exp(math.log(cfg.mean_nodes) + cfg.size_sigma * z)))))
            parents = random_tree(gen, n)
            tokens = torch.randint(0, cfg.vocab, (n,), generator=gen).tolist()
            children: list[list[int]] = [[] for _ in range(n)]
            for i, p in enumerate(parents):
                if p >= 0:
                    children[p].append(i)
            score = [0.0] * n
            height = [0] * n
            for i in reversed(range(n)):  # children always have larger ids than their parent
                s = float(polarity[tokens[i]]) + sum(score[c] for c in children[i])
                score[i] = -s if tokens[i] in negators else s
                height[i] = 1 + max((height[c] for c in children[i]), default=-1)
            labels = [_bucket(s, cfg.classes) for s in score]
            all_tokens += tokens
            all_labels += labels
            all_heights += height
            all_parents += [p + offset if p >= 0 else -1 for p in parents]
            sizes.append(n)
            offset += n
        return _group_levels(all_tokens, all_labels, all_heights, all_parents, sizes)

    def loss(self, model: nn.Module, batch: TreeBatch) -> torch.Tensor:
        logits, labels = model(batch)
        return F.cross_entropy(logits, labels)

    def step_facts(self) -> dict:
        return dict(self.extras.get("last", {}))

    def make_batch(self, step: int) -> TreeBatch:
        b = super().make_batch(step)
        self.extras["last"] = {"tree_sizes": list(b.sizes), "levels": len(b.levels),
                               "nodes_per_level": [int(x.numel()) for x in b.levels]}
        return b


def _bucket(score: float, classes: int) -> int:
    # Map a subtree score to a class: negative / neutral / positive (more classes split the ends).
    edges = torch.linspace(-1.5, 1.5, classes - 1).tolist()
    return sum(score > e for e in edges)


def _group_levels(tokens, labels, heights, parents, sizes) -> TreeBatch:
    n_levels = max(heights) + 1
    levels_py: list[list[int]] = [[] for _ in range(n_levels)]
    pos = [0] * len(tokens)
    for node, h in enumerate(heights):
        pos[node] = len(levels_py[h])
        levels_py[h].append(node)
    edges_py: list[dict[int, tuple[list[int], list[int]]]] = [{} for _ in range(n_levels)]
    for child, parent in enumerate(parents):
        if parent < 0:
            continue
        lc, lp = heights[child], heights[parent]
        cp, pp = edges_py[lp].setdefault(lc, ([], []))
        cp.append(pos[child])
        pp.append(pos[parent])
    return TreeBatch(
        tokens=torch.tensor(tokens, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        levels=[torch.tensor(lv, dtype=torch.long) for lv in levels_py],
        edges=[
            [(lower, torch.tensor(cp, dtype=torch.long), torch.tensor(pp, dtype=torch.long))
             for lower, (cp, pp) in sorted(e.items())]
            for e in edges_py
        ],
        sizes=sizes,
    )


def _extras(cfg: TreeLSTMConfig, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 404)
    polarity = torch.randint(-1, 2, (cfg.vocab,), generator=gen)
    negators = set(torch.randperm(cfg.vocab, generator=gen)[: max(1, cfg.vocab // 20)].tolist())
    for t in negators:
        polarity[t] = 0
    return {"polarity": polarity.tolist(), "negators": negators}


FAMILY = Family(
    name="tree_lstm",
    description="Child-sum Tree-LSTM over random dependency trees, batched level by level",
    stands_for="Tree-LSTM (Tai et al. 2015) on SST/SICK dependency parses",
    dynamic="tree size, depth and fan-in vary per sample; level count and sizes follow the data",
    config_cls=TreeLSTMConfig,
    presets={
        "tiny": TreeLSTMConfig(),
        "small": TreeLSTMConfig(vocab=2000, embed=128, hidden=256, batch=32, mean_nodes=20, max_nodes=128),
        "large": TreeLSTMConfig(vocab=30000, embed=512, hidden=2048, batch=2048, mean_nodes=24, size_sigma=0.6,
                                max_nodes=512, classes=5),
    },
    build_model=lambda cfg: ChildSumTreeLSTM(cfg),
    workload_cls=TreeLSTMWorkload,
    size_knob="batch",
    extras=_extras,
)
