"""The pilot's native inference kernel: ``kernel.c``, built at install or on first use, loaded with ctypes.

The numpy code stays the reference and the fallback (:meth:`FeatureState.features_numpy
<dynn_runtime.pilot.features.FeatureState.features_numpy>`, :meth:`PilotModel.probs
<dynn_runtime.pilot.model.PilotModel.probs>`). The kernel computes the same feature rows bit for bit
(its logarithms come from tables that numpy fills, :mod:`.tables`, so both round alike) and the same
network up to float32 summation order.

Files: ``kernel.c`` (the C source), ``pilot_kernel.h`` (generated from the feature table by
:mod:`.abi`), :mod:`.tables` (the address tables the calls pass), :mod:`.calls` (the library's calls).

Build: CMake builds it at install (``pilot/kernel/_kernel.so``, with ``_kernel.sha256``, the hash of
the source and header it was built from, :func:`source_hash`); it is used when that hash matches
these files and ``DYNN_PILOT_INSTALLED`` is not ``0``. Otherwise it is compiled at run time: the
system C compiler (``$CC``, else ``cc``) with ``-O3 -march=native`` (retried without
``-march=native`` if the compiler refuses it) into ``$DYNN_CACHE_DIR``, else
``$XDG_CACHE_HOME/dynn_runtime``, else ``~/.cache/dynn_runtime``; the file name is keyed by a hash of
the source, the compiler's ``--version``, the flags and the CPU (machine and its feature flags), so
a changed source, compiler or machine gets its own build. Compiled to a temporary file and renamed
into place, so processes that race both succeed. ``DYNN_PILOT_NATIVE=0`` turns it off. Without a
compiler, or when compiling or loading fails, :func:`available` is false, :func:`reason` says why
(logged once) and everything runs on numpy.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

from ..._log import logger
from .calls import NativeKernel
from .tables import ModelTable, NativeHeap, PolicyTable, StateTable

__all__ = ["available", "reason", "kernel", "resolve", "reset", "cache_dir", "source_hash", "NativeKernel",
           "PolicyTable", "StateTable", "ModelTable", "NativeHeap", "BACKENDS"]

BACKENDS = ("native", "numpy")
SOURCE = Path(__file__).with_name("kernel.c")
HEADER = SOURCE.with_name("pilot_kernel.h")
#: flags tried in order (the second for compilers that refuse -march=native). No -ffast-math:
#: results keep IEEE semantics; -ffp-contract=off leaves only the explicit fmaf() fused.
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fPIC", "-shared", "-std=c99", "-ffp-contract=off"),
    ("-O3", "-fPIC", "-shared", "-std=c99", "-ffp-contract=off"),
)
LIBS = ("-lm",)

_lock = threading.Lock()
_kernel: NativeKernel | None = None
_reason = "not loaded yet"
_tried = False


def cache_dir() -> Path:
    """Where compiled kernels are kept (see the module docstring)."""
    d = os.environ.get("DYNN_CACHE_DIR")
    if d:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "dynn_runtime"


def _cpu_id() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[-1].strip()
                    break
    except OSError:
        pass
    return platform.machine() + "-" + hashlib.sha256(flags.encode()).hexdigest()[:12]


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def _compile(cc: list[str], flags: tuple[str, ...], path: Path) -> str | None:
    """Compile the kernel to ``path`` (through a temporary file renamed into place); None, or the error."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        r = subprocess.run([*cc, *flags, f"-I{HEADER.parent}", "-o", tmp, str(SOURCE), *LIBS], capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            return f"{' '.join(cc + list(flags))}: exit {r.returncode}: {r.stderr.strip()[-600:]}"
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(cc + list(flags))}: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def source_hash() -> str:
    """What ``_kernel.sha256`` records at install (CMakeLists.txt computes the same): the sha256 of
    the source's and the header's hex sha256 digests, concatenated."""
    parts = (hashlib.sha256(f.read_bytes()).hexdigest() for f in (SOURCE, HEADER))
    return hashlib.sha256("".join(parts).encode()).hexdigest()


