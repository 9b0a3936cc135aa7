"""The native hook protocol, mirrored in Python.

The patched PyTorch implements these rules in C++ (``c10/cuda/DynnReclaim.h`` and
``torch/csrc/autograd/dynn_engine_core.h`` in ``patches/new_files``); this module
implements the same rules for what the live runtime does from Python: on stock
torch it is the whole mechanism (the runtime catches out-of-memory and calls
:meth:`ReclaimRegistry.reclaim_and_retry` itself), on a patched torch the
trampolines registered through :class:`dynn_runtime.native.NativeHooks` call into
the same registries. The rules, numbered as in ``patches/README.md``:

1. Reclaim runs only after an allocation failed, before out-of-memory is raised.
2. The hook runs without the allocator lock: ``reclaim_and_retry`` releases the
   lock it is given and re-acquires it on every exit path.
3. Frees made from inside the hook on the same thread and device are observed
   (:meth:`ReclaimRegistry.note_free`) and count as freed bytes.
4. No re-entry: an allocation failing inside the hook does not call it again.
5. Retry when anything was freed (reported or observed); at most
   ``max_attempts`` hook calls per failed allocation.
6. A hook that raises counts as having freed nothing; the error is recorded and
   the caller raises its normal out-of-memory error.
7. GIL: the lock is never held while the hook runs, so a hook that needs the GIL
   cannot deadlock with a GIL holder waiting for that lock.

Example::

    >>> reg = ReclaimRegistry()
    >>> pool = {"free": 0}
    >>> handle = reg.set_hook(lambda req: pool.update(free=pool["free"] + req.nbytes) or req.nbytes)
    >>> reg.reclaim_and_retry(ReclaimRequest(device=0, nbytes=64), lambda: pool["free"] >= 64)
    True
    >>> handle.remove()
    True
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from .._log import logger

__all__ = [
    "ReclaimRequest",
    "ReclaimResult",
    "ReclaimStats",
    "ReclaimRegistry",
    "Handle",
    "ReadyNode",
    "EngineHookStats",
    "EngineHooks",
    "SavedTensorIndex",
]


class _Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ReclaimRequest:
    """What the allocator could not satisfy."""

    device: int
    """CUDA device index."""
    nbytes: int
    """Bytes requested (after the allocator's rounding)."""
    stream: int = 0
    """The allocation's stream (``cudaStream_t`` as an int)."""
    attempt: int = 1
    """1-based hook call number for this allocation."""


@dataclass(frozen=True, slots=True)
class ReclaimResult:
    reported: int = 0
    observed: int = 0
    raised: bool = False

    @property
    def effective(self) -> int:
        return max(self.reported, self.observed)


@dataclass(slots=True)
class ReclaimStats:
    calls: int = 0
    recovered: int = 0
    exhausted: int = 0
    nested_skipped: int = 0
    errors: int = 0
    bytes_reported: int = 0
    bytes_observed: int = 0


class Handle:
    """A removable registration (like ``torch.utils.hooks.RemovableHandle``)."""

    def __init__(self, remove: Callable[[], bool]) -> None:
        self._remove = remove

    def remove(self) -> bool:
        """Unregister; False when a newer registration already replaced this one."""
        return self._remove()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _ThreadState(threading.local):
    depth = 0
    device = -1
    observed = 0


class ReclaimRegistry:
    """Holds the reclaim hook and runs the retry loop (rules 1-7)."""

    def __init__(self, max_attempts: int = 3) -> None:
        self._mu = threading.Lock()  # leaf lock: never held while a hook runs
        self._hook: Callable[[ReclaimRequest], int] | None = None
        self._token = 0
        self.max_attempts = max(1, max_attempts)
        self.stats = ReclaimStats()
        self.last_error: BaseException | None = None
        self._tls = _ThreadState()

    def set_hook(self, hook: Callable[[ReclaimRequest], int]) -> Handle:
        """Install ``hook(request) -> bytes_freed``, replacing any previous hook."""
        with self._mu:
            self._hook = hook
            self._token += 1
            token = self._token

        def remove() -> bool:
            with self._mu:
                if self._token != token or self._hook is None:
                    return False
                self._hook = None
                return True

        return Handle(remove)

    @property
    def has_hook(self) -> bool:
        return self._hook is not None

    @property
    def in_reclaim(self) -> bool:
        """True on a thread that is running the hook (rule 4)."""
        return self._tls.depth > 0

    def note_free(self, device: int, nbytes: int) -> None:
        """Report a free; counted when this thread is reclaiming for ``device`` (rule 3)."""
        tls = self._tls
        if tls.depth > 0 and tls.device == device:
            tls.observed += nbytes

    def call(self, request: ReclaimRequest) -> ReclaimResult:
        """Run the hook once, inside the re-entrancy scope; never raises (rule 6)."""
        with self._mu:
            hook = self._hook
            if hook is not None:
                self.stats.calls += 1
        if hook is None:
            return ReclaimResult()
        tls = self._tls
        saved = (tls.depth, tls.device, tls.observed)
        tls.depth, tls.device, tls.observed = tls.depth + 1, request.device, 0
        reported, raised = 0, False
        try:
            reported = int(hook(request) or 0)
        except Exception as exc:  # noqa: BLE001 - rule 6: the allocator must not see it
            raised = True
            logger.warning("native: reclaim hook raised %r; treating it as 0 bytes freed", exc)
            with self._mu:
                self.stats.errors += 1
                self.last_error = exc
        finally:
            observed = tls.observed
            tls.depth, tls.device, tls.observed = saved
        with self._mu:
            self.stats.bytes_reported += max(0, reported)
            self.stats.bytes_observed += observed
        return ReclaimResult(max(0, reported), observed, raised)

    def reclaim_and_retry(
        self, request: ReclaimRequest, try_alloc: Callable[[], bool], lock: _Lock | None = None
    ) -> bool:
        """The retry loop. ``lock`` (held by the caller) is released around each hook call."""
        if self._hook is None:
            return False
        if self.in_reclaim:
            with self._mu:
                self.stats.nested_skipped += 1
            return False
        for attempt in range(1, self.max_attempts + 1):
            req = ReclaimRequest(request.device, request.nbytes, request.stream, attempt)
            with _released(lock):
                result = self.call(req)
            if result.raised or result.effective <= 0:
                break
            if try_alloc():
                with self._mu:
                    self.stats.recovered += 1
                return True
        with self._mu:
            self.stats.exhausted += 1
        return False

    def retry_on_oom(
        self,
        fn: Callable[[], object],
        nbytes: int,
        device: int = 0,
        oom_types: tuple[type[BaseException], ...] | None = None,
    ) -> object:
        """Run ``fn``; on out-of-memory, reclaim and retry it (the stock-torch path).

        ``oom_types`` defaults to ``torch.OutOfMemoryError`` (and ``MemoryError``).
        """
        if oom_types is None:
            oom_types = (MemoryError,)
            try:
                import torch

                oom_types = (torch.OutOfMemoryError, MemoryError)
            except (ImportError, AttributeError):
                pass
        try:
            return fn()
        except oom_types as first:
            box: dict[str, object] = {}

            def again() -> bool:
                try:
                    box["value"] = fn()
                    return True
                except oom_types:
                    return False

            if self.reclaim_and_retry(ReclaimRequest(device=device, nbytes=nbytes), again):
                return box["value"]
            raise first


@contextmanager
def _released(lock: _Lock | None):
    if lock is None:
        yield
        return
    lock.release()
    try:
        yield
    finally:
        lock.acquire()


# ---------------------------------------------------------------- engine hooks


@dataclass(frozen=True, slots=True)
class ReadyNode:
    sequence_nr: int
    name: str


@dataclass(slots=True)
class EngineHookStats:
    fetch_calls: int = 0
    lookahead_calls: int = 0
    lookahead_nodes: int = 0
    dropped: int = 0
    nested_skipped: int = 0
    lookahead_errors: int = 0


class EngineHooks:
    """Fetch and look-ahead hooks (the engine half of the protocol).

    ``note_ready`` only records (it runs under the ready queue's lock natively);
    ``before_node`` delivers the recorded nodes to the look-ahead hook, then calls
    the fetch hook. Fetch errors propagate; look-ahead errors are counted.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._mu = threading.Lock()
        self._ring: deque[ReadyNode] = deque()
        self._capacity = max(1, capacity)
        self._fetch: Callable[[int, str], None] | None = None
        self._lookahead: Callable[[list[ReadyNode]], None] | None = None
        self._tls = threading.local()
        self.stats = EngineHookStats()

    def set_fetch_hook(self, fn: Callable[[int, str], None] | None) -> Handle:
        with self._mu:
            self._fetch = fn
        return Handle(lambda: self._clear("_fetch", fn))

    def set_lookahead_hook(self, fn: Callable[[list[ReadyNode]], None] | None) -> Handle:
        with self._mu:
            self._lookahead = fn
            if fn is None:
                self._ring.clear()
        return Handle(lambda: self._clear("_lookahead", fn))

    def _clear(self, attr: str, fn: object) -> bool:
        with self._mu:
            if getattr(self, attr) is not fn or fn is None:
                return False
            setattr(self, attr, None)
            if attr == "_lookahead":
                self._ring.clear()
            return True

    def note_ready(self, sequence_nr: int, name: str) -> None:
        if self._lookahead is None:
            return
        with self._mu:
            if len(self._ring) >= self._capacity:
                self._ring.popleft()
                self.stats.dropped += 1
            self._ring.append(ReadyNode(sequence_nr, name))

    def before_node(self, sequence_nr: int, name: str) -> None:
        if self._fetch is None and self._lookahead is None:
            return
        if getattr(self._tls, "depth", 0) > 0:
            with self._mu:
                self.stats.nested_skipped += 1
            return
        with self._mu:
            fetch, lookahead = self._fetch, self._lookahead
            ready = list(self._ring) if lookahead is not None else []
            self._ring.clear()
        self._tls.depth = getattr(self._tls, "depth", 0) + 1
        try:
            if lookahead is not None and ready:
                failed = False
                try:
                    lookahead(ready)
                except Exception as exc:  # noqa: BLE001 - look-ahead is advice
                    failed = True
                    logger.warning("native: look-ahead hook raised %r; ignored", exc)
                with self._mu:
                    self.stats.lookahead_calls += 1
                    self.stats.lookahead_nodes += len(ready)
                    self.stats.lookahead_errors += int(failed)
            if fetch is not None:
                with self._mu:
                    self.stats.fetch_calls += 1
                fetch(sequence_nr, name)
        finally:
            self._tls.depth -= 1


@dataclass(slots=True)
class SavedTensorIndex:
    """Names the saved tensors a node will unpack, by the node's sequence number.

    A pack hook runs right after its autograd Node was constructed, so on the
    packing thread that Node's ``sequence_nr`` is ``torch._C._dynn_peek_sequence_nr() - 1``
    (patched torch); the fetch hook receives the same number for the node about to
    run. Handles are whatever the runtime's pack hook returns.
    """

    _by_node: dict[int, list[object]] = field(default_factory=dict)
    _mu: threading.Lock = field(default_factory=threading.Lock)

    def add(self, sequence_nr: int, handle: object) -> None:
        with self._mu:
            self._by_node.setdefault(sequence_nr, []).append(handle)

    def for_node(self, sequence_nr: int) -> list[object]:
        with self._mu:
            return list(self._by_node.get(sequence_nr, ()))

    def for_nodes(self, sequence_nrs: Iterable[int]) -> list[object]:
        with self._mu:
            return [h for s in sequence_nrs for h in self._by_node.get(s, ())]

    def forget(self, sequence_nr: int) -> None:
        with self._mu:
            self._by_node.pop(sequence_nr, None)

    def forget_below(self, sequence_nr: int) -> None:
        """Drop the nodes numbered below ``sequence_nr`` (their graph is gone)."""
        with self._mu:
            for k in [k for k in self._by_node if k < sequence_nr]:
                del self._by_node[k]

    def __len__(self) -> int:
        with self._mu:
            return sum(len(v) for v in self._by_node.values())
