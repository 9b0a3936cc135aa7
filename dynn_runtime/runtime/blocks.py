"""Repeated blocks of a model, and wrapping them in ``torch.utils.checkpoint`` (the live ``checkpoint``
policy, and the ``checkpoint`` baseline of ``dynn bench --real``)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def repeated_blocks(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """The blocks of ``model``'s outermost ``nn.ModuleList`` objects (the repeated blocks; lists
    nested in a block are not separate) and those lists' names."""
    lists: list[str] = []
    blocks: list[nn.Module] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(w + ".") for w in lists):
            lists.append(name)
            blocks.extend(m)
    return lists, blocks


def checkpoint_modules(modules: list[nn.Module]) -> None:
    """Run each module's forward under non-reentrant ``torch.utils.checkpoint`` when gradients are
    on (an instance attribute over the class's forward: ``del m.forward`` undoes it)."""

    from torch.utils.checkpoint import checkpoint

    def run(fwd: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fwd(*args, **kwargs)
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    for m in modules:
        m.forward = functools.partial(run, m.forward)


def _checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """Checkpoint every repeated block; a model without one is checkpointed per top-level child."""
    blocks = repeated_blocks(model)[1]
    if not blocks:
        blocks = [c for c in model.children() if any(p.requires_grad for p in c.parameters())]
    checkpoint_modules(blocks)
    return blocks


def _is_compiled(model: nn.Module) -> bool:
    for m in model.modules():
        if type(m).__name__ == "OptimizedModule" or hasattr(m, "_orig_mod"):
            return True
        fwd = getattr(m, "forward", None)
        if fwd is not None and hasattr(fwd, "_torchdynamo_orig_callable"):
            return True
    return False