def _installed() -> tuple[NativeKernel, str] | None:
    """The kernel CMake built at install (``pilot/kernel/_kernel.so``), if it was built from these
    very files (its ``_kernel.sha256``): an editable checkout whose source changed since compiles anew."""
    if os.environ.get("DYNN_PILOT_INSTALLED", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    dirs = [SOURCE.parent]
    try:  # an editable install keeps built files beside the installed package, not the source
        import importlib.util

        spec = importlib.util.find_spec("dynn_runtime._C")
        if spec is not None and spec.origin:
            dirs.append(Path(spec.origin).parent / "pilot" / "kernel")
    except (ImportError, ValueError):
        pass
    for d in dirs:
        lib, stamp = d / "_kernel.so", d / "_kernel.sha256"
        try:
            if stamp.read_text().strip() != source_hash():
                continue
            return NativeKernel(lib), f"native kernel {lib} (built at install)"
        except (OSError, RuntimeError, AttributeError):
            continue
    return None


def _build() -> tuple[NativeKernel | None, str]:
    if os.environ.get("DYNN_PILOT_NATIVE", "").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by DYNN_PILOT_NATIVE=0"
    installed = _installed()
    if installed is not None:
        return installed
    cc = _compiler()
    if not cc:
        return None, "no C compiler ($CC is empty)"
    try:
        ver = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"no usable C compiler ({' '.join(cc)!r}: {exc})"
    if ver.returncode != 0:
        return None, f"C compiler {' '.join(cc)!r} --version failed (exit {ver.returncode})"
    try:
        src = SOURCE.read_bytes() + HEADER.read_bytes()
    except OSError as exc:
        return None, f"kernel source {SOURCE} or {HEADER.name} unreadable ({exc})"
    cpu = _cpu_id()
    out_dir = cache_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK):
            raise OSError("not writable")
    except OSError:
        out_dir = Path(tempfile.gettempdir()) / f"dynn_runtime-{os.getuid() if hasattr(os, 'getuid') else 'u'}"
        out_dir.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    refused: list[tuple[Path, str]] = []
    for flags in FLAG_SETS:
        h = hashlib.sha256()
        for part in (src, ver.stdout.encode(), " ".join(cc).encode(), " ".join(flags + LIBS).encode(), cpu.encode()):
            h.update(part)
            h.update(b"\0")
        path = out_dir / f"pilot_native-{h.hexdigest()[:20]}.so"
        failed = path.with_suffix(".failed")  # refused these flags while later ones built: do not retry
        if not path.is_file() and failed.is_file():
            errors.append(f"{' '.join(cc + list(flags))}: failed before ({failed})")
            continue
        kern = None
        for attempt in range(2):  # a cached file that does not load (truncated, stale) is rebuilt once
            if not path.is_file():
                msg = _compile(cc, flags, path)
                if msg:
                    errors.append(msg)
                    refused.append((failed, msg))
                    break
            try:
                kern = NativeKernel(path)
                break
            except (OSError, RuntimeError, AttributeError) as exc:
                errors.append(f"loading {path}: {exc}")
                if attempt == 0:
                    try:
                        path.unlink()
                    except OSError:
                        break
        if kern is None:
            continue
        for marker, msg in refused:  # the compiler works, so those flags are what it refused
            try:
                marker.write_text(msg + "\n")
            except OSError:
                pass
        return kern, f"native kernel {path} ({' '.join(flags)})"
    return None, "compiling the native kernel failed: " + " | ".join(errors)


def kernel() -> NativeKernel | None:
    """The loaded kernel (compiled on the first call), or None; :func:`reason` says why."""
    global _kernel, _reason, _tried
    if _tried:
        return _kernel
    with _lock:
        if not _tried:
            try:
                _kernel, _reason = _build()
            except Exception as exc:  # never let the optional kernel break the policy
                _kernel, _reason = None, f"native kernel unavailable ({type(exc).__name__}: {exc})"
            _tried = True
            if _kernel is None:
                log = logger.info if "DYNN_PILOT_NATIVE" in _reason else logger.warning
                log("pilot: using the numpy inference path: %s", _reason)
            else:
                logger.debug("pilot: %s", _reason)
    return _kernel


def available() -> bool:
    """Whether the native kernel is usable in this process (compiles it on the first call)."""
    return kernel() is not None


def reason() -> str:
    """Why the kernel is (not) available: the loaded file, or what failed."""
    kernel()
    return _reason


def reset() -> None:
    """Forget the loaded kernel: the next call reads the environment and compiles (or loads) again."""
    global _kernel, _reason, _tried
    with _lock:
        _kernel, _reason, _tried = None, "not loaded yet", False


def resolve(backend: str | None) -> str:
    """``None``/``"auto"``: ``"native"`` when available, else ``"numpy"``; ``"native"`` raises
    :class:`~dynn_runtime.errors.PilotError` with the reason when it is not available."""
    if backend in (None, "auto"):
        return "native" if available() else "numpy"
    if backend == "numpy":
        return "numpy"
    if backend == "native":
        if not available():
            from ...errors import PilotError

            raise PilotError(f"pilot: the native inference kernel is not available: {reason()}. "
                             "Use backend='numpy' (or leave it unset to fall back).")
        return "native"
    raise ValueError(f"pilot: backend must be one of {BACKENDS} or None, got {backend!r}")


