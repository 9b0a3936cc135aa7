"""The Python mirror of the hook protocol (dynn_runtime.native.protocol)."""

from __future__ import annotations

import doctest
import threading

import pytest

from dynn_runtime.native import protocol
from dynn_runtime.native.protocol import EngineHooks, ReclaimRegistry, ReclaimRequest, SavedTensorIndex


class FakeAllocator:
    """Capacity-bounded allocator with a plain (non-reentrant) lock, like the C++ driver."""

    def __init__(self, reg: ReclaimRegistry, capacity: int, device: int = 0) -> None:
        self.lock = threading.Lock()
        self.capacity, self.used, self.live, self.next = capacity, 0, {}, 1
        self.reg, self.device = reg, device

    def _try(self, n: int, out: list) -> bool:
        if self.used + n > self.capacity:
            return False
        self.used += n
        self.live[self.next] = n
        out.append(self.next)
        self.next += 1
        return True

    def malloc(self, n: int) -> int:
        out: list = []
        self.lock.acquire()
        try:
            if not self._try(n, out):
                self.reg.reclaim_and_retry(ReclaimRequest(self.device, n), lambda: self._try(n, out), self.lock)
            assert self.lock.locked()
        finally:
            self.lock.release()
        return out[0] if out else 0

    def free(self, bid: int) -> None:
        with self.lock:  # would deadlock if called from a hook while malloc held it
            n = self.live.pop(bid, 0)
            self.used -= n
        self.reg.note_free(self.device, n)


def test_docstring_example_runs():
    assert doctest.testmod(protocol).failed == 0


def test_reentrant_free_recovers_and_is_observed():
    reg = ReclaimRegistry()
    a = FakeAllocator(reg, 100)
    victim = a.malloc(60)
    seen = {}

    def hook(req):
        seen["lock_free"] = not a.lock.locked()
        a.free(victim)
        return 0  # under-reports: the observed free justifies the retry

    reg.set_hook(hook)
    assert a.malloc(60) != 0
    assert seen["lock_free"]
    assert reg.stats.recovered == 1 and reg.stats.bytes_observed == 60


def test_no_hook_and_nothing_freed_is_oom():
    reg = ReclaimRegistry()
    a = FakeAllocator(reg, 100)
    a.malloc(90)
    assert a.malloc(50) == 0
    reg.set_hook(lambda req: 0)
    assert a.malloc(50) == 0
    assert reg.stats.calls == 1 and reg.stats.exhausted == 1


def test_bounded_retries_and_attempt_numbers():
    reg = ReclaimRegistry(max_attempts=3)
    a = FakeAllocator(reg, 100)
    small = [a.malloc(10) for _ in range(10)]
    attempts = []

    def hook(req):
        attempts.append(req.attempt)
        a.free(small.pop())
        return 10

    reg.set_hook(hook)
    assert a.malloc(50) == 0
    assert attempts == [1, 2, 3]


def test_hook_exception_is_contained():
    reg = ReclaimRegistry()
    a = FakeAllocator(reg, 100)
    a.malloc(90)

    def hook(req):
        raise RuntimeError("offload failed")

    reg.set_hook(hook)
    assert a.malloc(50) == 0
    assert not a.lock.locked()
    assert reg.stats.errors == 1 and str(reg.last_error) == "offload failed"


def test_nested_allocation_inside_hook_does_not_recurse():
    reg = ReclaimRegistry()
    a = FakeAllocator(reg, 100)
    victim = a.malloc(90)
    inner = []

    def hook(req):
        assert reg.in_reclaim
        inner.append(a.malloc(70))  # fails, must not re-enter
        a.free(victim)
        return 90

    reg.set_hook(hook)
    assert a.malloc(50) != 0
    assert inner == [0] and reg.stats.nested_skipped == 1 and not reg.in_reclaim


