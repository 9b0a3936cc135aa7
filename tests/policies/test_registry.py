"""The policy registry: plug-ins named by module path are imported on first lookup, not before."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dynn_runtime.errors import PolicyError
from dynn_runtime.policies import POLICIES, Policy, make_policy
from dynn_runtime.policies.base import PolicyRegistry


def _fresh(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_importing_the_interface_does_not_import_the_pilot():
    out = _fresh(
        "import sys\n"
        "from dynn_runtime.policies import POLICIES\n"
        "print(sorted(POLICIES), 'pilot' in POLICIES, 'dynn_runtime.pilot.policy' in sys.modules)\n"
        "cls = POLICIES['pilot']\n"
        "print(cls.__module__, *list(POLICIES)[-2:], 'dynn_runtime.pilot.policy' in sys.modules)\n"
    )
    listed, looked_up = out.splitlines()
    assert listed == ("['checkpoint', 'dtr', 'hybrid', 'hybrid_oracle', 'lru', 'none', 'oracle', 'pilot', 'replay', "
                      "'save_on_cpu', 'uvm'] True False")
    # resolved in place: still registered in its place, before the other lazy entry (hybrid)
    assert looked_up == "dynn_runtime.pilot.policy pilot hybrid True"


def test_make_policy_resolves_the_lazy_entry():
    pol = make_policy("pilot")
    assert type(pol) is POLICIES["pilot"] and type(pol).__name__ == "PilotPolicy"
    assert POLICIES.get("pilot") is type(pol) and dict(POLICIES.items())["pilot"] is type(pol)
    with pytest.raises(PolicyError, match="pilot needs pilot"):
        make_policy("pilot", provides=("history",))


def test_lazy_entry_and_errors():
    reg = PolicyRegistry()
    reg.add_lazy("thing", "dynn_runtime.policies.basic")  # imports, but registers nothing named "thing"
    assert "thing" in reg and list(reg) == ["thing"] and len(reg) == 1
    with pytest.raises(AssertionError, match="did not register a policy named 'thing'"):
        reg["thing"]
    with pytest.raises(KeyError):
        reg["nothing"]
    assert reg.get("nothing") is None

    class Mine(Policy):
        name = "thing"

    reg["thing"] = Mine
    reg.add_lazy("thing", "elsewhere")  # a resolved entry stays
    assert reg["thing"] is Mine
    del reg["thing"]
    assert list(reg) == []
