"""Which module is running: shared by the trace recorder and the live runtime.

Forward: global module pre/post hooks keep a stack of interned module ids. Backward: the forward post
hook tags the autograd nodes a module created (a walk from its outputs that stops at nodes already
tagged by inner modules) in ``node_modules`` (autograd sequence number -> module id), and
:meth:`ModuleTracker.current` reads the tag of the node the engine is executing
(``torch._C._current_autograd_node()``). The walk is Python's, which also tags each node's
``metadata``, or given as ``tagger`` (``dynn_runtime._C.tag_nodes``, csrc/modules.cpp: the same walk
with ``node_modules`` as its only tags). Paths are interned to small ints; ``on_new`` is told of each
new one (the recorder writes an ``M`` record). :meth:`ModuleTracker.prune` forgets the tags of nodes
made before the previous call (a training loop calls it once a step).
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
    def __init__(self, model: nn.Module, on_new: Callable[[int, str], None] | None = None,
                 tagger: Callable[..., int] | None = None) -> None:
        self.names = {m: name for name, m in model.named_modules()}
        #: the model's modules' interned ids, filled as each first runs
        self._mids: dict[nn.Module, int] = {}
        self._tagger = tagger
        self._hi = -1  # the largest sequence number tagged so far
        self._cut = -1  # prune() forgets tags at or below it
        self.paths: list[str] = [""]
        self._ids: dict[str, int] = {"": 0}
        self._stack: list[int] = []
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

    @property
    def installed(self) -> bool:
        """Whether the global module hooks are in place."""
        return bool(self._handles)

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

    def _mid_of(self, module: nn.Module) -> int:
        mid = self._mids.get(module)
        if mid is None:
            path = self.names.get(module)
            if path is None:  # not the model's: by its type's name, not kept (it may be made per call)
                return self.module_id(type(module).__name__)
            mid = self._mids[module] = self.module_id(path)
        return mid

    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        if module is self._root and not self._stack and self.on_root_forward is not None:
            self.on_root_forward()
        mid = self._mid_of(module)
        self._stack.append(mid)
        if self.on_module is not None:
            self.on_module(mid)

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        stack = self._stack
        mid = stack.pop() if stack else 0
        if self.on_module is not None:
            self.on_module(stack[-1] if stack else 0)
        if not torch.is_grad_enabled():
            return
        tagger = self._tagger
        if tagger is not None:
            hi = tagger(output, mid, self.node_modules)
            if hi < -1:  # -2 (modules.cpp kUnknown): a type the walk does not descend into; pytree flattens
                hi = tagger(tree_flatten(output)[0], mid, self.node_modules, False)
            if hi > self._hi:
                self._hi = hi
            return
        flat, _ = tree_flatten(output)
        stack = [t.grad_fn for t in flat if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or NODE_TAG in node.metadata or node.name() == "torch::autograd::AccumulateGrad":
                continue
            node.metadata[NODE_TAG] = mid
            seq = node._sequence_nr()
            self.node_modules[seq] = mid
            if seq > self._hi:
                self._hi = seq
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)

    def prune(self) -> None:
        """Forget the tags of the nodes tagged before the previous call: ``node_modules`` holds the
        graphs of at most the last two calls' intervals (a step's backward reads its own forward's)."""
        cut, self._cut = self._cut, self._hi
        if cut >= 0 and self.node_modules:
            self.node_modules = {k: v for k, v in self.node_modules.items() if k > cut}

    def current(self, backward: bool) -> int:
        """Interned path of the running module (0: none)."""
        if backward:
            node = torch._C._current_autograd_node()
            if node is None:
                return 0
            if self._tagger is not None:
                return self.node_modules.get(node._sequence_nr(), 0)
            return node.metadata.get(NODE_TAG, 0)
        return self._stack[-1] if self._stack else 0
