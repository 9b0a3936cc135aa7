"""The live MemoryManager on the CPU (logical budget): bit identity, budgets, faults, detach."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import dynn_runtime as dr
from dynn_runtime.errors import BudgetError, ConfigError, HostMemoryError, PolicyError
from dynn_runtime.runtime.events import native_module
from dynn_runtime.workload import load_workload, make_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from zoo_training import train_family  # noqa: E402

FAMILIES = ("moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen")
NATIVE = native_module() is not None
# The smallest fraction of the unmanaged peak at which an offloading policy trains each tiny
# family (below it one operator's inputs and outputs alone exceed the budget); measured with lru.
SMALLEST = {"moe": 0.125, "skipnet": 0.2, "early_exit": 0.4, "tree_lstm": 0.6, "evoformer": 0.125, "varlen": 0.4}


_train = train_family


_BASE: dict = {}


def _baseline(family):
    """Unmanaged training, and the per-step peaks under the manager's accounting (policy none)."""
    if family not in _BASE:
        losses, state, _ = _train(family)
        l2, s2, stats = _train(family, "none", 1 << 40)
        assert l2 == losses and all(torch.equal(a, b) for a, b in zip(state, s2)), "policy none changed the numbers"
        _BASE[family] = (losses, state, max(s["peak_device_bytes"] for s in stats["per_step"]))
    return _BASE[family]


def _limit(stats, budget):
    """The most a step may hold: the budget on the Python source (exact); on the native source, where
    room is made after operators, the budget plus the largest single allocation (events.cpp)."""
    return budget + (stats["largest_allocation_bytes"] or 0 if stats["event_source"] == "native" else 0)


def _assert_same(family, losses, state):
    base_losses, base_state, _ = _baseline(family)
    assert losses == base_losses
    assert len(state) == len(base_state)
    for a, b in zip(state, base_state):
        assert torch.equal(a, b)


