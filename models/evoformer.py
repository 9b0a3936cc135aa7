"""``evoformer``: AlphaFold-style Evoformer-lite with recycling, trained on distograms.

Stands for the Evoformer trunk of AlphaFold 2 (Jumper et al., 2021) and its reimplementations
(OpenFold, FastFold), the workload whose memory DyNN-Offload, DTR and UVM are compared on.

What is dynamic: each step samples a crop size (the number of residues; pair activations grow with
its square, triangle attention with its cube) and a number of recycling iterations in
``[min_recycles, max_recycles]`` (AlphaFold samples 1 to 4 during training). All but the last
recycling pass run without gradient and feed their pair and first-MSA-row outputs back into the
next pass, so the graph kept for backward is one pass, while time, peak memory and which tensors
live across passes depend on the sample.

One block: MSA row attention with pair bias, MSA column attention, MSA transition, outer-product
mean into the pair, triangle multiplicative updates (outgoing, incoming), triangle attention
(starting node, ending node), pair transition. The synthetic protein is a persistent random walk
in 3-D (3.8 Angstrom steps); the MSA holds mutated copies of its sequence; the target is the
binned distance map.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Family, ZooWorkload, positive_ints, require
from ._layers import Attention

AMINO = 21  # 20 amino acids + gap


@dataclass(kw_only=True)
class EvoformerConfig:
    """Configuration of the ``evoformer`` family."""

    msa_seqs: int = 4
    """Sequences in the MSA."""
    residues_min: int = 8
    """Smallest crop (residues)."""
    residues_max: int = 16
    """Largest crop (residues)."""
    c_m: int = 16
    """MSA channels."""
    c_z: int = 8
    """Pair channels."""
    heads: int = 2
    """Attention heads (MSA and triangle attention)."""
    blocks: int = 2
    """Evoformer blocks."""
    c_hidden: int = 8
    """Hidden width of outer-product mean and triangle multiplication."""
    min_recycles: int = 1
    """Fewest passes through the trunk per step."""
    max_recycles: int = 4
    """Most passes through the trunk per step."""
    bins: int = 16
    """Distogram bins."""
    batch: int = 1
    """Proteins per batch (all cropped to the same size)."""

    def validate(self) -> None:
        positive_ints(self, "evoformer", "msa_seqs", "residues_min", "residues_max", "c_m", "c_z", "heads",
                      "blocks", "c_hidden", "min_recycles", "max_recycles", "bins", "batch")
        require(self.residues_min <= self.residues_max, "evoformer", "residues_min",
                f"<= residues_max={self.residues_max}", self.residues_min)
        require(self.min_recycles <= self.max_recycles, "evoformer", "min_recycles",
                f"<= max_recycles={self.max_recycles}", self.min_recycles)
        require(self.c_m % self.heads == 0, "evoformer", "c_m", f"divisible by heads={self.heads}", self.c_m)
        require(self.c_z % self.heads == 0, "evoformer", "c_z", f"divisible by heads={self.heads}", self.c_z)
        require(self.residues_min >= 2, "evoformer", "residues_min", ">= 2", self.residues_min)


class Transition(nn.Module):
    def __init__(self, c: int, factor: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c)
        self.up = nn.Linear(c, c * factor)
        self.down = nn.Linear(c * factor, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(self.norm(x))))


class MSARowAttention(nn.Module):
    """Attention along residues within each MSA row, biased by the pair representation."""

    def __init__(self, c_m: int, c_z: int, heads: int) -> None:
        super().__init__()
        self.norm_m = nn.LayerNorm(c_m)
        self.norm_z = nn.LayerNorm(c_z)
        self.bias = nn.Linear(c_z, heads, bias=False)
        self.attn = Attention(c_m, heads, gated=True)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        b, s, r, c = m.shape
        bias = self.bias(self.norm_z(z)).permute(0, 3, 1, 2)  # [B, H, R, R]
        bias = bias.unsqueeze(1).expand(b, s, *bias.shape[1:]).reshape(b * s, *bias.shape[1:])
        return self.attn(self.norm_m(m).reshape(b * s, r, c), bias=bias).view(b, s, r, c)


class MSAColumnAttention(nn.Module):
    """Attention along sequences within each MSA column."""

    def __init__(self, c_m: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.attn = Attention(c_m, heads, gated=True)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        b, s, r, c = m.shape
        mt = self.norm(m).transpose(1, 2).reshape(b * r, s, c)
        return self.attn(mt).view(b, r, s, c).transpose(1, 2)


class OuterProductMean(nn.Module):
    def __init__(self, c_m: int, c_z: int, c_hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c_m)
        self.a = nn.Linear(c_m, c_hidden)
        self.b = nn.Linear(c_m, c_hidden)
        self.out = nn.Linear(c_hidden * c_hidden, c_z)

    def forward(self, m: torch.Tensor) -> torch.Tensor:
        mn = self.norm(m)
        a, b = self.a(mn), self.b(mn)
        outer = torch.einsum("bsic,bsjd->bijcd", a, b) / m.shape[1]
        return self.out(outer.flatten(-2))


class TriangleMultiplication(nn.Module):
    def __init__(self, c_z: int, c_hidden: int, outgoing: bool) -> None:
        super().__init__()
        self.outgoing = outgoing
        self.norm_in = nn.LayerNorm(c_z)
        self.proj = nn.Linear(c_z, 4 * c_hidden)  # a, b and their gates
        self.norm_out = nn.LayerNorm(c_hidden)
        self.out = nn.Linear(c_hidden, c_z)
        self.gate = nn.Linear(c_z, c_z)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        zn = self.norm_in(z)
        a, ga, b, gb = self.proj(zn).chunk(4, dim=-1)
        a, b = a * torch.sigmoid(ga), b * torch.sigmoid(gb)
        if self.outgoing:
            x = torch.einsum("bikc,bjkc->bijc", a, b)
        else:
            x = torch.einsum("bkic,bkjc->bijc", a, b)
        return torch.sigmoid(self.gate(zn)) * self.out(self.norm_out(x))


class TriangleAttention(nn.Module):
    def __init__(self, c_z: int, heads: int, starting: bool) -> None:
        super().__init__()
        self.starting = starting
        self.norm = nn.LayerNorm(c_z)
        self.bias = nn.Linear(c_z, heads, bias=False)
        self.attn = Attention(c_z, heads, gated=True)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if not self.starting:
            z = z.transpose(1, 2)
        b, r, _, c = z.shape
        zn = self.norm(z)
        bias = self.bias(zn).permute(0, 3, 1, 2)  # [B, H, R, R], shared by all rows i
        bias = bias.unsqueeze(1).expand(b, r, *bias.shape[1:]).reshape(b * r, *bias.shape[1:])
        out = self.attn(zn.reshape(b * r, r, c), bias=bias).view(b, r, r, c)
        return out if self.starting else out.transpose(1, 2)


class EvoformerBlock(nn.Module):
    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.row = MSARowAttention(cfg.c_m, cfg.c_z, cfg.heads)
        self.col = MSAColumnAttention(cfg.c_m, cfg.heads)
        self.msa_transition = Transition(cfg.c_m)
        self.opm = OuterProductMean(cfg.c_m, cfg.c_z, cfg.c_hidden)
        self.tri_out = TriangleMultiplication(cfg.c_z, cfg.c_hidden, outgoing=True)
        self.tri_in = TriangleMultiplication(cfg.c_z, cfg.c_hidden, outgoing=False)
        self.tri_start = TriangleAttention(cfg.c_z, cfg.heads, starting=True)
        self.tri_end = TriangleAttention(cfg.c_z, cfg.heads, starting=False)
        self.pair_transition = Transition(cfg.c_z)

    def forward(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = m + self.row(m, z)
        m = m + self.col(m)
        m = m + self.msa_transition(m)
        z = z + self.opm(m)
        z = z + self.tri_out(z)
        z = z + self.tri_in(z)
        z = z + self.tri_start(z)
        z = z + self.tri_end(z)
        z = z + self.pair_transition(z)
        return m, z


class Evoformer(nn.Module):
    RELPOS = 32

    def __init__(self, cfg: EvoformerConfig) -> None:
        super().__init__()
        self.msa_embed = nn.Linear(AMINO, cfg.c_m)
        self.target_embed = nn.Linear(AMINO, cfg.c_m)
        self.left = nn.Linear(AMINO, cfg.c_z)
        self.right = nn.Linear(AMINO, cfg.c_z)
        self.relpos = nn.Embedding(2 * self.RELPOS + 1, cfg.c_z)
        self.recycle_norm_m = nn.LayerNorm(cfg.c_m)
        self.recycle_norm_z = nn.LayerNorm(cfg.c_z)
        self.blocks = nn.ModuleList(EvoformerBlock(cfg) for _ in range(cfg.blocks))
        self.distogram = nn.Linear(cfg.c_z, cfg.bins)
        self.last_recycles = 0

    def embed(self, msa: torch.Tensor, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        msa1h = F.one_hot(msa, AMINO).to(self.msa_embed.weight.dtype)
        seq1h = F.one_hot(seq, AMINO).to(self.msa_embed.weight.dtype)
        m = self.msa_embed(msa1h) + self.target_embed(seq1h).unsqueeze(1)
        r = seq.shape[1]
        idx = torch.arange(r, device=seq.device)
        rel = (idx[None, :] - idx[:, None]).clamp(-self.RELPOS, self.RELPOS) + self.RELPOS
        z = self.left(seq1h)[:, :, None] + self.right(seq1h)[:, None, :] + self.relpos(rel)
        return m, z

    def trunk(self, m: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for blk in self.blocks:
            m, z = blk(m, z)
        return m, z

    def forward(self, msa: torch.Tensor, seq: torch.Tensor, recycles: int) -> torch.Tensor:
        m0, z0 = self.embed(msa, seq)
        prev_m = torch.zeros_like(m0[:, 0])
        prev_z = torch.zeros_like(z0)
        for cycle in range(recycles):
            last = cycle == recycles - 1
            with torch.set_grad_enabled(last and torch.is_grad_enabled()):
                m = torch.cat([(m0[:, :1] + self.recycle_norm_m(prev_m).unsqueeze(1)), m0[:, 1:]], dim=1)
                z = z0 + self.recycle_norm_z(prev_z)
                m, z = self.trunk(m, z)
            if not last:
                prev_m, prev_z = m[:, 0].detach(), z.detach()
        self.last_recycles = recycles
        return self.distogram(z + z.transpose(1, 2))


class EvoformerWorkload(ZooWorkload):
    def _batch(self, gen: torch.Generator, step: int) -> dict:
        cfg: EvoformerConfig = self.config
        r = int(torch.randint(cfg.residues_min, cfg.residues_max + 1, (), generator=gen))
        recycles = int(torch.randint(cfg.min_recycles, cfg.max_recycles + 1, (), generator=gen))
        seqs, msas, dists = [], [], []
        for _ in range(cfg.batch):
            full = r + int(torch.randint(0, r + 1, (), generator=gen))
            coords = _protein_walk(gen, full)
            seq_full = torch.randint(0, AMINO - 1, (full,), generator=gen)
            start = int(torch.randint(0, full - r + 1, (), generator=gen))
            seq = seq_full[start : start + r]
            xyz = coords[start : start + r]
            rate = torch.rand(cfg.msa_seqs, 1, generator=gen) * 0.6  # per-sequence divergence
            mutate = torch.rand(cfg.msa_seqs, r, generator=gen) < rate
            msa = torch.where(mutate, torch.randint(0, AMINO, (cfg.msa_seqs, r), generator=gen), seq.expand(cfg.msa_seqs, r))
            msa[0] = seq
            seqs.append(seq)
            msas.append(msa)
            dists.append(torch.cdist(xyz, xyz))
        edges = torch.linspace(2.0, 22.0, cfg.bins - 1)
        return {
            "msa": torch.stack(msas),
            "seq": torch.stack(seqs),
            "target": torch.bucketize(torch.stack(dists), edges),
            "recycles": recycles,
        }

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["msa"], batch["seq"], batch["recycles"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["target"].reshape(-1))

    def step_facts(self) -> dict:
        return dict(self.extras.get("last", {}))

    def make_batch(self, step: int) -> dict:
        b = super().make_batch(step)
        self.extras["last"] = {"residues": int(b["seq"].shape[1]), "recycles": b["recycles"]}
        return b


def _protein_walk(gen: torch.Generator, n: int) -> torch.Tensor:
    """C-alpha trace as a persistent random walk with 3.8 Angstrom steps."""
    steps = torch.empty(n, 3)
    d = F.normalize(torch.randn(3, generator=gen), dim=0)
    for i in range(n):
        d = F.normalize(d + 0.8 * torch.randn(3, generator=gen), dim=0)
        steps[i] = d
    return torch.cumsum(steps * 3.8, dim=0)


FAMILY = Family(
    name="evoformer",
    description="AlphaFold-style Evoformer-lite: MSA/pair attention, triangle updates, sampled recycling",
    stands_for="AlphaFold 2 Evoformer (OpenFold / FastFold)",
    dynamic="crop size (pair memory ~ residues^2) and recycling count (1-4) sampled per step",
    config_cls=EvoformerConfig,
    presets={
        "tiny": EvoformerConfig(),
        "small": EvoformerConfig(msa_seqs=16, residues_min=48, residues_max=80, c_m=32, c_z=16, heads=4,
                                 blocks=3, c_hidden=16),
        "large": EvoformerConfig(msa_seqs=64, residues_min=128, residues_max=192, c_m=256, c_z=128, heads=8,
                                 blocks=4, c_hidden=32),
    },
    build_model=lambda cfg: Evoformer(cfg),
    workload_cls=EvoformerWorkload,
    size_knob="residues_max",
    depth_knob="blocks",
)
