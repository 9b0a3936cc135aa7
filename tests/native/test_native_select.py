"""Native-path selection with a fake probe, the NativeHooks wiring, and `dynn doctor`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import dynn_runtime.native as native
from dynn_runtime.errors import NativeError
from dynn_runtime.native import (
    REQUIRED_FEATURES,
    EngineHooks,
    HookPath,
    NativeFeatures,
    NativeHooks,
    Preference,
    ReclaimRegistry,
    probe,
    select_path,
)

PATCHED = NativeFeatures(available=True, series="dynn-hooks-1", features=REQUIRED_FEATURES, reclaim_protocol=1,
                         engine_protocol=1, torch_version="2.13.0+dynn", reason="torch carries dynn-hooks-1")
STOCK = NativeFeatures(available=False, torch_version="2.13.0", reason="torch 2.13.0 is a stock build")


class FakeC:
    """Stands in for a patched torch._C: records registrations, lets tests fire hooks."""

    def __init__(self, features=None):
        self.features = features or {"series": "dynn-hooks-1", "features": sorted(REQUIRED_FEATURES),
                                     "reclaim_protocol": 1, "engine_protocol": 1}
        self.reclaim = self.fetch = self.lookahead = None
        self.observers, self.max_attempts = {}, None

    def _dynn_features(self):
        return self.features

    def _dynn_set_reclaim_hook(self, fn):
        self.reclaim = fn

    def _dynn_set_reclaim_max_attempts(self, n):
        self.max_attempts = n

    def _dynn_add_free_observer(self, fn):
        self.observers[len(self.observers) + 1] = fn
        return len(self.observers)

    def _dynn_remove_observer(self, oid):
        return self.observers.pop(oid, None) is not None

    def _dynn_set_fetch_hook(self, fn):
        self.fetch = fn

    def _dynn_set_lookahead_hook(self, fn):
        self.lookahead = fn


def test_docstring_examples_run():
    import doctest

    assert doctest.testmod(native).failed == 0


def test_probe_on_stock_and_patched_and_broken_torch():
    assert probe(SimpleNamespace(__version__="2.13.0", _C=SimpleNamespace())).available is False
    feats = probe(SimpleNamespace(__version__="2.13.0+dynn", _C=FakeC()))
    assert feats.available and feats.features == REQUIRED_FEATURES and feats.series == "dynn-hooks-1"

    def boom():
        raise RuntimeError("bad build")

    broken = probe(SimpleNamespace(__version__="x", _C=SimpleNamespace(_dynn_features=boom)))
    assert not broken.available and "bad build" in broken.reason


def test_probe_of_the_installed_torch_is_stock():
    feats = probe()
    assert feats.available is False and "stock build" in feats.reason


@pytest.mark.parametrize(
    ("feats", "device", "cuda", "path", "why"),
    [
        (PATCHED, "cuda", True, HookPath.NATIVE, "present"),
        (PATCHED, "cuda:1", True, HookPath.NATIVE, "present"),
        (PATCHED, "cpu", True, HookPath.STOCK, "device is cpu"),
        (PATCHED, "cuda", False, HookPath.STOCK, "CUDA is not available"),
        (STOCK, "cuda", True, HookPath.STOCK, "stock build"),
        (NativeFeatures(available=True, features=frozenset({"fetch_hook"}), reclaim_protocol=1,
                        engine_protocol=1), "cuda", True, HookPath.STOCK, "lacks features"),
        (NativeFeatures(available=True, features=REQUIRED_FEATURES, reclaim_protocol=2, engine_protocol=1),
         "cuda", True, HookPath.STOCK, "reclaim protocol 2"),
    ],
)
def test_select_path_rules(feats, device, cuda, path, why):
    choice = select_path(feats, device, cuda_available=cuda)
    assert choice.path is path and why in choice.reason


def test_preferences():
    assert select_path(PATCHED, "cuda", prefer=Preference.STOCK, cuda_available=True).path is HookPath.STOCK
    with pytest.raises(NativeError, match="^native: native hooks were required"):
        select_path(STOCK, "cuda", prefer=Preference.REQUIRE_NATIVE, cuda_available=True)
    assert select_path(PATCHED, "cuda", prefer=Preference.REQUIRE_NATIVE,
                       cuda_available=True).path is HookPath.NATIVE


def test_active_path_uses_injected_probe():
    feats, choice = native.active_path("cuda", probe_fn=lambda: PATCHED, cuda_available=True)
    assert feats is PATCHED and choice.path is HookPath.NATIVE


def test_native_hooks_wire_the_protocol_objects():
    c = FakeC()
    reg, eng = ReclaimRegistry(max_attempts=2), EngineHooks()
    freed = []

    def evict(req):
        c.observers[1](0xABC, 100, 512, req.device, 0)  # native free observer fires inside the hook
        freed.append(req.nbytes)
        return 0

    reg.set_hook(evict)
    fetched, ahead = [], []
    eng.set_fetch_hook(lambda seq, name: fetched.append((seq, name)))
    eng.set_lookahead_hook(lambda nodes: ahead.extend(n.sequence_nr for n in nodes))
    with NativeHooks(reg, eng, torch_c=c):
        assert c.max_attempts == 2
        assert c.reclaim(0, 4096, 0, 1) == 512  # observed bytes reported back to the allocator
        c.lookahead([(11, "AddBackward0"), (12, "MulBackward0")])
        c.fetch(10, "MmBackward0")
    assert freed == [4096] and fetched == [(10, "MmBackward0")] and ahead == [11, 12]
    assert c.reclaim is None and c.fetch is None and c.observers == {}


def test_native_hooks_refuse_stock_torch():
    with pytest.raises(NativeError, match="^native: .*not patched"):
        NativeHooks(ReclaimRegistry(), EngineHooks(), torch_c=SimpleNamespace())


def test_pinned_release_reads_the_pin_file():
    pin = native.pinned_release()
    assert pin["version"] == "2.13.0" and pin["tag"] == "v2.13.0" and len(pin["commit"]) == 40


def test_doctor_report_with_fake_probe():
    from dynn_runtime.runtime.doctor import doctor_report

    rep = doctor_report("cuda", probe_fn=lambda: PATCHED, cuda_available=False)
    assert rep["patched"] and rep["path"] == "stock" and "CUDA is not available" in rep["why"]


def test_doctor_cli(capsys):
    from dynn_runtime.cli import main

    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "hook path" in out and "stock" in out and "pinned release" in out and "2.13.0" in out
    assert main(["doctor", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["path"] == "stock" and rep["patched"] is False
    assert main(["doctor", "--require-native"]) == 2
