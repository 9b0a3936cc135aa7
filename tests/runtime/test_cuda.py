"""The live manager on CUDA: real streams, events and pinned memory (``gpu``: skipped without CUDA).

Every managed run is compared bit for bit with PyTorch alone, both sides under deterministic
algorithms (some CUDA kernels differ from themselves run to run otherwise), through each event
source that loads here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dynn_runtime.runtime.events import native_module, resolve
from dynn_runtime.runtime.manager import MemoryManager
from dynn_runtime.runtime.train import deterministic, state_digests, train_managed, train_unmanaged
from dynn_runtime.workload import load_workload, make_optimizer, to_device, train_step

pytestmark = pytest.mark.gpu


def _sources() -> list[str]:
    out = ["python"]
    try:
        if resolve("native")[0] == "native":
            out.append("native")
    except Exception:  # noqa: BLE001 - the native source is optional
        pass
    return out


#: the copy engines: runtime/copies.py's CudaCopies, and the C++ one (MemoryManager.copies_in_c), its
#: copies one cudaMemcpyAsync each (MemoryManager.raw_copies) or a Tensor.copy_ each
ENGINES = ["python", "native", "native-tensorcopy"]


def _engine(monkeypatch, engine: str) -> None:
    if engine != "python" and native_module() is None:
        pytest.skip("the native extension is not built")
    monkeypatch.setattr(MemoryManager, "copies_in_c", engine != "python")
    monkeypatch.setattr(MemoryManager, "raw_copies", engine == "native")


def _engine_of(mm: MemoryManager) -> str:
    if type(mm._copies).__name__ != "NativeCopies":
        return "python"
    return "native" if mm._copies.raw_copies else "native-tensorcopy"


def test_a_cuda_build_copies_with_one_cudamemcpyasync_where_it_hears_the_allocator():
    """Both need CUDA's headers at the build (CMakeLists.txt); the raw copy also finds torch's CUDA
    runtime at run time (csrc/copies_cuda.cpp)."""
    mod = native_module()
    if mod is None:
        pytest.skip("the native extension is not built")
    assert mod.RAW_CUDA_COPIES == mod.HEAR_CUDA
    from dynn_runtime.runtime.copies import native_copies

    assert native_copies("cuda", 0, True).raw_copies == mod.RAW_CUDA_COPIES
    assert not native_copies("cuda", 0, True, raw_copies=False).raw_copies
    assert not native_copies("cuda", 0, False).raw_copies  # pageable: blocking copies stay copy_'s


def test_the_raw_copy_is_taken_only_for_the_same_bytes_on_both_sides():
    """A raw copy is n bytes from pointer to pointer: another dtype, a strided view or another size
    goes to copy_ (its conversion, or its error), never past the end of a buffer."""
    mod = native_module()
    if mod is None or not mod.RAW_CUDA_COPIES:
        pytest.skip("no raw CUDA copy in this build")
    from dynn_runtime.runtime.copies import native_copies

    engine = native_copies("cuda", 0, True)
    assert engine.raw_copies
    src = torch.arange(64, dtype=torch.float32, device="cuda")
    same = torch.empty(64, dtype=torch.float32).pin_memory()
    engine.to_host(src, same).synchronize()
    assert torch.equal(same, src.cpu())
    other = torch.empty(64, dtype=torch.float64).pin_memory()  # copy_ converts
    engine.to_host(src, other).synchronize()
    assert torch.equal(other, src.cpu().double())
    strided = torch.arange(128, dtype=torch.float32, device="cuda")[::2]  # copy_ gathers it first
    engine.to_host(strided, same).synchronize()
    assert torch.equal(same, strided.cpu())
    back = torch.empty(32, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError):  # 64 floats into 32: copy_'s error, not 128 bytes past the end
        engine.to_device(same, back)
    engine.sync()


@pytest.fixture(autouse=True)
def _deterministic():
    with deterministic():
        yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("events", _sources())
def test_offloaded_tensor_comes_back_bit_identical(events, engine, monkeypatch):
    monkeypatch.setenv("DYNN_EVENTS", events)
    _engine(monkeypatch, engine)
    model = torch.nn.Linear(256, 256).cuda()
    x = torch.randn(1024, 256, device="cuda")
    with MemoryManager(budget=64 << 20, policy="lru", device="cuda").attach(model) as mm:
        assert _engine_of(mm) == engine
        with mm.step():
            torch.cuda._sleep(50_000_000)  # the compute stream is busy: the eviction's copy must wait for it
            y = model(x) * 3.0
            want = y.clone()
            nbytes = y.untyped_storage().nbytes()
            assert mm.offload(y) == nbytes
            assert y.untyped_storage().nbytes() == 0, "the device copy is released at once (stream-ordered)"
            assert any(True for _ in mm.offloaded())
            got = y + 0.0  # the next use brings it back, ordered on the GPU
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert mm.stats()["bytes_offloaded"] >= nbytes


@pytest.mark.parametrize("events", _sources())
@pytest.mark.parametrize("family,fraction", [("moe", 0.25), ("evoformer", 0.25), ("tree_lstm", 0.4)])
def test_training_through_the_native_copy_engine_is_bit_identical(family, fraction, events, monkeypatch):
    """lru at a fraction of the peak (a logical budget) with every copy issued by csrc/copies.cpp.
    (At 1/4 of tree_lstm's peak one operator of its backward needs more than the budget.)"""
    monkeypatch.setenv("DYNN_EVENTS", events)
    _engine(monkeypatch, "native")
    base = train_unmanaged(family, steps=3, preset="small", device="cuda")
    r = train_managed(family, int(max(base.peak_bytes) * fraction), "lru", steps=3, preset="small", device="cuda")
    assert r.stats["bytes_offloaded"] > 0 and r.stats["bytes_fetched_on_demand"] > 0
    differ = [k for k, v in r.tensor_digests.items() if base.tensor_digests.get(k) != v]
    assert not differ, f"{len(differ)} tensors differ from PyTorch alone, e.g. {differ[:3]}"
    assert r.losses == base.losses


@pytest.mark.parametrize("events", _sources())
@pytest.mark.parametrize("family,fraction", [("moe", 0.25), ("varlen", 0.3), ("evoformer", 0.25)])
def test_training_under_a_hard_cap_is_bit_identical(family, fraction, events, monkeypatch):
    """Adam's CUDA default (foreach) included; the caching allocator enforces the cap (an overshoot
    is an OutOfMemoryError), so the manager must leave room for what it does not manage."""
    monkeypatch.setenv("DYNN_EVENTS", events)
    base = train_unmanaged(family, steps=3, preset="small", device="cuda")
    cap = int(max(base.peak_bytes) * fraction)
    r = train_managed(family, cap, "lru", steps=3, preset="small", device="cuda", hard_cap=True)
    st = r.stats
    assert st["event_source"] == events
    assert st["bytes_offloaded"] > 0, "the cap must make the manager move something"
    differ = [k for k, v in r.tensor_digests.items() if base.tensor_digests.get(k) != v]
    assert not differ, f"{len(differ)} tensors differ from PyTorch alone, e.g. {differ[:3]}"
    assert r.losses == base.losses
    assert st["hard_cap_bytes"] == cap and st["budget_bytes"] < cap
    # operators the allocator ran out in were retried after room was made (runtime/oom.py), and counted
    assert st["oom_retries"] == sum(s["oom_retries"] for s in st["per_step"] if s["managed"])


@pytest.mark.parametrize("events", _sources())
def test_an_operator_the_capped_allocator_cannot_fit_is_retried_after_room_is_made(events, monkeypatch):
    """Under a hard cap of 64 MiB, with memory the manager does not see (a 16 MiB block allocated
    with the manager's own work suspended, as a workspace or a partly used segment would be), an
    8 MiB operator fits the manager's count but not the allocator's: it needs a new 20 MiB segment.
    The operator's OOM is caught, the two least recently used 4 MiB tensors (adjacent in their
    segment) are evicted, and the retry fits in the hole they leave; every value is as computed."""
    monkeypatch.setenv("DYNN_EVENTS", events)
    from dynn_runtime.runtime.events import no_mode

    torch.cuda.empty_cache()
    mib = 1 << 20
    model = torch.nn.Linear(8, 8).cuda()
    with MemoryManager(budget=64 * mib, policy="lru", device="cuda", hard_cap=True).attach(model) as mm:
        assert mm.event_source == events
        allowed = mm.cap_bytes + mm._outside0  # the allocator's limit (budget.py: _apply_hard_cap)
        with mm.step():
            xs = [torch.full((mib,), float(i), device="cuda") for i in range(9)]  # 4 MiB each: 36 MiB
            with no_mode():
                hidden = torch.empty(16 * mib, dtype=torch.uint8, device="cuda")
            assert mm.used + 8 * mib <= mm.budget, "the manager's count says the next operator fits"
            assert torch.cuda.memory_reserved() + 20 * mib > allowed, "the allocator has no room for a new segment"
            y = torch.full((2 * mib,), 1.0, device="cuda")  # 8 MiB: runs out, is retried
            assert mm._cur.oom_retries == 1 and mm._cur.evictions >= 2
            del hidden
            assert y.sum().item() == 2 * mib
            assert [x[0].item() for x in xs] == [float(i) for i in range(9)]
            assert all(bool((x == x[0]).all()) for x in xs)
            del xs, y
        assert mm.steps[-1].oom_retries == 1 and mm.stats()["oom_retries"] == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_copies_run_on_side_streams_and_the_host_rarely_waits(engine, monkeypatch):
    """A step that moves hundreds of MiB must not block the host on most copies."""
    _engine(monkeypatch, engine)
    base = train_unmanaged("moe", steps=3, preset="small", device="cuda")
    r = train_managed("moe", int(max(base.peak_bytes) * 0.5), "lru", steps=3, preset="small", device="cuda")
    per = r.stats["per_step"]
    moves = sum(s["evictions"] for s in per[1:])
    syncs = sum(s["host_syncs"] for s in per[1:])
    assert moves > 0
    assert syncs * 10 <= moves, f"the host waited {syncs} times for {moves} evictions"


@pytest.mark.parametrize("events", _sources())
def test_fraction_budget_on_a_model_larger_than_the_free_memory(events, monkeypatch):
    """``budget="1/4"`` measures the peak in a first step run under the device's free memory: with
    that made a third of the model's peak, the first step moves storages and measures the peak all
    the same, and every later step keeps to a quarter of it, bit-identically."""
    monkeypatch.setenv("DYNN_EVENTS", events)
    base = train_unmanaged("moe", steps=3, preset="small", device="cuda")
    free = int(max(base.peak_bytes) / 3)
    monkeypatch.setattr(MemoryManager, "_first_step_budget", lambda self: free)
    r = train_managed("moe", "1/4", "lru", steps=3, preset="small", device="cuda")
    st = r.stats
    first = st["per_step"][0]
    assert not first["managed"] and first["evictions"] > 0
    assert st["measured_peak_bytes"] >= max(base.peak_bytes) * 0.75  # the allocator rounds above the storages
    differ = [k for k, v in r.tensor_digests.items() if base.tensor_digests.get(k) != v]
    assert not differ and r.losses == base.losses


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("events", _sources())
def test_an_eviction_waits_for_the_stream_that_last_wrote_the_tensor(events, engine, monkeypatch):
    """A tensor written on a side stream and evicted from the default stream right away: the copy
    to the host must wait for the side stream (its last use), not only for the current stream."""
    monkeypatch.setenv("DYNN_EVENTS", events)
    _engine(monkeypatch, engine)
    model = torch.nn.Linear(64, 64).cuda()
    side = torch.cuda.Stream()
    with MemoryManager(budget=1 << 30, policy="lru", device="cuda").attach(model) as mm:
        assert _engine_of(mm) == engine
        with mm.step():
            y = model(torch.randn(4096, 64, device="cuda"))
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)  # the side stream is busy for tens of milliseconds
                y.mul_(0).add_(7.0)  # ... then writes y
            y.record_stream(side)
            assert mm.offload(y) > 0  # from the default stream, which has not waited for the side one
            torch.cuda.current_stream().wait_stream(side)
            got = (y + 0.0).cpu()
        assert torch.all(got == 7.0), "the host copy was taken before the side stream wrote the tensor"


