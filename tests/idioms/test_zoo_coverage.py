"""Every operator a zoo family runs in one training step gets a vector from a rule or override.

The families are whatever ``dynn_runtime.models.FAMILIES`` holds; ops are recorded with a
TorchDispatchMode over forward, backward and one Adam step.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dynn_runtime import models
from dynn_runtime.idioms import idiom_vector


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.setdefault(func._name, func)
        return func(*args, **(kwargs or {}))


def _training_step_ops(name: str) -> dict[str, object]:
    wl = models.build(name, preset="tiny", seed=0)
    opt = torch.optim.Adam(wl.model.parameters())
    with _OpRecorder() as rec:
        loss = wl.loss(wl.model, wl.make_batch(0))
        loss.backward()
        opt.step()
    return rec.ops


@pytest.mark.parametrize("family", sorted(models.FAMILIES))
def test_zoo_ops_never_use_default(family):
    ops = _training_step_ops(family)
    assert len(ops) > 10, f"{family}: recorded only {sorted(ops)}"
    uncovered = {n: idiom_vector(op).source for n, op in ops.items() if idiom_vector(op).source == "default"}
    assert not uncovered, f"{family}: operators without a rule: {sorted(uncovered)}"
    # the recorder's OpOverload path and the name path agree
    for op in ops.values():
        assert idiom_vector(op) == idiom_vector(
            op._name + (".default" if op._overloadname == "default" else "")
        )


def test_default_source_is_detected():
    # guard: the check above would be vacuous if nothing could ever be 'default'
    from dynn_runtime.idioms import all_vectors

    assert any(v.source == "default" for v in all_vectors().values())
