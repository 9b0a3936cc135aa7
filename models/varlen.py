"""``varlen``: Transformer encoder over variable-length sequences with long-tailed lengths.

Stands for BERT-style encoders trained with dynamic padding (each batch padded to its own longest
sequence), the common case for speech, text and code corpora.

What is dynamic: sequence lengths follow a log-normal distribution clipped to
``[min_len, max_len]`` (most sequences short, a few very long); every batch is padded only to its
own longest sequence, so activation shapes, and the attention matrices that grow with the square
of the length, change from batch to batch. The task is masked-token prediction over sequences
from a sparse Markov chain; the number of masked positions changes too.
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
class VarLenConfig:
    """Configuration of the ``varlen`` family."""

    vocab: int = 64
    """Vocabulary size (the last id is the mask token, id ``vocab - 2`` is padding)."""
    dim: int = 32
    """Model width."""
    heads: int = 2
    """Attention heads."""
    layers: int = 2
    """Encoder blocks."""
    ffn_hidden: int = 64
    """Feed-forward hidden width."""
    batch: int = 8
    """Sequences per batch."""
    median_len: int = 12
    """Median sequence length."""
    length_sigma: float = 0.8
    """Log-normal spread of lengths (larger: longer tail)."""
    min_len: int = 4
    """Shortest sequence."""
    max_len: int = 64
    """Longest sequence."""
    mask_prob: float = 0.15
    """Fraction of tokens masked for prediction."""

    def validate(self) -> None:
        positive_ints(self, "varlen", "vocab", "dim", "heads", "layers", "ffn_hidden", "batch", "median_len",
                      "min_len", "max_len")
        require(self.dim % self.heads == 0, "varlen", "dim", f"divisible by heads={self.heads}", self.dim)
        require(self.min_len <= self.max_len, "varlen", "min_len", f"<= max_len={self.max_len}", self.min_len)
        require(0 < self.mask_prob < 1, "varlen", "mask_prob", "in (0, 1)", self.mask_prob)
        require(self.length_sigma >= 0, "varlen", "length_sigma", ">= 0", self.length_sigma)
        require(self.vocab >= 8, "varlen", "vocab", ">= 8", self.vocab)


class Encoder(nn.Module):
    def __init__(self, cfg: VarLenConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, FeedForward(cfg.dim, cfg.ffn_hidden)) for _ in range(cfg.layers)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = blk(x, key_padding_mask=padding)
        return self.head(self.norm(x))


class VarLenWorkload(ZooWorkload):
    def _batch(self, gen: torch.Generator, step: int) -> dict:
        cfg: VarLenConfig = self.config
        pad_id, mask_id = cfg.vocab - 2, cfg.vocab - 1
        z = torch.randn(cfg.batch, generator=gen)
        lengths = (math.log(cfg.median_len) + cfg.length_sigma * z).exp().round().long()
        lengths = lengths.clamp(cfg.min_len, cfg.max_len)
        width = int(lengths.max())
        seqs = markov_tokens(gen, self.extras["transition"], cfg.batch, width)
        padding = torch.arange(width)[None, :] >= lengths[:, None]
        masked = (torch.rand(cfg.batch, width, generator=gen) < cfg.mask_prob) & ~padding
        masked[torch.arange(cfg.batch), (lengths - 1).clamp_min(0)] = True  # at least one target per row
        inputs = seqs.masked_fill(masked, mask_id).masked_fill(padding, pad_id)
        return {"inputs": inputs, "targets": seqs, "padding": padding, "masked": masked, "lengths": lengths}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["inputs"], batch["padding"])
        sel = batch["masked"]
        return F.cross_entropy(logits[sel], batch["targets"][sel])

    def step_facts(self) -> dict:
        return dict(self.extras.get("last", {}))

    def make_batch(self, step: int) -> dict:
        b = super().make_batch(step)
        self.extras["last"] = {"padded_len": int(b["inputs"].shape[1]), "lengths": b["lengths"].tolist()}
        return b


def _extras(cfg: VarLenConfig, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 606)
    # Real tokens are 0 .. vocab-3; padding and mask ids are never generated.
    return {"transition": sparse_transition(gen, cfg.vocab - 2, 3)}


FAMILY = Family(
    name="varlen",
    description="Transformer encoder (masked-token task) over long-tailed variable-length sequences",
    stands_for="BERT-style encoders with dynamic padding",
    dynamic="padded length per batch follows a long-tailed length distribution; attention ~ length^2",
    config_cls=VarLenConfig,
    presets={
        "tiny": VarLenConfig(),
        "small": VarLenConfig(vocab=1024, dim=128, heads=4, layers=4, ffn_hidden=512, batch=16, median_len=48,
                              max_len=256),
        "large": VarLenConfig(vocab=32000, dim=1024, heads=16, layers=24, ffn_hidden=4096, batch=32,
                              median_len=512, length_sigma=0.7, max_len=4096),
    },
    build_model=lambda cfg: Encoder(cfg),
    workload_cls=VarLenWorkload,
    size_knob="batch",
    depth_knob="layers",
    extras=_extras,
)