@pytest.mark.parametrize("events", ["python", "native"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["lru", "replay", "pilot"])
def test_bit_identical_at_smallest_budget(family, policy, events):
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    _, _, peak = _baseline(family)
    budget = int(peak * SMALLEST[family])
    losses, state, stats = _train(family, policy, budget, events=events)
    assert stats["event_source"] == events
    _assert_same(family, losses, state)
    if events == "python":  # output sizes are known before each operator: the budget is exact
        assert stats["peak_device_bytes"] <= budget
        assert stats["budget_overshoot_bytes"] == 0
    else:  # room is made after operators for the largest allocation seen so far (events.cpp, invariant 6)
        over = [s["budget_overshoot_bytes"] for s in stats["per_step"]]
        assert max(over) <= stats["largest_allocation_bytes"] < budget, over
        assert stats["peak_device_bytes"] == budget + max(over) or stats["peak_device_bytes"] <= budget
        # where the largest one happened, for the user to read
        assert [bool(s["budget_overshoot_at"]) for s in stats["per_step"]] == [o > 0 for o in over]
        if max(over):
            worst = max(stats["per_step"], key=lambda s: s["budget_overshoot_bytes"])
            assert stats["budget_overshoot_at"] == f"step {worst['step']}, {worst['budget_overshoot_at']}"
    assert stats["bytes_offloaded"] > 0 and stats["evictions"] > 0
    # what left came back: every demand fetch is a miss, every prefetch a hit or still pending
    assert stats["bytes_fetched_on_demand"] + stats["bytes_prefetched"] > 0


@pytest.mark.parametrize("family", ["moe", "evoformer"])
def test_bit_identical_save_on_cpu_and_fraction_budget(family):
    losses, state, stats = _train(family, "save_on_cpu", 0.75)
    _assert_same(family, losses, state)
    first, later = stats["per_step"][0], stats["per_step"][1:]
    assert not first["managed"] and first["bytes_offloaded"] == 0  # the measuring step runs unmanaged
    # the measured peak adds the optimizer state born after step 0's peak (there at later peaks)
    assert stats["measured_peak_bytes"] > first["peak_device_bytes"]
    assert stats["budget_bytes"] == int(stats["measured_peak_bytes"] * 0.75)
    assert all(s["peak_device_bytes"] <= stats["budget_bytes"] for s in later)
    assert sum(s["bytes_offloaded"] for s in later) > 0


@pytest.mark.parametrize("events", ["python", "native"])
@pytest.mark.parametrize("family", ["moe", "evoformer"])
def test_fraction_budget_measures_a_model_larger_than_the_device(family, events, monkeypatch):
    """On CUDA a fractional budget's measuring step runs under the device's free memory, not
    unmanaged, so "1/4" works for a model that does not fit the device. Here the device is made
    smaller than the model (a third of its peak): the first step moves storages, still measures the
    peak PyTorch alone reaches, and the run is bit-identical."""
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    _, _, peak = _baseline(family)
    _, _, ref = _train(family, "lru", 0.75, events=events)  # measured unmanaged (the CPU's measuring step)
    for device in (int(peak / 3), int(peak / 2.5), int(peak / 2.9)):  # the measurement may not depend on it
        monkeypatch.setattr(dr.MemoryManager, "_first_step_budget", lambda self, d=device: d)
        losses, state, stats = _train(family, "lru", 0.75, events=events)
        _assert_same(family, losses, state)
        first = stats["per_step"][0]
        assert not first["managed"] and first["evictions"] > 0  # measuring, and it had to move things
        assert first["peak_device_bytes"] <= _limit(stats, device)
        assert stats["measured_peak_bytes"] == ref["measured_peak_bytes"], device
        assert stats["budget_bytes"] == ref["budget_bytes"] == int(stats["measured_peak_bytes"] * 0.75)
        assert all(s["peak_device_bytes"] <= _limit(stats, stats["budget_bytes"]) for s in stats["per_step"][1:])


def test_oracle_from_a_recorded_trace(tmp_path):
    from dynn_runtime.trace.recorder import record

    family = "moe"
    path = tmp_path / "moe.jsonl.gz"
    record(family, path, steps=3, preset="tiny", seed=0)
    _, _, peak = _baseline(family)
    budget = int(peak * 0.25)
    losses, state, stats = _train(family, "oracle", budget, trace=str(path))
    _assert_same(family, losses, state)
    assert stats["peak_device_bytes"] <= budget
    assert stats["prefetch_hits"] > 0  # it knew what came next
    lru = _train(family, "lru", budget)[2]
    assert stats["prefetch_misses"] < lru["prefetch_misses"]


def test_oracle_needs_a_trace():
    with pytest.raises(PolicyError, match="trace="):
        dr.MemoryManager("1MiB", policy="oracle", device="cpu")


def test_offloaded_storage_is_released_and_restored_in_place():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = [p.detach().clone() for p in model.parameters()]
    ids = [id(p) for p in model.parameters()]
    mm = dr.MemoryManager(1 << 20, policy="lru", device="cpu").attach(model, opt)
    w = model[0].weight
    assert mm.offload(w) == 64 * 64 * 4
    assert w.untyped_storage().nbytes() == 0  # truly released
    assert mm.status(mm._sid(w)) == "host"
    assert mm.offload(torch.ones(3)) == 0  # not managed: ignored
    mm.detach()
    assert w.untyped_storage().nbytes() == 64 * 64 * 4
    assert [id(p) for p in model.parameters()] == ids  # the model keeps its Parameter objects
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref))


def test_access_between_steps_fetches_and_state_dict_is_complete():
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters())
    mm = dr.MemoryManager(1 << 20, policy="lru", device="cpu").attach(model, opt)
    x = torch.randn(8, 32)
    with mm.step():
        model(x).sum().backward()
        opt.step()
    mm.offload(*model.parameters())  # push everything off the device
    assert model[0].weight.untyped_storage().nbytes() == 0
    y = model(x)  # outside a step: fetched on access
    assert torch.isfinite(y).all()
    mm.offload(*model.parameters())
    sd = model.state_dict()  # the pre hook brings everything back before it is read
    assert all(v.untyped_storage().nbytes() == v.numel() * v.element_size() for v in sd.values())
    mm.detach()


def test_budget_smaller_than_one_operator_names_it():
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = dr.MemoryManager(64 << 10, policy="lru", device="cpu").attach(model, opt)
    try:
        with pytest.raises(BudgetError, match=r"one operator needs: operator aten::\w+.*Raise the budget to at least"):
            with mm.step():
                model(torch.randn(64, 256)).sum().backward()
    finally:
        mm.detach()


