"""``skipnet``: residual CNN whose blocks are skipped per sample by learned hard gates.

Stands for SkipNet (Wang et al., ECCV 2018) and other dynamic-depth networks (BlockDrop, ConvNet-AIG).

What is dynamic: before every gated residual block a small gate looks at the globally pooled
features and decides, per sample, whether to run the block (hard threshold at 0.5 in the forward
pass, gradient through the soft probability: the straight-through estimator). Only the samples
whose gate fired go through the block (gathered with ``index_select`` and scattered back), and a
block no sample needs is not run at all. A compute penalty on the gate probabilities pushes easy
samples to skip; the synthetic images mix easy (high-contrast) and hard (low-contrast) samples
with a long-tailed difficulty, so how much of the network runs varies per batch and over training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Family, ZooWorkload, positive_ints, require


@dataclass(kw_only=True)
class SkipNetConfig:
    """Configuration of the ``skipnet`` family."""

    widths: tuple[int, ...] = (8, 16)
    """Channels of each stage; a stride-2 transition block (always run) starts every stage but the first."""
    blocks_per_stage: int = 2
    """Gated residual blocks per stage."""
    image: int = 16
    """Image side in pixels."""
    classes: int = 10
    """Number of classes."""
    batch: int = 16
    """Images per batch."""
    gate_hidden: int = 8
    """Hidden width of each gate."""
    compute_penalty: float = 0.05
    """Weight of the mean gate probability in the loss (pushes towards skipping)."""

    def validate(self) -> None:
        positive_ints(self, "skipnet", "blocks_per_stage", "image", "classes", "batch", "gate_hidden")
        require(len(self.widths) >= 1 and all(isinstance(w, int) and w > 0 for w in self.widths),
                "skipnet", "widths", "a non-empty tuple of positive integers", self.widths)
        min_side = self.image // 2 ** (len(self.widths) - 1)
        require(min_side >= 2, "skipnet", "image", f">= {2 ** len(self.widths)} for {len(self.widths)} stages",
                self.image)
        require(self.compute_penalty >= 0, "skipnet", "compute_penalty", ">= 0", self.compute_penalty)


def _conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout)]


class Gate(nn.Module):
    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc2(F.relu(self.fc1(x.mean(dim=(2, 3)))))).squeeze(1)


class GatedBlock(nn.Module):
    def __init__(self, channels: int, gate_hidden: int) -> None:
        super().__init__()
        self.gate = Gate(channels, gate_hidden)
        self.body = nn.Sequential(*_conv_bn(channels, channels), nn.ReLU(), *_conv_bn(channels, channels))
        self.last_prob = torch.zeros(())
        self.last_executed = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.gate(x)
        self.last_prob = p
        idx = (p > 0.5).nonzero().squeeze(1)
        self.last_executed = int(idx.numel())
        if idx.numel() == 0:
            return x
        ps = p.index_select(0, idx)
        st = (ps - ps.detach() + 1.0).view(-1, 1, 1, 1)  # value 1, gradient of p: straight-through
        xs = x.index_select(0, idx)
        ys = F.relu(xs + st * self.body(xs))
        return x.index_copy(0, idx, ys)


class SkipNet(nn.Module):
    def __init__(self, cfg: SkipNetConfig) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, cfg.widths[0]), nn.ReLU())
        stages: list[nn.Module] = []
        cin = cfg.widths[0]
        for i, w in enumerate(cfg.widths):
            if i > 0:
                stages.append(nn.Sequential(*_conv_bn(cin, w, stride=2), nn.ReLU()))
            stages.extend(GatedBlock(w, cfg.gate_hidden) for _ in range(cfg.blocks_per_stage))
            cin = w
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(cin, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for m in self.stages:
            x = m(x)
        return self.head(x.mean(dim=(2, 3)))

    def gated(self) -> list[GatedBlock]:
        return [m for m in self.stages if isinstance(m, GatedBlock)]


class SkipNetWorkload(ZooWorkload):
    def _batch(self, gen: torch.Generator, step: int) -> dict:
        cfg: SkipNetConfig = self.config
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        # Long-tailed difficulty: most samples are clear, some are very noisy.
        contrast = (torch.rand(cfg.batch, generator=gen) ** 2).view(-1, 1, 1, 1) * 1.5 + 0.1
        noise = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=gen)
        images = self.extras["templates"][labels] * contrast + noise
        return {"images": images, "labels": labels}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        logits = model(batch["images"])
        ce = F.cross_entropy(logits, batch["labels"])
        gates = _unwrap(model).gated()
        usage = torch.stack([g.last_prob.mean() for g in gates]).mean()
        return ce + self.config.compute_penalty * usage

    def step_facts(self) -> dict:
        gates = _unwrap(self.model).gated()
        return {"samples_per_block": [g.last_executed for g in gates],
                "blocks_skipped": sum(g.last_executed == 0 for g in gates)}


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


def _extras(cfg: SkipNetConfig, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 202)
    coarse = torch.randn(cfg.classes, 3, 4, 4, generator=gen)
    templates = F.interpolate(coarse, size=(cfg.image, cfg.image), mode="bilinear", align_corners=False)
    return {"templates": templates}


FAMILY = Family(
    name="skipnet",
    description="Residual CNN with per-sample hard gates (straight-through) that skip blocks",
    stands_for="SkipNet / BlockDrop / ConvNet-AIG",
    dynamic="gates choose per sample which residual blocks run; blocks nobody needs are skipped",
    config_cls=SkipNetConfig,
    presets={
        "tiny": SkipNetConfig(),
        "small": SkipNetConfig(widths=(32, 64, 128), blocks_per_stage=3, image=32, batch=64, gate_hidden=16),
        "large": SkipNetConfig(widths=(128, 256, 512, 1024), blocks_per_stage=6, image=128, batch=128,
                               classes=1000, gate_hidden=64),
    },
    build_model=lambda cfg: SkipNet(cfg),
    workload_cls=SkipNetWorkload,
    size_knob="batch",
    depth_knob="blocks_per_stage",
    extras=_extras,
)
