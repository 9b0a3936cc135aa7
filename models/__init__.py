"""The zoo of dynamic neural networks used to evaluate dynn-runtime.

Six families, each dynamic during training, each with a config dataclass and presets
``tiny`` (CPU tests), ``small`` (CPU benchmarks) and ``large`` (GPU scale)::

    >>> from dynn_runtime import models
    >>> sorted(models.FAMILIES)
    ['early_exit', 'evoformer', 'moe', 'skipnet', 'tree_lstm', 'varlen']
    >>> wl = models.build("moe", preset="tiny", seed=0)
    >>> loss = wl.loss(wl.model, wl.make_batch(0))
"""

from __future__ import annotations

from typing import Any

import torch

from dynn_runtime.errors import WorkloadError

from . import early_exit, evoformer, moe, skipnet, tree_lstm, varlen
from ._common import PRESETS, Family, ZooWorkload

__all__ = ["FAMILIES", "PRESETS", "Family", "ZooWorkload", "build", "family"]

FAMILIES: dict[str, Family] = {
    m.FAMILY.name: m.FAMILY for m in (moe, skipnet, early_exit, tree_lstm, evoformer, varlen)
}


def family(name: str) -> Family:
    """The zoo family called ``name``; a WorkloadError lists the choices otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise WorkloadError(
            f"models: unknown workload {name!r}. Zoo families: {', '.join(FAMILIES)}; "
            "or give your own as path/to/file.py:function (see `dynn train --help`)."
        ) from None


def build(name: str, preset: str = "tiny", seed: int = 0, **overrides: Any) -> ZooWorkload:
    """Build the workload of family ``name`` at ``preset``; ``overrides`` replace config fields."""
    fam = family(name)
    cfg = fam.config(preset, **overrides)
    # The model's initial weights depend on the seed alone, not on the global RNG state.
    fork_devices: list = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = fam.build_model(cfg)
    extras = fam.extras(cfg, seed) if fam.extras is not None else {}
    return fam.workload_cls(family=fam.name, preset=preset, config=cfg, seed=seed, model=model, extras=extras)
