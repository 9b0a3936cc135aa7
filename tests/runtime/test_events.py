"""The native event source (dynn_runtime._C, runtime/events.py) against the Python dispatch path."""

from __future__ import annotations

import contextlib
import struct
import warnings

import pytest
import torch
from torch import nn

import dynn_runtime as dr
from dynn_runtime.errors import BudgetError, ConfigError
from dynn_runtime.runtime import native_source
from dynn_runtime.runtime.events import native_module, no_mode, resolve

C = native_module()
pytestmark = pytest.mark.skipif(C is None, reason="the native event source is not built")


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _ops(log: bytes) -> list[tuple[int, list[int]]]:
    """(op id, input sids) of every operator record in a raw log."""
    w = struct.unpack(f"{len(log) // 8}q", log)
    out, i = [], 0
    while i < len(w):
        if w[i] == C.LOG_OP:
            ni, no, nw, na = w[i + 5:i + 9]
            out.append((w[i + 1], list(w[i + 9:i + 9 + ni])))
            i += 9 + ni + no + nw + na
        elif w[i] == C.LOG_ALLOC:
            i += 4
        else:
            i += 2
    return out


def test_log_tags_match_the_extension():
    assert (C.LOG_OP, C.LOG_ALLOC, C.LOG_FREE) == native_source._C_TAGS


def test_the_observer_logs_each_kernel_once_and_skips_what_decomposes():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        x = torch.randn(4, 8)
        w = torch.randn(3, 8)
        nn.functional.linear(x, w).relu_()  # linear decomposes (t, mm); relu_ writes in place
        log, names = ob.take_log()
    finally:
        ob.stop()
    seen = [names[i] for i, _ in _ops(log)]
    assert seen == ["aten::randn", "aten::randn", "aten::t", "aten::mm", "aten::relu_"]
    assert ob.position == 5 and ob.tracked >= 3


def _op_records(log: bytes) -> list[tuple[int, list[int], list[int], list[int], list[int]]]:
    """(op id, inputs, outputs, writes, allocations) of every operator record in a raw log."""
    w = struct.unpack(f"{len(log) // 8}q", log)
    out, i = [], 0
    while i < len(w):
        if w[i] == C.LOG_OP:
            ni, no, nw, na = w[i + 5:i + 9]
            k = i + 9
            ins, outs = list(w[k:k + ni]), list(w[k + ni:k + ni + no])
            writes = list(w[k + ni + no:k + ni + no + nw])
            allocs = list(w[k + ni + no + nw:k + ni + no + nw + na])
            out.append((w[i + 1], ins, outs, writes, allocs))
            i = k + ni + no + nw + na
        else:
            i += 4 if w[i] == C.LOG_ALLOC else 2
    return out


def _served_unboxed(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "DeferredInit")


def test_operators_with_an_unboxed_kernel_are_recorded_as_the_boxed_fallback_records_them():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        # the unboxed kernels are registered at the first start; sub_ and exp stay on the fallback
        assert _served_unboxed("aten::add_.Tensor") and _served_unboxed("aten::sigmoid")
        assert _served_unboxed("aten::cat") and _served_unboxed("aten::native_layer_norm")
        assert not _served_unboxed("aten::sub_.Tensor") and not _served_unboxed("aten::exp")
        ob.set_in_step(True)
        x, y, w = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
        _, names = ob.take_log()
        sx, sy, sw = ob.sid_of(x), ob.sid_of(y), ob.sid_of(w)
        x.add_(y)  # unboxed, writes its first argument
        x.sub_(y)  # boxed, the same schema
        a = torch.sigmoid(x)  # unboxed, allocates
        b = torch.exp(x)  # boxed, the same schema
        torch.cat([a, b])  # a tensor list (ITensorListRef)
        torch.stack([a, b])  # a tensor list (TensorList)
        torch.split(a, 2)  # views of its input's storage, returned as a list
        torch.native_layer_norm(x, [8], w, None, 1e-5)  # optional tensors; a tuple of three returned
        log, more = ob.take_log()
    finally:
        ob.stop()
    names = names + more
    recs = [(names[r[0]], *r[1:]) for r in _op_records(log)]
    sa, sb = ob.sid_of(a), ob.sid_of(b)
    add, sub, sig, exp, cat, stack, split, norm = recs
    assert add == ("aten::add_.Tensor", [sx, sy], [sx], [sx], [])
    assert sub == ("aten::sub_.Tensor", [sx, sy], [sx], [sx], [])
    assert sig == ("aten::sigmoid", [sx], [sa], [], [sa])
    assert exp == ("aten::exp", [sx], [sb], [], [sb])
    assert cat[:2] == ("aten::cat", [sa, sb]) and len(cat[4]) == 1 and cat[2] == cat[4]
    assert stack[:2] == ("aten::stack", [sa, sb]) and len(stack[4]) == 1 and stack[2] == stack[4]
    assert split == ("aten::split.Tensor", [sa], [sa], [], [])
    assert norm[:2] == ("aten::native_layer_norm", [sx, sw]) and len(norm[2]) == 3 and norm[2] == norm[4]


