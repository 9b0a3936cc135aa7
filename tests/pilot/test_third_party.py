"""Networks from other projects (tools/third_party/), evaluation only: they load through the
``file.py:function`` protocol, are dynamic, train under the manager; skipped without their packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TP = Path(__file__).resolve().parents[2] / "tools" / "third_party"
NETWORKS = {"moe_lm": "transformers", "layerdrop_audio": "transformers", "dynamic_gnn": "torch_geometric"}


def _tool():
    spec = importlib.util.spec_from_file_location("third_party_evaluate", TP / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_network_is_dynamic_and_trains_under_the_manager_with_the_fallback(name):
    pytest.importorskip(NETWORKS[name])
    import torch

    from dynn_runtime.runtime.train import train_managed, train_unmanaged
    from dynn_runtime.workload import load_workload

    spec = f"{TP / (name + '.py')}:build"
    wl = load_workload(spec, preset="tiny")
    shapes = {tuple(t.shape) for step in range(4) for t in wl.make_batch(step).values() if torch.is_tensor(t)}
    assert len(shapes) > 2  # batch shapes change from step to step
    ref = train_unmanaged(spec, steps=2, preset="tiny")
    cap = max(ref.peak_bytes) // 2  # of the largest step: the first step's batch may be the smallest
    r = train_managed(spec, cap, "pilot", steps=2, preset="tiny", policy_options={"fallback": True})
    assert r.losses == ref.losses and r.digest == ref.digest  # the numbers are PyTorch's own
    assert r.stats["bytes_offloaded"] > 0


def test_steps_to_recover():
    tool = _tool()

    def steps(*pairs):
        return [{"prefetch_hits": h, "prefetch_misses": m, "stall_seconds": s} for h, m, s in pairs]

    per_step = {"replay": steps((5, 5, 1.0), (5, 5, 1.0), (5, 5, 1.0)), "lru": steps((0, 9, 0.5), (0, 9, 0.5), (0, 9, 0.5)),
                "pilot": steps((0, 10, 2.0), (6, 4, 2.0), (7, 3, 0.1))}
    assert tool.steps_to_recover(per_step, "pilot") == 1  # from step 1 on: 13/7 against replay's 10/10
    assert tool.steps_to_recover(per_step, "pilot", stalls=True) == 2  # and the stalls only from step 2 on
    per_step["pilot"] = steps((0, 10, 2.0), (0, 10, 2.0), (4, 6, 0.1))
    assert tool.steps_to_recover(per_step, "pilot") is None
    per_step["pilot"] = steps((0, 10, 2.0), (1, 10, 2.0), (0, 0, 0.0))  # a last step that needed nothing back
    assert tool.steps_to_recover(per_step, "pilot") is None
    assert tool.steps_to_recover({"pilot": per_step["pilot"]}, "pilot") is None  # no baseline ran (--methods)
    with pytest.raises(ValueError, match="no method 'nope'"):
        tool.live("dynamic_gnn", 0.25, 1, only=["replay", "nope"])


def test_candidate_weights_run_beside_each_shipped_variant():
    tool = _tool()
    assert tool.methods() == tool.METHODS
    m = tool.methods("w.npz")
    assert list(m) == ["pilot (shipped)", "candidate", "pilot (fallback)", "candidate (fallback)", "pilot (adapted)",
                       "candidate (adapted)", "replay", "lru"]
    assert m["candidate (adapted)"] == ("pilot", {**tool.METHODS["pilot (adapted)"][1], "weights": "w.npz"})
    assert all("weights" not in (opts or {}) for k, (_, opts) in m.items() if not k.startswith("candidate"))
    runs = [{"prefetch_hits": 3, "prefetch_misses": 1, "stall_seconds": 0.5, "bytes_moved": 10, "wall_s": 1.0,
             "bit_identical": True, "hit_rate": 0.75},
            {"prefetch_hits": 1, "prefetch_misses": 3, "stall_seconds": 0.25, "bytes_moved": 6, "wall_s": 1.0,
             "bit_identical": False, "hit_rate": 0.25}]
    both = tool._combine(runs)
    assert (both["prefetch_hits"], both["prefetch_misses"], both["hit_rate"], both["bytes_moved"]) == (4, 4, 0.5, 16)
    assert both["stall_seconds"] == 0.75 and not both["bit_identical"] and both["rounds"] == runs


def test_live_runs_the_device_path_and_reports_the_step_time_ratio(monkeypatch):
    """``live`` on the CPU runs the code ``--device cuda`` runs (deterministic algorithms, the device passed to
    every run): per method hits / misses / stalls / bytes moved, the step time over PyTorch alone, and steps
    to recover for the pilot; the table prints them without the trace's columns (``--no-trace``)."""
    pytest.importorskip("torch_geometric")
    tool = _tool()
    monkeypatch.setattr(tool, "METHODS", {k: tool.METHODS[k] for k in ("pilot (fallback)", "replay", "lru")})
    seen = []
    import torch

    import dynn_runtime.runtime.train as train

    real = train.train_managed
    monkeypatch.setattr(train, "train_managed", lambda *a, **k: seen.append(k["device"]) or real(*a, **k))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tool's main() does: tiny graphs
    try:
        res = tool.live("dynamic_gnn", 0.5, 2, device="cpu")
    finally:
        torch.set_num_threads(threads)
    assert seen == ["cpu"] * 4 and res["device"] == "cpu"  # the managed peak's run, then each method
    assert res["alone_step_s"] == pytest.approx(sum(res["alone_step_s_before_after"]) / 2) and res["alone_step_s"] > 0
    for m in res["methods"].values():
        assert m["bit_identical"] and m["step_s"] > 0 and m["step_ratio"] == pytest.approx(m["step_s"] / res["alone_step_s"])
        assert len(m["per_step"]) == 2 and m["bytes_moved"] > 0
    assert "steps_to_recover" in res["methods"]["pilot (fallback)"]
    text = tool.table({"dynamic_gnn": {"trace": None, "live": res}})
    row = next(line for line in text.splitlines() if "| lru |" in line)
    assert f"| {res['methods']['lru']['step_ratio']:.2f}x | yes |" in row and "| - |" in row


