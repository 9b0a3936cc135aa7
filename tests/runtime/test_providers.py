"""The hook surface (runtime/providers.py): provider choice, and the runtime run through each provider.

The patched provider runs against ``FakeTorchC``, a stand-in for a patched ``torch._C`` that keeps
the contracts of patches/README.md: an allocator whose reclaim hook runs without its (non
re-entrant) lock, observes frees made from inside the hook, retries while anything was freed, skips
nested reclaims and counts hook errors; an engine whose fetch hook runs right before a node
(emulated with node pre-hooks, so before the node unpacks its saved tensors) after the look-ahead
hook got the nodes that became ready; and the sequence-number peek of the real build.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import dynn_runtime as dr
from dynn_runtime.errors import ConfigError, NativeError
from dynn_runtime.native import REQUIRED_FEATURES, NativeFeatures
from dynn_runtime.residency import Status
from dynn_runtime.runtime.copies import SyncCopies
from dynn_runtime.runtime.events import native_module
from dynn_runtime.runtime.providers import (
    NativeEventsProvider,
    PatchedProvider,
    PythonProvider,
    Verb,
    select_provider,
)

PATCHED = NativeFeatures(available=True, series="dynn-hooks-1", features=REQUIRED_FEATURES, reclaim_protocol=1,
                         engine_protocol=1, reason="torch carries dynn-hooks-1")
STOCK = NativeFeatures(available=False, reason="torch 2.13.0 is a stock build")
EVENT_SOURCES = ["python"] + (["native"] if native_module() is not None else [])


class FakeOOM(MemoryError):
    pass


class FakeTorchC:
    """A patched torch._C in miniature (see the module docstring for the contracts it keeps)."""

    def __init__(self, capacity: int = 1 << 40, lookahead: bool = True) -> None:
        self.capacity = capacity
        self.deliver_lookahead = lookahead
        self.used = 0
        self._mu = threading.Lock()  # not re-entrant: a hook called under it would deadlock
        self._blocks: dict[int, int] = {}
        self._next_ptr = 1
        self._tls = threading.local()
        self.reclaim_hook = self.fetch_hook = self.lookahead_hook = None
        self.max_attempts = 3
        self.observers: dict[int, tuple[str, object]] = {}
        self.stats = {"calls": 0, "recovered": 0, "exhausted": 0, "nested_skipped": 0, "errors": 0,
                      "observed": 0}
        self.last_error = ""
        self._ready: list[tuple[int, str]] = []
        self.engine = {"fetch_calls": 0, "lookahead_calls": 0, "saved_checked": 0, "saved_away": 0}

    # -- probe ---------------------------------------------------------------------------------
    def _dynn_features(self) -> dict:
        return {"series": "dynn-hooks-1", "features": sorted(REQUIRED_FEATURES), "reclaim_protocol": 1,
                "engine_protocol": 1}

    def _dynn_peek_sequence_nr(self) -> int:
        return torch._C._autograd._get_sequence_nr()

    # -- registration --------------------------------------------------------------------------
    def _dynn_set_reclaim_hook(self, fn) -> None:
        self.reclaim_hook = fn

    def _dynn_set_reclaim_max_attempts(self, n: int) -> None:
        self.max_attempts = max(1, n)

    def _dynn_add_free_observer(self, fn) -> int:
        oid = len(self.observers) + 1
        self.observers[oid] = ("free", fn)
        return oid

    def _dynn_remove_observer(self, oid: int) -> bool:
        return self.observers.pop(oid, None) is not None

    def _dynn_set_fetch_hook(self, fn) -> None:
        self.fetch_hook = fn

    def _dynn_set_lookahead_hook(self, fn) -> None:
        self.lookahead_hook = fn
        if fn is None:
            self._ready.clear()

    # -- allocator -----------------------------------------------------------------------------
    def _lock(self) -> None:
        assert self._mu.acquire(timeout=5), "fake allocator: lock held across the reclaim hook (deadlock)"

    def _take(self, nbytes: int) -> int | None:
        if self.used + nbytes > self.capacity:
            return None
        ptr, self._next_ptr = self._next_ptr, self._next_ptr + 1
        self._blocks[ptr] = nbytes
        self.used += nbytes
        return ptr

    def malloc(self, device: int, nbytes: int) -> int:
        self._lock()
        try:
            ptr = self._take(nbytes)
            if ptr is not None:
                return ptr
            if self.reclaim_hook is None:
                raise FakeOOM(nbytes)
            if getattr(self._tls, "depth", 0):  # an allocation failing inside the hook: no re-entry
                self.stats["nested_skipped"] += 1
                raise FakeOOM(nbytes)
            for attempt in range(1, self.max_attempts + 1):
                self._mu.release()  # the hook runs without the allocator lock
                self._tls.depth, self._tls.device, self._tls.observed = 1, device, 0
                try:
                    self.stats["calls"] += 1
                    try:
                        reported = int(self.reclaim_hook(device, nbytes, 0, attempt) or 0)
                    except Exception as exc:  # noqa: BLE001 - the contract: counted, treated as 0
                        self.stats["errors"] += 1
                        self.last_error = repr(exc)
                        reported = -1
                    observed = self._tls.observed
                finally:
                    self._tls.depth = 0
                    self._lock()
                self.stats["observed"] += observed
                if reported < 0 or max(reported, observed) <= 0:
                    break
                ptr = self._take(nbytes)
                if ptr is not None:
                    self.stats["recovered"] += 1
                    return ptr
            self.stats["exhausted"] += 1
            raise FakeOOM(nbytes)
        finally:
            self._mu.release()

    def free(self, device: int, ptr: int) -> None:
        self._lock()
        try:
            nbytes = self._blocks.pop(ptr)
            self.used -= nbytes
        finally:
            self._mu.release()
        if getattr(self._tls, "depth", 0) and self._tls.device == device:
            self._tls.observed += nbytes
        for kind, fn in list(self.observers.values()):  # outside the allocator lock, like GPUTrace
            if kind == "free":
                fn(ptr, nbytes, nbytes, device, 0)

    # -- engine ----------------------------------------------------------------------------------
    def before_node(self, seq: int, name: str) -> None:
        ready, self._ready = self._ready, []
        if self.lookahead_hook is not None and ready and self.deliver_lookahead:
            self.engine["lookahead_calls"] += 1
            try:
                self.lookahead_hook(ready)
            except Exception:  # noqa: BLE001 - advice only
                pass
        if self.fetch_hook is not None:
            self.engine["fetch_calls"] += 1
            self.fetch_hook(seq, name)

    def _run_node(self, node) -> None:
        self.before_node(node._sequence_nr(), node.name())
        for attr in dir(node):  # what the node is about to unpack must be on the device now
            if attr.startswith("_saved_"):
                t = getattr(node, attr)
                if isinstance(t, torch.Tensor) and t.numel():
                    self.engine["saved_checked"] += 1
                    self.engine["saved_away"] += t.untyped_storage().nbytes() == 0

    def drive(self, root) -> None:
        """Make the next backward from ``root`` call the hooks as the patched engine would."""
        seen, todo = set(), [root]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_prehook(lambda g, n=node: self._run_node(n))
            nxt = [f for f, _ in node.next_functions if f is not None]
            node.register_hook(lambda gi, go, nxt=nxt: self._ready.extend((f._sequence_nr(), f.name()) for f in nxt))
            todo.extend(nxt)


class FakeDeviceCopies(SyncCopies):
    """Synchronous copies whose device bytes are blocks of the fake allocator: the runtime's
    releases become allocator frees (re-entrant when made from inside the reclaim hook)."""

    def __init__(self, c: FakeTorchC) -> None:
        self.c = c
        self.block: dict[int, int] = {}

    def adopt(self, mm) -> int:
        """Account every resident managed storage as an allocator block (as if allocated there)."""
        n = 0
        for s in mm.st.values():
            st = s.storage()
            if st is not None and s.status is Status.RESIDENT and st._cdata not in self.block and st.nbytes():
                saved, self.c.capacity = self.c.capacity, 1 << 40
                self.block[st._cdata] = self.c.malloc(0, st.nbytes())
                self.c.capacity = saved
                n += st.nbytes()
        return n

    def allocate(self, st, nbytes: int) -> None:
        self.block[st._cdata] = self.c.malloc(0, nbytes)
        super().allocate(st, nbytes)

    def release(self, st) -> None:
        ptr = self.block.pop(st._cdata, None)
        super().release(st)
        if ptr is not None:
            self.c.free(0, ptr)


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _train(mm_kwargs: dict | None, steps: int = 3, drive: FakeTorchC | None = None):
    model, opt = _model()
    mm = dr.MemoryManager(device="cpu", async_copies=False, **mm_kwargs).attach(model, opt) if mm_kwargs else None
    losses = []
    try:
        for i in range(steps):
            torch.manual_seed(100 + i)
            x = torch.randn(256, 64)
            ctx = mm.step() if mm is not None else _null()
            with ctx:
                loss = model(x).pow(2).mean()
                if drive is not None:
                    drive.drive(loss.grad_fn)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    finally:
        stats = mm.stats() if mm is not None else None
        if mm is not None:
            mm.detach()
    return losses, [p.detach().clone() for p in model.parameters()], stats


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------- choice


def test_patched_is_chosen_where_the_probe_and_device_allow_it():
    p = select_provider("cuda", "native", "built", probe_fn=lambda: PATCHED, cuda_available=True)
    assert isinstance(p, PatchedProvider) and p.event_source == "native"
    assert set(p.delivers) == set(Verb)
    assert "dynn-hooks-1" in p.reason


@pytest.mark.parametrize("event_source,cls", [("native", NativeEventsProvider), ("python", PythonProvider)])
def test_stock_torch_falls_back_to_the_event_source(event_source, cls):
    p = select_provider("cuda", event_source, "why", probe_fn=lambda: STOCK, cuda_available=True)
    assert type(p) is cls and "stock build" in p.reason
    assert Verb.LOOKAHEAD not in p.delivers


def test_choice_rules_device_stock_request_and_errors():
    cpu = select_provider("cpu", "python", "why", probe_fn=lambda: PATCHED, cuda_available=True)
    assert type(cpu) is PythonProvider and "device is cpu" in cpu.reason
    stock = select_provider("cuda", "native", "why", hooks="stock", probe_fn=lambda: PATCHED, cuda_available=True)
    assert type(stock) is NativeEventsProvider and "hooks='stock'" in stock.reason
    no_gpu = select_provider("cuda", "native", "why", probe_fn=lambda: PATCHED, cuda_available=False)
    assert type(no_gpu) is NativeEventsProvider and "CUDA is not available" in no_gpu.reason
    with pytest.raises(NativeError, match="native hooks were required"):
        select_provider("cuda", "native", "why", hooks="patched", probe_fn=lambda: STOCK, cuda_available=True)
    with pytest.raises(ConfigError, match="hooks='fast'"):
        select_provider("cuda", "native", "why", hooks="fast")
    with pytest.raises(ConfigError, match="hooks='fast'"):
        dr.MemoryManager(1 << 20, device="cpu", hooks="fast")


@pytest.mark.parametrize("events", EVENT_SOURCES)
def test_stats_name_the_provider_and_the_stock_providers_train_exactly(events):
    ref_losses, ref_params, _ = _train(None)
    losses, params, stats = _train({"budget": 0.5, "policy": "lru", "events": events})
    assert stats["hook_provider"] == events and stats["event_source"] == events
    assert stats["hook_delivers"]["lookahead"] is None and stats["hook_delivers"]["fetch"]
    assert stats["evictions"] > 0  # the budget made it move things
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))


def test_doctor_names_the_provider():
    from dynn_runtime.runtime.doctor import doctor_report

    rep = doctor_report("cpu", probe_fn=lambda: STOCK, cuda_available=False)
    assert rep["hook_provider"] == rep["event_source"]
    assert "device is cpu" in rep["hook_provider_why"]


# ---------------------------------------------------------------- the patched provider, through the runtime


@pytest.mark.parametrize("events", EVENT_SOURCES)
def test_patched_provider_brings_saved_tensors_back_before_their_node_runs(events):
    ref_losses, ref_params, _ = _train(None)
    for lookahead in (False, True):
        c = FakeTorchC(lookahead=lookahead)
        losses, params, stats = _train({"budget": 0.5, "policy": "lru", "events": events,
                                        "hooks": PatchedProvider(c), "copies": FakeDeviceCopies(c)}, drive=c)
        assert stats["hook_provider"] == "patched" and stats["event_source"] == events
        hs = stats["hook_stats"]
        assert hs["fetch_calls"] > 0 and c.engine["fetch_calls"] == hs["fetch_calls"]
        assert c.engine["saved_checked"] > 0 and c.engine["saved_away"] == 0
        if lookahead:  # the ready nodes' saved tensors: prefetched within the budget, else fetched
            assert hs["lookahead_calls"] > 0 and hs["prefetched_bytes"] + hs["fetched_bytes"] > 0
            if events == "python":  # the budget is kept before operators: room to prefetch
                assert hs["prefetched_bytes"] > 0
        else:  # saved activations evicted in the forward came back through the fetch hook
            assert hs["fetched_bytes"] > 0 and hs["prefetched_bytes"] == 0
        assert losses == ref_losses
        assert all(torch.equal(a, b) for a, b in zip(params, ref_params, strict=True))
        assert c.reclaim_hook is None and c.fetch_hook is None and not c.observers  # detach uninstalled


def _patched_lru():
    """A fake patched torch, its device copies, and an lru manager attached through it."""
    c = FakeTorchC()
    copies = FakeDeviceCopies(c)
    model, opt = _model()
    mm = dr.MemoryManager(1 << 30, policy="lru", device="cpu", async_copies=False, hooks=PatchedProvider(c),
                          copies=copies).attach(model, opt)
    return c, copies, model, opt, mm


def test_a_failing_allocation_reclaims_through_the_runtime_which_frees_reentrantly():
    c, copies, model, opt, mm = _patched_lru()
    try:
        with mm.step():
            loss = model(torch.randn(256, 64)).pow(2).mean()
            held = copies.adopt(mm)
            assert held > 0
            need = held // 2
            c.capacity = c.used + 1024  # the device is full: the next large allocation fails
            ptr = c.malloc(0, need)  # an operator's workspace, say
            assert ptr in c._blocks
            c.capacity = 1 << 40
            loss.backward()  # whatever the reclaim evicted faults back
            opt.step()
        s = c.stats
        assert s["calls"] >= 1 and s["recovered"] == 1 and s["errors"] == 0
        assert s["observed"] >= need - 1024  # the runtime's evictions freed through the allocator
        hs = mm.stats()["hook_stats"]
        assert hs["reclaim_calls"] == s["calls"] and hs["reclaim_bytes_observed"] >= s["observed"]
        assert mm.stats()["evictions"] > 0
    finally:
        mm.detach()


def test_reclaim_that_cannot_free_leaves_the_normal_out_of_memory():
    c, copies, model, opt, mm = _patched_lru()
    try:
        mm.pin(model)  # nothing the policy may move
        with mm.step():
            model(torch.randn(8, 64)).sum().backward()
        copies.adopt(mm)
        c.capacity = c.used
        with pytest.raises(FakeOOM):
            c.malloc(0, 1 << 20)
        assert c.stats["calls"] == 1 and c.stats["exhausted"] == 1  # freed nothing: no retry
        c.capacity = 1 << 40
    finally:
        mm.detach()


def test_fetch_hook_errors_fail_the_node_and_lookahead_errors_do_not():
    c = FakeTorchC()
    p = PatchedProvider(c)

    class Client:
        def hook_sid(self, t):
            return 7

        def hook_fetch(self, sids, where):
            raise RuntimeError(f"cannot make {sids} resident at {where}")

        def hook_lookahead(self, sids):
            raise RuntimeError("advice failed")

        def hook_reclaim(self, nbytes, device):
            return 0

    p.install(Client())
    try:
        pack = p.wrap_pack(lambda t: t)
        x = torch.ones(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = (x * x).sum()
        node = y.grad_fn.next_functions[0][0]  # MulBackward0 saved x twice
        c._ready = [(node._sequence_nr(), node.name())]
        with pytest.raises(RuntimeError, match="cannot make \\[7"):
            c.before_node(node._sequence_nr(), node.name())
        assert p.engine.stats.lookahead_errors == 1
    finally:
        p.uninstall()
    assert c.fetch_hook is None


def test_docstring_example_runs():
    import doctest

    from dynn_runtime.runtime import providers

    res = doctest.testmod(providers)
    assert res.failed == 0 and res.attempted > 0
