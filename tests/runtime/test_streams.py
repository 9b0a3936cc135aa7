"""The stream of a storage's last access reaches the copy engine at eviction (CPU: stream id 0; the
ordering itself is tested on a GPU, tests/runtime/test_cuda.py)."""

from __future__ import annotations

import pytest
import torch

import dynn_runtime as dr
from dynn_runtime.runtime.copies import FakeAsyncCopies
from dynn_runtime.runtime.events import native_module


class _Recording(FakeAsyncCopies):
    def __init__(self) -> None:
        super().__init__(seed=0)
        self.last_streams: list = []

    def to_host(self, src, dst, last_stream=None):
        self.last_streams.append(last_stream)
        return super().to_host(src, dst, last_stream)


@pytest.mark.parametrize("events", ["python", "native"])
def test_evictions_pass_the_last_use_stream_to_the_copy_engine(events):
    if events == "native" and native_module() is None:
        pytest.skip("the native event source is not built")
    copies = _Recording()
    model = torch.nn.Linear(16, 16)
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events=events, copies=copies).attach(model)
    try:
        with mm.step():
            y = model(torch.randn(8, 16))
            want = y.detach().clone()
            assert mm.offload(y, model.weight) > 0
            if events == "native":
                assert mm._obs.last_stream(mm._sid(y)) == 0  # the CPU's one stream
            assert torch.equal(y, want)  # back, bit for bit
    finally:
        mm.detach()
    assert copies.last_streams == [0, 0]
