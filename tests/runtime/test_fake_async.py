"""The asynchronous copy paths on the CPU, through a copy engine that behaves like a late, unordered
GPU (runtime/copies.py, FakeAsyncCopies): a missing event wait or an early release corrupts data,
and the bit-identity checks here see it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.runtime.copies import FakeAsyncCopies
from dynn_runtime.runtime.events import native_module

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

SOURCES = ["python", "native"] if native_module() is not None else ["python"]
FRACTION = {"moe": 0.125, "evoformer": 0.125, "varlen": 0.4}


def _train(family, budget=None, copies=None, events="python"):
    if budget is None:
        return train_family(family)
    return train_family(family, "lru", budget, events=events, copies=copies)


_BASE: dict = {}


def _base(family):
    if family not in _BASE:
        losses, state, _ = _train(family)
        _, _, stats = _train(family, 1 << 40)
        _BASE[family] = (losses, state, int(stats["peak_device_bytes"] * FRACTION[family]))
    return _BASE[family]


def _same(family, losses, state) -> bool:
    want_losses, want, _ = _base(family)
    return losses == want_losses and all(torch.equal(a, b) for a, b in zip(state, want, strict=True))


@pytest.mark.parametrize("events", SOURCES)
@pytest.mark.parametrize("family", sorted(FRACTION))
@pytest.mark.parametrize("schedule", [(0, 0.0), (1, 0.3), (2, 1.0)], ids=["never-early", "random", "eager"])
def test_late_unordered_copies_keep_the_bits(family, schedule, events):
    seed, p = schedule
    fake = FakeAsyncCopies(seed=seed, p_complete=p)
    losses, state, stats = _train(family, _base(family)[2], copies=fake, events=events)
    assert stats["bytes_offloaded"] > 0 and stats["bytes_fetched_on_demand"] > 0
    assert fake.poisoned_reads == 0
    if p == 0.0:
        assert fake.forced > 0, "copies completed only when waited for: every wait was exercised"
    assert _same(family, losses, state)


def _corrupted(family, fake) -> bool:
    """Poison read by the training either reaches an operator that checks its input (moe's routing
    indices: bincount raises) or changes the numbers."""
    try:
        losses, state, _ = _train(family, _base(family)[2], copies=fake)
    except RuntimeError:
        return True
    return not _same(family, losses, state)


def test_a_missing_compute_wait_is_caught(monkeypatch):
    """The manager without invariant 3 (compute waits for the H2D copy) reads poison: demand
    fetches on the side stream, as prefetches are."""
    from dynn_runtime.runtime.moves import Moves

    monkeypatch.setattr(Moves, "inline_demand_fetches", False)
    monkeypatch.setattr(FakeAsyncCopies, "compute_waits", lambda self, event: None)
    monkeypatch.setattr(FakeAsyncCopies, "timed_wait", lambda self, event: None)
    assert _corrupted("moe", FakeAsyncCopies(seed=0, p_complete=0.0))


def test_an_unordered_release_is_caught(monkeypatch):
    """Giving an evicted block back before its D2H copy read it (no stream order) loses the bytes."""
    monkeypatch.setattr(FakeAsyncCopies, "release", lambda self, st: st.resize_(0))
    fake = FakeAsyncCopies(seed=0, p_complete=0.0)
    assert _corrupted("moe", fake)
    assert fake.poisoned_reads > 0


@pytest.mark.parametrize("events", SOURCES)
def test_a_late_fetch_is_a_timed_stall_and_a_landed_one_is_none(events, monkeypatch):
    """Asynchronous copies on side streams: a fetch whose copy has not landed when the compute stream
    needs it is a late fetch, its wait timed by the copy engine's pair of events and summed into
    stall_seconds at the step's end (on CUDA: events on the compute stream); a copy that landed first
    costs nothing. A demand fetch the engine copies on the compute stream (``fetch_inline``) is a
    late fetch by construction."""
    from dynn_runtime.runtime.moves import Moves

    budget = _base("moe")[2]
    _, _, inline = _train("moe", budget, copies=FakeAsyncCopies(seed=2, p_complete=1.0), events=events)
    assert inline["late_fetches"] == inline["prefetch_misses"] > 0 and inline["stall_seconds"] > 0
    monkeypatch.setattr(Moves, "inline_demand_fetches", False)
    _, _, late = _train("moe", budget, copies=FakeAsyncCopies(seed=0, p_complete=0.0), events=events)
    assert late["bytes_fetched_on_demand"] > 0 and late["late_fetches"] >= late["prefetch_misses"] > 0
    assert late["stall_seconds"] > 0
    assert late["late_fetches"] == sum(s["late_fetches"] for s in late["per_step"] if s["managed"])
    for s in late["per_step"]:
        assert (s["stall_seconds"] > 0) == (s["late_fetches"] > 0)
    _, _, landed = _train("moe", budget, copies=FakeAsyncCopies(seed=2, p_complete=1.0), events=events)
    assert landed["bytes_fetched_on_demand"] > 0 and landed["late_fetches"] == 0 and landed["stall_seconds"] == 0


def test_a_sample_of_the_late_fetches_is_timed_and_scaled_up_to_all(monkeypatch):
    """Each late fetch's wait is ordered on the device; the step's first and one in
    ``time_late_every`` after it are also timed (two timing events each), and ``stall_seconds``
    is their time scaled up to every late fetch."""
    from dynn_runtime.runtime.moves import Moves

    budget = _base("moe")[2]
    losses, state, st = _train("moe", budget, copies=FakeAsyncCopies(seed=0, p_complete=0.0), events="native")
    assert _same("moe", losses, state)
    every = Moves.time_late_every
    for s in st["per_step"]:
        assert s["late_fetches_timed"] == -(-s["late_fetches"] // every)
        assert (s["stall_seconds"] > 0) == (s["late_fetches"] > 0)
    assert st["late_fetches"] > 2 * st["late_fetches_timed"] > 0
    monkeypatch.setattr(Moves, "time_late_every", 1)
    _, _, each = _train("moe", budget, copies=FakeAsyncCopies(seed=0, p_complete=0.0), events="native")
    assert each["late_fetches_timed"] == each["late_fetches"] == st["late_fetches"]


def test_a_demand_fetch_on_the_compute_stream_keeps_the_event_of_the_copy_that_filled_the_host_buffer():
    """A host read of the buffer (``state_dict``'s copy of a storage away) waits for that event; the
    compute stream's copy has none of its own."""
    import dynn_runtime as dr
    from dynn_runtime.residency import Status

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    want = model.weight.detach().clone()
    mm = dr.MemoryManager(1 << 40, policy="lru", device="cpu", events="native",
                          copies=FakeAsyncCopies(seed=0, p_complete=0.0))
    mm.attach(model)
    try:
        with mm.step():
            w = model.weight
            assert mm.offload(w) == w.numel() * 4
            s = mm.st[mm._sid(w)]
            filled = s.event
            assert filled is not None and not filled.op.done
            assert torch.equal(w.detach() * 1, want)  # a demand fetch, on the "compute stream"
            assert s.status is Status.RESIDENT and s.host_valid and s.event is filled and s.fetch_event is None
            assert mm.offload(w) == w.numel() * 4  # its host copy is valid: no copy
            assert s.event is filled
        assert torch.equal(model.state_dict()["weight"], want)
    finally:
        mm.detach()

