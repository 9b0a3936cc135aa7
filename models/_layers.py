"""Layers shared by the zoo's attention families.

Attention is written out (matmul, softmax, matmul) instead of calling a fused kernel so the
attention matrix is a real, saved activation whose size follows the sequence length: that is the
memory behaviour offloading has to cope with in the non-fused case.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Multi-head self-attention with an optional key-padding mask and an optional additive bias."""

    def __init__(self, dim: int, heads: int, gated: bool = False) -> None:
        super().__init__()
        assert dim % heads == 0, "dim must be divisible by heads"
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim) if gated else None

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [B, L, D]; key_padding_mask: [B, L] True where padded; bias: broadcastable to [B, H, L, L]
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d // self.heads))
        if bias is not None:
            scores = scores + bias
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        attn = scores.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, n, d)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x))
        return self.out(y)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block; ``ffn`` may be any module mapping [..., D] to [..., D]."""

    def __init__(self, dim: int, heads: int, ffn: nn.Module) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = ffn

    def forward(
        self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), key_padding_mask=key_padding_mask, bias=bias)
        return x + self.ffn(self.norm2(x))


def markov_tokens(
    gen: torch.Generator, transition: torch.Tensor, batch: int, length: int, start: torch.Tensor | None = None
) -> torch.Tensor:
    """Sample ``batch`` sequences of ``length`` tokens from a Markov chain (rows of ``transition`` sum to 1)."""
    vocab = transition.shape[0]
    out = torch.empty(batch, length, dtype=torch.long)
    cur = start if start is not None else torch.randint(0, vocab, (batch,), generator=gen)
    out[:, 0] = cur
    for i in range(1, length):
        cur = torch.multinomial(transition[cur], 1, generator=gen).squeeze(1)
        out[:, i] = cur
    return out


def sparse_transition(gen: torch.Generator, vocab: int, fanout: int) -> torch.Tensor:
    """A random Markov transition matrix where each token has ``fanout`` likely successors."""
    logits = torch.full((vocab, vocab), -4.0)
    succ = torch.randint(0, vocab, (vocab, fanout), generator=gen)
    logits.scatter_(1, succ, torch.rand(vocab, fanout, generator=gen) * 3.0 + 1.0)
    return logits.softmax(dim=1)