def test_indexing_with_an_unboxed_kernel_sees_every_index_tensor():
    """``index.Tensor`` and ``index_put_`` take their indices as ``Tensor?[]`` (a list of optional
    tensors): each index is an input, so one that is away comes back before the kernel reads it."""
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        assert _served_unboxed("aten::index.Tensor") and _served_unboxed("aten::index_put_")
        ob.set_in_step(True)
        x, rows, cols, v = torch.randn(6, 5), torch.tensor([0, 2, 5]), torch.tensor([1, 1, 4]), torch.ones(3)
        _, names = ob.take_log()
        sx, sr, sc, sv = (ob.sid_of(t) for t in (x, rows, cols, v))
        y = x[rows, cols]  # aten::index.Tensor(x, [rows, cols])
        z = x[:, cols]  # a None in the list (a slice first): aten::index.Tensor(x, [None, cols])
        x.index_put_((rows, cols), v)  # writes its first argument
        log, more = ob.take_log()
    finally:
        ob.stop()
    names = names + more
    recs = {names[r[0]]: r[1:] for r in _op_records(log)}
    sy, sz = ob.sid_of(y), ob.sid_of(z)
    idx = [r[1:] for r in _op_records(log) if names[r[0]] == "aten::index.Tensor"]
    assert idx[0] == ([sx, sr, sc], [sy], [], [sy])
    assert idx[1][1:] == ([sz], [], [sz]) and sx in idx[1][0] and sc in idx[1][0]
    assert recs["aten::index_put_"] == ([sx, sr, sc, sv], [sx], [sx], [])


def test_an_index_tensor_away_faults_back_before_indexing():
    model, opt = _mlp()
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events="native").attach(model, opt)
    try:
        x = torch.randn(8, 4)
        want = x[torch.tensor([7, 0, 3])]
        with mm.step():
            idx = torch.tensor([7, 0, 3]) + 0  # made by an operator in the step: the manager may move it
            assert mm.offload(idx) > 0 and idx.untyped_storage().nbytes() == 0
            faults = mm._obs.faults
            got = x[idx]
            assert mm._obs.faults == faults + 1
        assert torch.equal(got, want)
    finally:
        mm.detach()


def test_a_python_number_wrapped_for_one_operator_is_not_tracked():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        x = torch.randn(4)
        ob.take_log()
        tracked = ob.tracked
        x.add_(1)  # the binding wraps 1 in a 0-dimensional tensor: add_.Tensor(x, tensor(1))
        x.mul_(2.0)
        log, names = ob.take_log()
    finally:
        ob.stop()
    recs = _op_records(log)
    assert [r[1] for r in recs] == [[ob.sid_of(x)], [ob.sid_of(x)]]  # x alone is read
    assert ob.tracked == tracked
    assert len(log) // 8 == 2 * (9 + 3)  # the two operator records (x in, out, written), no birth


def test_the_observers_key_is_included_only_while_it_runs_and_not_for_the_managers_own_work():
    included = lambda: C.key_state()[0]  # noqa: E731
    excluded = lambda: C.key_state()[1]  # noqa: E731
    assert not included()
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        assert included()
        ob.set_in_step(True)
        x = torch.ones(4)
        ob.suspend()
        ob.suspend()
        assert excluded()
        y = x * 2  # the manager's own work: not observed
        ob.resume()
        assert excluded()  # still inside the outer suspend
        ob.resume()
        assert not excluded()
        z = y + 1
        log, names = ob.take_log()
    finally:
        ob.stop()
    assert not included() and not excluded()
    assert [names[i] for i, _ in _ops(log)] == ["aten::ones", "aten::add.Tensor"]
    assert ob.sid_of(z) > 0


def test_a_death_is_known_at_the_next_operator_without_a_sweep():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        big = torch.ones(1 << 16)
        small = torch.ones(4)
        assert ob.exposed == 0  # allocator-made storages are covered
        before = ob.tracked
        del big
        small.add_(small)  # in place: no new peak, so nothing would walk the table
        assert ob.tracked == before - 1
        assert ob.peak == (1 << 18) + 16
        log, _ = ob.take_log()
        words = struct.unpack(f"{len(log) // 8}q", log)
        assert C.LOG_FREE in words
    finally:
        ob.stop()


def test_each_step_counts_its_own_table_sweeps(monkeypatch):
    """A measuring step walks the table after every operator; with every death known (covered on
    the CPU) a managed step walks it only at its start and end, and at a make-room."""
    from dynn_runtime.runtime.train import train_managed

    monkeypatch.setenv("DYNN_EVENTS", "native")
    r = train_managed("moe", "1/2", "lru", steps=3, preset="tiny", device="cpu")
    assert r.stats["event_source"] == "native"
    measuring, *managed = r.stats["per_step"]
    assert not measuring["managed"] and measuring["table_sweeps"] >= measuring["ops"]
    assert all(s["managed"] and 2 <= s["table_sweeps"] < s["ops"] for s in managed)
    assert r.stats["table_sweeps"] == sum(s["table_sweeps"] for s in r.stats["per_step"])
    idle = train_managed("moe", 1 << 40, "lru", steps=2, preset="tiny", device="cpu")
    assert [s["table_sweeps"] for s in idle.stats["per_step"]] == [2, 2]