def test_fraction_too_small_for_largest_operator_after_measuring_step():
    with pytest.raises(BudgetError, match="smaller than what one operator needs"):
        _train("tree_lstm", "lru", 0.2, steps=2)


def _peaks_with_adam(budget, events, foreach, batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    mm = dr.MemoryManager(budget, policy="lru", device="cpu", events=events).attach(model, opt)
    try:
        for step in range(3):
            x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(step))
            with mm.step():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        return mm.measured_peak, [s.peak_device_bytes for s in mm.steps]
    finally:
        mm.detach()


@pytest.mark.parametrize("events", ["python", "native"] if NATIVE else ["python"])
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("batch", [64, 256])
def test_the_measured_peak_is_the_peak_of_the_steps_after_it(events, foreach, batch):
    # Adam's moments are made in the first step's optimizer, after its forward: every later step
    # holds them from its start. With these sizes the first step's peak is in its optimizer and a
    # later step's in its forward (batch 256), or both in the optimizer (batch 64); the measured
    # peak must be the later steps' either way, on both sources (the native source once counted the
    # moments twice: their records took the optimizer hook's position, after the peak's)
    measured, _ = _peaks_with_adam(1.0, events, foreach, batch)
    _, peaks = _peaks_with_adam(1 << 40, events, foreach, batch)  # nothing managed: what PyTorch holds
    assert peaks[1] == peaks[2] >= peaks[0]
    assert measured == peaks[1]


