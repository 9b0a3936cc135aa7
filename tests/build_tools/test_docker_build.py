"""build_tools/docker_build.sh: the docker command it runs, and its errors where Docker is missing."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "build_tools" / "docker_build.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def _run(tmp_path: Path, *args: str, docker: str | None, env: dict | None = None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("dirname", "nproc"):  # what the script needs besides docker
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    if docker is not None:
        fake = bin_dir / "docker"
        fake.write_text(docker)
        fake.chmod(0o755)
    base = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    return subprocess.run([shutil.which("bash"), str(SCRIPT), *args], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=60)


# records its arguments, one per line; `docker info` succeeds
RECORDER = '#!/bin/sh\nif [ "$1" = info ]; then exit 0; fi\nfor a in "$@"; do echo "$a"; done > "$HOME/args"\n'


def _stages() -> set[str]:
    return set(re.findall(r"^FROM \S+ AS (\w+)", (ROOT / "build_tools" / "Dockerfile").read_text(), re.M))


def test_builds_the_runtime_stage_with_the_knobs(tmp_path):
    proc = _run(tmp_path, docker=RECORDER, env={"MAX_JOBS": "16", "TORCH_CUDA_ARCH_LIST": "9.0", "IMAGE": "x:1"})
    assert proc.returncode == 0, proc.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert args[:3] == ["build", "-f", str(ROOT / "build_tools" / "Dockerfile")]
    assert args[args.index("--target") + 1] == "runtime" and args[args.index("-t") + 1] == "x:1"
    assert "MAX_JOBS=16" in args and "TORCH_CUDA_ARCH_LIST=9.0" in args and args[-1] == str(ROOT)
    assert {"build", "check", "wheel", "runtime"} <= _stages()


def test_check_only_stops_at_the_anchor_check(tmp_path):
    assert _run(tmp_path, "--check-only", docker=RECORDER).returncode == 0
    args = (tmp_path / "args").read_text().splitlines()
    assert args[args.index("--target") + 1] == "check"
    docker = (ROOT / "build_tools" / "Dockerfile").read_text()
    check = docker.split("AS check", 1)[1].split("FROM", 1)[0]
    assert "python -m build_tools.anchored_edit check --tree third_party/pytorch" in check


def test_without_docker_it_says_what_to_do(tmp_path):
    proc = _run(tmp_path, docker=None)
    assert proc.returncode == 2 and "expected docker on PATH" in proc.stderr and "Without Docker" in proc.stderr


def test_a_daemon_that_does_not_answer_is_reported(tmp_path):
    proc = _run(tmp_path, docker="#!/bin/sh\nexit 1\n")
    assert proc.returncode == 2 and "daemon does not answer" in proc.stderr


def test_make_docker_runs_the_script():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", "docker"], cwd=ROOT, capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and "build_tools/docker_build.sh" in out.stdout