def test_a_make_room_walks_the_table_once_the_host_pool_has_handed_out_a_quarter_of_what_it_holds():
    """With every death of a storage counted in ``used`` known (covered on the CPU, heard on CUDA), a
    walk of the table before a make-room can find only storages that died away (on CUDA: their data
    is given up, so nothing hears them), which free host buffers: it runs once the host pool has
    handed out a quarter of what it holds since the last walk (or has less than the room needed
    free), not at every make-room."""
    mm = dr.MemoryManager(4 << 20, policy="lru", device="cpu", events="native")
    mm.attach(nn.Linear(4, 4))  # 80 bytes of parameters, the first victims
    obs = mm._obs
    try:
        with mm.step():
            a, b, c = torch.ones(1 << 16), torch.ones(1 << 16), torch.ones(1 << 17)
            assert mm.offload(a) == 1 << 18  # the host pool hands out 256 KiB; b and c get records
            assert obs.exposed == 0
            sweeps = obs.sweeps
            with no_mode():  # as the manager makes room: its own copies unobserved
                mm.make_room(mm.budget - mm.used + 1, set())  # a quarter handed out since: walks
            assert obs.sweeps == sweeps + 1 and obs.away == (1 << 18) + 64  # a and the weight
            with no_mode():
                mm.make_room(mm.budget - mm.used + (1 << 18), set())  # 512 bytes handed out since: no walk
            assert obs.sweeps == sweeps + 1 and obs.away == (2 << 18) + 80  # b and the bias too
            with no_mode():
                mm.make_room(mm.budget - mm.used + (1 << 18), set())  # b's 256 KiB handed out since
            assert obs.sweeps == sweeps + 2 and obs.away == (4 << 18) + 80  # c too
            assert torch.equal(a, b) and torch.equal(b + 1, torch.full((1 << 16,), 2.0))
            assert torch.equal(c, torch.ones(1 << 17))
    finally:
        mm.detach()


def test_walking_the_table_at_every_make_room_changes_no_decision(monkeypatch):
    from dynn_runtime.runtime.moves import Moves
    from dynn_runtime.runtime.train import train_managed

    monkeypatch.setenv("DYNN_EVENTS", "native")
    runs = []
    for every in (True, False):
        monkeypatch.setattr(Moves, "walk_every_room", every)
        runs.append(train_managed("moe", "1/2", "lru", steps=4, preset="tiny", device="cpu"))
    walked, skipped = runs
    assert walked.losses == skipped.losses
    for key in ("evictions", "bytes_offloaded", "prefetch_misses"):
        assert walked.stats[key] == skipped.stats[key] > 0
    assert walked.stats["table_sweeps"] > skipped.stats["table_sweeps"]


def test_an_earlier_observer_destroyed_meanwhile_does_not_deafen_the_running_one():
    old = C.Observer("cpu")
    old.start(None, None)
    old.stop()
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        doomed, keep = torch.ones(1 << 10), torch.ones(4)
        del old  # its destructor stops it again
        before = ob.tracked
        del doomed
        keep.add_(keep)
        assert ob.tracked == before - 1
    finally:
        ob.stop()


def test_a_death_on_another_thread_is_known_too_and_foreign_memory_is_swept():
    import threading

    import numpy as np

    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        doomed = [torch.ones(1 << 12)]
        base = torch.zeros(4)
        before = ob.tracked
        t = threading.Thread(target=doomed.clear)
        t.start()
        t.join()
        base.add_(base)
        assert ob.tracked == before - 1
        foreign = torch.from_numpy(np.ones(1 << 10, dtype=np.float32))  # numpy owns the data
        foreign.mul_(2)
        assert ob.exposed == 1
        used = ob.used
        del foreign
        ob.sweep()
        assert ob.used == used - (1 << 12) and ob.exposed == 0
    finally:
        ob.stop()
    del base  # freed with the allocator's own deleter after the observer stopped


def _frees(log: bytes) -> list[int]:
    """The sids of the kFree records of a raw log, in log order."""
    w = struct.unpack(f"{len(log) // 8}q", log)
    out, i = [], 0
    while i < len(w):
        if w[i] == C.LOG_OP:
            i += 9 + sum(w[i + 5:i + 9])
        elif w[i] == C.LOG_ALLOC:
            i += 4
        else:
            out.append(w[i + 1])
            i += 2
    return out


def test_the_deaths_a_sweep_finds_are_logged_by_storage_id():
    """Storages whose deaths only a sweep finds (numpy owns their data) are logged in ascending
    storage id, whatever order they died in and wherever their StorageImpls lie (the table is keyed
    by address): the log is a function of the program's operations (events.cpp, invariant 14)."""
    import numpy as np

    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        foreign = [torch.from_numpy(np.ones(16, dtype=np.float32)) for _ in range(40)]
        for f in foreign:
            f.mul_(2)
        del f
        sids = [ob.sid_of(t) for t in foreign]
        assert ob.exposed == 40 and len(set(sids)) == 40
        ob.take_log()
        for k in (*range(1, 40, 2), *range(38, -1, -2)):  # odd ones first, then the even ones backwards
            foreign[k] = None
        ob.sweep()
        log, _ = ob.take_log()
    finally:
        ob.stop()
    assert _frees(log) == sorted(sids)


def test_a_deaths_drained_order_is_the_order_they_died():
    """Covered storages' deaths come as their data was freed, not by id or address."""
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        ts = [torch.ones(64) for _ in range(12)]
        sids = [ob.sid_of(t) for t in ts]
        ob.take_log()
        order = [5, 0, 11, 3, 7, 1, 9, 2, 10, 4, 8, 6]
        for k in order:
            ts[k] = None
        torch.zeros(1).add_(1)
        log, _ = ob.take_log()
    finally:
        ob.stop()
    assert _frees(log) == [sids[k] for k in order]