class _DynamicDepth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(6))

    def forward(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for layer in self.layers[:depth]:
            x = torch.tanh(layer(x))
        return x


@pytest.mark.parametrize("events", ["python", "native"] if NATIVE else ["python"])
def test_a_fraction_measured_over_several_steps_takes_their_largest_peak(events):
    # the first batch runs one layer of six (a dynamic-depth network): one measuring step sees a
    # sixth of the parameters' gradients and state; three see the deepest batch too (the second)
    depths = [1, 6, 1, 6]

    def run(budget, measure_steps=1):
        torch.manual_seed(0)
        model = _DynamicDepth()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        mm = dr.MemoryManager(budget, policy="lru", device="cpu", events=events, measure_steps=measure_steps)
        mm.attach(model, opt)
        losses = []
        try:
            for step, depth in enumerate(depths):
                x = torch.randn(256, 128, generator=torch.Generator().manual_seed(step))
                with mm.step():
                    loss = model(x, depth).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                losses.append(loss.item())
            return mm.measured_peak, [s.managed for s in mm.steps], [s.peak_device_bytes for s in mm.steps], losses
        finally:
            mm.detach()

    _, _, peaks, want = run(1 << 40)  # nothing managed
    one, managed1, _, losses1 = run(0.5)
    three, managed3, got, losses3 = run(0.5, measure_steps=3)
    assert one < max(peaks) * 0.55  # the first step (and the state it made) holds about half of a deep step's
    assert three == max(peaks)  # the deep step with the state the first two made: what step 3 holds
    assert managed1 == [False, True, True, True] and managed3 == [False, False, False, True]
    assert got[3] <= three // 2 + (0 if events == "python" else 128 * 256 * 4)  # (native: one allocation over)
    assert losses1 == losses3 == want
    with pytest.raises(ConfigError, match="measure_steps"):
        dr.MemoryManager(0.5, device="cpu", measure_steps=0)


@pytest.mark.parametrize("bad", [0.0, 1.5, -3, "lots", "1/0", True])
def test_bad_budget_values(bad):
    with pytest.raises(BudgetError):
        dr.MemoryManager(bad, device="cpu")


def test_unknown_policy_and_device():
    with pytest.raises(PolicyError, match="unknown policy"):
        dr.MemoryManager("1MiB", policy="magic", device="cpu")
    with pytest.raises(ConfigError):
        dr.MemoryManager("1MiB", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            dr.MemoryManager("1MiB", device="cuda")


def test_host_budget_exhausted_names_the_knob():
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mm = dr.MemoryManager(200 << 10, policy="lru", device="cpu", host_budget="64KiB").attach(model, opt)
    try:
        with pytest.raises(HostMemoryError, match="host_budget"):
            with mm.step():
                model(torch.randn(16, 128)).sum().backward()
                opt.step()
    finally:
        mm.detach()


class _Boom(Exception):
    pass


@pytest.mark.parametrize("exc", [_Boom, KeyboardInterrupt])
def test_exception_inside_step_leaves_everything_restorable(exc):
    family = "moe"
    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    _, _, peak = _baseline(family)
    mm = dr.MemoryManager(int(peak * 0.25), policy="lru", device="cpu").attach(model, opt)
    with pytest.raises(exc):
        with mm.step():
            loss = wl.loss(model, wl.make_batch(0))
            loss.backward()
            raise exc()
    assert any(s.status == "host" for s in mm.st.values())  # something was off the device mid-step
    opt.zero_grad(set_to_none=True)
    # still usable: the same training continues and matches a run that never failed
    wl2 = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    ref_model = wl2.model
    ref_opt = make_optimizer(wl2, ref_model.parameters())
    for step in range(2):
        with mm.step():
            loss = wl.loss(model, wl.make_batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss2 = wl2.loss(ref_model, wl2.make_batch(step))
        loss2.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert loss.item() == loss2.item()
    mm.detach()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


def test_compiled_module_is_left_alone_with_one_warning():
    model = nn.Linear(8, 8)
    compiled = torch.compile(model)
    with pytest.warns(RuntimeWarning, match="torch.compile"):
        mm = dr.MemoryManager("1MiB", policy="lru", device="cpu").attach(compiled)
    assert mm.stats()["managed_storages"] == 0
    mm.detach()


def test_gradient_accumulation_and_autocast_bit_identical():
    def run(managed):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        mm = dr.MemoryManager(192 << 10, policy="lru", device="cpu").attach(model, opt) if managed else None
        g = torch.Generator().manual_seed(1)
        losses = []
        for _step in range(3):
            ctx = mm.step() if mm else torch.enable_grad()
            with ctx:
                for _ in range(2):  # two micro-batches per optimizer step
                    x = torch.randn(16, 64, generator=g)
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(x).float().pow(2).mean() / 2
                    loss.backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad(set_to_none=True)
        stats = mm.stats() if mm else None
        if mm:
            mm.detach()
        return losses, [p.detach().clone() for p in model.parameters()], stats

    l0, p0, _ = run(False)
    l1, p1, stats = run(True)
    assert l0 == l1
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert stats["bytes_offloaded"] > 0 and stats["peak_device_bytes"] <= _limit(stats, 192 << 10)


def test_torch_checkpoint_composes():
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))

        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=False)
            return x.sum()

    def run(managed):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mm = dr.MemoryManager(80 << 10, policy="lru", device="cpu").attach(model, opt) if managed else None
        for step in range(2):
            ctx = mm.step() if mm else torch.enable_grad()
            with ctx:
                model(torch.full((32, 64), 0.1 * (step + 1))).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        if mm:
            assert mm.stats()["bytes_offloaded"] > 0
            mm.detach()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


def test_step_misuse():
    mm = dr.MemoryManager("1MiB", device="cpu")
    with pytest.raises(ConfigError, match="attach"):
        with mm.step():
            pass
    model = nn.Linear(4, 4)
    mm.attach(model)
    with pytest.raises(ConfigError, match="already attached"):
        mm.attach(model)
    with pytest.raises(ConfigError, match="nest"):
        with mm.step():
            with mm.step():
                pass
    mm.detach()


@pytest.mark.parametrize("family", ["moe", "evoformer"])
def test_checkpoint_policy_live_is_bit_identical_and_saves_memory(family):
    _, _, peak = _baseline(family)
    losses, state, stats = _train(family, "checkpoint", 1 << 40)
    _assert_same(family, losses, state)
    assert stats["peak_device_bytes"] < peak  # the blocks kept nothing for backward
    wl = load_workload(family, preset="tiny", seed=0)
    mm = dr.MemoryManager(1 << 40, policy="checkpoint", device="cpu").attach(wl.model)
    assert mm._checkpointed
    mm.detach()
    assert all("forward" not in vars(m) for m in wl.model.modules())  # unwrapped again


