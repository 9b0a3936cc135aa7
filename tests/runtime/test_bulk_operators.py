"""A policy that reads operators, told a batch in one Policy.on_operators call on the native source, gets
the events the per-operator path tells it, in the same order and with the same arguments."""

from __future__ import annotations

import pytest
import torch

import dynn_runtime as dr
from dynn_runtime.policies.base import OPERATOR, TOUCH_ALLOC, TOUCH_FREE, Policy
from dynn_runtime.runtime.events import native_module

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native event source is not built")


class _Told(Policy):
    """Records every notification; with ``bulk``, asks for batches and records what its view says of
    the storages a batch saw die (the runtime forgets them only after the call)."""

    name = "test-told"

    def __init__(self, bulk: bool) -> None:
        super().__init__()
        self.bulk = bulk
        self.told: list[tuple] = []
        self.batches = 0
        self.dead_sizes: list[int] = []

    def operators_in_bulk(self) -> bool:
        return self.bulk

    def on_operators(self, events, phase):
        self.batches += 1
        for ev in events:
            if ev[0] == TOUCH_FREE:
                self.dead_sizes.append(self.view.nbytes(ev[1]))
        super().on_operators(events, phase)

    def on_alloc(self, sid, position):
        self.told.append(("alloc", sid, position))

    def on_free(self, sid):
        self.told.append(("free", sid))

    def on_operator(self, position, op, accessed):
        self.told.append(("op", position, op.name, op.phase, op.allocs, tuple(accessed)))

    def after_op(self, position):  # acts ahead: the runtime reads its log every 32 operators
        return []


def _run(policy: _Told) -> list[tuple]:
    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    lin = torch.nn.Linear(16, 16)
    inp = torch.randn(4, 16)
    mm = dr.MemoryManager(1 << 40, policy=policy, device="cpu", events="native").attach(lin)
    try:
        for _ in range(3):
            with mm.step():
                y = x
                for _ in range(20):
                    y = torch.relu(torch.mm(y * 0.5 + x, w))
                lin(inp * y.sum()).sum().backward()
                lin.zero_grad(set_to_none=True)
    finally:
        mm.detach()
    # storage ids as first told (two managers number their storages apart)
    ids: dict[int, int] = {}

    def norm(sids):
        return tuple(ids.setdefault(s, len(ids)) for s in sids)

    out = []
    for ev in policy.told:
        if ev[0] == "op":
            out.append((*ev[:4], norm(ev[4]), tuple(sorted(norm(ev[5])))))
        else:
            out.append((ev[0], *norm(ev[1:2]), *ev[2:]))
    return out


def test_a_batch_told_in_bulk_is_the_per_operator_calls():
    per_op, bulk = _Told(bulk=False), _Told(bulk=True)
    expected = _run(per_op)
    got = _run(bulk)
    assert per_op.batches == 0 and bulk.batches > 5
    assert sum(ev[0] == "op" for ev in got) > 200 and any(ev[0] == "free" for ev in got)
    assert got == expected
    assert bulk.dead_sizes and all(n > 0 for n in bulk.dead_sizes)


def test_the_default_on_operators_makes_the_calls_in_order():
    pol = _Told(bulk=True)
    op = type("Op", (), {"name": "aten::mul.Tensor", "phase": "forward", "allocs": (7,)})()
    Policy.on_operators(pol, [(TOUCH_ALLOC, 3, -1), (OPERATOR, 0, op, [3, 7]), (TOUCH_FREE, 3)], "forward")
    assert pol.told == [("alloc", 3, -1), ("op", 0, "aten::mul.Tensor", "forward", (7,), (3, 7)), ("free", 3)]