def _nodes(log: bytes) -> list[int]:
    """The node word of every operator record in a raw log."""
    w = struct.unpack(f"{len(log) // 8}q", log)
    out, i = [], 0
    while i < len(w):
        if w[i] == C.LOG_OP:
            out.append(w[i + 3])
            i += 9 + sum(w[i + 5:i + 9])
        else:
            i += 4 if w[i] == C.LOG_ALLOC else 2
    return out


def test_an_operators_node_is_one_it_made_not_the_threads_last():
    """An operator that makes no autograd node logs -1 also as a step's first, after the thread made
    nodes before the step (events.cpp, invariant 15); one that makes a node logs it; the same
    operators log the same relative nodes in a later step. The Python event source and the trace
    recorder's AutogradNodes keep the same rule."""
    from dynn_runtime.trace.recorder import AutogradNodes

    w = torch.ones(3, requires_grad=True)

    def step() -> None:
        x = torch.ones(3)  # no node
        y = (x * w).sum()  # mul and sum make one each
        torch.zeros(2)  # no node
        y.backward()

    ob = C.Observer("cpu")
    ob.start(None, None)
    runs, names = [], []
    try:
        for _ in range(2):
            (w * 2).sum().backward()  # nodes made before the step, outside it
            names += ob.take_log()[1]
            ob.set_in_step(True)
            step()
            log, new = ob.take_log()
            names += new
            ob.set_in_step(False)
            runs.append([(names[op], n) for (op, _), n in zip(_ops(log), _nodes(log), strict=True)])
    finally:
        ob.stop()
    fwd = [r[:4] for r in runs]
    assert [n for _, n in fwd[0]][0] == -1 and [n for _, n in fwd[0]][3] == -1
    assert fwd[0][1][1] >= 0 and fwd[0][2][1] == fwd[0][1][1] + 1
    base = [fwd[k][1][1] for k in range(2)]
    rel = [[(name, n if n < 0 else n - base[k]) for name, n in r] for k, r in enumerate(runs)]
    assert rel[0] == rel[1]
    nodes = AutogradNodes()
    (w * 2).sum().backward()
    nodes.begin()
    torch.ones(3)
    assert nodes() == -1
    (torch.ones(3) * w).sum()
    assert nodes() >= 0


def test_a_kernel_that_raises_leaves_the_observer_consistent():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        a, b = torch.ones(2, 3), torch.ones(2, 3)
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            torch.mm(a, b)
        c = a + b
        log, names = ob.take_log()
    finally:
        ob.stop()
    assert [names[i] for i, _ in _ops(log)] == ["aten::ones", "aten::ones", "aten::add.Tensor"]
    assert ob.position == 3 and ob.sid_of(c) > 0


def test_where_the_key_is_served_by_someone_else_auto_takes_python_and_says_why():
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "lib = torch.library.Library('_', 'IMPL', 'DeferredInit')\n"
        "lib.fallback(torch.library.fallthrough_kernel)\n"
        "import warnings; warnings.simplefilter('ignore')\n"
        "from dynn_runtime.runtime.events import resolve\n"
        "print(resolve('auto'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "DYNN_EVENTS"}  # make test's second run sets it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "'python'" in out.stdout and "DeferredInit already has a fallback" in out.stdout


def test_an_offloaded_storage_faults_back_before_any_kernel_reads_it():
    model, opt = _mlp()
    ref = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    ref.load_state_dict(model.state_dict())
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events="native").attach(model, opt)
    try:
        x = torch.randn(16, 32)
        for p in model.parameters():
            assert mm.offload(p) > 0 and p.untyped_storage().nbytes() == 0
        faults = mm._obs.faults
        with mm.step():
            out = model(x)  # linear decomposes into t and addmm: the fault comes at the kernel
        assert torch.equal(out, ref(x))
        assert mm._obs.faults > faults
        assert mm.stats()["bytes_fetched_on_demand"] >= sum(p.numel() * 4 for p in model.parameters())
        mm.offload(model[0].weight)
        with torch.no_grad():  # a list operator between steps faults too
            torch._foreach_mul_(list(model.parameters()), 2.0)
            torch._foreach_mul_(list(ref.parameters()), 2.0)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    finally:
        mm.detach()


def test_a_kernel_never_reads_a_storage_the_fault_handler_could_not_bring_back(monkeypatch):
    """A failed fetch (here the copy engine raises) fails the operator before its kernel runs, with
    the cause in its message; the storage's host copy is intact, and once the cause is gone training
    goes on bit-identically to PyTorch alone (events.cpp, invariant 12)."""
    model, opt = _mlp()
    ref = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events="native").attach(model, opt)
    try:
        x = torch.randn(16, 32)
        w = model[0].weight
        assert mm.offload(w) > 0 and w.untyped_storage().nbytes() == 0

        def broken(s, st):
            raise RuntimeError("the copy engine is broken")

        monkeypatch.setattr(mm, "_start_fetch", broken)
        with pytest.raises(Exception) as info, mm.step():
            model(x)
        text = "".join(str(e) for e in (info.value, info.value.__context__) if e is not None)
        assert "did not run" in text and "the copy engine is broken" in text
        assert w.untyped_storage().nbytes() == 0  # still away: no kernel touched the missing block
        monkeypatch.undo()
        for _ in range(2):
            with mm.step():
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            ref_opt.zero_grad()
            ref(x).square().mean().backward()
            ref_opt.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    finally:
        mm.detach()


