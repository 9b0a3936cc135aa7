"""The policy interface is complete: every view implements every :class:`MemoryView` member, policies
read nothing the protocol does not declare, and mechanisms read declared capabilities, never names."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import dynn_runtime as dr
from dynn_runtime.policies import POLICIES
from dynn_runtime.policies.base import NO_CONTEXT, IterationContext, MemoryView, Policy, policy_class
from dynn_runtime.sim import Simulator

ROOT = Path(__file__).resolve().parents[2] / "dynn_runtime"


def _members(proto: type) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {k for k, v in vars(proto).items() if callable(v) and not k.startswith("_")}
    return names


MEMBERS = _members(MemoryView)
METHODS = {k for k, v in vars(MemoryView).items() if callable(v) and not k.startswith("_")}


def test_protocol_lists_what_policies_call():
    assert {"forward_done", "producer_of", "last_access_time", "now", "host_now", "device_slack",
            "next_use", "position", "phase"} <= MEMBERS


def _sim(tiny_trace):
    return Simulator(tiny_trace, "lru", None)


@pytest.fixture
def tiny_trace():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
    from builder import TB

    tb = TB()
    tb.storage("w", 100, "param", persistent_from=0)
    tb.iteration([("f", "forward", "m", ["w"], [("a", 200, "activation", True)], ["a"])])
    return tb.trace()


def test_simulator_implements_every_member(tiny_trace):
    sim = _sim(tiny_trace)
    missing = sorted(m for m in MEMBERS if not hasattr(sim, m))
    assert not missing, f"Simulator lacks {missing}"
    assert all(callable(getattr(sim, m)) for m in METHODS)
    assert isinstance(sim, MemoryView)


def test_live_manager_implements_every_member():
    mm = dr.MemoryManager(1 << 20, device="cpu")
    missing = sorted(m for m in MEMBERS if not hasattr(mm, m))
    assert not missing, f"MemoryManager lacks {missing}"
    assert all(callable(getattr(mm, m)) for m in METHODS)
    assert isinstance(mm, MemoryView)
    # what the live runtime cannot know it answers neutrally (the documented answers)
    assert mm.host_now() is None and mm.device_slack() is None and mm.producer_of(0) is None


def test_simulator_clocks(tiny_trace):
    sim = _sim(tiny_trace)
    assert sim.host_now() == sim.now() and sim.device_slack() is None  # no host timeline


def _view_reads(path: Path, bare: bool) -> set[tuple[str, int]]:
    """``self.view.X`` (and with ``bare``, ``view.X``) attribute reads in ``path``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if (bare and isinstance(v, ast.Name) and v.id == "view") or (
                isinstance(v, ast.Attribute) and v.attr == "view" and isinstance(v.value, ast.Name)
                and v.value.id == "self"):
            out.add((node.attr, node.lineno))
    return out


def test_policies_read_only_declared_view_members():
    # in policies/ ``view`` is always the attached view; in the pilot's training code a local ``view``
    # may be the walk's own (it plays the mechanism), so only ``self.view`` counts there
    files = [(p, True) for p in sorted((ROOT / "policies").rglob("*.py"))]
    files += [(p, False) for p in sorted((ROOT / "pilot").rglob("*.py"))]
    undeclared = [f"{p.relative_to(ROOT)}:{line} reads view.{name}" for p, bare in files
                  for name, line in sorted(_view_reads(p, bare)) if name not in MEMBERS]
    assert any(_view_reads(p, bare) for p, bare in files)  # the check sees reads at all
    assert not undeclared, "; ".join(undeclared)


def test_no_getattr_probe_on_the_view():
    files = sorted((ROOT / "policies").rglob("*.py")) + sorted((ROOT / "pilot").rglob("*.py"))
    probes = [f"{p.relative_to(ROOT)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"getattr\((self\.)?view\b", line)]
    assert not probes, f"getattr on the view (declare the member in MemoryView instead): {probes}"


def test_mechanisms_read_capabilities_not_names():
    pattern = re.compile(r"""policy\.name\s*[!=]=|policy\s*[!=]=\s*["']|getattr\(self\.policy\b""")
    files = sorted((ROOT / "sim").rglob("*.py")) + sorted((ROOT / "runtime").rglob("*.py"))
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "branches on a policy's name (declare a capability on Policy): " + "; ".join(found)


def test_capabilities_declared():
    assert POLICIES["dtr"].recomputes == "operators" and POLICIES["checkpoint"].recomputes == "blocks"
    assert POLICIES["none"].moves_nothing and not POLICIES["lru"].moves_nothing
    remat = ("dtr", "hybrid", "hybrid_oracle")
    assert all(POLICIES[name].recomputes == "operators" for name in remat)
    assert all(cls.recomputes is None for name, cls in POLICIES.items() if name not in (*remat, "checkpoint"))
    assert policy_class("oracle") is POLICIES["oracle"] and policy_class("no such policy") is None


def test_live_runtime_refuses_operator_recompute_by_capability():
    class _Remat(Policy):
        name = "remat_test"
        recomputes = "operators"

    POLICIES["remat_test"] = _Remat
    try:
        with pytest.raises(dr.PolicyError, match="remat_test is available in the simulator only"):
            dr.MemoryManager(1 << 20, policy="remat_test", device="cpu")
    finally:
        del POLICIES["remat_test"]


def test_iteration_context_is_frozen_and_typed():
    ctx = IterationContext(history=(), trace=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.history = ()  # type: ignore[misc]
    assert NO_CONTEXT.history == () and NO_CONTEXT.trace is None and NO_CONTEXT.iteration is None
    assert NO_CONTEXT.bound_before is None  # live: a policy sees for itself whether the budget bound
    assert {f.name for f in dataclasses.fields(IterationContext)} == {"history", "trace", "iteration", "bound_before"}
