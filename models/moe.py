"""``moe``: Transformer language model with top-k gated mixture-of-experts feed-forward layers.

Stands for Switch Transformer (k=1) and GShard / Mixtral-style (k=2) MoE models.

What is dynamic: the router picks k experts per token; each expert takes at most
``capacity = ceil(capacity_factor * tokens * k / experts)`` tokens and drops the rest (they pass
through the residual). Which experts run, and on how many tokens, changes from batch to batch, so
which expert weights, gradients, optimizer states and activations a step touches changes too; an
expert that receives no token is not run at all. The synthetic corpus mixes "topics" (each its own
Markov chain over its own slice of the vocabulary) in proportions drawn per batch, so routing
shifts as the data does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Family, ZooWorkload, positive_ints, require
from ._layers import Block, FeedForward, markov_tokens, sparse_transition


@dataclass(kw_only=True)
class MoEConfig:
    """Configuration of the ``moe`` family."""

    vocab: int = 64
    """Vocabulary size (split evenly among topics)."""
    dim: int = 32
    """Model width."""
    heads: int = 2
    """Attention heads."""
    layers: int = 2
    """Transformer blocks, each with an MoE feed-forward layer."""
    experts: int = 4
    """Experts per MoE layer."""
    top_k: int = 2
    """Experts each token is routed to (1 = Switch, 2 = GShard)."""
    ffn_hidden: int = 64
    """Hidden width of each expert."""
    capacity_factor: float = 1.25
    """Slack on an expert's even share of tokens; tokens beyond capacity are dropped."""
    batch: int = 8
    """Sequences per batch."""
    seq_len: int = 32
    """Tokens per sequence."""
    topics: int = 4
    """Number of topics in the synthetic corpus."""
    aux_loss_weight: float = 0.01
    """Weight of the Switch load-balancing loss."""

    def validate(self) -> None:
        positive_ints(self, "moe", "vocab", "dim", "heads", "layers", "experts", "ffn_hidden", "batch",
                      "seq_len", "topics")
        require(self.top_k in (1, 2), "moe", "top_k", "1 or 2", self.top_k)
        require(self.top_k <= self.experts, "moe", "top_k", f"at most experts={self.experts}", self.top_k)
        require(self.dim % self.heads == 0, "moe", "dim", f"divisible by heads={self.heads}", self.dim)
        require(self.capacity_factor > 0, "moe", "capacity_factor", "> 0", self.capacity_factor)
        require(self.vocab >= self.topics * 2, "moe", "vocab", f">= 2 * topics={2 * self.topics}", self.vocab)
        require(self.seq_len >= 2, "moe", "seq_len", ">= 2", self.seq_len)


class MoELayer(nn.Module):
    """Top-k routed experts with capacity and token dropping."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int, capacity_factor: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(dim, hidden) for _ in range(experts))
        self.aux_loss = torch.zeros(())
        self.last_counts: list[int] = []
        self.last_dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens, n_exp = x.shape[0], len(self.experts)
        probs = self.router(x).softmax(dim=-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        if self.top_k > 1:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        capacity = max(1, math.ceil(self.capacity_factor * tokens * self.top_k / n_exp))
        # Choice-major order: every token's first choice is served before any second choice.
        assign_e = top_i.t().reshape(-1)
        assign_t = torch.arange(tokens, device=x.device).repeat(self.top_k)
        assign_w = top_w.t().reshape(-1)
        out = torch.zeros_like(x)
        counts, dropped = [], 0
        for e, expert in enumerate(self.experts):
            sel = (assign_e == e).nonzero().squeeze(1)
            dropped += max(0, sel.numel() - capacity)
            sel = sel[:capacity]
            counts.append(int(sel.numel()))
            if sel.numel() == 0:
                continue  # an idle expert is not run: its weights are not touched this step
            tok = assign_t[sel]
            y = expert(x.index_select(0, tok)) * assign_w[sel].unsqueeze(1)
            out = out.index_add(0, tok, y)
        frac = torch.bincount(top_i[:, 0], minlength=n_exp).to(probs.dtype) / tokens
        self.aux_loss = n_exp * (frac * probs.mean(dim=0)).sum()
        self.last_counts, self.last_dropped = counts, dropped
        return out.reshape(shape)


class MoETransformer(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, MoELayer(cfg.dim, cfg.ffn_hidden, cfg.experts, cfg.top_k, cfg.capacity_factor))
            for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)
        causal = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        for blk in self.blocks:
            x = blk(x, bias=self.causal[:n, :n])
        return self.head(self.norm(x))

    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks]


class MoEWorkload(ZooWorkload):
    def _batch(self, gen: torch.Generator, step: int) -> dict:
        cfg: MoEConfig = self.config
        trans = self.extras["transitions"]
        # Topic proportions drift from batch to batch (Dirichlet with small concentration).
        mix = _dirichlet(gen, cfg.topics, 0.5)
        topic = torch.multinomial(mix, cfg.batch, replacement=True, generator=gen)
        seqs = torch.empty(cfg.batch, cfg.seq_len, dtype=torch.long)
        per = cfg.vocab // cfg.topics
        for t in topic.unique().tolist():
            rows = (topic == t).nonzero().squeeze(1)
            seqs[rows] = markov_tokens(gen, trans[t], rows.numel(), cfg.seq_len) + t * per
        return {"tokens": seqs, "topic": topic}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        tok = batch["tokens"]
        logits = model(tok[:, :-1])
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1))
        aux = sum(layer.aux_loss for layer in _unwrap(model).moe_layers())
        return ce + self.config.aux_loss_weight * aux

    def step_facts(self) -> dict:
        layers = _unwrap(self.model).moe_layers()
        counts = [layer.last_counts for layer in layers]
        return {
            "tokens_per_expert": counts,
            "experts_idle": sum(c == 0 for row in counts for c in row),
            "tokens_dropped": sum(layer.last_dropped for layer in layers),
        }


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _dirichlet(gen: torch.Generator, k: int, alpha: float) -> torch.Tensor:
    # Gamma(alpha) samples through Marsaglia-Tsang are overkill here; -log(U)^(1/alpha) is a
    # cheap seeded stand-in with the same "few topics dominate" shape for alpha < 1.
    u = torch.rand(k, generator=gen).clamp_min(1e-6)
    w = (-u.log()) ** (1.0 / alpha)
    return w / w.sum()


def build_model(cfg: MoEConfig) -> nn.Module:
    return MoETransformer(cfg)


def _extras(cfg: MoEConfig, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 101)
    per = cfg.vocab // cfg.topics
    return {"transitions": [sparse_transition(gen, per, 3) for _ in range(cfg.topics)]}


FAMILY = Family(
    name="moe",
    description="Transformer LM with top-k gated MoE FFNs, capacity factor and token dropping",
    stands_for="Switch Transformer / GShard / Mixtral",
    dynamic="router picks experts per token; idle experts are skipped; overflow tokens dropped",
    config_cls=MoEConfig,
    presets={
        "tiny": MoEConfig(),
        "small": MoEConfig(vocab=512, dim=128, heads=4, layers=4, experts=8, ffn_hidden=512, batch=16,
                           seq_len=128, topics=8),
        "large": MoEConfig(vocab=8192, dim=1024, heads=16, layers=12, experts=16, ffn_hidden=4096, batch=32,
                           seq_len=1024, topics=16),
    },
    build_model=build_model,
    workload_cls=MoEWorkload,
    size_knob="batch",
    depth_knob="layers",
    extras=_extras,
)