def test_a_write_makes_the_host_copy_stale():
    model, opt = _mlp()
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events="native").attach(model, opt)
    try:
        w = model[0].weight
        before = w.detach().clone()
        mm.offload(w)
        with mm.step():
            w.data.mul_(3)  # fetched back (its host copy still valid), then written in place
        after = w.detach().clone()
        assert torch.equal(after, before * 3)
        mm.offload(w)  # must copy again: the host copy it had holds the bytes before the write
        assert w.untyped_storage().nbytes() == 0
        with mm.step():
            got = w.detach().clone()
        assert torch.equal(got, after)
    finally:
        mm.detach()


def test_budget_smaller_than_one_operator_names_it_natively():
    model, opt = _mlp()
    mm = dr.MemoryManager(4 << 10, policy="lru", device="cpu", events="native").attach(model, opt)
    try:
        for p in model.parameters():
            mm.offload(p)
        with pytest.raises(BudgetError, match="one operator needs: operator aten::\\w+.*Raise the budget"):
            with mm.step():
                model(torch.randn(8, 32)).sum().backward()
        # the step failed but nothing is lost: the same model still trains, unmanaged, after detach
    finally:
        mm.detach()
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_choosing_the_event_source(monkeypatch):
    assert resolve("python")[0] == "python"
    with pytest.raises(ConfigError, match="events="):
        resolve("fast")
    monkeypatch.delenv("DYNN_EVENTS", raising=False)
    assert resolve("auto")[0] == "native"  # the default where the extension loads
    monkeypatch.setenv("DYNN_EVENTS", "python")
    assert resolve("auto") == ("python", "DYNN_EVENTS=python in the environment")
    assert resolve("native")[0] == "native"  # asked for by name: the environment does not override it
    monkeypatch.delenv("DYNN_EVENTS")
    model, opt = _mlp()
    first = dr.MemoryManager(1 << 30, device="cpu", events="native").attach(model, opt)
    try:
        assert first.stats()["event_source"] == "native"
        other = nn.Linear(4, 4)
        with pytest.raises(ConfigError, match="one per process"):
            dr.MemoryManager(1 << 30, device="cpu", events="native").attach(other)
        second = dr.MemoryManager(1 << 30, device="cpu").attach(other)  # auto: falls back, and says why
        assert second.stats()["event_source"] == "python"
        assert "one per process" in second.stats()["event_source_reason"]
        second.detach()
    finally:
        first.detach()
    third = dr.MemoryManager(1 << 30, device="cpu", events="native").attach(other)  # released by detach
    third.detach()


def test_a_batch_in_which_nothing_was_decided_is_read_compacted():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        keep = torch.ones(16)
        for _ in range(5):
            keep = keep + 1  # each step's old ``keep`` dies: born and dead within the batch
        ob.sweep()
        log, _ = ob.take_log(compact=True)
    finally:
        ob.stop()
    assert _ops(log) == []
    records = _records(log)  # asserts that it holds no operator record
    assert [sid for tag, sid in records if tag == C.LOG_ALLOC] == [ob.sid_of(keep)]


def _records(log: bytes) -> list[tuple[int, int]]:
    """(tag, sid) of every kAlloc and kFree record in a compacted log (it holds no others)."""
    w = struct.unpack(f"{len(log) // 8}q", log)
    out, i = [], 0
    while i < len(w):
        assert w[i] in (C.LOG_ALLOC, C.LOG_FREE), f"unexpected tag {w[i]} at word {i}"
        out.append((w[i], w[i + 1]))
        i += 4 if w[i] == C.LOG_ALLOC else 2
    return out


def test_a_compacted_batch_keeps_the_death_of_a_storage_python_registered():
    ob = C.Observer("cpu")
    ob.start(None, None)
    try:
        ob.set_in_step(True)
        base = torch.ones(16)
        ob.take_log(compact=True)
        known, unknown = base + 1, base + 2  # both born in the batch; Python asks for the first one's id
        known_sid, unknown_sid = ob.track(known), ob.sid_of(unknown)
        del known, unknown
        ob.sweep()
        recs = _records(ob.take_log(compact=True)[0])
        late = base + 3  # born in the next batch, and dying in it: dropped again
        del late
        ob.sweep()
        later = _records(ob.take_log(compact=True)[0])
    finally:
        ob.stop()
    assert (C.LOG_FREE, known_sid) in recs and (C.LOG_ALLOC, known_sid) not in recs
    assert all(sid != unknown_sid for _, sid in recs)
    assert later == []


def test_a_light_step_forgets_what_the_manager_registered_and_saw_die():
    from dynn_runtime import hints
    from dynn_runtime.policies.base import Policy

    class Listening(Policy):  # reads hints, so a hint registers its tensors' storages in the step
        name = "listening"

        def on_hint(self, hint):
            pass

    model, opt = _mlp()
    mm = dr.MemoryManager(1 << 30, device="cpu", events="native", policy=Listening()).attach(model, opt)
    try:
        for _ in range(3):
            with mm.step():
                h = torch.relu(model(torch.randn(4, 32)))
                hints.next_use(h, steps=None)
                hinted = mm._obs.sid_of(h)
                assert hinted in mm.st  # registered by the hint, before its birth is read
                h.sum().backward()
                del h
                opt.step()
                opt.zero_grad(set_to_none=True)
            assert hinted not in mm.st
        assert all(mm._obs.alive(sid) for sid in mm.st)
    finally:
        mm.detach()