def test_gil_like_lock_does_not_deadlock():
    """A 'GIL' holder allocating in a loop while another thread's hook waits for the 'GIL'."""
    reg = ReclaimRegistry()
    a = FakeAllocator(reg, 1000)
    gil = threading.Lock()
    victims = [a.malloc(100) for _ in range(9)]

    def hook(req):
        with gil:
            for _ in range(3):
                a.free(victims.pop())
        return 300

    reg.set_hook(hook)
    holding = threading.Event()
    result = {}

    def gil_holder():
        with gil:
            holding.set()
            for _ in range(500):
                bid = a.malloc(1)
                if bid:
                    a.free(bid)

    def reclaimer():
        result["id"] = a.malloc(300)

    t1 = threading.Thread(target=gil_holder, daemon=True)
    t1.start()
    holding.wait(5)
    t2 = threading.Thread(target=reclaimer, daemon=True)
    t2.start()
    t2.join(10)
    t1.join(10)
    assert not t2.is_alive(), "deadlock: reclaim did not finish"
    assert result["id"] != 0


def test_concurrent_reclaims_from_threads():
    reg = ReclaimRegistry()
    a = FakeAllocator(reg, 2000)
    pool_lock = threading.Lock()
    victims = [a.malloc(100) for _ in range(20)]

    def hook(req):
        freed = 0
        while freed < req.nbytes:
            with pool_lock:
                if not victims:
                    break
                v = victims.pop()
            a.free(v)
            freed += 100
        return freed

    reg.set_hook(hook)
    ok = []

    def worker():
        for _ in range(5):
            ok.append(bool(a.malloc(100)))

    ts = [threading.Thread(target=worker) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert ok.count(True) == 20 and a.used <= a.capacity


def test_handle_remove_is_token_checked():
    reg = ReclaimRegistry()
    h1 = reg.set_hook(lambda r: 0)
    h2 = reg.set_hook(lambda r: 0)
    assert h1.remove() is False and reg.has_hook
    assert h2.remove() is True and not reg.has_hook


def test_retry_on_oom_runs_function_again():
    reg = ReclaimRegistry()
    state = {"room": False}
    reg.set_hook(lambda r: state.update(room=True) or r.nbytes)

    def op():
        if not state["room"]:
            raise MemoryError("CUDA out of memory")
        return "ok"

    assert reg.retry_on_oom(op, nbytes=8, oom_types=(MemoryError,)) == "ok"
    state["room"] = False
    reg.set_hook(lambda r: 0)
    with pytest.raises(MemoryError):
        reg.retry_on_oom(op, nbytes=8, oom_types=(MemoryError,))


def test_engine_hooks_lookahead_then_fetch_and_ring_bound():
    eh = EngineHooks(capacity=2)
    events = []
    eh.set_lookahead_hook(lambda nodes: events.append(("ahead", [n.sequence_nr for n in nodes])))
    eh.set_fetch_hook(lambda seq, name: events.append(("fetch", seq, name)))
    for s in (1, 2, 3):
        eh.note_ready(s, "X")
    eh.before_node(3, "MulBackward0")
    assert events == [("ahead", [2, 3]), ("fetch", 3, "MulBackward0")]
    assert eh.stats.dropped == 1


def test_engine_hooks_reentrancy_and_errors():
    eh = EngineHooks()
    calls = []

    def fetch(seq, name):
        calls.append(seq)
        eh.before_node(seq + 1, "inner")  # backward from inside the hook
        if seq == 99:
            raise RuntimeError("cannot fetch")

    eh.set_fetch_hook(fetch)
    eh.set_lookahead_hook(lambda nodes: 1 / 0)
    eh.note_ready(5, "n")
    eh.before_node(1, "outer")
    assert calls == [1] and eh.stats.nested_skipped == 1 and eh.stats.lookahead_errors == 1
    with pytest.raises(RuntimeError, match="cannot fetch"):
        eh.before_node(99, "x")
    eh.before_node(2, "after")
    assert calls == [1, 99, 2]


def test_saved_tensor_index():
    idx = SavedTensorIndex()
    idx.add(7, "a")
    idx.add(7, "b")
    idx.add(9, "c")
    assert idx.for_node(7) == ["a", "b"] and idx.for_nodes([9, 7]) == ["c", "a", "b"] and len(idx) == 3
    idx.forget(7)
    assert idx.for_node(7) == []
