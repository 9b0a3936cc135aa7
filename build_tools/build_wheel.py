"""Build the patched PyTorch wheel (DyNN-Offload native fetch hooks) in one command.

Steps (``--dry-run`` prints them all and does none):

1. source    reuse ``--source DIR`` or ``third_party/pytorch``; clone the pinned tag
             (with submodules) there when it is absent
2. commit    HEAD and the tag must be the commit recorded in ``patches/PYTORCH_PIN``
3. clean     no local changes except an earlier application of this very series
4. check     every anchor of the series matches exactly once (or is applied already)
5. apply     write the new files and the anchored edits (idempotent)
6. record    regenerate the unified diffs from the real tree into ``dist/patches/``
7. build     the official procedure (CMake + Ninja via ``pip wheel --no-build-isolation``)
             with ``USE_CUDA``, ``MAX_JOBS``, ``TORCH_CUDA_ARCH_LIST``
8. manifest  ``dist/manifest.json``: upstream commit, patch and file hashes, flags, wheel

Example::

    python build_tools/build_wheel.py --dry-run
    python build_tools/build_wheel.py --max-jobs 16 --cuda-arch-list "9.0"
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from build_tools import anchored_edit as ae  # noqa: E402
else:
    from . import anchored_edit as ae

REPO_ROOT = ae.REPO_ROOT
DEFAULT_SOURCE = REPO_ROOT / "third_party" / "pytorch"

__all__ = ["Pin", "BuildConfig", "BuildError", "read_pin", "plan_steps", "run", "main"]


class BuildError(ae.BaseError):  # NativeError when dynn_runtime is importable
    """A build step failed; the message says which and how to fix it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Pin:
    """The pinned upstream release (patches/PYTORCH_PIN)."""

    version: str
    tag: str
    commit: str
    repository: str = "https://github.com/pytorch/pytorch.git"


def parse_pin_text(text: str) -> dict[str, str]:
    """The pin file is flat TOML (key = "string"); tomllib where available (3.11+)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = None
    if tomllib is not None:
        return tomllib.loads(text)
    out = {}
    for line in text.splitlines():
        m = re.match(r'^\s*([A-Za-z_]+)\s*=\s*"([^"]*)"\s*(#.*)?$', line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def read_pin(path: Path = ae.PATCHES_DIR / "PYTORCH_PIN") -> Pin:
    try:
        data = parse_pin_text(Path(path).read_text())
    except FileNotFoundError:
        raise BuildError(f"build_tools: expected the pin file {path}, found none.") from None
    except ValueError as exc:  # tomllib.TOMLDecodeError
        raise BuildError(f"build_tools: {path} is not valid TOML: {exc}.") from None
    missing = [k for k in ("version", "tag", "commit") if not data.get(k)]
    if missing:
        raise BuildError(f"build_tools: {path} must set version, tag and commit; missing {missing}.")
    if len(data["commit"]) != 40:
        raise BuildError(f"build_tools: {path}: commit must be a full 40-hex sha, found {data['commit']!r}.")
    return Pin(**{k: data[k] for k in ("version", "tag", "commit", "repository") if k in data})


@dataclass(kw_only=True, slots=True)
class BuildConfig:
    """Everything that decides what gets built; stored in the manifest."""

    source: Path | None = None
    """PyTorch source tree; None: third_party/pytorch, cloned when absent."""
    dist: Path = REPO_ROOT / "dist"
    """Where the wheel, manifest.json and patches/ go."""
    pin_file: Path = ae.PATCHES_DIR / "PYTORCH_PIN"
    patches_dir: Path = ae.PATCHES_DIR
    repo_url: str | None = None
    """Clone from here instead of the pin's repository (a mirror, or a test fixture)."""
    use_cuda: bool = True
    max_jobs: int | None = None
    """MAX_JOBS for the compile; None lets PyTorch use every core."""
    cuda_arch_list: str | None = None
    """TORCH_CUDA_ARCH_LIST, e.g. "9.0" or "8.0;9.0"; None builds for the visible GPU."""
    build_cmd: Sequence[str] | None = None
    """Replaces the build command (tests use a fake that writes a wheel to $DYNN_WHEEL_DIR)."""
    dry_run: bool = False

    @property
    def source_dir(self) -> Path:
        return Path(self.source) if self.source is not None else DEFAULT_SOURCE


