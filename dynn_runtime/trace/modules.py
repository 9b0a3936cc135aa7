"""Which module is running: shared by the trace recorder and the live runtime.

Forward: global module pre/post hooks keep a stack of module paths. Backward: the forward post
hook tags the autograd nodes a module created (a walk from its outputs that stops at nodes
already tagged by inner modules), and :meth:`ModuleTracker.current` reads the tag of the node the
engine is executing (``torch._C._current_autograd_node()``). Paths are interned to small ints;
``on_new`` is told of each new one (the recorder writes an ``M`` record).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["ModuleTracker", "NODE_TAG"]

NODE_TAG = "dynn_module"


class ModuleTracker:
    def __init__(self, model: nn.Module, on_new: Callable[[int, str], None] | None = None) -> None:
        self.names = {m: name for name, m in model.named_modules()}
        self.paths: list[str] = [""]
        self._ids: dict[str, int] = {"": 0}
        self._stack: list[str] = []
        self._handles: list[Any] = []
        self._on_new = on_new
        #: called with the root module's forward pre hook (a new forward pass starts)
        self.on_root_forward: Callable[[], None] | None = None
        #: called with the interned path of the module that runs now, as modules enter and leave
        self.on_module: Callable[[int], None] | None = None
        #: autograd node sequence number -> interned path of the module whose forward made it
        self.node_modules: dict[int, int] = {}
        self._root = model

    def module_id(self, path: str) -> int:
        mid = self._ids.get(path)
        if mid is None:
            mid = len(self.paths)
            self._ids[path] = mid
            self.paths.append(path)
            if self._on_new is not None:
                self._on_new(mid, path)
        return mid

    def install(self) -> None:
        if not self._handles:
            self._handles = [
                nn.modules.module.register_module_forward_pre_hook(self._pre_hook),
                nn.modules.module.register_module_forward_hook(self._post_hook),
            ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack.clear()

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if module is self._root and not self._stack and self.on_root_forward is not None:
            self.on_root_forward()
        self._stack.append(self.names.get(module, type(module).__name__))
        if self.on_module is not None:
            self.on_module(self.module_id(self._stack[-1]))

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        path = self._stack.pop() if self._stack else ""
        if self.on_module is not None:
            self.on_module(self.module_id(self._stack[-1]) if self._stack else 0)
        if torch.is_grad_enabled():
            mid = self.module_id(path)
            flat, _ = tree_flatten(output)
            stack = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            while stack:
                node = stack.pop()
                if node is None or NODE_TAG in node.metadata or node.name() == "torch::autograd::AccumulateGrad":
                    continue
                node.metadata[NODE_TAG] = mid
                self.node_modules[node._sequence_nr()] = mid
                stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def current(self, backward: bool) -> int:
        """Interned path of the running module (0: none)."""
        if backward:
            node = torch._C._current_autograd_node()
            return node.metadata.get(NODE_TAG, 0) if node is not None else 0
        return self.module_id(self._stack[-1]) if self._stack else 0