@pytest.mark.parametrize("events", _sources())
def test_record_stream_is_honoured_on_managed_storages(events, monkeypatch):
    """The caching allocator keeps a block that a side stream was recorded on until that stream
    passes: the observer must not hide a managed storage's block from ``record_stream`` (the
    manager's own evictions rely on it to release a block while its copy still reads it)."""
    monkeypatch.setenv("DYNN_EVENTS", events)
    model = torch.nn.Linear(256, 256).cuda()
    side = torch.cuda.Stream()
    with MemoryManager(budget=1 << 30, policy="none", device="cuda").attach(model) as mm:
        with mm.step():
            x = model(torch.randn(1024, 256, device="cuda"))
            block = x.data_ptr()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(50_000_000)  # the side stream is busy for tens of milliseconds
            x.record_stream(side)
            del x
            y = torch.empty(1024, 256, device="cuda")  # the same size: the freed block would fit
            assert y.data_ptr() != block, "a block recorded on a busy stream was handed out again"
        torch.cuda.synchronize()


class _StepFailed(Exception):
    pass


def fail_then_train(device: str, budget: int | None, hard_cap: bool = False) -> tuple[list[float], str]:
    """varlen ``small``: steps 0 and 1 train, step 2 raises after its forward (the error's traceback
    holds that forward's activations while the step ends), steps 3 and 4 train; under a manager with
    lru when ``budget`` is given. Returns the losses and the digest of the parameters and optimizer
    state. (Also run on the CPU, with a logical budget: the session-25 notes in docs/benchmarks.md.)"""
    wl = load_workload("varlen", preset="small", seed=0)
    torch.manual_seed(0)
    model = wl.model.to(device)
    opt = make_optimizer(wl, model.parameters())
    mm = None if budget is None else MemoryManager(budget, policy="lru", device=device, hard_cap=hard_cap)
    if mm is not None:
        mm.attach(model, opt)
    losses = []
    try:
        for step in range(5):
            batch = to_device(wl.make_batch(step), device)
            try:
                with mm.step() if mm is not None else contextlib.nullcontext():
                    loss = wl.loss(model, batch) if step == 2 else train_step(wl, model, opt, batch)
                    if step == 2:
                        raise _StepFailed(f"step {step} fails after its forward")
                losses.append(loss.item())
            except _StepFailed:
                pass  # any other error (an out-of-memory error of the step's end) fails the test
            del batch, loss
    finally:
        if mm is not None:
            mm.detach()
    return losses, state_digests(model, opt)[0]


