"""``early_exit``: multi-exit CNN (BranchyNet style) whose batch shrinks with depth.

Stands for BranchyNet (Teerapittayanon et al., 2016), MSDNet, and learned-exit models.

What is dynamic: after every stage an exit classifier predicts the class and a halting head
estimates the probability that this exit is already right. A sample leaves the network at an exit
when the classifier is confident (max softmax above ``threshold``, as BranchyNet does) or when the
halting decision, sampled with the halting probability, says so (exploration as in PonderNet's
training); later stages run only on the samples still present. Every exit is trained on the
samples that reach it and every halting head learns whether its exit's prediction is correct.
The sampling noise is part of the batch (``make_batch`` draws it), so a step is a pure function of
the seed. How many samples reach each stage varies per batch and drifts as training sharpens the
exits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ._common import Family, ZooWorkload, positive_ints, require


@dataclass(kw_only=True)
class EarlyExitConfig:
    """Configuration of the ``early_exit`` family."""

    widths: tuple[int, ...] = (8, 16, 32)
    """Channels of each stage; each stage halves the resolution after the first and ends in an exit."""
    convs_per_stage: int = 2
    """3x3 convolutions per stage."""
    image: int = 16
    """Image side in pixels."""
    classes: int = 10
    """Number of classes."""
    batch: int = 32
    """Images per batch."""
    threshold: float = 0.9
    """Confidence (max softmax) at which a sample leaves at an exit."""
    halt_init: float = 0.25
    """Initial halting probability of every exit (bias of the halting heads)."""

    def validate(self) -> None:
        positive_ints(self, "early_exit", "convs_per_stage", "image", "classes", "batch")
        require(len(self.widths) >= 2 and all(isinstance(w, int) and w > 0 for w in self.widths),
                "early_exit", "widths", "a tuple of at least two positive integers", self.widths)
        require(self.image // 2 ** (len(self.widths) - 1) >= 1, "early_exit", "image",
                f">= {2 ** (len(self.widths) - 1)}", self.image)
        require(0 < self.threshold <= 1, "early_exit", "threshold", "in (0, 1]", self.threshold)
        require(0 < self.halt_init < 1, "early_exit", "halt_init", "in (0, 1)", self.halt_init)


class Stage(nn.Module):
    def __init__(self, cin: int, cout: int, convs: int, downsample: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(convs):
            stride = 2 if (downsample and i == 0) else 1
            layers += [nn.Conv2d(cin if i == 0 else cout, cout, 3, stride=stride, padding=1, bias=False),
                       nn.BatchNorm2d(cout), nn.ReLU()]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Exit(nn.Module):
    def __init__(self, channels: int, classes: int, halt_init: float) -> None:
        super().__init__()
        self.classifier = nn.Linear(channels, classes)
        self.halt = nn.Linear(channels, 1)
        nn.init.constant_(self.halt.bias, math.log(halt_init / (1 - halt_init)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pooled = x.mean(dim=(2, 3))
        # The halting head reads detached features: learning when to stop must not bend the trunk.
        return self.classifier(pooled), torch.sigmoid(self.halt(pooled.detach())).squeeze(1)


class MultiExitNet(nn.Module):
    def __init__(self, cfg: EarlyExitConfig) -> None:
        super().__init__()
        self.threshold = cfg.threshold
        self.stages = nn.ModuleList()
        self.exits = nn.ModuleList()
        cin = 3
        for i, w in enumerate(cfg.widths):
            self.stages.append(Stage(cin, w, cfg.convs_per_stage, downsample=i > 0))
            self.exits.append(Exit(w, cfg.classes, cfg.halt_init))
            cin = w
        self.last_sizes: list[int] = []

    def forward(self, images: torch.Tensor, labels: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Return the summed training loss of all exits; records how many samples reached each stage."""
        alive = torch.arange(images.shape[0], device=images.device)
        x, total, sizes = images, images.new_zeros(()), []
        last = len(self.stages) - 1
        for i, (stage, exit_) in enumerate(zip(self.stages, self.exits)):
            sizes.append(int(alive.numel()))
            x = stage(x)
            logits, halt = exit_(x)
            y = labels.index_select(0, alive)
            total = total + F.cross_entropy(logits, y, reduction="sum")
            if i == last:
                break
            with torch.no_grad():
                correct = (logits.argmax(dim=1) == y).to(halt.dtype)
                confident = logits.softmax(dim=1).amax(dim=1) >= self.threshold
                leave = confident | (noise[i].index_select(0, alive) < halt)
            total = total + F.binary_cross_entropy(halt, correct, reduction="sum")
            stay = (~leave).nonzero().squeeze(1)
            if stay.numel() == 0:
                break
            alive = alive.index_select(0, stay)
            x = x.index_select(0, stay)
        self.last_sizes = sizes
        return total / images.shape[0]


class EarlyExitWorkload(ZooWorkload):
    def _batch(self, gen: torch.Generator, step: int) -> dict:
        cfg: EarlyExitConfig = self.config
        labels = torch.randint(0, cfg.classes, (cfg.batch,), generator=gen)
        contrast = (torch.rand(cfg.batch, generator=gen) ** 2).view(-1, 1, 1, 1) * 1.5 + 0.1
        noise = torch.randn(cfg.batch, 3, cfg.image, cfg.image, generator=gen)
        images = self.extras["templates"][labels] * contrast + noise
        exit_noise = torch.rand(len(cfg.widths), cfg.batch, generator=gen)
        return {"images": images, "labels": labels, "exit_noise": exit_noise}

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return model(batch["images"], batch["labels"], batch["exit_noise"])

    def step_facts(self) -> dict:
        return {"samples_per_stage": list(getattr(self.model, "module", self.model).last_sizes)}


def _extras(cfg: EarlyExitConfig, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 303)
    coarse = torch.randn(cfg.classes, 3, 4, 4, generator=gen)
    return {"templates": F.interpolate(coarse, size=(cfg.image, cfg.image), mode="bilinear", align_corners=False)}


FAMILY = Family(
    name="early_exit",
    description="Multi-exit CNN (BranchyNet): confident samples leave early, the batch shrinks with depth",
    stands_for="BranchyNet / MSDNet / learned early exits",
    dynamic="samples leave at exits by confidence or sampled halting; later stages see fewer samples",
    config_cls=EarlyExitConfig,
    presets={
        "tiny": EarlyExitConfig(),
        "small": EarlyExitConfig(widths=(32, 64, 128, 256), convs_per_stage=2, image=32, batch=64),
        "large": EarlyExitConfig(widths=(128, 256, 512, 1024, 2048), convs_per_stage=4, image=128, batch=256,
                                 classes=1000),
    },
    build_model=lambda cfg: MultiExitNet(cfg),
    workload_cls=EarlyExitWorkload,
    size_knob="batch",
    depth_knob="convs_per_stage",
    extras=_extras,
)
