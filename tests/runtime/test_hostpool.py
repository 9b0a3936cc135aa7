"""The host pool's chunk sizes: within host_budget, also where the CUDA host allocator rounds."""

from __future__ import annotations

import pytest

from dynn_runtime.errors import HostMemoryError
from dynn_runtime.runtime.hostpool import HostPool, chunk_size

MiB = 1 << 20


def test_pinned_chunks_are_powers_of_two_within_the_room():
    # the CUDA host allocator would hold 128 MiB for a 100 MiB pinned block: the pool asks for it
    assert chunk_size(100 * MiB, 64 * MiB, None, pinned=True) == 128 * MiB
    assert chunk_size(1 * MiB, 64 * MiB, None, pinned=True) == 64 * MiB
    # 90 MiB left: a 64 MiB chunk (not 90, which the allocator would round to 128)
    assert chunk_size(1 * MiB, 64 * MiB, 90 * MiB, pinned=True) == 64 * MiB
    assert chunk_size(40 * MiB, 64 * MiB, 50 * MiB, pinned=True) is None  # 64 would exceed the room
    for need in (1, 3 * MiB, 33 * MiB, 200 * MiB):
        for room in (None, 48 * MiB, 300 * MiB):
            size = chunk_size(need, 64 * MiB, room, pinned=True)
            if size is not None:
                assert size & (size - 1) == 0 and size >= need and (room is None or size <= room)


def test_pageable_chunks_fill_the_room():
    assert chunk_size(1 * MiB, 64 * MiB, 90 * MiB, pinned=False) == 64 * MiB
    assert chunk_size(1 * MiB, 64 * MiB, 10 * MiB, pinned=False) == 10 * MiB
    assert chunk_size(20 * MiB, 64 * MiB, 10 * MiB, pinned=False) is None


def test_the_budget_error_names_the_knob():
    pool = HostPool(budget_bytes=4 * MiB, chunk_bytes=2 * MiB)
    a = pool.alloc(2 * MiB)
    b = pool.alloc(2 * MiB)
    with pytest.raises(HostMemoryError, match="host_budget"):
        pool.alloc(1 * MiB)
    pool.release(a)
    assert pool.alloc(1 * MiB) is not None and b is not None  # a released buffer is reused


def test_reserve_allocates_up_front_within_the_budget():
    pool = HostPool(budget_bytes=7 * MiB, chunk_bytes=2 * MiB)
    pool.reserve(7 * MiB)
    assert pool.reserved == 7 * MiB and len(pool.chunks) == 4  # 2 + 2 + 2 + 1
    chunks = len(pool.chunks)
    bufs = [pool.alloc(MiB) for _ in range(7)]
    assert len(pool.chunks) == chunks and len(bufs) == 7  # no allocation during use


class _Copy:
    """A copy event that completes only when waited for."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_a_full_pool_waits_for_the_oldest_copy_only():
    pool = HostPool(budget_bytes=4 * MiB, chunk_bytes=4 * MiB)
    bufs = [pool.alloc(MiB) for _ in range(4)]
    events = [_Copy() for _ in bufs]
    for b, e in zip(bufs, events, strict=True):
        pool.release(b, e)  # each buffer still read by a copy in flight
    again = pool.alloc(MiB)
    assert again is not None and pool.syncs == 1
    assert [e.done for e in events] == [True, False, False, False]
