"""The cheap paths of a move and a fault do what their references do: the same transitions of the
same storages in the same order, the same statistics, training bit-identical to PyTorch alone."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.residency import AWAY, HOLDS_DEVICE, TRANSITIONS, Residency, Status
from dynn_runtime.runtime import hostpool
from dynn_runtime.runtime.events import native_module
from dynn_runtime.runtime.hostpool import HostPool
from dynn_runtime.runtime.moves import Moves
from dynn_runtime.runtime.native_source import NativeSource
from dynn_runtime.runtime.storages import _S, _u8

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

NATIVE = native_module() is not None
native_only = pytest.mark.skipif(not NATIVE, reason="the native event source is not built")

#: StepStats fields that are host times (they differ from run to run)
_TIMES = ("seconds", "_s")


def _counts(stats: dict) -> list[dict]:
    return [{k: v for k, v in step.items() if not any(t in k for t in _TIMES)} for step in stats["per_step"]]


def _run(family: str, fraction: float, reference: bool, monkeypatch) -> tuple:
    """``family`` under lru at ``fraction`` of its peak with the cheap paths on (or their references):
    its losses, final state, statistics, every status transition (sid, old, new), and how often the
    compact parse and the native byte view ran."""
    monkeypatch.setattr(Moves, "byte_view_in_c", not reference)
    monkeypatch.setattr(NativeSource, "skip_empty_parse", not reference)
    # every fault reads the log in both (test_fault_parse.py compares putting that read off): the
    # reads an empty log skips are those of a fault right after a decision
    monkeypatch.setattr(NativeSource, "defer_parse", False)
    transitions: list[tuple[int, str, str]] = []
    calls = {"parse": 0, "byte_view": 0}
    set_status = Residency.set_status
    parse = NativeSource._native_recency_parse
    mod = native_module()
    byte_view = mod.byte_view

    def spy_status(self, s, new):
        transitions.append((s.sid, s.status.value, new.value))
        set_status(self, s, new)

    def spy_parse(self, light):
        calls["parse"] += 1
        parse(self, light)

    def spy_view(st):
        calls["byte_view"] += 1
        return byte_view(st)

    monkeypatch.setattr(Moves, "set_status", spy_status)
    monkeypatch.setattr(NativeSource, "_native_recency_parse", spy_parse)
    monkeypatch.setattr(mod, "byte_view", spy_view)
    try:
        losses, state, stats = train_family(family, "lru", fraction, steps=4, events="native")
    finally:
        monkeypatch.undo()
    return losses, state, stats, transitions, calls


@native_only
@pytest.mark.parametrize("family", ["tree_lstm", "moe"])
def test_the_cheap_paths_move_what_the_references_move(family, monkeypatch):
    fraction = 0.6 if family == "tree_lstm" else 0.5
    base_losses, base_state, _ = train_family(family, steps=4)
    ref = _run(family, fraction, True, monkeypatch)
    fast = _run(family, fraction, False, monkeypatch)
    for losses, state, stats, _, _ in (ref, fast):
        assert stats["event_source"] == "native"
        assert losses == base_losses
        assert all(torch.equal(a, b) for a, b in zip(state, base_state, strict=True))
        assert sum(s["evictions"] for s in stats["per_step"]) > 0
    assert _counts(fast[2]) == _counts(ref[2])
    assert fast[3] == ref[3]  # the same transitions of the same storages, in the same order
    assert ref[4]["byte_view"] == 0 and fast[4]["byte_view"] > 0
    assert fast[4]["parse"] < ref[4]["parse"]  # reads that would have found nothing were skipped


@native_only
def test_the_native_byte_view_is_the_reference_view():
    mod = native_module()
    for dtype, n in ((torch.float32, 7), (torch.int64, 3), (torch.uint8, 0)):
        st = torch.arange(n).to(dtype).untyped_storage()
        ref, view = _u8(st, torch.device("cpu")), mod.byte_view(st)
        assert view.dtype == ref.dtype == torch.uint8 and view.shape == ref.shape == (st.nbytes(),)
        assert view.stride() == ref.stride() and view.storage_offset() == ref.storage_offset() == 0
        assert view.device == ref.device
        assert view.untyped_storage().data_ptr() == st.data_ptr()
        assert view.is_contiguous() and not view.requires_grad and view.grad_fn is None
        if n:
            view.fill_(7)  # a view over the storage itself, not a copy
            assert bytes(st) == bytes([7]) * st.nbytes()


def test_a_buffer_carved_where_one_was_is_the_same_buffer(monkeypatch):
    pool = HostPool(chunk_bytes=1 << 12)
    a = pool.alloc(100)
    a.tensor.fill_(1)
    pool.release(a)
    b = pool.alloc(100)
    assert b is a and b.tensor is a.tensor and (b.chunk, b.offset, b.nbytes) == (a.chunk, a.offset, a.nbytes)
    c = pool.alloc(64)  # another place: its own view, over its own bytes
    assert c.offset != b.offset and c.tensor.numel() == 64
    c.tensor.fill_(2)
    assert int(b.tensor.sum()) == 100  # untouched by c
    chunk = pool.chunks[c.chunk].data
    assert chunk[c.offset:c.offset + 64].eq(2).all()
    monkeypatch.setattr(hostpool, "_VIEWS", 2)  # a full cache starts over
    pool.release(b)
    d = pool.alloc(32)
    assert len(pool._bufs) == 1 and d.tensor.numel() == 32
    pool.close()
    assert pool._bufs == {}


class _Counted(Residency):
    def __init__(self) -> None:
        self.st, self.budget = {}, None
        self._init_residency()

        class _Policy:
            returned: list[int] = []

            def on_return(self, sid: int) -> None:
                self.returned.append(sid)

        self.policy = _Policy()


def test_set_status_keeps_the_counts_the_sets_define():
    """Every pair of statuses: a legal one moves ``used``, ``away`` and ``pending`` by what
    HOLDS_DEVICE, AWAY and OFFLOADING say, an illegal one is rejected and changes nothing."""
    for old, new in itertools.product(Status, Status):
        r = _Counted()
        s = _S(1, 1, None, 96, "temp", True, 0)
        s.status = old  # set up directly: the state machine's entry into ``old`` is not under test
        r.used = 96 if old in HOLDS_DEVICE else 0
        r.away = 96 if old in AWAY else 0
        if old is Status.OFFLOADING:
            r.pending, r.offloading[1] = 96, s
        if old is Status.FETCHING:
            r.fetching[1] = s
        if new not in TRANSITIONS[old]:
            with pytest.raises(Exception, match="illegal transition"):
                r.set_status(s, new)
            assert s.status is old
            continue
        r.set_status(s, new)
        assert s.status is new
        assert r.used == (96 if new in HOLDS_DEVICE else 0)
        assert r.away == (96 if new in AWAY else 0)
        assert r.pending == (96 if new is Status.OFFLOADING else 0)
        assert set(r.offloading) == ({1} if new is Status.OFFLOADING else set())
        assert set(r.fetching) == ({1} if new is Status.FETCHING else set())
        assert r.policy.returned[-1:] == ([1] if new is Status.RESIDENT and old is not Status.ABSENT else [])
        r.policy.returned.clear()