@dataclass(slots=True)
class Step:
    name: str
    describe: list[str]
    action: Callable[[], None]


@dataclass(slots=True)
class _State:
    specs: list = field(default_factory=list)
    wheel: Path | None = None
    recorded: list = field(default_factory=list)


def _git(args: Sequence[str], cwd: Path | None = None, strip: bool = True) -> str:
    if shutil.which("git") is None:
        raise BuildError("build_tools: expected git on PATH, found none. Install git.")
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(
            f"build_tools: `git {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout.strip() if strip else proc.stdout


def build_env(cfg: BuildConfig, pin: Pin) -> dict[str, str]:
    """The environment knobs of PyTorch's official build (only those we set)."""
    env = {
        "USE_CUDA": "1" if cfg.use_cuda else "0",
        "CMAKE_GENERATOR": "Ninja",
        "BUILD_TEST": "0",
        "PYTORCH_BUILD_VERSION": f"{pin.version}+dynn",
        "PYTORCH_BUILD_NUMBER": "1",
        "DYNN_WHEEL_DIR": str(cfg.dist),
    }
    if cfg.max_jobs:
        env["MAX_JOBS"] = str(cfg.max_jobs)
    if cfg.cuda_arch_list and cfg.use_cuda:
        env["TORCH_CUDA_ARCH_LIST"] = cfg.cuda_arch_list
    return env


def build_command(cfg: BuildConfig) -> list[str]:
    if cfg.build_cmd:
        return list(cfg.build_cmd)
    return [sys.executable, "-m", "pip", "wheel", ".", "--no-build-isolation", "--no-deps", "-v",
            "-w", str(cfg.dist)]


def _dirty_paths(src: Path) -> list[str]:
    # porcelain v1: "XY path"; the leading status column may be a space, so never strip.
    out = _git(["status", "--porcelain", "--untracked-files=all", "--ignore-submodules=dirty"], src,
               strip=False)
    return [line[3:] for line in out.splitlines() if line.strip()]


def _check_clean(src: Path, cfg: BuildConfig, specs: list) -> None:
    """Rule: the tree is pristine, or only carries this series (a re-run is fine)."""
    ours_new = {rel for s in specs for rel in s.new_files}
    ours_edit = {e.file for s in specs for e in s.edits}
    foreign = []
    for rel in _dirty_paths(src):
        if rel in ours_new and (src / rel).read_bytes() == (cfg.patches_dir / "new_files" / rel).read_bytes():
            continue
        if rel in ours_edit:
            head = _git(["show", f"HEAD:{rel}"], src)
            if ae.strip_blocks(ae._read(src / rel)).rstrip("\n") == head.rstrip("\n"):
                continue
        foreign.append(rel)
    if foreign:
        shown = ", ".join(foreign[:8]) + (" ..." if len(foreign) > 8 else "")
        raise BuildError(
            f"build_tools: source tree {src} is dirty: expected no local changes besides this patch series, "
            f"found changes to {shown}. Stash or discard them (`git -C {src} stash -u`) or pass a clean "
            "--source."
        )


def _find_wheel(dist: Path, started: float) -> Path:
    # Written (or rewritten: a rebuild keeps the name) since the build started.
    wheels = sorted((p for p in dist.glob("torch-*.whl") if p.stat().st_mtime >= started),
                    key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise BuildError(
            f"build_tools: the build finished but wrote no torch-*.whl to {dist}. Check the build log above."
        )
    return wheels[-1]


def write_manifest(cfg: BuildConfig, pin: Pin, specs: list, wheel: Path | None, recorded: list) -> Path:
    nf = cfg.patches_dir / "new_files"
    manifest = {
        "schema": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "upstream": asdict(pin),
        "source": str(cfg.source_dir),
        "series": [
            {
                "name": s.name,
                "spec_sha256": ae.sha256_file(s.spec_path),
                "patch_sha256": (
                    ae.sha256_file(cfg.patches_dir / f"{s.name}.patch")
                    if (cfg.patches_dir / f"{s.name}.patch").is_file()
                    else None
                ),
                "new_files": {rel: ae.sha256_file(nf / rel) for rel in s.new_files},
                "edits": [f"{e.file}:{e.id}" for e in s.edits],
            }
            for s in specs
        ],
        "applied_diffs": {p.name: ae.sha256_file(p) for p in recorded},
        "build": {
            "env": build_env(cfg, pin),
            "command": build_command(cfg),
            "python": platform.python_version(),
            "host": platform.platform(),
        },
        "wheel": {"file": wheel.name, "sha256": ae.sha256_file(wheel)} if wheel else None,
    }
    path = cfg.dist / "manifest.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def plan_steps(cfg: BuildConfig, log: Callable[[str], None] = print) -> list[Step]:
    """The eight steps, each with a description and an action."""
    pin = read_pin(cfg.pin_file)
    src = cfg.source_dir
    url = cfg.repo_url or pin.repository
    st = _State()
    clone = ["git", "clone", "--branch", pin.tag, "--recursive", "--depth", "1", "--shallow-submodules",
             url, str(src)]

    def do_source() -> None:
        if src.is_dir():
            if not (src / ".git").exists():
                raise BuildError(f"build_tools: {src} exists but is not a git checkout; expected a clone of "
                                 f"{pin.tag}. Remove it or pass --source to a git clone.")
            log(f"  reusing {src}")
            return
        if cfg.source is not None:
            raise BuildError(f"build_tools: --source {src} does not exist. Expected a git clone of PyTorch "
                             f"{pin.tag}; create it with: {shlex.join(clone)}")
        src.parent.mkdir(parents=True, exist_ok=True)
        log(f"  $ {shlex.join(clone)}")
        proc = subprocess.run(clone)
        if proc.returncode != 0:
            raise BuildError(f"build_tools: cloning {url} at {pin.tag} failed (exit {proc.returncode}); "
                             "check the network or pass --source DIR with an existing clone.")

    def do_commit() -> None:
        head = _git(["rev-parse", "HEAD"], src)
        if head != pin.commit:
            raise BuildError(f"build_tools: {src} is at commit {head}, expected {pin.commit} ({pin.tag}, "
                             f"patches/PYTORCH_PIN). Run `git -C {src} checkout {pin.tag} && git -C {src} "
                             "submodule update --init --recursive`.")
        tag = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{pin.tag}^{{commit}}"], cwd=src,
                             capture_output=True, text=True).stdout.strip()
        if tag and tag != pin.commit:
            raise BuildError(f"build_tools: tag {pin.tag} resolves to {tag} in {src}, but the pin records "
                             f"{pin.commit}. Either the pin or the clone is wrong; do not build.")
        log(f"  HEAD = {head} ({pin.tag}{' verified' if tag else '; tag not fetched, HEAD checked'})")

    def do_clean() -> None:
        st.specs = ae.load_series(cfg.patches_dir)
        _check_clean(src, cfg, st.specs)
        log("  clean (or carrying only this series)")

    def do_check() -> None:
        # every anchor's result, then the planning apply repeats (it stops at the first problem)
        rows = ae.check_series(src, st.specs, cfg.patches_dir / "new_files")
        for line in ae.format_check(rows).splitlines():
            log(f"  {line}")
        ae.plan_series(src, st.specs, cfg.patches_dir / "new_files")

    def do_apply() -> None:
        plan = ae.plan_series(src, st.specs, cfg.patches_dir / "new_files")
        written = ae.apply_series(plan)
        log(f"  wrote {len(written)} file(s)" if written else "  already applied; nothing written")

    def do_record() -> None:
        cfg.dist.mkdir(parents=True, exist_ok=True)
        st.recorded = ae.generate_patches(src, st.specs, cfg.dist / "patches", cfg.patches_dir / "new_files",
                                          source_note=f"pytorch {pin.tag} ({pin.commit})")
        log(f"  wrote {len(st.recorded)} diff(s) to {cfg.dist / 'patches'}")

    def do_build() -> None:
        cfg.dist.mkdir(parents=True, exist_ok=True)
        started = time.time() - 1.0  # filesystem timestamps may be coarse
        env = {**os.environ, **build_env(cfg, pin)}
        cmd = build_command(cfg)
        log(f"  $ (cd {src} && {shlex.join(cmd)})")
        proc = subprocess.run(cmd, cwd=src, env=env)
        if proc.returncode != 0:
            raise BuildError(f"build_tools: the build command failed (exit {proc.returncode}). See the log "
                             "above; a missing dependency usually means `pip install -r requirements.txt` "
                             f"in {src} was not run.")
        st.wheel = _find_wheel(cfg.dist, started)
        log(f"  built {st.wheel.name}")

    def do_manifest() -> None:
        path = write_manifest(cfg, pin, st.specs, st.wheel, st.recorded)
        log(f"  wrote {path}")

    env_str = " ".join(f"{k}={shlex.quote(v)}" for k, v in build_env(cfg, pin).items())
    return [
        Step("source", [f"reuse {src} if it exists, else: {shlex.join(clone)}"], do_source),
        Step("commit", [f"check `git -C {src} rev-parse HEAD` and `{pin.tag}^{{commit}}` == {pin.commit}"],
             do_commit),
        Step("clean", [f"check `git -C {src} status --porcelain` lists no change outside this series"],
             do_clean),
        Step("check", [f"check every anchor of {cfg.patches_dir / 'series'} matches exactly once in {src}"],
             do_check),
        Step("apply", [f"copy {cfg.patches_dir / 'new_files'} and apply the anchored edits to {src}"],
             do_apply),
        Step("record", [f"write the applied diffs to {cfg.dist / 'patches'}"], do_record),
        Step("build", [f"cd {src} && {env_str} {shlex.join(build_command(cfg))}"], do_build),
        Step("manifest", [f"write {cfg.dist / 'manifest.json'} (upstream commit, patch hashes, flags, wheel)"],
             do_manifest),
    ]


def run(cfg: BuildConfig, log: Callable[[str], None] = print) -> int:
    steps = plan_steps(cfg, log)
    for i, step in enumerate(steps, 1):
        prefix = "[dry-run] " if cfg.dry_run else ""
        log(f"{prefix}step {i}/{len(steps)} {step.name}: {step.describe[0]}")
        for extra in step.describe[1:]:
            log(f"{prefix}    {extra}")
        if not cfg.dry_run:
            step.action()
    log("dry run: nothing was done" if cfg.dry_run else f"done: see {cfg.dist / 'manifest.json'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="build_wheel.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, help="existing PyTorch clone (default: third_party/pytorch)")
    p.add_argument("--dist", type=Path, default=REPO_ROOT / "dist", help="output folder (default: dist/)")
    p.add_argument("--dry-run", action="store_true", help="print every step without doing it")
    p.add_argument("--max-jobs", type=int, help="MAX_JOBS for the compile")
    p.add_argument("--cuda-arch-list", help='TORCH_CUDA_ARCH_LIST, e.g. "9.0"')
    p.add_argument("--no-cuda", action="store_true", help="USE_CUDA=0 (CPU-only build, for testing)")
    p.add_argument("--repo-url", help="clone from this URL instead of the pin's repository")
    p.add_argument("--pin", type=Path, default=ae.PATCHES_DIR / "PYTORCH_PIN", help=argparse.SUPPRESS)
    p.add_argument("--build-cmd", help=argparse.SUPPRESS)  # tests: replace the multi-hour compile
    args = p.parse_args(argv)
    cfg = BuildConfig(
        source=args.source, dist=args.dist, pin_file=args.pin, repo_url=args.repo_url,
        use_cuda=not args.no_cuda, max_jobs=args.max_jobs, cuda_arch_list=args.cuda_arch_list,
        build_cmd=shlex.split(args.build_cmd) if args.build_cmd else None, dry_run=args.dry_run,
    )
    try:
        return run(cfg)
    except ae.BaseError as exc:
        print(f"build_wheel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
