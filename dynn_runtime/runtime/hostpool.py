"""Host memory for offloaded storages: a reusable pool under a byte budget.

On CUDA the pool is pinned (page-locked) memory, so device-to-host and host-to-device copies can
run asynchronously on the copy streams. Pinning is expensive (``cudaHostAlloc`` maps and locks
pages), so it is done in large chunks and never per tensor; buffers are carved out of chunks
first-fit and coalesce with their neighbours when released. A buffer released while a copy may
still be reading or writing it (``release(event)``) only returns to the free list once that event
has completed: the pool never hands out memory a copy engine is still using.

If pinning fails (the OS limit on locked memory, or no CUDA), the pool warns once and falls back
to pageable memory: copies then become synchronous, which is slower but still correct.

The same code runs on the CPU (pageable chunks), so the allocator is exercised by the test suite
on machines without a GPU.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import HostMemoryError, internal_assert
from ..memory import format_bytes

__all__ = ["HostPool", "HostBuffer"]

_ALIGN = 512  # bytes; keeps every buffer aligned for vectorised copies
_VIEWS = 1 << 14  # buffers kept for reuse at most (each view holds only its chunk, which the pool holds anyway)


@dataclass(eq=False)
class HostBuffer:
    """``nbytes`` of host memory: ``tensor`` is a uint8 view into one of the pool's chunks."""

    tensor: torch.Tensor
    chunk: int
    offset: int
    size: int  # reserved (aligned) size
    nbytes: int


class _Chunk:
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.size = data.numel()
        self.free: list[tuple[int, int]] = [(0, self.size)]  # sorted (offset, size)

    def take(self, size: int) -> int | None:
        for i, (off, sz) in enumerate(self.free):
            if sz >= size:
                if sz == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, sz - size)
                return off
        return None

    def give(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (off, 0))
        # coalesce with the right neighbour, then the left one
        if i < len(self.free) and off + size == self.free[i][0]:
            size += self.free[i][1]
            del self.free[i]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == off:
            off, size = self.free[i - 1][0], self.free[i - 1][1] + size
            i -= 1
            del self.free[i]
        self.free.insert(i, (off, size))


def chunk_size(need: int, chunk_bytes: int, room: int | None, pinned: bool) -> int | None:
    """Bytes of the next chunk for a buffer of ``need`` bytes, within ``room`` (None: no host budget),
    or None when it does not fit. Pinned chunks are powers of two: the CUDA host allocator rounds a
    pinned block up to one, and the budget must count what it really holds."""
    size = max(need, chunk_bytes)
    if not pinned:
        size = size if room is None else min(size, room)
        return size if size >= need else None
    size = 1 << (size - 1).bit_length()
    if room is not None and size > room:
        size = 1 << (room.bit_length() - 1) if room > 0 else 0  # the largest power of two within the room
    return size if size >= need else None


