"""The native observer's books for storages whose deaths are heard by address (csrc/heard.h,
events.cpp invariant 9): on CUDA the caching allocator reports every block it frees; here, on the
CPU, the test reports the frees itself (``_C.report_free``), with covering off, so that the
bookkeeping the GPU runs without sweeping is exercised where no GPU is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.runtime.events import native_module

sys.path.insert(0, str(Path(__file__).parent))
from test_events import _frees  # noqa: E402

C = native_module()
pytestmark = pytest.mark.skipif(C is None, reason="the native event source is not built")
CPU = -1  # the device a CPU observer listens as


def _started() -> object:
    """A CPU observer keeping the books of a hearing CUDA observer, started, in a step."""
    ob = C.Observer("cpu")
    ob.cover = False
    ob.hear = True
    ob.start(None, None)
    ob.set_in_step(True)
    return ob


@pytest.fixture
def hearing():
    ob = _started()
    try:
        yield ob
    finally:
        ob.stop()


def _addr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_hearing_is_the_cuda_default_and_needs_covering_off_on_the_cpu():
    assert C.Observer("cuda").hear is True and C.Observer("cpu").hear is False
    ob = C.Observer("cpu")
    ob.hear = True  # covering on: nothing to hear
    ob.start(None, None)
    try:
        assert not ob.hearing and ob.heard == 0
    finally:
        ob.stop()


def test_storages_tracked_before_the_start_are_heard_from_it():
    """The model's parameters are registered at attach, before the observer starts: an operator
    may not touch them for a whole step (an expert no token chose), and until something hears them
    every new peak would sweep the table."""
    ob = C.Observer("cpu")
    ob.cover = False
    ob.hear = True
    w = torch.ones(512)
    sid = ob.track(w)
    assert ob.exposed == 1
    ob.start(None, None)
    try:
        assert ob.hearing and ob.exposed == 0 and ob.exposed_entries() == []
        addr, n, used = _addr(w), w.untyped_storage().nbytes(), ob.used
        del w
        C.report_free(CPU, addr)
        assert ob.used == used - n and not ob.alive(sid)
    finally:
        ob.stop()


def test_a_heard_death_is_learned_from_its_free_without_a_sweep(hearing):
    ob = hearing
    x = torch.ones(1024)
    y = x * 2
    sid, addr, n = ob.sid_of(y), _addr(y), y.untyped_storage().nbytes()
    assert ob.hearing and ob.heard >= 2 and ob.exposed == 0
    used, sweeps = ob.used, ob.sweeps
    del y
    assert ob.used == used, "nothing reported yet, and a heard storage is not swept for"
    C.report_free(CPU, addr)
    assert ob.used == used - n and not ob.alive(sid)
    assert ob.sweeps == sweeps
    assert sid in _frees(ob.take_log()[0])


def test_a_reported_address_whose_storage_lives_changes_nothing(hearing):
    ob = hearing
    x = torch.ones(256) + 1
    used, heard = ob.used, ob.heard
    C.report_free(CPU, _addr(x))  # its block's earlier owner, say
    C.report_free(1, _addr(x))  # another device's free
    assert ob.used == used and ob.heard == heard and ob.alive(ob.sid_of(x))


def test_data_replaced_in_place_is_heard_at_its_new_address(hearing):
    ob = hearing
    z = torch.ones(8)
    sid, old = ob.sid_of(z), _addr(z)
    z.resize_(4096)  # new data, the old given back
    z.add_(1)  # seen again
    new = _addr(z)
    assert new != old and ob.nbytes(sid) == 4096 * 4 and ob.exposed == 0
    used = ob.used
    C.report_free(CPU, old)  # the old data's free: no longer z's
    assert ob.used == used and ob.alive(sid)
    del z
    C.report_free(CPU, new)
    assert ob.used == used - 4096 * 4 and not ob.alive(sid)


def test_a_storage_away_is_not_heard_and_is_heard_again_when_back(hearing):
    ob = hearing
    x = torch.ones(512) * 3
    sid, heard = ob.sid_of(x), ob.heard
    ob.set_away(sid, True)
    assert ob.heard == heard - 1
    C.report_free(CPU, _addr(x))  # the data of a storage away is none of the table's business
    assert ob.alive(sid) and ob.heard == heard - 1
    ob.set_away(sid, False)
    assert ob.heard == heard and ob.exposed == 0


def test_a_new_storage_at_an_address_a_dead_one_still_holds_is_heard_at_once(hearing):
    """Storages over one buffer (``torch.frombuffer``: the same data address, as a block the
    allocator gave back and handed out again before its free was drained). The dead one is
    shadowed: its own free, reported first, still logs its death, and the new one is heard from
    its birth (no sweep needed). Only two live storages over one address leave one exposed."""
    ob = hearing
    buf = bytearray(4096)
    a = torch.frombuffer(buf, dtype=torch.float32)
    a.add_(1)  # seen: heard at the buffer's address
    dead = ob.sid_of(a)
    assert ob.exposed == 0
    del a  # its free not reported: the dead entry still holds the address
    b = torch.frombuffer(buf, dtype=torch.float32)
    b.add_(1)
    sid, heard, sweeps = ob.sid_of(b), ob.heard, ob.sweeps
    assert ob.exposed == 0 and ob.alive(dead) is False and heard >= 2, "both heard: the dead one shadowed"
    C.report_free(CPU, _addr(b))  # a's free, reported late
    assert ob.used > 0  # reading `used` drains
    assert ob.sid_of(b) == sid and ob.heard == heard - 1 and ob.exposed == 0
    assert dead in _frees(ob.take_log()[0]) and ob.sweeps == sweeps, "a's death heard, not swept for"
    b2 = torch.frombuffer(buf, dtype=torch.float32)  # a second live storage at the same address
    b2.add_(1)
    s2 = ob.sid_of(b2)
    assert ob.exposed == 1 and ob.exposed_entries() == [(s2, "shared")]
    del b2
    assert ob.exposed_entries() == [(s2, "dead")], "a dead exposed entry waits for a sweep"
    used, n, addr = ob.used, b.untyped_storage().nbytes(), _addr(b)
    del b
    C.report_free(CPU, addr)  # b's own free
    assert ob.used == used - n and not ob.alive(sid)


def test_shadowed_deaths_at_one_address_are_logged_in_the_order_of_their_frees(hearing):
    """Two storages die at one address before either free is drained, a third lives there: each
    reported free logs the death of the oldest entry still waiting for it."""
    ob = hearing
    buf = bytearray(1024)
    sids = []
    for _ in range(3):
        t = torch.frombuffer(buf, dtype=torch.float32)
        t.mul_(1)
        sids.append(ob.sid_of(t))
        if len(sids) < 3:
            del t
    ob.take_log()
    assert ob.exposed == 0
    addr = _addr(t)
    C.report_free(CPU, addr)
    assert ob.used > 0 and _frees(ob.take_log()[0]) == [sids[0]]
    C.report_free(CPU, addr)
    assert ob.used > 0 and _frees(ob.take_log()[0]) == [sids[1]]
    assert ob.alive(sids[2]) and ob.exposed == 0
    del t


def test_a_stopped_observer_no_longer_hears():
    ob = _started()
    try:
        x = torch.ones(64) * 2
        sid, addr = ob.sid_of(x), _addr(x)
    finally:
        ob.stop()
    assert not ob.hearing and ob.heard == 0 and ob.exposed >= 1
    del x
    C.report_free(CPU, addr)
    assert ob.alive(sid) is False  # dead, and found so by looking, not by a report
    assert ob.sweep() >= 1
