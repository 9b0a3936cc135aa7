"""ModuleTracker: the native walk of a module's autograd nodes (csrc/modules.cpp) tags what Python's does."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from dynn_runtime import models
from dynn_runtime.runtime.events import native_module
from dynn_runtime.trace.modules import ModuleTracker
from dynn_runtime.workload import load_workload

_C = native_module()
needs_native = pytest.mark.skipif(_C is None, reason="dynn_runtime._C is not built")


def _tags(tracker: ModuleTracker) -> dict[int, str]:
    return {seq: tracker.paths[mid] for seq, mid in tracker.node_modules.items()}


def _both(model: nn.Module, run) -> tuple[dict[int, str], dict[int, str]]:
    """The tags of one forward under Python's walk and the native one, both installed at once
    (each stops at its own tags: metadata, or its dict)."""
    py_tracker, c_tracker = ModuleTracker(model), ModuleTracker(model, tagger=_C.tag_nodes)
    py_tracker.install()
    c_tracker.install()
    try:
        run()
    finally:
        py_tracker.remove()
        c_tracker.remove()
    return _tags(py_tracker), _tags(c_tracker)


@needs_native
@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_the_native_walk_tags_every_zoo_familys_nodes_as_pythons(family):
    wl = load_workload(family, "tiny", seed=1)
    model = wl.model
    batch = wl.make_batch(0)
    losses = []
    py_tags, c_tags = _both(model, lambda: losses.append(wl.loss(model, batch)))
    assert len(py_tags) > 10
    assert c_tags == py_tags
    losses[0].backward()  # the graph is intact


class _Odd:
    """A container pytree does not know: a leaf to it, and so to both walks."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


Pair = namedtuple("Pair", "a b")


class _Outputs(nn.Module):
    """Submodules whose outputs are the shapes a module returns: a nested tuple with numbers and
    None, a dict, an OrderedDict, a namedtuple, a list holding an object pytree does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        z = self.b(y) * 2
        w = self.c(z + y)
        return w.sum()


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module, shape: str) -> None:
        super().__init__()
        self.inner, self.shape = inner, shape

    def forward(self, x: torch.Tensor):
        y = self.inner(x).relu()
        if self.shape == "nested":
            return (y, (y * 3, None, 1.5, "s"), True)
        if self.shape == "dict":
            return {"out": y, "aux": [y + 1]}
        if self.shape == "ordered":
            return OrderedDict(out=y)
        if self.shape == "namedtuple":
            return Pair(y, y - 1)
        return [_Odd(y * 5), y]


@needs_native
@pytest.mark.parametrize("shape", ["nested", "dict", "ordered", "namedtuple", "odd"])
def test_the_native_walk_finds_the_tensors_pytree_finds(shape):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    model = nn.Sequential(_Wrap(inner, shape))
    x = torch.randn(2, 4)
    py_tags, c_tags = _both(model, lambda: model(x))
    assert c_tags == py_tags
    # the wrapper's own operators (relu, and each shape's arithmetic) are tagged as its own; an
    # object pytree does not descend into hides its tensor's node from both walks
    wrapper = [p for p in py_tags.values() if p == "0"]
    assert len(wrapper) >= (1 if shape in ("ordered", "odd") else 2)


@needs_native
def test_the_native_walk_passes_over_accumulate_grad_and_stops_at_inner_tags():
    torch.manual_seed(0)
    model = _Outputs()
    x = torch.randn(2, 4, requires_grad=True)
    py_tags, c_tags = _both(model, lambda: model(x))
    assert c_tags == py_tags
    assert sorted(set(c_tags.values())) == ["", "a", "b", "c"]  # the root's own operators: mul, add, sum


@needs_native
def test_prune_forgets_the_tags_of_graphs_before_the_last_interval():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    tracker = ModuleTracker(model, tagger=_C.tag_nodes)
    tracker.install()
    try:
        sizes = []
        for _ in range(6):
            tracker.prune()
            model(torch.randn(2, 4)).sum().backward()
            sizes.append(len(tracker.node_modules))
    finally:
        tracker.remove()
    per_step = sizes[0]
    assert per_step > 0
    assert sizes[1] == 2 * per_step  # the previous interval's tags are kept
    assert sizes[2:] == [2 * per_step] * 4  # ... and nothing older: the table does not grow with training


def _managed_modules(family: str, in_c: bool) -> tuple[list[float], list[list[tuple[str, str, str]]], list[int]]:
    """Four tiny steps of ``family`` under the pilot (a policy that reads modules) with the module
    hooks' walk in C or in Python: the losses, each step's operators' (name, phase, module) and the
    size of the tracker's tags after each step."""
    import dynn_runtime as dr
    from dynn_runtime.workload import make_optimizer, train_step

    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(1 << 40, policy="pilot", device="cpu", events="native")
    mm.tag_nodes_in_c = in_c
    mm.record_every_op = True
    mm.attach(model, opt)
    losses, tags = [], []
    try:
        for step in range(4):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(step)).item())
            tags.append(len(mm._modules.node_modules))
        ops = [[(o.name, o.phase, o.module) for o in it.ops] for it in mm.history]
    finally:
        mm.detach()
    return losses, ops, tags


@needs_native
@pytest.mark.parametrize("family", ["evoformer", "moe"])
def test_under_the_manager_the_native_walk_gives_backward_operators_their_modules(family):
    ref = _managed_modules(family, in_c=False)
    got = _managed_modules(family, in_c=True)
    assert got[0] == ref[0]
    assert got[1] == ref[1]
    backward = [m for it in got[1] for _, phase, m in it if phase == "backward"]
    assert sum(1 for m in backward if m) > len(backward) // 2  # most backward operators have a module
    # pruned at each step's start: the tags hold at most two steps' graphs, so they stop growing
    assert got[2][3] <= got[2][1] * 1.5