def test_the_cap_is_a_fraction_of_the_managed_peak_whatever_else_the_device_counts(monkeypatch):
    """The cap is ``fraction`` of PyTorch alone's peak as the manager counts it, not of the device's own
    count: on CUDA that holds what the manager never manages (cuBLAS workspaces), which at ``tiny`` is
    several times the managed bytes; a cap taken from it can move nothing. Modelled on the CPU by an
    unmanaged run whose every step's peak carries 32 MiB the manager does not see."""
    tool = _tool()
    import dynn_runtime.runtime.train as train

    real = train.train_unmanaged

    def with_workspace(*a, **k):
        r = real(*a, **k)
        r.peak_bytes = [p + (32 << 20) for p in r.peak_bytes]
        return r

    monkeypatch.setattr(train, "train_unmanaged", with_workspace)
    monkeypatch.setattr(tool, "_spec", lambda name, optimizer="default": "varlen")  # a zoo network: no package
    monkeypatch.setattr(tool, "METHODS", {"lru": tool.METHODS["lru"]})
    res = tool.live("varlen", 0.25, 2)
    peak = tool.managed_peak("varlen", 2)
    assert res["peak_bytes"] == peak and res["cap_bytes"] == tool.cap_bytes(peak, 0.25) == peak // 4
    assert res["unmanaged_peak_bytes"] > 32 << 20  # kept beside it, not used
    lru = res["methods"]["lru"]
    assert lru["bytes_moved"] > 0 and lru["prefetch_misses"] > 0 and lru["bit_identical"]
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
        tool.cap_bytes(peak, 4)


@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_the_multi_tensor_variant_trains_with_the_optimizer_torch_picks_on_cuda(name):
    """``--optimizer foreach`` runs each network with multi-tensor Adam (torch's CUDA default) on any
    device; ``default`` leaves torch's choice (on the CPU, one parameter at a time)."""
    pytest.importorskip(NETWORKS[name])
    import torch

    from dynn_runtime.workload import load_workload, make_optimizer

    tool = _tool()
    optimizers = {}
    for which in tool.OPTIMIZERS:
        wl = load_workload(tool._spec(name, which), preset="tiny")
        optimizers[which] = make_optimizer(wl, wl.model.parameters())
    assert all(type(o) is torch.optim.Adam and o.defaults["lr"] == 1e-3 for o in optimizers.values())
    assert optimizers["foreach"].defaults["foreach"] is True and not optimizers["default"].defaults["foreach"]
