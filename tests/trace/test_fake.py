"""Shape-only (fake) recordings: large tensors hold no data, and the trace equals a real recording
wherever no decision reads a large tensor's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from dynn_runtime.errors import TraceError
from dynn_runtime.trace import read_trace, record
from dynn_runtime.trace.fake import ShapeMode, iteration_summary, record_fake


def _op_bytes(trace):
    """Per operator of the last iteration: name, module, and the bytes of what it allocated."""
    it = trace.iterations[-1]
    return [(op.name, op.module, tuple(trace.storages[s].nbytes for s in op.allocs), op.flops) for op in it.ops]


def test_large_tensors_are_fake_small_ones_real():
    with ShapeMode(small_numel=256):
        big = torch.randn(64, 64)
        small = torch.randn(8)
        mixed = big @ torch.ones(64, 4)       # 256 elements, read from a large tensor: stays a shape
        picked = mixed.argmax(dim=1)          # a decision: computed on seeded values, real
        idx = (small > 0).nonzero()           # real inputs: the real answer
    assert isinstance(big, FakeTensor) and big.shape == (64, 64)
    assert not isinstance(small, FakeTensor)
    assert isinstance(mixed, FakeTensor)
    assert not isinstance(picked, FakeTensor) and picked.shape == (64,) and int(picked.max()) < 4
    assert torch.equal(idx, (small > 0).nonzero())


def test_fake_recording_equals_real_where_no_decision_reads_a_large_tensor(tmp_path):
    # varlen's decisions (lengths, masks) come from its batch, which stays real: with the activations
    # fake (small_numel far below their size) every operator, allocation and FLOP count is the real one.
    # A batch of 32: its masks (drawn from the batch's generator) are larger than small_numel.
    real_p, fake_p = tmp_path / "real.jsonl.gz", tmp_path / "fake.jsonl.gz"
    record("varlen", real_p, steps=1, preset="tiny", overrides={"batch": 32})
    record_fake("varlen", fake_p, steps=1, preset="tiny", overrides={"batch": 32}, small_numel=256)
    real, fake = read_trace(real_p), read_trace(fake_p)
    assert fake.header["values"] == "fake" and fake.header["small_numel"] == 256
    assert _op_bytes(fake) == _op_bytes(real)
    assert iteration_summary(fake) == iteration_summary(real)


class _Gated(nn.Module):
    """Runs its second layer on the rows whose first-layer output is positive: a decision that reads
    a large activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        h = self.a(x)
        rows = (h[:, 0] > 0).nonzero().squeeze(1)
        return h.index_add(0, rows, self.b(h.index_select(0, rows)))


class _GatedWorkload:
    def __init__(self) -> None:
        self.model = _Gated()

    def make_batch(self, step):
        return torch.randn(64, 32, generator=torch.Generator().manual_seed(step))

    def loss(self, model, batch):
        return model(batch).square().mean()


def test_decision_on_a_large_activation_is_drawn_and_bounded(tmp_path):
    with ShapeMode(small_numel=256) as mode:
        wl = _GatedWorkload()
    with mode:
        out = record(wl, tmp_path / "g.jsonl.gz", steps=1)
    assert out.ops > 0 and mode.realized > 0
    # the same decision with decide_numel below the activation it reads: a clear error, not a guess
    with ShapeMode(small_numel=16, decide_numel=32) as mode:
        wl = _GatedWorkload()
    with mode, pytest.raises(TraceError, match="decide_numel"):
        record(wl, tmp_path / "g2.jsonl.gz", steps=1)


def test_bad_thresholds():
    with pytest.raises(TraceError, match="small_numel <= decide_numel"):
        ShapeMode(small_numel=10, decide_numel=5)


def test_a_real_mask_selects_from_a_large_tensor_without_its_values():
    # varlen's loss picks the masked positions out of logits far larger than decide_numel: the
    # result's size is the mask's count, and backward runs, both without the logits' values.
    with ShapeMode(small_numel=256, decide_numel=1000):
        w = nn.Parameter(torch.randn(30, 300))
        logits = torch.randn(4, 100, 30) @ w
        mask = torch.zeros(4, 100, dtype=torch.bool)
        mask[0, :7] = True
        mask[2, 3:5] = True
        picked = logits[mask]
        torch.nn.functional.cross_entropy(picked, torch.zeros(9, dtype=torch.long)).backward()
    assert isinstance(picked, FakeTensor) and picked.shape == (9, 300)
    assert isinstance(w.grad, FakeTensor) and w.grad.shape == (30, 300)