def test_dtr_is_refused_live_with_a_reason():
    with pytest.raises(PolicyError, match="simulator only"):
        dr.MemoryManager("1MiB", policy="dtr", device="cpu")


def test_in_flight_copies_are_registered_by_status():
    # reaping and waiting on CUDA look only at the in-flight sets; a storage whose copy is in flight but
    # missing from them would never become usable, one left in them would be waited on forever. The
    # live manager keeps them through the residency state machine the simulator uses too.
    from dynn_runtime.residency import Status
    from dynn_runtime.runtime.storages import _S

    ABSENT, FETCHING, HOST, OFFLOADING, RESIDENT = (
        Status.ABSENT, Status.FETCHING, Status.HOST, Status.OFFLOADING, Status.RESIDENT)

    mm = dr.MemoryManager(1 << 20, device="cpu")
    s = _S(7, 0, None, 16, "activation", movable=True, step=0)
    mm.st[7] = s
    mm.set_status(s, RESIDENT)
    assert (mm.used, mm.offloading, mm.fetching) == (16, {}, {})
    mm.set_status(s, OFFLOADING)
    assert mm.offloading == {7: s} and mm.pending == 16 and mm.used == 16
    mm.set_status(s, HOST)
    assert (mm.used, mm.pending, mm.offloading) == (0, 0, {})
    mm.set_status(s, FETCHING)
    assert mm.fetching == {7: s} and mm.used == 16
    mm.set_status(s, RESIDENT)
    assert mm.fetching == {}
    mm.set_status(s, OFFLOADING)
    mm.set_status(s, ABSENT)  # freed while its copy was in flight
    assert (mm.used, mm.pending, mm.offloading) == (0, 0, {})
    assert mm.status(7) == "absent"
    with pytest.raises(AssertionError, match="illegal transition absent -> host"):
        mm.set_status(s, HOST)


def test_pilot_worker_in_the_live_runtime():
    """Rule 11 on a real thread under the live manager: the same numbers as unmanaged training, the
    worker's results merged. Rule 12 (the default, ``worker="auto"``) on a CPU device: the operators
    run on this thread, the manager reports no device slack, every decision is taken here."""
    from dynn_runtime.pilot import kernel as native

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from pilot_lab import LabPilot  # worker=True (always hand off) is an experiment switch

    assert dr.MemoryManager(1 << 20, device="cpu").device_slack() is None
    _, _, peak = _baseline("moe")
    budget = int(peak * SMALLEST["moe"])
    for worker in ((True, "auto") if native.available() else ("auto",)):
        pol = LabPilot(worker=worker)
        losses, state, stats = _train("moe", pol, budget)
        _assert_same("moe", losses, state)
        assert stats["evictions"] > 0 and pol.decisions > 0
        if worker is True:
            assert pol.handoffs > 0 and pol.merged > 0
        else:
            assert pol.handoffs == 0
        # the worker's thread ended with the run (Policy.close at detach)
        assert pol._pool is None and not [t for t in threading.enumerate() if t.name.startswith("dynn-pilot")]


def test_live_operators_carry_the_autograd_nodes_the_recorder_writes():
    """The pilot's mirror (rule 9 of its features) needs each operator's autograd node in the live
    runtime too: the operators a policy sees under the manager name the same nodes as a recording."""
    from dynn_runtime.policies.basic import LRUPolicy

    class Ops(LRUPolicy):
        def __init__(self):
            super().__init__()
            self.ops = []

        def on_op(self, position, op):
            super().on_op(position, op)
            self.ops.append(op)

    pol = Ops()
    _, _, peak = _baseline("tree_lstm")
    _train("tree_lstm", pol, int(peak * 0.8), steps=1)
    fwd = {op.node: op.name for op in pol.ops if op.phase == "forward" and op.node >= 0}
    bwd = [op for op in pol.ops if op.phase == "backward"]
    assert len(fwd) > 50 and len(bwd) > 50
    assert sum(op.node in fwd for op in bwd) >= 0.95 * len(bwd)
    for op in bwd:
        if op.name in ("aten::tanh_backward", "aten::sigmoid_backward"):
            assert fwd[op.node] == op.name.replace("_backward", "")
    assert all(op.node < 0 for op in pol.ops if op.phase == "optimizer")


