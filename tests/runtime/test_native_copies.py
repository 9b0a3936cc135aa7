"""The copy engine in C++ (``csrc/copies.cpp``) on its ``log`` device: the CPU, with streams and
events that log what they were asked. The copies run at once there, so these tests read the
protocol that orders them on a GPU (runtime/copies.py's rules), and train under the engine bit for
bit; on CUDA, tests/runtime/test_cuda.py runs it on real streams."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dynn_runtime.runtime.copies import native_copies
from dynn_runtime.runtime.events import native_module

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native extension is not built")

COMPUTE = 0


def _engine():
    return native_copies("log", 0, False)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return native_module().byte_view(t.untyped_storage())


def check_protocol(log, d2h: int, h2d: int) -> dict:
    """Every rule of runtime/copies.py that the log can show, for every copy in ``log``: a copy runs on
    its side stream, after that side stream waited, within the same call, for a point just recorded
    on the compute stream; the compute stream is current again right after it; the copy's event is
    recorded on its side stream and its device block is kept for that stream. A demand fetch
    (``fetch_inline``) runs on the compute stream, with no stream switch around it. A block the engine
    gives back is given back on the compute stream right after it was kept for the eviction's side
    stream; one it allocates, on the compute stream. Returns, per side-stream copy's event id, the
    stream it was recorded on."""
    current = COMPUTE
    recorded: dict[int, int] = {}  # event -> the stream of its latest record
    waited_since: set[tuple[int, int]] = set()  # (waiting stream, stream the event was recorded on) since the last copy
    done: dict[int, int] = {}
    i = 0
    while i < len(log):
        what, a, b = log[i]
        if what == "record":
            recorded[a] = b
        elif what == "wait":
            waited_since.add((b, recorded[a]))
        elif what == "stream":
            current = a
        elif what == "release":
            assert current == COMPUTE and a == COMPUTE, "a block was given back off the compute stream"
            assert log[i - 1] == ("keep", d2h, -1), "a block was given back before it was kept for its copy"
        elif what == "allocate":
            assert current == COMPUTE and a == COMPUTE, "a block was allocated off the compute stream"
        elif what == "copy" and current == COMPUTE:  # a demand fetch, inline
            assert i + 1 == len(log) or log[i + 1][0] != "stream", "an inline copy switched streams"
            waited_since = set()
        elif what == "copy":
            side = current
            assert side in (d2h, h2d), f"a copy ran on stream {side}, not a side stream"
            assert (side, COMPUTE) in waited_since, f"a copy on stream {side} did not wait for the compute stream"
            tail = log[i + 1:i + 4]
            assert tail[0] == ("stream", COMPUTE, side), "the compute stream is not current right after a copy"
            assert tail[1][0] == "record" and tail[1][2] == side, "the copy's event is not recorded on its stream"
            assert tail[2] == ("keep", side, -1), "the copy's device block is not kept for its side stream"
            done[tail[1][1]] = side
            waited_since = set()
        i += 1
    assert current == COMPUTE
    return done


def test_an_eviction_waits_for_the_compute_stream_and_the_stream_that_last_used_the_bytes():
    eng = _engine()
    d2h, h2d = eng.stream_ids
    x = torch.randn(64)
    host = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8)
    eng.to_host(_bytes(x), host, 7)  # last used on stream 7
    log = eng.take_log()
    check_protocol(log, d2h, h2d)
    on7 = {a for what, a, b in log if what == "record" and b == 7}
    copy_at = next(i for i, e in enumerate(log) if e[0] == "copy")
    assert any(e[0] == "wait" and e[1] in on7 and e[2] == d2h for e in log[:copy_at]), log
    assert torch.equal(host, _bytes(x))
    eng.to_host(_bytes(x), host, COMPUTE)  # last used on the compute stream: no second wait
    assert not any(e[0] == "record" and e[2] not in (COMPUTE, d2h) for e in eng.take_log())


def test_a_fetch_waits_for_the_copy_that_filled_its_host_buffer_and_the_compute_stream_for_the_fetch():
    eng = _engine()
    d2h, h2d = eng.stream_ids
    x = torch.randn(256)
    want = x.clone()
    host = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8)
    out = eng.to_host(_bytes(x), host, None)
    x.zero_()
    back = eng.to_device(host, _bytes(x), out)
    eng.compute_waits(back)
    log = eng.take_log()
    done = check_protocol(log, d2h, h2d)
    (out_id,) = [e for e, s in done.items() if s == d2h]
    (back_id,) = [e for e, s in done.items() if s == h2d]
    h2d_copy = max(i for i, e in enumerate(log) if e[0] == "copy")
    assert ("wait", out_id, h2d) in log[:h2d_copy], "the fetch did not wait for the eviction's copy"
    assert log[-1] == ("wait", back_id, COMPUTE), "the compute stream did not wait for the fetch"
    assert torch.equal(x, want)


def test_evict_and_fetch_take_the_storage_and_ask_what_the_views_ask():
    """The manager's calls (``takes_storages``): the byte view over the device storage made in the
    engine, the same streams, events, waits and copies as ``to_host``/``to_device`` on views."""
    logs = []
    for storages in (True, False):
        eng = _engine()
        x = torch.randn(256)
        want = x.clone()
        host = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8)
        if storages:
            out = eng.evict(x.untyped_storage(), host, 5)
            x.zero_()
            back = eng.fetch(host, x.untyped_storage(), out)
        else:
            out = eng.to_host(_bytes(x), host, 5)
            x.zero_()
            back = eng.to_device(host, _bytes(x), out)
        eng.compute_waits(back)
        assert torch.equal(x, want)
        logs.append(eng.take_log())
    assert logs[0] == logs[1] and any(e[0] == "copy" for e in logs[0])
    assert native_copies("log", 0, False).takes_storages


def test_events_query_synchronize_and_time_a_late_wait():
    eng = _engine()
    x = torch.randn(16)
    host = torch.empty(64, dtype=torch.uint8)
    ev = eng.to_host(_bytes(x), host, None)
    assert not ev.query() and ev.query()  # the log device's event: late once, then reached
    ev2 = eng.to_host(_bytes(x), host, None)
    ev2.synchronize()
    assert ev2.query()
    before, after = eng.timed_wait(ev)
    assert before.elapsed_time(after) == 0.0
    log = eng.take_log()
    assert sum(e[0] == "sync_event" for e in log) == 1
    assert [e[0] for e in log[-3:]] == ["record", "wait", "record"] and log[-2][2] == COMPUTE
    eng.sync()
    assert [e[0] for e in eng.take_log()] == ["sync_stream"] * 3
    del eng
    assert ev.query()  # an event outlives its engine


def _last_copy_event_in(log: list, side: int) -> int:
    i = max(i for i, e in enumerate(log) if e[0] == "copy")
    assert log[i + 2][0] == "record" and log[i + 2][2] == side
    return log[i + 2][1]


def _last_copy_event(eng, full: list, side: int) -> int:
    """The last copy's event id (recorded on its side stream right after the copy), ``full`` extended
    with what the engine logged since."""
    full.extend(eng.take_log())
    i = max(i for i, e in enumerate(full) if e[0] == "copy")
    assert full[i + 2][0] == "record" and full[i + 2][2] == side
    return full[i + 2][1]


@pytest.mark.parametrize("reuse", [True, False])
def test_a_copy_reuses_the_event_of_a_copy_whose_event_died_and_never_one_still_held(reuse):
    eng = native_copies("log", 0, False, reuse_events=reuse)
    d2h, h2d = eng.stream_ids
    full: list = []
    x = torch.randn(16)
    host = torch.empty(64, dtype=torch.uint8)
    held = eng.to_host(_bytes(x), host, None)
    first = _last_copy_event(eng, full, d2h)
    gone = eng.to_host(_bytes(x), host, None)
    second = _last_copy_event(eng, full, d2h)
    assert second != first, "an event still held went to another copy"
    del gone
    back = eng.to_device(host, _bytes(x), held)
    third = _last_copy_event(eng, full, h2d)
    assert (third == second) == reuse
    assert ("wait", first, h2d) in full, "the fetch waits for the eviction's own event"
    eng.compute_waits(back)
    full.extend(eng.take_log())
    assert full[-1] == ("wait", third, COMPUTE)
    check_protocol(full, d2h, h2d)
    before, after = eng.timed_wait(back)
    del before, after
    again = eng.timed_wait(back)
    timing = [e[1] for e in eng.take_log() if e[0] == "record"]
    assert (set(timing[:2]) == set(timing[2:])) == reuse and third not in timing  # apart from copies'
    del again


def test_a_copy_that_raises_leaves_the_compute_stream_current():
    eng = _engine()
    d2h, _ = eng.stream_ids
    x = torch.randn(64)
    with pytest.raises(RuntimeError):
        eng.to_host(_bytes(x), torch.empty(3, dtype=torch.uint8), None)  # the wrong size
    log = eng.take_log()
    assert ("stream", d2h, COMPUTE) in log and log[-1] == ("stream", COMPUTE, d2h)


def test_the_engine_names_its_devices():
    with pytest.raises(RuntimeError, match="runs on cuda"):
        native_copies("xpu", 0, False)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cuda"):
            native_copies("cuda", 0, True)


@pytest.mark.parametrize("events", ["python", "native"])
def test_training_through_the_engine_is_bit_identical_and_every_copy_keeps_the_protocol(events):
    want_losses, want, _ = train_family("moe")
    _, _, stats = train_family("moe", "lru", 1 << 40)
    budget = int(stats["peak_device_bytes"] * 0.125)
    eng = _engine()
    d2h, h2d = eng.stream_ids
    losses, state, stats = train_family("moe", "lru", budget, events=events, copies=eng)
    assert stats["bytes_offloaded"] > 0 and stats["bytes_fetched_on_demand"] > 0
    assert losses == want_losses and all(torch.equal(a, b) for a, b in zip(state, want, strict=True))
    log = eng.take_log()
    done = check_protocol(log, d2h, h2d)
    fetched = {e for e, s in done.items() if s == h2d}
    waited = {a for what, a, b in log if what == "wait" and b == COMPUTE}
    assert fetched <= waited, f"{len(fetched - waited)} fetches the compute stream never waited for"
    copies_on = {stream: sum(e[0] == "copy" and e[1] == stream for e in log) for stream in (COMPUTE, d2h, h2d)}
    assert copies_on[COMPUTE] > 0 and copies_on[d2h] > 0, copies_on  # demand fetches inline; evictions
    # every eviction gave its block back in the engine's call, every demand fetch got one there
    said = {what: sum(e[0] == what for e in log) for what in ("release", "allocate")}
    assert said == {"release": copies_on[d2h], "allocate": copies_on[COMPUTE]}, (said, copies_on)


def test_an_eviction_gives_the_block_back_after_keeping_it_for_its_copy_and_a_demand_fetch_allocates_one():
    eng = _engine()
    d2h, h2d = eng.stream_ids
    x = torch.randn(256)
    want = x.clone()
    st = x.untyped_storage()
    host = torch.empty(st.nbytes(), dtype=torch.uint8)
    out = eng.evict(st, host, None, release=True)
    assert st.nbytes() == 0 and torch.equal(host, _bytes(want))
    log = eng.take_log()
    check_protocol(log, d2h, h2d)
    assert log[-2:] == [("keep", d2h, -1), ("release", COMPUTE, 1024)], log[-3:]
    assert eng.fetch_inline(host, st, out, nbytes=1024) is None
    assert st.nbytes() == 1024 and torch.equal(x, want)  # the tensor over the storage reads its bytes again
    out_id = _last_copy_event_in(log, d2h)
    assert eng.take_log() == [("allocate", COMPUTE, 1024), ("wait", out_id, COMPUTE), ("copy", COMPUTE, 1024)]


def test_a_demand_fetch_whose_allocation_runs_out_raises_the_allocators_error_and_changes_nothing():
    eng = _engine()
    x = torch.randn(64)
    want = x.clone()
    st = x.untyped_storage()
    host = torch.empty(st.nbytes(), dtype=torch.uint8)
    out = eng.evict(st, host, None, release=True)
    eng.take_log()
    eng.fail_allocations(1)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        eng.fetch_inline(host, st, out, nbytes=256)
    assert st.nbytes() == 0 and eng.take_log() == []  # no block, no copy, no wait
    eng.fetch_inline(host, st, out, nbytes=256)  # the retry
    assert torch.equal(x, want)
    with pytest.raises(RuntimeError, match="holds 256 bytes"):  # a block is only ever given to an empty storage
        eng.fetch_inline(host, st, out, nbytes=256)


def test_training_through_the_engine_retries_a_demand_fetch_whose_allocation_ran_out():
    """The manager's own allocation running out (the allocator's count is not the manager's): room is
    made and the fetch tried once more, and training stays bit-identical."""
    want_losses, want, _ = train_family("moe")
    _, _, stats = train_family("moe", "lru", 1 << 40)
    budget = int(stats["peak_device_bytes"] * 0.25)
    engine = type(_engine())
    armed = []

    class Failing(engine):
        def fetch_inline(self, src, st, after, timed=False, nbytes=None):
            if not armed:  # the run's first demand fetch runs out once
                armed.append(nbytes)
                self.fail_allocations(1)
            return engine.fetch_inline(self, src, st, after, timed, nbytes)

    eng = Failing("log", 0, False)
    losses, state, stats = train_family("moe", "lru", budget, events="native", copies=eng)
    assert armed and armed[0] > 0 and stats["bytes_fetched_on_demand"] > 0 and stats["oom_retries"] == 1
    assert any(e[0] == "allocate" for e in eng.take_log())
    assert losses == want_losses and all(torch.equal(a, b) for a, b in zip(state, want, strict=True))


def test_a_demand_fetch_is_copied_on_the_compute_stream_after_the_copy_that_filled_its_host_buffer():
    eng = _engine()
    d2h, h2d = eng.stream_ids
    x = torch.randn(256)
    want = x.clone()
    host = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8)
    out = eng.evict(x.untyped_storage(), host, None)
    x.zero_()
    assert eng.fetch_inline(host, x.untyped_storage(), out) is None
    log = eng.take_log()
    check_protocol(log, d2h, h2d)
    out_id = _last_copy_event_in(log[:-1], d2h)
    assert log[-2:] == [("wait", out_id, COMPUTE), ("copy", COMPUTE, 1024)], log[-3:]
    assert torch.equal(x, want)
    before, after = eng.fetch_inline(host, x.untyped_storage(), None, timed=True)
    log = eng.take_log()
    assert [e[0] for e in log] == ["record", "copy", "record"] and log[0][2] == log[2][2] == COMPUTE
    assert before.elapsed_time(after) == 0.0


def test_a_step_waits_for_the_device_at_its_end_only_where_it_moved_something():
    """The step's end synchronizes the streams to settle copies in flight; a step with none (nothing
    moved) must not, or the host could never run ahead of the device into the next step."""
    import dynn_runtime as dr
    from dynn_runtime.workload import load_workload, make_optimizer

    def run(budget) -> tuple[list[int], int]:
        wl = load_workload("moe", preset="tiny", seed=0)
        model = wl.model
        opt = make_optimizer(wl, model.parameters())
        eng = _engine()
        mm = dr.MemoryManager(budget, policy="lru", device="cpu", copies=eng).attach(model, opt)
        syncs = []
        try:
            for step in range(3):
                with mm.step():
                    wl.loss(model, wl.make_batch(step)).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                syncs.append(sum(e[0] == "sync_stream" for e in eng.take_log()))
            moved = mm.stats()["bytes_offloaded"]
        finally:
            mm.detach()
        return syncs, moved

    idle, moved = run(1 << 40)
    assert moved == 0 and idle == [0, 0, 0]
    busy, moved = run(0.25)  # the first step measures the peak; the others move
    assert moved > 0 and all(n > 0 for n in busy[1:]), busy