class HostPool:
    """A chunked, optionally pinned host allocator with a budget.

    ``budget_bytes``: the most host memory the pool may hold (``None``: no limit). ``chunk_bytes``:
    the size of each chunk it reserves (a larger request gets a chunk of its own size).
    """

    def __init__(self, budget_bytes: int | None = None, pin: bool = False, chunk_bytes: int = 64 << 20) -> None:
        self.budget = budget_bytes
        self.pin = pin
        self.chunk_bytes = chunk_bytes
        self.chunks: list[_Chunk] = []
        self.reserved = 0  # bytes in chunks
        self.syncs = 0  # times alloc waited on a copy still holding a released buffer
        self.in_use = 0  # bytes handed out (aligned)
        self.peak_in_use = 0
        self.handed_out = 0  # bytes handed out since the pool was made (aligned)
        self._pending: list[tuple[Any, HostBuffer]] = []  # released, waiting for a copy to finish
        self._warned = False
        #: (chunk, offset, nbytes) -> the buffer handed out for it before: a buffer carved where one was
        #: before is that same object (its fields are those three and the aligned size, which nbytes
        #: fixes), without slicing the chunk again; at most one holder has it at a time
        self._bufs: dict[tuple[int, int, int], HostBuffer] = {}

    @property
    def pinned(self) -> bool:
        return self.pin

    def _new_chunk(self, need: int) -> _Chunk:
        room = None if self.budget is None else self.budget - self.reserved
        size = chunk_size(need, self.chunk_bytes, room, self.pin)
        if size is None:
            raise HostMemoryError(
                f"runtime: the host memory budget is exhausted: offloading {format_bytes(need)} more would "
                f"exceed host_budget={format_bytes(self.budget)} ({format_bytes(self.in_use)} in use for "
                f"offloaded tensors). Raise host_budget (MemoryManager(..., host_budget=...) or "
                "`--host-budget`), or give the device a larger budget so that less is offloaded."
            )
        with torch.utils._python_dispatch._disable_current_modes():
            return self._alloc_chunk(size)

    def _alloc_chunk(self, size: int) -> _Chunk:
        # pinned: ``size`` is a power of two (chunk_size), all the CUDA host allocator reserves for it
        data = None
        if self.pin:
            try:
                data = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:
                self.pin = False
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"dynn-runtime: pinning {format_bytes(size)} of host memory failed ({exc}); falling back "
                        "to pageable memory: copies will be synchronous and slower. Raise the locked-memory "
                        "limit (ulimit -l) to restore asynchronous copies.",
                        RuntimeWarning, stacklevel=3,
                    )
        if data is None:
            data = torch.empty(size, dtype=torch.uint8)
        chunk = _Chunk(data)
        self.chunks.append(chunk)
        self.reserved += size
        return chunk

    def reserve(self, nbytes: int) -> None:
        """Allocate chunks now until ``nbytes`` are reserved (within the budget), so that pinning,
        which is slow, happens here rather than during a step."""
        while self.reserved < nbytes:
            room = None if self.budget is None else self.budget - self.reserved
            size = chunk_size(min(self.chunk_bytes, nbytes - self.reserved), self.chunk_bytes, room, self.pin)
            if size is None:
                return
            with torch.utils._python_dispatch._disable_current_modes():
                self._alloc_chunk(size)

    @property
    def waiting(self) -> int:
        """Released buffers still waiting for the copies that read or write them."""
        return len(self._pending)

    def poll(self) -> None:
        """Return buffers whose copies have completed to the free lists."""
        if not self._pending:
            return
        keep = []
        for event, buf in self._pending:
            if event is None or event.query():
                self._give(buf)
            else:
                keep.append((event, buf))
        self._pending = keep

    def alloc(self, nbytes: int) -> HostBuffer:
        size = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        if self._pending:
            self.poll()
        got = self._take(size, nbytes)
        # copies still hold released buffers: wait for the oldest, one at a time, before growing
        while got is None and self._pending:
            event, buf = self._pending.pop(0)  # release() keeps a buffer pending only with an event
            event.synchronize()
            self.syncs += 1
            self._give(buf)
            self.poll()
            got = self._take(size, nbytes)
        if got is not None:
            return got
        self._new_chunk(size)
        got = self._take(size, nbytes)  # first fit: the chunks before the new one had no room
        internal_assert(got is not None, "host pool: a new chunk had no room for the buffer it was made for")
        return got

    def _take(self, size: int, nbytes: int) -> HostBuffer | None:
        """A buffer of ``nbytes`` (``size`` aligned) carved first-fit from the chunks, or None."""
        for ci, chunk in enumerate(self.chunks):  # noqa: B007  (read after the break)
            off = chunk.take(size)
            if off is not None:
                break
        else:
            return None
        self.in_use += size
        self.handed_out += size
        if self.in_use > self.peak_in_use:
            self.peak_in_use = self.in_use
        bufs = self._bufs
        key = (ci, off, nbytes)
        buf = bufs.get(key)
        if buf is None:
            if len(bufs) >= _VIEWS:
                bufs.clear()
            buf = bufs[key] = HostBuffer(chunk.data[off:off + nbytes], ci, off, size, nbytes)
        return buf

    def release(self, buf: HostBuffer, event: Any = None) -> None:
        """Give ``buf`` back; with ``event``, only once the copy that event marks has completed."""
        if event is not None and not event.query():
            self._pending.append((event, buf))
        else:
            self._give(buf)

    def _give(self, buf: HostBuffer) -> None:
        self.in_use -= buf.size
        self.chunks[buf.chunk].give(buf.offset, buf.size)

    def close(self) -> None:
        for event, _ in self._pending:
            if event is not None:
                event.synchronize()
        self._pending = []
        self.chunks = []
        self._bufs = {}
        self.reserved = self.in_use = 0