def test_gradients_are_labelled_when_read_and_never_registered_when_they_die_unread():
    model, opt = _mlp()
    mm = dr.MemoryManager(1 << 30, device="cpu", events="native").attach(model, opt)
    try:
        with mm.step():
            model(torch.randn(4, 32)).sum().backward()
            opt.step()  # its pre-hook labels the gradients; they outlive the step
        grads = {mm._obs.sid_of(p.grad) for p in model.parameters()}
        assert {mm.st[sid].kind for sid in grads} == {"grad"} and all(mm.st[sid].movable for sid in grads)
        opt.zero_grad(set_to_none=True)
        with mm.step():
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
            assert mm._grad_pending  # not read yet: nothing decided in this step
            opt.zero_grad(set_to_none=True)
        assert not any(s.kind == "grad" for s in mm.st.values())
        assert not mm._grad_pending and not mm._saved_pending
    finally:
        mm.detach()


def test_gradients_are_labelled_beside_frozen_parameters_and_gradients_already_recorded():
    """The optimizer's pre-hook reads every parameter's gradient natively: a frozen parameter (no
    gradient) is passed over, a gradient born since the log was read waits for its birth to be read,
    and one already recorded (kept across steps by accumulation) keeps its label without a call
    into the labelling."""
    model, _ = _mlp()
    model[0].weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    mm = dr.MemoryManager(1 << 30, device="cpu", events="native").attach(model, opt)
    try:
        with mm.step():
            model(torch.randn(4, 32)).sum().backward()
            opt.step()
        assert model[0].weight.grad is None
        trained = [p for p in model.parameters() if p.requires_grad]
        grads = {mm._obs.sid_of(p.grad) for p in trained}
        assert len(grads) == len(trained) and {mm.st[sid].kind for sid in grads} == {"grad"}
        labelled: list[str] = []
        track = mm._track
        mm._track = lambda t, kind, fresh: labelled.append(kind) or track(t, kind, fresh)
        with mm.step():  # no zero_grad: the same gradients accumulate, already in the table
            model(torch.randn(4, 32)).sum().backward()
            assert {mm._obs.sid_of(p.grad) for p in trained} == grads
            opt.step()
            assert not mm._grad_pending  # recorded already: labelled, nothing waits
        assert {mm.st[sid].kind for sid in grads} == {"grad"} and "grad" not in labelled
    finally:
        mm.detach()


def test_doctor_says_which_event_source_is_used(monkeypatch):
    from dynn_runtime.runtime.doctor import doctor_report

    monkeypatch.delenv("DYNN_EVENTS", raising=False)
    rep = doctor_report("cpu", cuda_available=False)
    assert rep["native_events_built"] and rep["event_source"] == "native"
    # how CUDA deaths are learned follows the build: heard where it compiled heard_cuda.cpp with CUDA
    assert rep["cuda_deaths"].startswith("heard" if C.HEAR_CUDA else "swept for")
    assert not C.HEAR_CUDA or torch.version.cuda is not None  # no hearing without a CUDA build of torch
    from dynn_runtime.runtime.manager import MemoryManager

    assert rep["copy_engine"].startswith("C++" if MemoryManager.copies_in_c else "Python")
    monkeypatch.setattr(MemoryManager, "copies_in_c", not MemoryManager.copies_in_c)
    assert doctor_report("cpu", cuda_available=False)["copy_engine"].startswith(
        "C++" if MemoryManager.copies_in_c else "Python")
    monkeypatch.setenv("DYNN_EVENTS", "python")
    rep = doctor_report("cpu", cuda_available=False)
    assert rep["event_source"] == "python" and "DYNN_EVENTS=python" in rep["event_source_why"]


def test_without_the_extension_auto_falls_back_to_python_with_one_warning(monkeypatch):
    from dynn_runtime.runtime import events

    monkeypatch.delenv("DYNN_EVENTS", raising=False)
    monkeypatch.setattr(events, "native_module", lambda: None)
    monkeypatch.setattr(events, "_warned", False)
    with pytest.warns(RuntimeWarning, match="Python event path"):
        assert resolve("auto")[0] == "python"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("auto")[0] == "python"  # once
    with pytest.raises(ConfigError, match="events='native'"):
        resolve("native")


def test_an_extension_built_from_other_sources_is_not_used_and_the_reason_says_rebuild(monkeypatch):
    from dynn_runtime.runtime import events

    monkeypatch.setattr(C, "ABI", events.NATIVE_ABI - 1)
    monkeypatch.setattr(events, "_loaded", False)
    try:
        assert events.native_module() is None
        assert "rebuild it" in events.native_reason() and f"ABI {events.NATIVE_ABI - 1}" in events.native_reason()
    finally:
        monkeypatch.undo()
        events._loaded = False
        assert events.native_module() is C


