"""Copy engines: how the manager moves bytes between device storages and host buffers, and orders
those copies against the compute stream.

The manager speaks only this interface (``MemoryManager._copies``); every ordering rule of the
module docstring of :mod:`~dynn_runtime.runtime.manager` is one call here:

* ``to_host(src, dst, last_stream)``: copy device bytes ``src`` into host buffer ``dst`` once the
  compute stream, and the stream that last used them (``last_stream``, a stream id; None or the
  current stream's: no other), have produced them; returns the copy's event.
* ``release(st)``: give an evicted storage's device block back (``st.resize_(0)``), *stream-ordered*:
  the block is not reused before every copy reading it has completed.
* ``allocate(st, nbytes)``: give a storage its device block back before a fetch.
* ``to_device(src, dst, after)``: copy host bytes into a freshly allocated device storage once the
  allocation is ordered and the event ``after`` (the copy that filled the host buffer) completed.
* ``compute_waits(event)``: the compute stream waits for ``event`` before its next kernel (on the GPU,
  not the host).
* ``timed_wait(event)``: ``compute_waits`` for a copy that had not landed when asked (a stall),
  bracketed by two timing events (``before.elapsed_time(after)``: milliseconds, read once the step's
  copies completed); None where waits are not timed (synchronous copies: their wall time is the stall).
* ``sync()``: the host waits for everything (step ends, detach).

Events have ``query()`` and ``synchronize()`` (host pool buffers wait on them).

An engine whose ``takes_storages`` is true also has ``evict(st, dst, last_stream, release)`` and
``fetch(src, st, after)``: ``to_host`` and ``to_device`` with the device side given as its
``UntypedStorage``, the byte view over it made by the engine (the manager then makes none); with
``release``, ``evict`` also does what ``release(st)`` does, in the same call.

An engine with ``fetch_inline(src, st, after, timed, nbytes)`` copies a demand fetch on the compute
stream itself, after ``after`` (the copy that filled the host buffer; no event of its own), having
first done what ``allocate(st, nbytes)`` does (its out-of-memory error changes nothing): a side
stream's copy would first wait for the compute stream's work so far, and the compute stream for
the copy at once, so it orders the same work with three more events. ``timed``: it returns the
(before, after) timing events around the copy (its stall), else None. The host buffer it read is
ordered for reuse by the compute stream: the next copy that writes one is an eviction, which waits
for the compute stream first (the manager keeps the event of the copy that filled it for host reads).

:class:`CudaCopies` is the real one (two side streams, pinned buffers, ``record_stream``).
:func:`native_copies` makes the same engine in C++ (``csrc/copies.cpp``: each copy one call from
Python, its streams and events through c10's backend-generic interface); on its ``log`` device it
runs on the CPU with streams and events that only log what was asked of them, which is how the
tests read its protocol without a GPU.
:class:`FakeAsyncCopies` runs on the CPU for tests and behaves like a GPU that is late and
unordered: a copy completes at a random later call, streams complete in order but independently of
each other, a destination is poison until its copy completes, a block released while a copy still
reads it poisons that copy. A missing wait in the manager therefore corrupts data on the CPU, where
the bit-identity tests see it.
"""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from .events import native_module

__all__ = ["CudaCopies", "FakeAsyncCopies", "SyncCopies", "cuda_copies", "native_copies"]


class SyncCopies:
    """Every copy on the calling thread, complete when the call returns (CPU, ``async_copies=False``)."""

    asynchronous = False

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, last_stream: int | None = None) -> None:
        dst.copy_(src)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> None:
        dst.copy_(src)

    def release(self, st: torch.UntypedStorage) -> None:
        st.resize_(0)

    def allocate(self, st: torch.UntypedStorage, nbytes: int) -> None:
        st.resize_(nbytes)

    def compute_waits(self, event: Any) -> None:
        pass

    def timed_wait(self, event: Any) -> tuple[Any, Any] | None:
        return None

    def sync(self) -> None:
        pass


