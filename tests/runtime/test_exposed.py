"""The native observer's books with every storage exposed, as on CUDA, where no storage's data is
covered (csrc/covered.h: the caching allocator's recordStream ignores a wrapped deleter), so deaths
are found by sweeping the table rather than heard of. On the CPU covering is the default; these
tests turn it off, so that the CPU suite runs the bookkeeping the GPU runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.runtime.copies import FakeAsyncCopies
from dynn_runtime.runtime.events import native_module

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

_C = native_module()
pytestmark = pytest.mark.skipif(_C is None, reason="the native event source is not built")
FRACTION = {"moe": 0.125, "evoformer": 0.125, "varlen": 0.4}


@pytest.fixture
def exposed(monkeypatch):
    """Every Observer the manager makes from here keeps its storages exposed; yields those made."""
    made = []

    class Exposed(_C.Observer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cover = False
            made.append(self)

    monkeypatch.setattr(_C, "Observer", Exposed)
    return made


def test_covering_is_the_cpu_default_and_cannot_be_turned_on_for_cuda():
    assert _C.Observer("cpu").cover is True
    cuda = _C.Observer("cuda")
    assert cuda.cover is False
    with pytest.raises(RuntimeError, match="never covered"):
        cuda.cover = True


@pytest.mark.parametrize("family", sorted(FRACTION))
def test_exposed_books_keep_the_bits_and_the_budget(family, exposed):
    want_losses, want, _ = train_family(family)
    _, _, free = train_family(family, "lru", 1 << 40, events="native")
    budget = int(free["peak_device_bytes"] * FRACTION[family])
    losses, state, stats = train_family(family, "lru", budget, events="native",
                                        copies=FakeAsyncCopies(seed=1, p_complete=0.3))
    assert exposed and all(o.cover is False for o in exposed)
    assert stats["event_source"] == "native" and stats["bytes_offloaded"] > 0
    assert losses == want_losses and all(torch.equal(a, b) for a, b in zip(state, want, strict=True))
    # the budget is kept after operators, with room for the largest one (events.cpp, invariant 6)
    assert all(s["peak_device_bytes"] <= budget + stats["largest_allocation_bytes"] for s in stats["per_step"])
