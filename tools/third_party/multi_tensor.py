"""The networks of this folder trained with PyTorch's multi-tensor Adam (``foreach=True``), the
optimizer ``torch.optim.Adam`` picks by default for CUDA parameters (the CPU's default updates one
parameter at a time): ``tools/third_party/multi_tensor.py:moe_lm`` and so on, one function per
network. ``evaluate.py --optimizer foreach`` runs them, so that the CPU sees the optimizer a GPU run
does (each of its operators reads one state of every parameter at once).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _multi_tensor(name: str, preset: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"dynn_third_party_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    wl = module.build(preset)
    wl.optimizer = lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True)  # the workload default's lr
    return wl


def moe_lm(preset: str) -> Any:
    return _multi_tensor("moe_lm", preset)


def layerdrop_audio(preset: str) -> Any:
    return _multi_tensor("layerdrop_audio", preset)


def dynamic_gnn(preset: str) -> Any:
    return _multi_tensor("dynamic_gnn", preset)