class CudaCopies:
    """D2H and H2D copies on two side streams of ``device``, ordered by events."""

    asynchronous = True

    def __init__(self, device: torch.device, pinned: bool) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.pinned = pinned
        self._d2h: Any = None
        self._h2d: Any = None

    def _streams(self) -> tuple[Any, Any]:
        if self._d2h is None:
            self._d2h = torch.cuda.Stream(self.device)
            self._h2d = torch.cuda.Stream(self.device)
        return self._d2h, self._h2d

    def to_host(self, src: torch.Tensor, dst: torch.Tensor, last_stream: int | None = None) -> Any:
        d2h, _ = self._streams()
        compute = torch.cuda.current_stream(self._index)
        ready = torch.cuda.Event()
        ready.record(compute)
        d2h.wait_event(ready)  # invariant 1: the bytes are produced on the compute stream first
        if last_stream is not None and last_stream != compute.stream_id:  # ... and on the stream that last used them
            other = torch.cuda.Stream(stream_id=last_stream, device_index=self._index, device_type=1)
            also = torch.cuda.Event()
            also.record(other)
            d2h.wait_event(also)
        self._on(d2h, compute, dst, src)
        ev = torch.cuda.Event()
        ev.record(d2h)
        src.record_stream(d2h)  # the allocator keeps the block until the copy stream passes this point
        return ev

    def _on(self, side: Any, compute: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` issued on stream ``side``, then ``compute`` is current again.
        ``torch.cuda.set_stream`` rather than the ``torch.cuda.stream`` context manager: the context
        resolves the current device (a CUDA availability query) on entry and exit of every copy."""
        torch.cuda.set_stream(side)
        try:
            dst.copy_(src, non_blocking=self.pinned)
        finally:
            torch.cuda.set_stream(compute)

    def release(self, st: torch.UntypedStorage) -> None:
        st.resize_(0)  # stream-ordered by the record_stream of to_host

    def allocate(self, st: torch.UntypedStorage, nbytes: int) -> None:
        st.resize_(nbytes)

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> Any:
        _, h2d = self._streams()
        compute = torch.cuda.current_stream(self._index)
        alloc = torch.cuda.Event()
        alloc.record(compute)
        h2d.wait_event(alloc)  # invariant 2: the allocation is ordered on the compute stream
        if after is not None:
            h2d.wait_event(after)  # ... and the host copy must have landed
        self._on(h2d, compute, dst, src)
        ev = torch.cuda.Event()
        ev.record(h2d)
        dst.record_stream(h2d)
        return ev

    def compute_waits(self, event: Any) -> None:
        torch.cuda.current_stream(self._index).wait_event(event)  # invariant 3

    def timed_wait(self, event: Any) -> tuple[Any, Any]:
        """``compute_waits`` bracketed by timing events (a late prefetch's stall, read at step end)."""
        compute = torch.cuda.current_stream(self._index)
        before = torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(event)
        after = torch.cuda.Event(enable_timing=True)
        after.record(compute)
        return before, after

    def sync(self) -> None:
        torch.cuda.current_stream(self._index).synchronize()
        if self._d2h is not None:
            self._d2h.synchronize()
            self._h2d.synchronize()


_NATIVE: Any = None  # the class native_copies makes, once


def native_copies(device_type: str, index: int, pinned: bool, reuse_events: bool = True,
                  raw_copies: bool = True) -> Any | None:
    """:class:`CudaCopies`' protocol in C++ (``dynn_runtime._C.CopyEngine``) on ``device_type``
    ``"cuda"`` (device ``index``; ``pinned``: non-blocking copies) or ``"log"`` (tests: the CPU,
    ``take_log()`` says what its streams and events were asked); None where the extension does not
    load. Its events (``_C.CopyEvent``) have ``query``, ``synchronize`` and ``elapsed_time``; with
    ``reuse_events`` each goes back to the engine's pool when it dies, for a later copy, rather
    than being destroyed (an event made and destroyed per copy is two driver calls a copy). With
    ``raw_copies`` (and ``pinned``, on CUDA, where the build has CUDA's headers) each copy is one
    ``cudaMemcpyAsync`` of the two contiguous byte ranges, not a ``Tensor.copy_``
    (``csrc/copies_cuda.h``)."""
    global _NATIVE
    if _NATIVE is None:
        mod = native_module()
        if mod is None:
            return None

        class NativeCopies(mod.CopyEngine):
            asynchronous = True
            takes_storages = True  # evict(st, dst, last_stream, release), fetch(src, st, after)

            def release(self, st: torch.UntypedStorage) -> None:
                st.resize_(0)  # stream-ordered: to_host recorded the block on its side stream

            def allocate(self, st: torch.UntypedStorage, nbytes: int) -> None:
                st.resize_(nbytes)

        _NATIVE = NativeCopies
    return _NATIVE(device_type, index, pinned, reuse_events, raw_copies)


def cuda_copies(device: torch.device, pinned: bool, native: bool, raw: bool = True) -> Any:
    """The copy engine for CUDA ``device``: the C++ one where ``native`` and the extension loads
    (``raw``: :func:`native_copies`' ``raw_copies``), else :class:`CudaCopies`."""
    engine = None
    if native:
        index = device.index if device.index is not None else torch.cuda.current_device()
        engine = native_copies("cuda", index, pinned, raw_copies=raw)
    return engine if engine is not None else CudaCopies(device, pinned)


class _FakeEvent:
    __slots__ = ("engine", "op")

    def __init__(self, engine: FakeAsyncCopies, op: _FakeOp) -> None:
        self.engine, self.op = engine, op

    def query(self) -> bool:
        self.engine._tick()
        return self.op.done

    def synchronize(self) -> None:
        self.engine._finish(self.op)


class _FakeTime:
    """A timing event of the fake GPU: the host clock when it was made; ``elapsed_time`` in
    milliseconds, as ``torch.cuda.Event``'s."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _FakeTime) -> float:
        return (end.t - self.t) * 1e3


class _FakeOp:
    __slots__ = ("stream", "run", "done", "reads")

    def __init__(self, stream: str, run: Any, reads: torch.UntypedStorage | None) -> None:
        self.stream, self.run, self.done, self.reads = stream, run, False, reads


#: what a destination holds until its copy completes (and what a copy from a released block yields)
POISON = 0xA5


class FakeAsyncCopies:
    """A late, unordered GPU on the CPU (see the module docstring). ``seed`` fixes the schedule;
    ``p_complete`` is the chance that a pending copy completes at each call into the engine."""

    asynchronous = True

    def __init__(self, seed: int = 0, p_complete: float = 0.3) -> None:
        self.rng = random.Random(seed)
        self.p = p_complete
        self.queues: dict[str, list[_FakeOp]] = {"d2h": [], "h2d": []}
        self.pending_release: list[tuple[torch.UntypedStorage, list[_FakeOp]]] = []
        self.poisoned_reads = 0  # copies that met a block already given back (a missing stream order)
        self.forced = 0  # copies completed because something waited for them (not by the schedule)

    # -- completion ---------------------------------------------------------------------------
    def _complete_head(self, stream: str) -> None:
        op = self.queues[stream].pop(0)
        op.run()
        op.done = True
        op.run = op.reads = None  # a GPU holds no reference to a storage once its copy is done
        self._release_ready()

    def _finish(self, op: _FakeOp) -> None:
        while not op.done:
            self.forced += 1
            self._complete_head(op.stream)

    def _tick(self) -> None:
        for stream in self.rng.sample(list(self.queues), len(self.queues)):
            while self.queues[stream] and self.rng.random() < self.p:
                self._complete_head(stream)

    def _release_ready(self) -> None:
        keep = []
        for st, ops in self.pending_release:
            if all(o.done for o in ops):
                st.resize_(0)
            else:
                keep.append((st, ops))
        self.pending_release = keep

    def _reading(self, st: torch.UntypedStorage) -> list[_FakeOp]:
        """Pending copies that read or write ``st``'s block."""
        key = st._cdata
        return [o for q in self.queues.values() for o in q if o.reads is not None and o.reads._cdata == key]

    # -- the interface --------------------------------------------------------------------------
    def to_host(self, src: torch.Tensor, dst: torch.Tensor, last_stream: int | None = None) -> _FakeEvent:
        self._tick()
        st = src.untyped_storage()
        n = src.numel()

        def run() -> None:
            if st.nbytes() < n:  # the block went back before this copy read it
                self.poisoned_reads += 1
                dst.fill_(POISON)
            else:
                dst.copy_(src)

        op = _FakeOp("d2h", run, st)
        self.queues["d2h"].append(op)
        return _FakeEvent(self, op)

    def release(self, st: torch.UntypedStorage) -> None:
        self._tick()
        ops = self._reading(st)
        if ops:
            self.pending_release.append((st, ops))  # stream-ordered: after the copies that read it
        else:
            st.resize_(0)

    def allocate(self, st: torch.UntypedStorage, nbytes: int) -> None:
        # A new block for a storage whose old block is still awaiting its copies: on a GPU those are
        # two blocks. Here they are one storage, so the old block's copies finish first.
        for o in self._reading(st):
            self._finish(o)
        self._release_ready()
        st.resize_(nbytes)
        torch.empty(0, dtype=torch.uint8).set_(st).fill_(POISON)  # fresh device memory is garbage

    def to_device(self, src: torch.Tensor, dst: torch.Tensor, after: Any) -> _FakeEvent:
        self._tick()
        dep = after.op if after is not None else None
        st = dst.untyped_storage()
        n = dst.numel()

        def run() -> None:
            if dep is not None and not dep.done:  # a stream wait: this copy cannot start before ``after``
                self._finish(dep)
            if st.nbytes() < n:  # the block went back before this copy wrote it
                self.poisoned_reads += 1
            else:
                dst.copy_(src)

        op = _FakeOp("h2d", run, st)
        self.queues["h2d"].append(op)
        return _FakeEvent(self, op)

    def fetch_inline(self, src: torch.Tensor, st: torch.UntypedStorage, after: Any, timed: bool = False,
                     nbytes: int | None = None) -> tuple[_FakeTime, _FakeTime] | None:
        """The copy on the "compute stream" (the host, now), once ``after`` completed; with
        ``nbytes``, the storage's block is allocated first."""
        if nbytes is not None:
            self.allocate(st, nbytes)
        self._tick()
        before = _FakeTime() if timed else None
        if after is not None:
            self._finish(after.op)
        torch.empty(0, dtype=torch.uint8).set_(st).copy_(src)
        return (before, _FakeTime()) if before is not None else None

    def compute_waits(self, event: Any) -> None:
        self._finish(event.op)  # the CPU's "compute stream" runs now: waiting means completing

    def timed_wait(self, event: Any) -> tuple[_FakeTime, _FakeTime]:
        """``compute_waits`` bracketed by two host-clock marks: the wait is the forced copies' run,
        as on a GPU it is the compute stream's time before the copy lands."""
        before = _FakeTime()
        self.compute_waits(event)
        return before, _FakeTime()

    def sync(self) -> None:
        for stream in self.queues:
            while self.queues[stream]:
                self._complete_head(stream)
        self._release_ready()