def _history_of_two_steps(events: str) -> list:
    """Two managed steps of a small MLP after autograd work outside them: per step, each operator's
    name, phase and node (relative to the step's first node), and the deaths by position."""
    model, opt = _mlp()
    x = torch.randn(16, 32)
    (torch.ones(2, requires_grad=True) * 3).sum().backward()  # nodes made before the manager
    mm = dr.MemoryManager(1 << 40, device="cpu", events=events, record_every_op=True).attach(model, opt)
    mm.history_len = 4
    try:
        for _ in range(2):
            with mm.step():
                x2 = x * 1.0  # makes no node: its node word must be -1
                model(x2).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            (torch.ones(2, requires_grad=True) * 3).sum().backward()  # ... and between the steps
    finally:
        mm.detach()
    out = []
    for it in mm.history:
        base = min(o.node for o in it.ops if o.node >= 0)
        out.append(([(o.name, o.phase, o.node if o.node < 0 else o.node - base) for o in it.ops],
                    sorted(it.frees.items())))
    return out


@pytest.mark.parametrize("events", ["native", "python"])
def test_a_steps_nodes_do_not_depend_on_what_ran_before_it(events):
    """The operators of the first step of a manager and of a later one, each after autograd work
    outside the step, log the same nodes: the first operator, which makes none, logs -1 (not the
    thread's last node), and both steps and both runs alike."""
    a = _history_of_two_steps(events)
    b = _history_of_two_steps(events)
    assert a[0][0][0] == ("aten::mul.Tensor", "forward", -1)
    assert a[0][0] == a[1][0]
    assert a == b


def test_a_live_recency_step_logs_no_operator_records_but_keeps_the_tables_records():
    # while lru's order is kept in the observer, the compact parse is the log's only reader and would
    # drop every operator record: none is written, and what changes the table still is
    def run(records: bool) -> tuple[list, list, int]:
        ob = C.Observer("cpu")
        ob.start(None, None)
        try:
            ob.set_recency(0.0)
            ob.op_records_while_live = records
            ob.set_in_step(True)
            ob.set_recency_live(True)
            keep = torch.ones(16)
            for _ in range(3):
                keep = keep + 1
            ob.sweep()
            log, names = ob.take_log()
            timeline = ob.take_recency()[0]
            keep = keep + 1
            dropped, _, _, name_id, _, ins, _ = ob.take_recency(False)  # a light read: the timeline is not wanted
            assert dropped == b"" and name_id >= 0 and ins
            assert ob.take_recency()[0] == b""  # ... and it went with that read
            order = ob.recency_order()
        finally:
            ob.stop()
        return [names[i] for i, _ in _ops(log)], _tags(log), len(timeline) // 24, order

    ops, tags, timeline_ops, order = run(records=False)
    assert ops == [] and set(tags) == {C.LOG_ALLOC, C.LOG_FREE}
    assert timeline_ops == 4  # ones and three adds: the order was told each of them (and a fourth, dropped)
    ops_ref, tags_ref, timeline_ref, order_ref = run(records=True)
    assert ops_ref == ["aten::ones"] + ["aten::add.Tensor"] * 3
    assert [t for t in tags_ref if t != C.LOG_OP] == tags
    assert timeline_ref == timeline_ops and len(order_ref) == len(order)


def _tags(log: bytes) -> list[int]:
    w = struct.unpack(f"{len(log) // 8}q", log)
    out, i = [], 0
    while i < len(w):
        out.append(w[i])
        i += 9 + sum(w[i + 5:i + 9]) if w[i] == C.LOG_OP else 4 if w[i] == C.LOG_ALLOC else 2
    return out


@pytest.mark.parametrize("events", ["native", "python"])
def test_paused_runs_pytorch_alone_beside_a_managed_run_and_leaves_it_unchanged(events):
    """``MemoryManager._paused()`` (the overhead bench's PyTorch-alone side): between steps, an operator
    reaches no manager, no module hook or saved-tensor hook of the manager runs and the list splitter
    is out; afterwards all of it is back, and the managed run trains as it would have without the
    pauses (bit for bit). Not inside a step."""
    from dynn_runtime.runtime.events import QUIET
    from dynn_runtime.runtime.lists import ListSplitter

    def run(pause: bool) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        alone = nn.Sequential(nn.Linear(16, 16), nn.Sigmoid())
        xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)]
        from dynn_runtime.pilot.policy import PilotPolicy

        # every step told: the pilot's module hooks stay installed between steps on either source
        mm = dr.MemoryManager(1 << 40, policy=PilotPolicy(defer_idle=False), events=events).attach(model, opt)
        losses = []
        try:
            for x in xs:
                with mm.step():
                    loss = model(x).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                losses.append(loss.item())
                if pause:
                    obs = QUIET[-1] if QUIET else None
                    before = obs.position if obs is not None else None
                    modules_before = len(mm._modules.paths)
                    hooks_before = torch._C._autograd._top_saved_tensors_default_hooks(False)
                    with mm._paused():
                        assert torch._C._len_torch_dispatch_stack() == 0 and not ListSplitter._active
                        assert not mm._modules.installed
                        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
                        alone(x).sum().backward()
                    assert obs is None or obs.position == before  # nothing observed
                    assert len(mm._modules.paths) == modules_before  # no module hook ran
                    assert mm._modules.installed and ListSplitter._active
                    assert torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks_before
                    assert (hooks_before is not None) == (events == "python")  # native: pushed per step
            with mm.step(), pytest.raises(AssertionError, match="between steps"), mm._paused():
                pass
        finally:
            mm.detach()
        return losses

    assert run(True) == run(False)


