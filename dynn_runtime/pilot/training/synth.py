"""Synthetic dynamic networks: extra, varied training traces for the pilot (never an evaluation family).

Each zoo family is the only architecture of its kind, so a model trained on the others has never
seen, say, a recursive cell or a recycling loop. :class:`SynthWorkload` builds, from a seed, a small
random network out of the same dynamic idioms, so that the pilot's training data holds many
architectures:

* a trunk: MLP on vectors, a small convnet on images, or a recursive cell over random trees batched
  level by level (per-level index tensors in the batch, children summed with ``index_add``), the
  cell rewriting one state tensor or (half of the tree trunks) keeping each level's states apart,
  read later by whichever levels the batch's trees say;
* then 1-4 random stages: gated residual blocks skipped per step (MLP or conv), early-exit heads
  (later stages skipped when an exit fires), recycling loops with a per-step pass count (earlier
  passes optionally without gradient), top-1 routing of rows among experts, plain layers;
* and, for three networks in four, 1-2 more stages inserted among those (:data:`EXTRA_STAGES`,
  those of the kinds named by ``extra``; with none, a network is generator 2's):
  message passing over a random graph drawn per step (each row a graph of its own, node and edge
  counts drawn per step; messages gathered along the edge list and scattered to their targets with
  ``index_add`` / ``scatter_add``, degree-normalised or with attention weights normalised per
  target), token dropping (Mixture-of-Depths: rows become sequences of a length drawn per step, and
  in each block a router keeps the top-k tokens, k from a capacity drawn per step, the others skip
  the block), and LayerDrop over 6-16 layers (each dropped with a probability drawn per network, so
  that the optimizer updates a different subset of many parameters every step).

Half of the networks (drawn per seed) tell what they know of their near future through
:mod:`dynn_runtime.hints` (tree levels, skipped and exited blocks, dropped layers, idle experts,
recycling passes), so the pilot learns to use hints from architectures no zoo family has and to do
without them; the graph and token-dropping stages give none.

Every dynamic choice (tree shapes, skips, exits, passes, routes, graphs, capacities, dropped
layers) is drawn per step from the batch's seeded generators, so a seed gives the same traces on
every run and different steps differ. Sizes are tiny (width 8-24, batch 4): a 4-step trace
records in a few seconds on a CPU.

    from dynn_runtime.pilot.training.synth import SynthWorkload, synth_traces
    traces = synth_traces(range(16), steps=3)         # recorded once, cached like the zoo's
    zoo_like = synth_traces(range(16), steps=3, extra=())   # generator 2's networks
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ... import hints

__all__ = ["SynthNet", "SynthWorkload", "synth_traces", "SYNTH_FAMILY", "STAGES", "EXTRA_STAGES"]

#: the workload name synthetic traces carry (never one of the zoo's families)
SYNTH_FAMILY = "synthetic"
#: the generator's version, part of the cached traces' names (2: tree trunks with per-level states;
#: 3: the extra stages)
GENERATOR_VERSION = 3
TRUNKS = ("mlp", "conv", "tree")
STAGES = ("skip", "exit", "recycle", "moe", "plain")
#: stages drawn from a random stream of their own (architecture and per-step plans), so that the
#: stages, weights and plans of :data:`STAGES` stay what each seed drew before these existed
EXTRA_STAGES = ("graph", "mod", "layerdrop")


class _Tree(nn.Module):
    def __init__(self, vocab: int, w: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, w)
        self.wx = nn.Linear(w, 2 * w)
        self.uh = nn.Linear(w, 2 * w, bias=False)

    def forward(self, b: dict[str, Any], tell: bool = False) -> torch.Tensor:
        x = self.emb(b["tokens"])
        h = torch.zeros_like(x)
        levels = b["levels"]
        if tell:
            for i, lv in enumerate(levels):
                hints.next_use(*lv, steps=i + 1)
        for nodes, child, slot in levels:
            if tell:
                hints.step()
            s = torch.zeros(len(nodes), x.shape[1], dtype=x.dtype).index_add(0, slot, h[child])
            z = self.wx(x[nodes]) + self.uh(s)
            g, c = z.chunk(2, dim=1)
            h = h.index_copy(0, nodes, torch.sigmoid(g) * torch.tanh(c))
            if tell:
                last = nodes is levels[-1][0]
                hints.next_use(nodes, child, slot, steps=None)
                hints.next_use(h, steps=1)  # the next level, or the roots' gather after the last
                hints.next_use(x, steps=None if last else 1)
        if tell:
            hints.step()
        return h[b["roots"]]


class _LevelTree(nn.Module):
    """A gated recursive cell that keeps each level's states in their own tensor: which later
    level reads a level's states is decided by the batch's trees (the idiom of child-sum
    Tree-LSTMs and DAG-RNNs), unlike :class:`_Tree`, whose one state tensor every level rewrites."""

    def __init__(self, vocab: int, w: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, w)
        self.wx = nn.Linear(w, 2 * w)
        self.uz = nn.Linear(w, w, bias=False)
        self.uh = nn.Linear(w, w, bias=False)

    def forward(self, b: dict[str, Any], tell: bool = False) -> torch.Tensor:
        levels, edges = b["levels"], b["edges"]
        n = len(levels)
        readers: list[list[int]] = [[] for _ in range(n)]  # per level: the later levels reading its states
        if tell:
            for lv, level_edges in enumerate(edges):
                for lower, _, _ in level_edges:
                    readers[lower].append(lv)
            for lv, (nodes, _, _) in enumerate(levels):
                hints.next_use(nodes, *(t for _, cp, pp in edges[lv] for t in (cp, pp)), steps=lv + 1)
        x_all = self.emb(b["tokens"])
        hs: list[torch.Tensor] = []
        for lv, (nodes, _, _) in enumerate(levels):
            if tell:
                hints.step()
            zx, hx = self.wx(x_all.index_select(0, nodes)).chunk(2, dim=1)
            agg = zx.new_zeros(len(nodes), zx.shape[1])
            for lower, cp, pp in edges[lv]:
                agg = agg.index_add(0, pp, hs[lower].index_select(0, cp))
                if tell:
                    _tell_reader(readers[lower], lv, n, hs[lower])
            z = torch.sigmoid(zx + self.uz(agg))
            hs.append((1 - z) * torch.tanh(hx + self.uh(agg)) + z * agg)
            if tell:
                _tell_reader(readers[lv], lv, n, hs[lv])
                hints.next_use(*(t for _, cp, pp in edges[lv] for t in (cp, pp)), steps=None)
        if tell:
            hints.step()
        return torch.cat(hs, dim=0).index_select(0, b["root_rows"])


def _tell_reader(readers: list[int], level: int, n: int, h: torch.Tensor) -> None:
    """Hint a level's states with the next level after ``level`` that reads them (the roots'
    gather at step n + 1 reads every level)."""
    nxt = next((r for r in readers if r > level), n)
    hints.next_use(h, steps=nxt - level)


class _Block(nn.Module):
    def __init__(self, w: int, conv: bool) -> None:
        super().__init__()
        self.conv = conv
        self.a = nn.Conv2d(w, w, 3, padding=1) if conv else nn.Linear(w, w)
        self.b = nn.Conv2d(w, w, 1) if conv else nn.Linear(w, w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.b(F.relu(self.a(h)))


class _Recycle(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.p = nn.Linear(w, w)
        self.q = nn.Linear(w, w)
        self.o = nn.Linear(w, w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pair = torch.einsum("bi,bj->bij", self.p(h), self.q(h))  # a pair representation
        att = torch.softmax(pair, dim=-1) @ h.unsqueeze(-1)
        return h + self.o(att.squeeze(-1))


class _Graph(nn.Module):
    """Message passing over a graph drawn per step (the plan, :meth:`SynthWorkload._graph_plan`):
    every batch row is a graph of its own whose nodes start from the row's vector plus a node
    feature; each layer gathers messages along the edge list (``index_select`` by source) and
    scatters them to their targets, degree-normalised (``scatter_add``, GCN-like) or weighted by a
    softmax over each target's incoming edges (``index_add``, GAT-like); then each graph's nodes are
    mean-pooled back to its row (``index_add`` by owner)."""

    def __init__(self, w: int, n: int, attention: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(w, w)
        self.msg = nn.ModuleList(nn.Linear(w, w) for _ in range(n))
        self.att = nn.ModuleList(nn.Linear(2 * w, 1) for _ in range(n)) if attention else None

    def forward(self, h: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
        owner, src, dst = p["owner"], p["src"], p["dst"]
        n_nodes, w = len(owner), h.shape[1]
        x = torch.relu(self.inp(h.index_select(0, owner)) + p["feat"])
        for i, lin in enumerate(self.msg):
            m = lin(x).index_select(0, src)
            if self.att is not None:
                s = self.att[i](torch.cat([x.index_select(0, dst), m], dim=1)).squeeze(1)
                s = torch.exp(s - s.max().detach())
                # every node has a self-loop, so no target's sum is zero
                den = s.new_zeros(n_nodes).index_add(0, dst, s)
                agg = x.new_zeros(n_nodes, w).index_add(0, dst, m * (s / den.index_select(0, dst)).unsqueeze(1))
            else:
                agg = x.new_zeros(n_nodes, w).scatter_add(0, dst.unsqueeze(1).expand(-1, w), m) * p["inv_deg"]
            x = x + torch.relu(agg)
        pooled = h.new_zeros(h.shape).index_add(0, owner, x) * p["inv_size"]
        return h + pooled


class _MoD(nn.Module):
    """Mixture-of-Depths token dropping: each row becomes a sequence of ``T`` tokens (``T`` drawn per
    step); in each block a router scores every token and only the top ``k`` (``k`` = a capacity drawn
    per step and block x the tokens) run the block, their output scaled by the router's gate and
    added back in place (``index_add``); the other tokens skip the block."""

    def __init__(self, w: int, n: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(0.1 * torch.randn(MAX_TOKENS, w))
        self.router = nn.ModuleList(nn.Linear(w, 1) for _ in range(n))
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(w), nn.Linear(w, 2 * w), nn.GELU(), nn.Linear(2 * w, w))
                                    for _ in range(n))

    def forward(self, h: torch.Tensor, p: tuple[int, list[float]]) -> torch.Tensor:
        tokens, caps = p
        rows, w = h.shape
        x = (h.unsqueeze(1) + self.pos[:tokens]).reshape(rows * tokens, w)
        for router, blk, cap in zip(self.router, self.blocks, caps):
            s = router(x).squeeze(1)
            top = torch.topk(s, max(1, round(cap * len(s)))).indices
            x = x.index_add(0, top, blk(x.index_select(0, top)) * torch.sigmoid(s.index_select(0, top)).unsqueeze(1))
        return h + x.view(rows, tokens, w).mean(dim=1)


class _DropLayer(nn.Module):
    """A pre-norm residual MLP layer (a transformer layer's parameter count and shape, no attention)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(w)
        self.up = nn.Linear(w, 2 * w)
        self.down = nn.Linear(2 * w, w)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


#: the longest token sequence of a token-dropping stage
MAX_TOKENS = 12
#: offset of the extra stages' random streams from the seed's own
EXTRA_SALT = 7_919_000


class SynthNet(nn.Module):
    """A random dynamic network drawn from ``seed`` (see the module docstring)."""

    def __init__(self, seed: int, extra: tuple[str, ...] = EXTRA_STAGES) -> None:
        super().__init__()
        unknown = set(extra) - set(EXTRA_STAGES)
        if unknown:
            raise ValueError(f"synth: extra stages {sorted(unknown)} are not among {EXTRA_STAGES}")
        r = random.Random(seed)
        self.w = w = r.choice((8, 12, 16, 24))
        self.trunk = r.choice(TRUNKS)
        self.conv = self.trunk == "conv"
        if self.trunk == "tree":
            self.tree = _Tree(32, w)
        elif self.conv:
            self.stem = nn.Conv2d(3, w, 3, padding=1)
            self.trunk_blocks = nn.ModuleList(_Block(w, True) for _ in range(r.randint(1, 3)))
        else:
            self.stem = nn.Linear(w, w)
        self.stages: list[tuple[str, int]] = []
        mods = nn.ModuleList()
        for _ in range(r.randint(1, 4)):
            kind = r.choice(STAGES)
            n = r.randint(2, 6) if kind in ("skip", "exit", "moe") else r.randint(1, 3)
            if kind == "skip":
                m = nn.ModuleList(_Block(w, self.conv and r.random() < 0.7) for _ in range(n))
            elif kind == "exit":
                m = nn.ModuleList(nn.ModuleDict({"blk": _Block(w, False), "head": nn.Linear(w, 1)}) for _ in range(n))
            elif kind == "recycle":
                m = nn.ModuleList(_Recycle(w) for _ in range(n))
            elif kind == "moe":
                m = nn.ModuleDict({"gate": nn.Linear(w, n), "experts": nn.ModuleList(
                    nn.Sequential(nn.Linear(w, 2 * w), nn.ReLU(), nn.Linear(2 * w, w)) for _ in range(n))})
            else:
                m = nn.Sequential(*(nn.Linear(w, w) for _ in range(n)))
            self.stages.append((kind, n))
            mods.append(m)
        self.stage_mods = mods
        self.no_grad_recycles = r.random() < 0.5
        self.head = nn.Linear(w, 1)
        self.tell = r.random() < 0.5  # drawn after the architecture: seeds kept theirs when hints came
        if self.trunk == "tree" and r.random() < 0.5:  # drawn last, for the same reason
            self.tree = _LevelTree(32, w)
        # the extra stages come from a stream of their own and are built last (the global generator
        # has initialised every earlier module), so that everything above stays what the seed drew
        rx = random.Random(seed + EXTRA_SALT)
        self.layerdrop = rx.uniform(0.2, 0.5)
        for _ in range(rx.choice((0, 1, 1, 2))):
            kind = rx.choice(EXTRA_STAGES)  # over all of them: a kind left out of ``extra`` is skipped
            if kind not in extra:
                continue
            if kind == "graph":
                n = rx.randint(1, 4)
                m = _Graph(w, n, attention=rx.random() < 0.5)
            elif kind == "mod":
                n = rx.randint(2, 6)
                m = _MoD(w, n)
            else:
                n = rx.randint(6, 16)
                m = nn.ModuleList(_DropLayer(w) for _ in range(n))
            at = rx.randint(0, len(self.stages))
            self.stages.insert(at, (kind, n))
            mods.insert(at, m)

    def forward(self, b: dict[str, Any]) -> torch.Tensor:
        tell = self.tell and hints.listening()
        if self.trunk == "tree":
            h = self.tree(b, tell)
        else:
            h = F.relu(self.stem(b["x"]))
            if self.conv:
                for blk in self.trunk_blocks:
                    h = blk(h)
        loss = h.new_zeros(())
        plan = b["plan"]
        for (kind, _n), m, p in zip(self.stages, self.stage_mods, plan):
            if self.conv and kind not in ("skip",) and h.dim() == 4:
                h = h.mean(dim=(2, 3))
            if tell:
                _tell_stage(kind, m, p, h.dim() == 4)
            if kind == "skip":
                for blk, run in zip(m, p):
                    if tell:
                        hints.step()
                    if run:
                        if blk.conv != (h.dim() == 4):
                            continue
                        h = blk(h)
            elif kind == "layerdrop":
                for layer, run in zip(m, p):
                    if tell:
                        hints.step()
                    if run:
                        h = layer(h)
            elif kind in ("graph", "mod"):
                h = m(h, p)
            elif kind == "exit":
                for i, e in enumerate(m):
                    if tell:
                        hints.step()
                    h = e["blk"](h)
                    loss = loss + e["head"](h).pow(2).mean()
                    if i == p:
                        return loss  # an exit fired: later stages do not run this step
            elif kind == "recycle":
                for k in range(p):
                    if tell:
                        hints.step()
                    last = k == p - 1
                    with torch.set_grad_enabled(last or not self.no_grad_recycles):
                        for blk in m:
                            h = blk(h)
                    if tell:  # read again by the next pass, or not again
                        hints.next_use(*m.parameters(), steps=None if last else 1)
                    if not last and self.no_grad_recycles:
                        h = h.detach()
            elif kind == "moe":
                route = p
                out = torch.zeros_like(h)
                for e, exp in enumerate(m["experts"]):
                    idx = route[e]
                    if len(idx):
                        g = torch.sigmoid(m["gate"](h[idx])[:, e: e + 1])
                        out = out.index_add(0, idx, exp(h[idx]) * g)
                h = h + out
            else:
                h = torch.relu(m(h))
        if h.dim() == 4:
            h = h.mean(dim=(2, 3))
        return loss + self.head(h).pow(2).mean()


def _tell_stage(kind: str, m: nn.Module, p: Any, images: bool) -> None:
    """Hints a stage's parameters with the step (counted from the stage's start) that reads them
    (``images``: the stage's input is 4-d, so only the convolutional blocks of a skip stage run)."""
    if kind == "skip":
        for i, (blk, run) in enumerate(zip(m, p)):
            hints.next_use(*blk.parameters(), steps=i + 1 if run and blk.conv == images else None)
    elif kind == "layerdrop":
        for i, (layer, run) in enumerate(zip(m, p)):
            hints.next_use(*layer.parameters(), steps=i + 1 if run else None)
    elif kind == "exit":
        for i, e in enumerate(m):
            hints.next_use(*e.parameters(), steps=i + 1 if i <= p else None)
    elif kind == "moe":
        hints.step()
        for e, exp in enumerate(m["experts"]):
            hints.next_use(*exp.parameters(), steps=0 if len(p[e]) else None)


class SynthWorkload:
    """A :mod:`dynn_runtime.workload`-shaped wrapper: ``model``, ``make_batch(step)``, ``loss``."""

    family = SYNTH_FAMILY

    def __init__(self, seed: int, batch: int = 4, extra: tuple[str, ...] = EXTRA_STAGES) -> None:
        torch.manual_seed(seed)
        self.seed = seed
        self.batch = batch
        self.model = SynthNet(seed, extra)

    def _tree_batch(self, r: random.Random) -> dict[str, Any]:
        parents: list[int] = []
        roots = []
        for _ in range(self.batch):
            n = r.randint(2, 14)
            base = len(parents)
            roots.append(base)
            parents.append(-1)
            for i in range(1, n):
                parents.append(base + (i - 1 if r.random() < 0.6 else r.randrange(i)))
        height = [0] * len(parents)
        for i in range(len(parents) - 1, 0, -1):  # children come after their parent
            p = parents[i]
            if p >= 0:
                height[p] = max(height[p], height[i] + 1)
        levels, edges = [], []
        n_levels = max(height) + 1
        at = {}  # node -> (level, position inside the level)
        for lv in range(n_levels):
            nodes = [i for i, hh in enumerate(height) if hh == lv]
            pos = {v: k for k, v in enumerate(nodes)}
            at.update({v: (lv, k) for v, k in pos.items()})
            child = [i for i, p in enumerate(parents) if p >= 0 and p in pos]
            slot = [pos[parents[i]] for i in child]
            levels.append((torch.tensor(nodes), torch.tensor(child, dtype=torch.long),
                           torch.tensor(slot, dtype=torch.long)))
            by_lower: dict[int, tuple[list[int], list[int]]] = {}
            for c, s in zip(child, slot):
                lo, k = at[c]
                by_lower.setdefault(lo, ([], []))[0].append(k)
                by_lower[lo][1].append(s)
            edges.append([(lo, torch.tensor(cp, dtype=torch.long), torch.tensor(pp, dtype=torch.long))
                          for lo, (cp, pp) in sorted(by_lower.items())])
        offset = [0] * (n_levels + 1)
        for lv in range(n_levels):
            offset[lv + 1] = offset[lv] + len(levels[lv][0])
        root_rows = [offset[at[v][0]] + at[v][1] for v in roots]
        return {"tokens": torch.tensor([r.randrange(32) for _ in parents]), "levels": levels, "edges": edges,
                "roots": torch.tensor(roots), "root_rows": torch.tensor(root_rows, dtype=torch.long)}

    def _graph_plan(self, r: random.Random, g: torch.Generator) -> dict[str, torch.Tensor]:
        """One graph per batch row, 2-12 nodes each, a self-loop on every node and each other
        ordered pair linked with a probability drawn per graph: node and edge counts vary per step."""
        owner: list[int] = []
        src: list[int] = []
        dst: list[int] = []
        sizes = []
        for row in range(self.batch):
            n, base, q = r.randint(2, 12), len(owner), r.uniform(0.1, 0.5)
            sizes.append(n)
            owner += [row] * n
            for a in range(n):
                for b in range(n):
                    if a == b or r.random() < q:
                        src.append(base + b)
                        dst.append(base + a)
        deg = torch.zeros(len(owner)).index_add_(0, torch.tensor(dst), torch.ones(len(dst)))
        return {"owner": torch.tensor(owner), "src": torch.tensor(src), "dst": torch.tensor(dst),
                "feat": torch.randn(len(owner), self.model.w, generator=g), "inv_deg": (1 / deg).unsqueeze(1),
                "inv_size": (1 / torch.tensor(sizes, dtype=torch.float32)).unsqueeze(1)}

    def make_batch(self, step: int) -> dict[str, Any]:
        r = random.Random(self.seed * 1000 + step)
        m = self.model
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        if m.trunk == "tree":
            b = self._tree_batch(r)
        elif m.conv:
            s = r.choice((4, 6, 8))
            b = {"x": torch.randn(self.batch, 3, s, s, generator=g)}
        else:
            b = {"x": torch.randn(self.batch, m.w, generator=g)}
        plan: list[Any] = []
        rx = random.Random((self.seed + EXTRA_SALT) * 1000 + step)  # the extra stages' plans (see SynthNet)
        for kind, n in m.stages:
            if kind == "graph":
                plan.append(self._graph_plan(rx, g))
            elif kind == "mod":
                plan.append((rx.randint(2, MAX_TOKENS), [rx.uniform(0.125, 0.75) for _ in range(n)]))
            elif kind == "layerdrop":
                plan.append([rx.random() >= m.layerdrop for _ in range(n)])
            elif kind == "skip":
                plan.append([r.random() < 0.6 for _ in range(n)])
            elif kind == "exit":
                plan.append(r.randrange(n + 1))  # n: no exit fires
            elif kind == "recycle":
                plan.append(r.randint(1, 4))
            elif kind == "moe":
                route = [r.randrange(n) for _ in range(self.batch)]
                plan.append([torch.tensor([i for i, e in enumerate(route) if e == k], dtype=torch.long)
                             for k in range(n)])
            else:
                plan.append(None)
        b["plan"] = plan
        return b

    def loss(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        return model(batch)

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1e-3)


def describe(seed: int, extra: tuple[str, ...] = EXTRA_STAGES) -> dict[str, Any]:
    """What a seed's network is (trunk, width, stages): for tests and provenance."""
    m = SynthNet(seed, extra)
    out = {"trunk": m.trunk, "width": m.w, "stages": [k for k, _ in m.stages]}
    if m.trunk == "tree":
        out["cell"] = "levels" if isinstance(m.tree, _LevelTree) else "shared"
    return out


def synth_traces(seeds: Iterable[int], steps: int = 3, cache_dir: str | Path = ".dynn-cache/traces",
                 extra: tuple[str, ...] = EXTRA_STAGES) -> list[Any]:
    """Record (or reuse) one synthetic trace per seed; returns the loaded traces.

    ``extra``: which of :data:`EXTRA_STAGES` the networks may hold (a drawn stage of another kind is
    left out); part of the cached traces' names when not all of them."""
    from ...trace import SCHEMA_VERSION, read_trace, record

    tag = "" if tuple(extra) == EXTRA_STAGES else "-x" + ("+".join(extra) or "none")
    out = []
    for seed in seeds:
        path = (Path(cache_dir) / f"{SYNTH_FAMILY}-seed{seed}-steps{steps}-g{GENERATOR_VERSION}{tag}"
                f"-v{SCHEMA_VERSION}.jsonl.gz")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(".tmp-" + path.name)
            record(SynthWorkload(seed, extra=extra), tmp, steps=steps, preset="synthetic", seed=seed)
            tmp.rename(path)
        out.append(read_trace(path))
    return out
