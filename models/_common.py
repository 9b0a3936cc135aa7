"""Shared machinery of the zoo: family registry entries, config validation, the workload object."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dynn_runtime.errors import ConfigError

PRESETS = ("tiny", "small", "large")


def require(cond: bool, family: str, fld: str, expected: str, value: Any) -> None:
    """Raise a ConfigError naming the family, the field, what was expected and what was found."""
    if not cond:
        raise ConfigError(f"models.{family}: config field {fld!r} must be {expected}, got {value!r}.")


def positive_ints(cfg: Any, family: str, *names: str) -> None:
    for n in names:
        v = getattr(cfg, n)
        require(isinstance(v, int) and not isinstance(v, bool) and v > 0, family, n, "a positive integer", v)


@dataclass
class Family:
    """A zoo family: its config class, presets and builder."""

    name: str
    description: str
    stands_for: str
    config_cls: type
    presets: dict[str, Any]
    build_model: Callable[[Any], nn.Module]
    workload_cls: type
    #: the config field that scales the family's memory ("batch", "width", "residues", ...)
    size_knob: str
    dynamic: str = ""
    #: the config field that sets the model's depth (layers, blocks), scanned by ``dynn bench
    #: --max-size-knob depth``; None when depth is not a config field (the Tree-LSTM's comes from the data)
    depth_knob: str | None = None
    #: data the generator needs that is fixed per (config, seed), e.g. class templates
    extras: Callable[[Any, int], dict] | None = None

    def config(self, preset: str, **overrides: Any) -> Any:
        from dynn_runtime.errors import WorkloadError

        if preset not in self.presets:
            raise WorkloadError(
                f"models.{self.name}: unknown preset {preset!r}; choices: {', '.join(self.presets)}."
            )
        base = self.presets[preset]
        names = {f.name for f in dataclasses.fields(base)}
        bad = sorted(set(overrides) - names)
        if bad:
            raise ConfigError(
                f"models.{self.name}: unknown config field(s) {bad}; fields are {sorted(names)}."
            )
        cfg = dataclasses.replace(base, **overrides)
        cfg.validate()
        return cfg


@dataclass
class ZooWorkload:
    """A zoo workload: model, seeded dynamic batches, loss, optimizer default.

    Subclasses implement ``_batch(gen, step)`` and ``loss``. ``make_batch(step)`` is a pure
    function of (seed, step): the same step always yields the same batch.
    """

    family: str
    preset: str
    config: Any
    seed: int
    model: nn.Module
    lr: float = 1e-3
    extras: dict = field(default_factory=dict)

    def make_batch(self, step: int) -> Any:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7919 + 17)
        return self._batch(gen, step)

    def _batch(self, gen: torch.Generator, step: int) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=self.lr)

    def step_facts(self) -> dict:
        """What the last step did that varies between steps (experts used, blocks run, exits...)."""
        return {}

    def describe_config(self) -> dict:
        return dataclasses.asdict(self.config)
