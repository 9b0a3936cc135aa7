"""build_wheel.py end to end against a fixture git repository, with a fake compile step."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from build_tools import anchored_edit as ae
from build_tools import build_wheel as bw

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_TAG = "v0.0.0-fixture"  # the tag conftest.fixture_repo creates


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()

# Stands in for `pip wheel .`: checks the knobs and that the tree is patched, writes a wheel.
FAKE_BUILD = (
    f"{sys.executable} -c \"import os, pathlib; "
    "assert os.environ['CMAKE_GENERATOR'] == 'Ninja'; "
    "assert pathlib.Path('c10/cuda/DynnReclaim.h').is_file(); "
    "pathlib.Path(os.environ['DYNN_WHEEL_DIR'], "
    "'torch-0.0.0+dynn-cp311-cp311-linux_x86_64.whl').write_bytes(b'wheel:' + "
    "os.environ['USE_CUDA'].encode() + os.environ.get('MAX_JOBS', '-').encode())\""
)


def _args(pin: Path, dist: Path, *extra: str) -> list[str]:
    return ["--pin", str(pin), "--dist", str(dist), "--build-cmd", FAKE_BUILD, *extra]


def test_pin_file_is_complete():
    pin = bw.read_pin()
    assert pin.version == "2.13.0" and pin.tag == "v2.13.0" and len(pin.commit) == 40


def test_dry_run_prints_every_step_and_does_nothing(tmp_path, capsys):
    src, dist = tmp_path / "src", tmp_path / "dist"
    assert bw.main(["--dry-run", "--source", str(src), "--dist", str(dist), "--max-jobs", "3",
                    "--cuda-arch-list", "9.0"]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("[dry-run] step ")]
    assert [s.split()[3].rstrip(":") for s in steps] == [
        "source", "commit", "clean", "check", "apply", "record", "build", "manifest"]
    assert "git clone --branch v2.13.0 --recursive" in out
    assert "MAX_JOBS=3" in out and "TORCH_CUDA_ARCH_LIST=9.0" in out and "USE_CUDA=1" in out
    assert "--no-build-isolation" in out
    assert not src.exists() and not dist.exists()


def test_script_runs_standalone(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "build_tools" / "build_wheel.py"), "--dry-run",
                           "--dist", str(tmp_path / "d")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step 8/8 manifest" in proc.stdout


def test_full_pipeline_clone_patch_build_manifest(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    src, dist = tmp_path / "third_party" / "pytorch", tmp_path / "dist"
    assert bw.main([*_args(pin, dist, "--no-cuda", "--max-jobs", "2"), "--source", str(src)]) == 2
    assert "does not exist" in capsys.readouterr().err  # --source must exist: we never clone into it
    cfg = bw.BuildConfig(source=None, dist=dist, pin_file=pin, use_cuda=False, max_jobs=2,
                         build_cmd=shlex.split(FAKE_BUILD))
    bw.DEFAULT_SOURCE, saved = src, bw.DEFAULT_SOURCE
    try:
        assert bw.run(cfg, log=lambda s: None) == 0
    finally:
        bw.DEFAULT_SOURCE = saved
    assert git("rev-parse", "HEAD", cwd=src) == commit
    assert (src / "c10/cuda/DynnHooks.cpp").is_file()
    wheel = dist / "torch-0.0.0+dynn-cp311-cp311-linux_x86_64.whl"
    assert wheel.read_bytes() == b"wheel:02"
    m = json.loads((dist / "manifest.json").read_text())
    assert m["upstream"]["commit"] == commit and m["upstream"]["tag"] == FIXTURE_TAG
    assert m["wheel"] == {"file": wheel.name, "sha256": ae.sha256_file(wheel)}
    assert m["build"]["env"]["USE_CUDA"] == "0" and m["build"]["env"]["MAX_JOBS"] == "2"
    names = [s["name"] for s in m["series"]]
    assert names == [s.name for s in ae.load_series()]
    assert m["series"][0]["patch_sha256"] == ae.sha256_file(ROOT / "patches" / f"{names[0]}.patch")
    assert m["series"][0]["new_files"]["c10/cuda/DynnReclaim.h"] == ae.sha256_file(
        ROOT / "patches/new_files/c10/cuda/DynnReclaim.h")
    assert sorted(m["applied_diffs"]) == [f"{n}.patch" for n in names]
    assert (dist / "patches" / f"{names[0]}.patch").read_text().count("dynn-patch begin") >= 4


def test_rerun_on_patched_tree_is_allowed_and_idempotent(fixture_repo, tmp_path):
    repo, commit, pin = fixture_repo
    dist = tmp_path / "dist"
    assert bw.main([*_args(pin, dist), "--source", str(repo)]) == 0
    snap = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}
    assert bw.main([*_args(pin, dist), "--source", str(repo)]) == 0
    assert snap == {p: p.read_bytes() for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts}


def test_dirty_tree_is_refused(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    (repo / "build_variables.bzl").write_text((repo / "build_variables.bzl").read_text() + "# local change\n")
    assert bw.main([*_args(pin, tmp_path / "dist"), "--source", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "is dirty" in err and "build_variables.bzl" in err and "git -C" in err
    assert not (repo / "c10/cuda/DynnReclaim.h").exists()


def test_untracked_foreign_file_is_refused(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    (repo / "stray.txt").write_text("x")
    assert bw.main([*_args(pin, tmp_path / "dist"), "--source", str(repo)]) == 2
    assert "stray.txt" in capsys.readouterr().err


def test_wrong_commit_is_refused(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "later", cwd=repo)
    assert bw.main([*_args(pin, tmp_path / "dist"), "--source", str(repo)]) == 2
    err = capsys.readouterr().err
    assert f"expected {commit}" in err and f"checkout {FIXTURE_TAG}" in err


def test_tag_moved_is_refused(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "later", cwd=repo)
    git("tag", "-f", FIXTURE_TAG, cwd=repo)
    git("checkout", "-q", commit, cwd=repo)
    assert bw.main([*_args(pin, tmp_path / "dist"), "--source", str(repo)]) == 2
    assert f"tag {FIXTURE_TAG} resolves to" in capsys.readouterr().err


def test_patch_that_does_not_apply_is_refused(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    f = repo / "torch/csrc/Module.cpp"
    f.write_text(f.read_text().replace("THPEngine_initModule", "THPEngine_init"))
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "upstream moved", cwd=repo)
    new = git("rev-parse", "HEAD", cwd=repo)
    pin.write_text(pin.read_text().replace(commit, new))
    git("tag", "-f", FIXTURE_TAG, cwd=repo)
    assert bw.main([*_args(pin, tmp_path / "dist"), "--source", str(repo)]) == 2
    err = capsys.readouterr().err
    assert "module-init-call-site not found" in err and not (repo / "torch/csrc/dynn").exists()


def test_failing_build_is_reported(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    args = ["--pin", str(pin), "--dist", str(tmp_path / "d"), "--source", str(repo),
            "--build-cmd", f"{sys.executable} -c 'raise SystemExit(3)'"]
    assert bw.main(args) == 2
    assert "build command failed (exit 3)" in capsys.readouterr().err


def test_build_that_writes_no_wheel_is_reported(fixture_repo, tmp_path, capsys):
    repo, commit, pin = fixture_repo
    args = ["--pin", str(pin), "--dist", str(tmp_path / "d"), "--source", str(repo),
            "--build-cmd", f"{sys.executable} -c pass"]
    assert bw.main(args) == 2
    assert "wrote no torch-*.whl" in capsys.readouterr().err


@pytest.mark.parametrize("body,match", [("", "must set version"), ('version="1"\ntag="v1"\ncommit="abc"\n',
                                                                      "full 40-hex")])
def test_bad_pin_file(tmp_path, body, match):
    p = tmp_path / "PIN"
    p.write_text(body)
    with pytest.raises(bw.BuildError, match=match):
        bw.read_pin(p)


def test_docker_and_docs_reference_the_tooling():
    docker = (ROOT / "build_tools" / "Dockerfile").read_text()
    assert "nvidia/cuda:" in docker and "cudnn-devel" in docker and "FROM ${CUDA_IMAGE} AS build" in docker
    assert "build_tools/build_wheel.py" in docker and "dynn\", \"bench\", \"--real\"" in docker
    doc = (ROOT / "docs" / "artifact-evaluation.md").read_text()
    for needle in ("docker build", "build_tools/build_wheel.py", "dynn doctor", "dynn bench --real",
                   "What was verified"):
        assert needle in doc
    readme = (ROOT / "patches" / "README.md").read_text()
    for hook in ("Reclaim hook", "Allocation observers", "Fetch hook", "Look-ahead hook", "Pinned release"):
        assert hook in readme
