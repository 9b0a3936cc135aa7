"""What the README states about the package is true: its layout table and which policies run live."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dynn_runtime.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_layout_names_every_package_and_module():
    layout = README[README.index("## Layout"):README.index("## Documentation")]
    packages = sorted(p.parent.name for p in (ROOT / "dynn_runtime").glob("*/__init__.py"))
    assert {"pilot", "policies", "trace", "runtime", "sim"} <= set(packages)  # the glob found the tree
    missing = [p for p in packages if f"`dynn_runtime/{p}/`" not in layout]
    assert not missing, f"README's layout table does not name {missing}"
    modules = sorted(p.name for p in (ROOT / "dynn_runtime").glob("*.py") if not p.name.startswith("_"))
    missing = [m for m in modules if f"`{m}`" not in layout]
    assert not missing, f"README's layout table does not name {missing}"


def _train(capsys, policy: str, budget: str) -> tuple[int, str]:
    rc = main(["train", "moe", "--preset", "tiny", "--steps", "2", "-q", "--budget", budget, "--policy", policy])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("policy, budget", [("uvm", "1/8"), ("checkpoint", "2MiB"), ("save_on_cpu", "1/2")])
def test_policies_the_readme_says_run_live(capsys, policy, budget):
    rc, out = _train(capsys, policy, budget)
    assert rc == 0, out
    assert re.search(r"bit-identical\s+yes", out), out


def test_dtr_is_refused_live(capsys):
    rc, out = _train(capsys, "dtr", "1/8")
    assert rc == 2 and "dtr is available in the simulator only" in out


def test_save_on_cpu_needs_room_for_parameters_and_optimizer_state(capsys):
    rc, out = _train(capsys, "save_on_cpu", "1/8")
    assert rc == 2 and "out of memory under policy 'save_on_cpu' at the start of the step" in out