def _count_packs(mm: dr.MemoryManager) -> list[int]:
    """Count the packs of ``mm``'s saved-tensor hooks (attached on the native source, where it pushes
    them per step): ``[count]``, kept up to date."""
    assert not mm._saved_entered
    packs = [0]
    hook = mm._saved_hooks.pack_hook

    def pack(t):
        packs[0] += 1
        return hook(t)

    mm._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack, mm._saved_hooks.unpack_hook)
    return packs


def _labels(pack_in_c: bool = True, grads_in_c: bool = True) -> tuple[list[float], list[list[tuple]], int, int, int]:
    """Three steps of a model whose operators save inputs, parameters and their own outputs (softmax,
    layer norm: packed before the observer logged them), one of whose parameters is frozen, under the
    pilot (a policy that reads labels), with the pack hook's and the gradient hook's common cases in
    the observer or all of them in Python: the losses, the table's labels after each forward, each
    backward and each step, the packs, and the calls of ``_pack`` and of ``_label_grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Softmax(-1), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    model[3].bias.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    from dynn_runtime.pilot.policy import PilotPolicy

    # every step told (defer_idle=False): none is sat out, so each pushes the saved-tensor hooks
    mm = dr.MemoryManager(1 << 40, policy=PilotPolicy(defer_idle=False), events="native")
    mm.pack_in_c, mm.grads_in_c = pack_in_c, grads_in_c
    calls = {"_pack": 0, "_label_grad": 0}
    for name in calls:
        real = getattr(mm, name)

        def counted(t, name=name, real=real):
            calls[name] += 1
            return real(t)

        setattr(mm, name, counted)
    mm.attach(model, opt)
    packs = _count_packs(mm)
    seen, losses = [], []
    order: dict[int, int] = {}

    def table(parse: bool = True) -> list[tuple]:
        if parse:
            mm._native_parse(in_step=True)
        return [(order.setdefault(sid, len(order)), s.kind, s.saved, s.nbytes) for sid, s in mm.st.items()]

    try:
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            with mm.step():
                loss = model(x).square().mean()
                seen.append(table())
                loss.backward()
                seen.append(table())
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            seen.append(table(parse=False))
    finally:
        mm.detach()
    return losses, seen, packs[0], calls["_pack"], calls["_label_grad"]


def test_the_observers_pack_hook_labels_what_the_python_hook_labels():
    ref = _labels(pack_in_c=False)
    got = _labels(pack_in_c=True)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert sum(saved for _, _, saved, _ in got[1][0]) >= 6  # the forward's saved storages are labelled
    assert ref[3] == ref[2] > 0  # the reference packs in Python only
    assert got[2] == ref[2] and 0 < got[3] < got[2]  # _pack takes the outputs not yet logged, the observer the rest


def test_the_observers_gradient_hook_labels_what_the_python_hook_labels():
    ref = _labels(grads_in_c=False)
    got = _labels(grads_in_c=True)
    assert got[0] == ref[0] and got[1] == ref[1]
    assert sum(kind == "grad" for _, kind, _, _ in got[1][1]) == 7  # after backward: every trainable one's
    assert ref[4] == 3 * 7  # the reference: a call per trainable parameter and step (none for the frozen bias)
    assert got[4] < ref[4]  # the observer takes the gradients whose birth is unread or whose record is labelled


def test_a_step_the_policy_sits_out_with_room_runs_without_its_hooks():
    """The pilot (it reads the saved labels and the modules) pushes its saved-tensor hooks for each
    step it is told and pops them at the step's end, and has its module hooks installed; a step it
    sits out while the last step's peak was within the budget runs without either (autograd calls no
    Python per saved tensor, nor a module's call per module), and the first step after the measuring
    step under a budget below its peak has them though it starts idle. Training is the same bit for
    bit, and the hooks' stack between steps is as it was."""
    def run(budget) -> tuple[list[float], list[int], list[bool]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mm = None if budget is None else dr.MemoryManager(budget, policy="pilot", events="native").attach(model, opt)
        packs = [0] if mm is None else _count_packs(mm)
        losses, per_step, idle, modules = [], [], [], []
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        try:
            for step in range(4):
                x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
                before = packs[0]
                with mm.step() if mm is not None else contextlib.nullcontext():
                    loss = model(x).square().mean()
                    modules.append(mm is not None and mm._modules.installed)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                assert torch._C._autograd._top_saved_tensors_default_hooks(False) == top
                losses.append(loss.item())
                per_step.append(packs[0] - before)
                idle.append(mm is not None and mm.steps[-1].idle)
        finally:
            if mm is not None:
                mm.detach()
        return losses, per_step, idle, modules

    roomy = run(1 << 40)
    assert roomy[2] == [False, True, True, True]  # told once, then sat out
    assert roomy[1][0] > 0 and roomy[1][1:] == [0, 0, 0]
    assert roomy[3] == [True, False, False, False]
    tight = run("1/2")  # step 0 measures the peak; the next starts idle and runs short
    assert tight[1][1] > 0 and not tight[2][1]  # it woke, with the hooks pushed from its start
    assert tight[3][1]
    assert roomy[0] == tight[0] == run(None)[0]