@pytest.mark.parametrize("events", ["python", "native"])
def test_a_budget_error_at_the_start_of_a_step_leaves_the_manager_usable(events):
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    wl = load_workload("moe", preset="tiny", seed=0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # save_on_cpu moves only saved activations: parameters alone exceed this budget
    mm = dr.MemoryManager(params // 2, policy="save_on_cpu", device="cpu", events=events).attach(model, opt)
    with pytest.raises(BudgetError, match="start of the step") as err:
        with mm.step():
            pass
    assert not mm._in_step
    # what is in use is named by kind and by why it did not move (here: the policy would not take it)
    assert re.search(r"In use: param [0-9.]+ KiB \(movable\), buffer", str(err.value))
    other = nn.Linear(64, 64)  # operators between steps are not budgeted
    assert other(torch.randn(4, 64)).shape == (4, 64)
    with pytest.raises(BudgetError, match="start of the step"):  # the next step meets the same problem, named
        with mm.step():
            pass
    mm.budget = 1 << 40  # raised: training goes on
    with mm.step():
        wl.loss(model, wl.make_batch(0)).backward()
        opt.step()
    mm.detach()


def test_timeline_and_meta_cache_stay_bounded(monkeypatch):
    monkeypatch.setattr(dr.MemoryManager, "TIMELINE_ENTRIES", 50)
    monkeypatch.setattr(dr.MemoryManager, "META_CACHE_ENTRIES", 8)
    _, _, peak = _baseline("varlen")
    seen = {}
    orig = dr.MemoryManager.detach

    def detach(self):
        seen["timeline"], seen["cache"] = len(self.timeline()), len(self._meta_cache)
        seen["last"] = self.timeline()[-1][0]
        orig(self)

    monkeypatch.setattr(dr.MemoryManager, "detach", detach)
    losses, state, stats = _train("varlen", "lru", int(peak * 0.5), events="python")
    assert stats["ops"] > 50
    assert seen["timeline"] == 50 and seen["last"] == 2  # the newest entries are kept
    assert seen["cache"] <= 8
    _assert_same("varlen", losses, state)


@pytest.mark.parametrize("events", ["python", "native"])
def test_pinned_modules_never_move_and_training_keeps_the_bits(events):
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    _, _, peak = _baseline("moe")
    wl = load_workload("moe", preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(int(peak * 0.25), policy="lru", device="cpu", events=events).attach(model, opt)
    first = next(model.children())
    pinned = [p for p in first.parameters()]
    assert mm.pin(first) == sum(p.untyped_storage().nbytes() for p in pinned)
    sids = {mm._sid(p) for p in pinned}
    evicted = set()
    evict = mm._evict

    def spy(s):
        ok = evict(s)
        if ok:
            evicted.add(s.sid)
        return ok

    mm._evict = spy
    losses = []
    try:
        for step in range(3):
            with mm.step():
                loss = wl.loss(model, wl.make_batch(step))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert evicted and not evicted & sids  # others moved, the pinned never
        mm.unpin(first)
        assert not mm._pinned
    finally:
        mm.detach()
    assert losses == _baseline("moe")[0]
    with pytest.raises(ConfigError, match="tensors and modules"):
        mm.pin("weights")


def test_cuda_graph_capture_of_a_step_is_refused(monkeypatch):
    mm = dr.MemoryManager(1 << 30, device="cpu").attach(nn.Linear(4, 4))
    mm.cuda = True  # what a CUDA device would see while torch.cuda.graph captures the stream
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ConfigError, match="CUDA graph"):
        with mm.step():
            pass
    mm.cuda = False
    assert not mm._in_step
    mm.detach()


@pytest.mark.parametrize("events", ["python", "native"])
def test_state_dict_of_a_model_over_the_budget_streams_to_host_copies(events, tmp_path):
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh()) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    budget = 1_200_000  # parameters 0.53 MB and Adam's two moments 1.06 MB: the state alone does not fit
    mm = dr.MemoryManager(budget, policy="lru", device="cpu", events=events).attach(model, opt)
    try:
        for _ in range(2):
            with mm.step():
                model(torch.randn(64, 128)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert any(True for _ in mm.offloaded())
        with pytest.warns(RuntimeWarning, match="CPU copies"):
            sd = model.state_dict()
        osd = opt.state_dict()
        assert mm.used <= budget  # nothing was brought back wholesale
        torch.save({"model": sd, "opt": osd}, tmp_path / "ckpt.pt")
        mm.restore_all()
        for name, p in model.named_parameters():
            assert torch.equal(sd[name], p.detach()) and sd[name].untyped_storage().data_ptr() != p.data_ptr()
        loaded = torch.load(tmp_path / "ckpt.pt")
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                assert torch.equal(loaded["opt"]["state"][i][k], v)
    finally:
        mm.detach()


def test_default_budget_is_free_device_memory_less_a_headroom(monkeypatch):
    from dynn_runtime.runtime import devicemem as manager

    assert dr.MemoryManager(device="cpu").budget == 1 << 62  # logical on the CPU: no limit
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 2 * gib)
    assert manager.default_budget(torch.device("cuda", 0)) == 32 * gib - 4 * gib  # 5% of 80 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (gib // 4, 8 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev=None: 0)
    with pytest.raises(BudgetError, match="headroom"):
        manager.default_budget(torch.device("cuda", 0))


def test_a_measuring_step_out_of_memory_says_to_give_bytes():
    model = nn.Linear(8, 8)
    mm = dr.MemoryManager("1/1", device="cpu").attach(model)
    with pytest.raises(BudgetError, match="measures the peak in its first steps, run unmanaged.*give the budget in bytes|Give the budget in bytes"):
        with mm.step():
            model(torch.randn(2, 8)).sum().backward()
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not mm._in_step and mm.budget is None  # still measuring: the next step measures again
    with mm.step():
        model(torch.randn(2, 8)).sum().backward()
    assert mm.budget is not None
    mm.detach()


def _offloaded_adam(events):
    """A model trained one step under the manager, then everything offloaded: parameters, gradients
    (kept: no zero_grad) and Adam's state all away from the device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", events=events).attach(model, opt)
    with mm.step():
        model(torch.randn(4, 32)).pow(2).mean().backward()
        opt.step()
    state = [*model.parameters(), *(p.grad for p in model.parameters())]
    state += [v for s in opt.state.values() for v in s.values() if v.dim()]
    want = [t.detach().clone() for t in state]
    assert mm.offload(*state) > 0
    return model, opt, mm, want


@pytest.mark.parametrize("events", ["python", "native"])
def test_restore_all_and_detach_when_the_state_does_not_fit_the_device(events, monkeypatch):
    """restore_all() refuses, moving nothing, when what is away exceeds the device's free memory;
    detach() then leaves the state on the CPU with the same values instead of running out of memory."""
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    from dynn_runtime.runtime import devicemem

    model, opt, mm, want = _offloaded_adam(events)
    away = mm.away
    assert away > 0
    monkeypatch.setattr(devicemem, "device_room", lambda dev: away - 1)
    with pytest.raises(BudgetError, match="restore_all\\(\\) needs .* nothing was moved"):
        mm.restore_all()
    assert mm.away == away and mm.attached
    with pytest.warns(RuntimeWarning, match="left .* tensors of it on the CPU"):
        mm.detach()
    assert not mm.attached
    got = [*model.parameters(), *(p.grad for p in model.parameters())]
    got += [v for s in opt.state.values() for v in s.values() if v.dim()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(t.untyped_storage().nbytes() > 0 for t in got)  # real storages again, none left empty


@pytest.mark.parametrize("events", ["python", "native"])
def test_detach_brings_everything_back_when_it_fits(events, monkeypatch):
    if events == "native" and not NATIVE:
        pytest.skip("the native event source is not built")
    from dynn_runtime.runtime import devicemem

    model, opt, mm, want = _offloaded_adam(events)
    monkeypatch.setattr(devicemem, "device_room", lambda dev: mm.away)  # just enough
    ids = [id(p) for p in model.parameters()]
    mm.detach()
    got = [*model.parameters(), *(p.grad for p in model.parameters())]
    got += [v for s in opt.state.values() for v in s.values() if v.dim()]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [id(p) for p in model.parameters()] == ids


def test_detach_that_cannot_move_something_stays_attached(monkeypatch):
    """A storage away from the device that no parameter, buffer, gradient or optimizer state holds
    cannot be put on the CPU for the program: detach() raises and nothing changes."""
    from dynn_runtime.runtime import devicemem

    model, opt, mm, want = _offloaded_adam("python")
    loose = torch.randn(64, 64)
    with mm.step():
        kept = loose * 2  # made in the step and movable while it runs
        expected = kept.clone()
        assert mm.offload(kept) > 0
        monkeypatch.setattr(devicemem, "device_room", lambda dev: 0)
        with pytest.raises(BudgetError, match="hold no parameter, buffer, gradient or optimizer state"):
            mm.detach()
    assert mm.attached
    monkeypatch.setattr(devicemem, "device_room", lambda dev: 1 << 62)
    mm.detach()
    assert torch.equal(kept, expected)


class _GroupedExperts(nn.Module):
    """Experts run through ``torch._grouped_mm``, whose meta kernel takes bfloat16 only."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 16, 64) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offs = torch.tensor([40, 80, 120, 160], dtype=torch.int32)
        return torch._grouped_mm(x, self.w, offs=offs)


def test_an_operator_whose_meta_kernel_refuses_the_dtype_is_still_sized_exactly():
    from dynn_runtime.runtime.python_source import _meta_out_bytes

    x, w = torch.randn(160, 16), torch.randn(4, 16, 64)
    offs = torch.tensor([40, 80, 120, 160], dtype=torch.int32)
    real = torch._grouped_mm(x, w, offs=offs).untyped_storage().nbytes()
    assert _meta_out_bytes(torch.ops.aten._grouped_mm.default, (x, w), {"offs": offs}) == real
    assert _meta_out_bytes(torch.ops.aten.nonzero.default, (x,), {}) is None  # data-dependent: no guess here

    torch.manual_seed(0)
    model = _GroupedExperts()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    budget = 4 * real  # output larger than the inputs: a sum-of-inputs guess falls short
    mm = dr.MemoryManager(budget, policy="lru", device="cpu", events="python").attach(model, opt)
    try:
        for _ in range(2):
            with mm.step():
                model(torch.randn(160, 16)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        stats = mm.stats()
    finally:
        mm.detach()
    assert stats["budget_overshoot_bytes"] == 0 and stats["peak_device_bytes"] <= budget


@pytest.mark.parametrize("events", ["python"] + (["native"] if NATIVE else []))
def test_optimizer_state_on_another_device_is_looked_at_once(events, monkeypatch):
    """State the manager does not manage (Adam's step counters stay on the host of a CUDA manager;
    here a meta tensor for a CPU one) is looked at once on the Python source and never handed to
    the labelling on the native one, not at every step's end; a state tensor the program replaces
    is labelled again."""
    monkeypatch.setenv("DYNN_EVENTS", events)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mm = dr.MemoryManager(1 << 30, policy="lru").attach(model, opt)
    seen: list[torch.device] = []
    track = mm._track

    def spy(t, kind, fresh):
        if kind == "opt_state":
            seen.append(t.device)
        return track(t, kind, fresh)

    monkeypatch.setattr(mm, "_track", spy)
    x = torch.randn(4, 8)
    with mm:
        for step in range(3):
            with mm.step():
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
            if step == 0:
                for p in model.parameters():
                    opt.state[p]["elsewhere"] = torch.empty(2, device="meta")
            if step == 1:
                replaced = model.weight
                opt.state[replaced]["momentum_buffer"] = opt.state[replaced]["momentum_buffer"].clone()
        # step 0: the two momentum buffers; step 1: the two meta tensors (not managed: the Python
        # source looks at them once, the native one never hands them over); step 2: the replaced
        # buffer, a temporary to the table until it is labelled
        assert [d.type for d in seen] == ["cpu", "cpu"] + (["meta", "meta"] if events == "python" else []) + ["cpu"]
        buf = opt.state[replaced]["momentum_buffer"]
        assert mm.st[mm._sid(buf)].kind == "opt_state"
    assert mm.stats()["managed_storages"] > 0
