"""Fixtures shared by the runtime's tests."""

from __future__ import annotations

import pytest
import torch

from dynn_runtime.runtime.copies import SyncCopies


@pytest.fixture
def failing_allocations(monkeypatch) -> list[int]:
    """The CPU copy engine's allocation for a fetch raises the allocator's OOM while ``left[0] > 0``
    (``left``, the list returned, starts at 0): the manager's own allocations running out."""
    real = SyncCopies.allocate
    left = [0]

    def allocate(self, st, nbytes):
        if left[0] > 0:
            left[0] -= 1
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected). Tried to allocate {nbytes} bytes.")
        return real(self, st, nbytes)

    monkeypatch.setattr(SyncCopies, "allocate", allocate)
    return left
