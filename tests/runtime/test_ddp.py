"""DDP (two processes, gloo, CPU) under the manager gives the same parameters as DDP without it."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")


def _worker(rank: int, world: int, init_file: str, out_dir: str, managed: bool) -> None:
    import dynn_runtime as dr

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        mm = dr.MemoryManager(96 << 10, policy="lru", device="cpu").attach(ddp, opt) if managed else None
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for _ in range(3):
            x = torch.randn(8, 32, generator=g)
            ctx = mm.step() if mm else torch.enable_grad()
            with ctx:
                loss = ddp(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        stats = mm.stats() if mm else {}
        if mm:
            mm.detach()
        torch.save({"params": [p.detach().clone() for p in model.parameters()],
                    "offloaded": stats.get("bytes_offloaded", 0), "peak": stats.get("peak_device_bytes", 0),
                    "slack": (stats.get("largest_allocation_bytes") or 0) if stats.get("event_source") == "native" else 0},
                   os.path.join(out_dir, f"{'m' if managed else 'u'}{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's worker threads sometimes abort the process in
    # it ("terminate called without an active exception", SIGABRT), after the results are written
    # and with or without the manager (seen 1 in 24 runs of this test under load, torch 2.13 CPU).
    # What this test checks is on disk by now; a failure above still raises and fails the spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.parametrize("world", [2])
def test_ddp_gloo_same_result_as_without_manager(tmp_path, world):
    results = {}
    for managed in (False, True):
        init = tmp_path / f"init-{managed}"
        mp.spawn(_worker, args=(world, str(init), str(tmp_path), managed), nprocs=world, join=True)
        for r in range(world):
            results[(managed, r)] = torch.load(tmp_path / f"{'m' if managed else 'u'}{r}.pt")
    for r in range(world):
        ref, got = results[(False, r)]["params"], results[(True, r)]["params"]
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), f"rank {r} differs"
        assert results[(True, r)]["offloaded"] > 0  # the budget made it move things
        assert results[(True, r)]["peak"] <= (96 << 10) + results[(True, r)]["slack"]  # native: soft budget
    # and the ranks agree with each other (the gradients were all-reduced)
    assert all(torch.equal(a, b) for a, b in zip(results[(True, 0)]["params"], results[(True, 1)]["params"]))


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Gate:
    """A collective's ``Work`` that completes only when the test says so (gloo on one rank is done at once)."""

    def __init__(self, work):
        self.work, self.open = work, False

    def is_completed(self):
        return self.open and self.work.is_completed()

    def wait(self):
        self.open = True
        return self.work.wait()


def test_a_collective_keeps_its_tensors_on_the_device_until_its_work_completes(one_rank, monkeypatch):
    """An all-reduce runs on after its operator returns (NCCL's stream, gloo's threads) and reads its
    tensors: the manager may not move them until the work completes (on the Python source, whose
    dispatch sees the ``Work``), or until the step ends (the native source, which does not)."""
    import dynn_runtime as dr
    from dynn_runtime.runtime import python_source

    gates = []
    real = python_source._works
    monkeypatch.setattr(python_source, "_works", lambda out: gates.extend(_Gate(w) for w in real(out)) or gates[-1:])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu").attach(model, opt)
    x = torch.randn(8, 64)
    try:
        with mm.step():
            model(x).pow(2).mean().backward()
            grad = model[0].weight.grad
            before, n = grad.clone(), grad.untyped_storage().nbytes()
            work = dist.all_reduce(grad, async_op=True)
            assert len(gates) == (mm.event_source == "python")
            assert mm.offload(grad) == 0  # in flight: it stays
            assert mm.status(mm._sid(grad)) == "resident"
            work.wait()
            for g in gates:
                g.open = True
            # the Python source saw the Work complete: free to move; the native source holds it to the end
            assert mm.offload(grad) == (n if mm.event_source == "python" else 0)
            opt.step()
        assert torch.equal(model[0].weight.grad, before)  # one rank: the sum is itself, bit for bit
        with mm.step():  # the step ended: nothing is held any more
            assert not mm._held and not mm._collectives
            assert mm.offload(model[0].weight.grad) > 0
            opt.step()
    finally:
        mm.detach()


def test_a_fault_after_a_collective_reads_the_log_so_the_collectives_storages_stay(one_rank):
    """A fault may put its read of the log off (``defer_parse``), but not while a collective ran
    since the last read: that read is what holds the collective's storages on the device, and the
    room the fault makes would otherwise take the all-reduced gradient."""
    import dynn_runtime as dr

    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events="native").attach(model, opt)
    if mm.event_source != "native" or not mm._native_order:
        mm.detach()
        pytest.skip("the native event source with lru's order in the observer is not built here")
    try:
        mm.pin(model)
        with mm.step():
            model(torch.randn(64, 256)).pow(2).mean().backward()
            grad = model.weight.grad
            a = torch.randn(256, 256)
            assert mm.offload(a) > 0
            work = dist.all_reduce(grad, async_op=True)
            assert not mm._can_defer_parse()  # the collective's storages are not held until the log is read
            mm.budget = mm.used + (a.untyped_storage().nbytes() >> 1)  # a's return needs the gradient's room
            mm._obs.set_budget(mm.budget)
            b = a + 0.0  # a fault: a comes back
            work.wait()
            assert mm.status(mm._sid(grad)) == "resident", "the fault moved the gradient a collective reads"
            del b
            opt.step()
    finally:
        mm.detach()