@pytest.mark.parametrize("events", _sources())
def test_a_failed_step_under_a_hard_cap_raises_its_own_error_and_training_goes_on(events, monkeypatch):
    """Under a hard cap of 0.3 of the peak, a step that fails after its forward ends with its own
    error: what its frames hold, most of it away, stays on the host (bringing it back would exceed
    the cap). The steps after it train bit for bit as PyTorch alone doing the same. (At 1/4 one
    operator of varlen's backward, 48 MiB at once, leaves the allocator's segments no slack.)"""
    monkeypatch.setenv("DYNN_EVENTS", events)
    base = train_unmanaged("varlen", steps=3, preset="small", device="cuda")
    cap = int(max(base.peak_bytes) * 0.3)
    assert fail_then_train("cuda", cap, hard_cap=True) == fail_then_train("cuda", None)


@pytest.mark.parametrize("family,budget", [("moe", 1 << 40), ("varlen", "1/2")])
def test_cuda_deaths_are_heard_from_the_allocator_with_the_books_a_sweep_keeps(family, budget, monkeypatch):
    """The native observer hears CUDA frees from the caching allocator's trace tracker
    (csrc/heard.h) instead of sweeping its table at each new peak: with nothing moved the same
    per-step peaks as an observer that sweeps for every death (hear off), with a tenth of the
    sweeps or fewer; under a budget the budget kept, with fewer sweeps in the managed steps (a
    make-room still walks the table for storages that died away); the same bits either way."""
    if "native" not in _sources():
        pytest.skip("the native event source is not built")
    monkeypatch.setenv("DYNN_EVENTS", "native")
    runs = {}
    for hear in (True, False):
        monkeypatch.setattr(MemoryManager, "hear_frees", hear)
        runs[hear] = train_managed(family, budget, "lru", steps=3, preset="small", device="cuda")
    heard, swept = runs[True], runs[False]
    assert heard.stats["deaths"] == "heard", (
        "CUDA frees are not heard: the build found no CUDA headers or libc10_cuda (CMakeLists.txt), or the "
        "allocator refused the tracker")
    assert swept.stats["deaths"] == "swept"
    assert heard.losses == swept.losses and heard.digest == swept.digest
    if budget == 1 << 40:
        assert heard.peak_bytes == swept.peak_bytes and heard.stats["evictions"] == 0
    else:
        largest = heard.stats["largest_allocation_bytes"]
        assert heard.stats["evictions"] > 0
        assert all(s["peak_device_bytes"] <= heard.budget_bytes + largest
                   for s in heard.stats["per_step"] if s["managed"])
    def sweeps(r) -> int:  # the measuring step sweeps after every operator, heard or not
        return sum(s["table_sweeps"] for s in r.stats["per_step"] if s["managed"])

    assert sweeps(heard) * (10 if budget == 1 << 40 else 1) < sweeps(swept)
    assert heard.stats["table_sweeps"] == sum(s["table_sweeps"] for s in heard.stats["per_step"])
