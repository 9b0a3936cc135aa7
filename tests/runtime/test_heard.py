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


def test_a_new_storage_at_an_address_a_dead_one_still_holds_stays_exposed_until_seen_again(hearing):
    """Two storages over one buffer (``torch.frombuffer``: the same data address, as a block the
    allocator gave back and handed out again before its free was drained)."""
    ob = hearing
    buf = bytearray(4096)
    a = torch.frombuffer(buf, dtype=torch.float32)
    a.add_(1)  # seen: heard at the buffer's address
    dead = ob.sid_of(a)
    assert ob.exposed == 0
    del a  # its free not reported: the dead entry still holds the address
    b = torch.frombuffer(buf, dtype=torch.float32)
    b.add_(1)
    sid = ob.sid_of(b)
    assert ob.exposed == 1, "two entries at one address: the new one is swept for"
    C.report_free(CPU, _addr(b))  # a's free, reported late
    assert ob.used > 0  # reading `used` drains: the dead one is forgotten
    assert not ob.alive(dead) and ob.alive(sid)
    b.add_(1)  # seen again: heard now
    assert ob.exposed == 0
    c = torch.frombuffer(buf, dtype=torch.float32)  # a second live storage at the same address
    c.add_(1)
    assert ob.exposed == 1 and ob.alive(ob.sid_of(c))
    del b, c


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
