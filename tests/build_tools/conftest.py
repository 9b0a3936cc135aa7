from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # build_tools/ is not part of the installed package
ANCHOR_CONTEXT = ROOT / "patches" / "anchor_context"
FIXTURE_TAG = "v0.0.0-fixture"


@pytest.fixture
def tree(tmp_path) -> Path:
    """A copy of the anchor-context stand-in for the PyTorch tree (no git)."""
    dst = tmp_path / "tree"
    shutil.copytree(ANCHOR_CONTEXT, dst)
    return dst


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def fixture_repo(tmp_path) -> tuple[Path, str, Path]:
    """A git repository of the stand-in tree with a tag, and a pin file recording it."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "upstream"
    shutil.copytree(ANCHOR_CONTEXT, repo)
    git("init", "-q", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "add", "-A", cwd=repo)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "fixture", cwd=repo)
    git("tag", FIXTURE_TAG, cwd=repo)
    commit = git("rev-parse", "HEAD", cwd=repo)
    pin = tmp_path / "PIN"
    pin.write_text(f'version = "0.0.0"\ntag = "{FIXTURE_TAG}"\ncommit = "{commit}"\n'
                   f'repository = "file://{repo}"\n')
    return repo, commit, pin
