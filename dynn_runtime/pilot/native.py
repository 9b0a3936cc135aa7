"""The pilot's native inference kernel: ``_native.c``, compiled on first use and loaded with ctypes.

The numpy code stays the reference and the fallback (:meth:`FeatureState.features_numpy
<dynn_runtime.pilot.features.FeatureState.features_numpy>`, :meth:`PilotModel.probs
<dynn_runtime.pilot.model.PilotModel.probs>`). The kernel computes the same feature rows bit for bit
(its logarithms come from tables that numpy fills here, so both round alike) and the same network up
to float32 summation order.

Build: CMake builds it at install (``pilot/_kernel.so``, with ``_kernel.sha256``, the hash of the
source it was built from); it is used when that hash matches this source and
``DYNN_PILOT_INSTALLED`` is not ``0``. Otherwise it is compiled at run time: the system C compiler (``$CC``, else ``cc``) with ``-O3 -march=native`` (retried without
``-march=native`` if the compiler refuses it) into ``$DYNN_CACHE_DIR``, else
``$XDG_CACHE_HOME/dynn_runtime``, else ``~/.cache/dynn_runtime``; the file name is keyed by a hash of
the source, the compiler's ``--version``, the flags and the CPU (machine and its feature flags), so
a changed source, compiler or machine gets its own build. Compiled to a temporary file and renamed
into place, so processes that race both succeed. ``DYNN_PILOT_NATIVE=0`` turns it off. Without a
compiler, or when compiling or loading fails, :func:`available` is false, :func:`reason` says why
(logged once) and everything runs on numpy.

Calls pass pointers, not arrays: a ``.ctypes.data`` costs about a microsecond per array, so a
:class:`FeatureState`'s arrays are gathered once into a table of addresses (rebuilt when the state
reallocates them) and a model's folded weights likewise; the per-call scalars go into a ctypes
structure whose address is fixed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from array import array
from pathlib import Path
from typing import Any

import numpy as np

from .._log import logger

__all__ = ["available", "reason", "kernel", "resolve", "reset", "cache_dir", "NativeKernel", "PolicyTable",
           "BACKENDS"]

BACKENDS = ("native", "numpy")
SOURCE = Path(__file__).with_name("_native.c")
#: flags tried in order (the second for compilers that refuse -march=native). No -ffast-math:
#: results keep IEEE semantics; -ffp-contract=off leaves only the explicit fmaf() fused.
FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fPIC", "-shared", "-std=c99", "-ffp-contract=off"),
    ("-O3", "-fPIC", "-shared", "-std=c99", "-ffp-contract=off"),
)
LIBS = ("-lm",)
_ABI = 9
_STATE_WORDS, _POINT_WORDS, _MODEL_WORDS, _POLICY_WORDS, _OP_WORDS = 44, 18, 16, 7, 16
_LANES = 16
_MAX_H, _MAX_K = 256, 64  # widest hidden layer and most (padded) outputs the kernel takes

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
        r = subprocess.run([*cc, *flags, "-o", tmp, str(SOURCE), *LIBS], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            return f"{' '.join(cc + list(flags))}: exit {r.returncode}: {r.stderr.strip()[-600:]}"
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{' '.join(cc + list(flags))}: {exc}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _installed() -> tuple[NativeKernel, str] | None:
    """The kernel CMake built at install (``pilot/_kernel.so``), if it was built from this very
    source (its ``_kernel.sha256``): an editable checkout whose source changed since compiles anew."""
    if os.environ.get("DYNN_PILOT_INSTALLED", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    dirs = [SOURCE.parent]
    try:  # an editable install keeps built files beside the installed package, not the source
        import importlib.util

        spec = importlib.util.find_spec("dynn_runtime._C")
        if spec is not None and spec.origin:
            dirs.append(Path(spec.origin).parent / "pilot")
    except (ImportError, ValueError):
        pass
    for d in dirs:
        lib, stamp = d / "_kernel.so", d / "_kernel.sha256"
        try:
            if stamp.read_text().strip() != hashlib.sha256(SOURCE.read_bytes()).hexdigest():
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
        src = SOURCE.read_bytes()
    except OSError as exc:
        return None, f"kernel source {SOURCE} unreadable ({exc})"
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
            from ..errors import PilotError

            raise PilotError(f"pilot: the native inference kernel is not available: {reason()}. "
                             "Use backend='numpy' (or leave it unset to fall back).")
        return "native"
    raise ValueError(f"pilot: backend must be one of {BACKENDS} or None, got {backend!r}")


# ---- tables the kernel's logarithms come from (filled by numpy, so both round alike) ----------------

_TABLES: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _tables(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = _TABLES.get(n)
    if t is None:
        i64 = np.arange(n, dtype=np.int64)
        f32 = np.arange(n, dtype=np.float32)
        # the expressions of FeatureState.features_numpy, on every integer argument: log1p of int64
        # (float64) / 8.0 stored as float32, and log1p of float32 counts / 4.0 and / 6.0 in float32
        l8 = (np.log1p(i64) / 8.0).astype(np.float32)
        l4 = np.log1p(f32) / 4.0
        l6 = np.log1p(f32) / 6.0
        t = _TABLES[n] = (l8, l4.astype(np.float32), l6.astype(np.float32))
    return t


def _table_size(need: int) -> int:
    n = 4096
    while n < need:
        n *= 2
    return n


class _Point(ctypes.Structure):
    """``dynn_point``: one call's scalars, rows and pending-external counterparts."""

    _fields_ = [*((f, ctypes.c_int64) for f in ("pos", "phase", "phase_start", "frontier", "p_here", "q",
                                                "stack_counter", "n_live")),
                ("hist_allocs", ctypes.c_double), ("rows", ctypes.c_void_p), ("m", ctypes.c_int64),
                ("rem", ctypes.c_void_p), ("nrem", ctypes.c_int64), ("mirror", ctypes.c_int64),
                *((f, ctypes.c_int64) for f in ("h_active", "h_step", "h_start", "h_len"))]


class _Policy(ctypes.Structure):
    """``dynn_policy``: what PilotPolicy._score's arithmetic needs besides the state and the model."""

    _fields_ = [*((f, ctypes.c_void_p) for f in ("logreps", "lower", "due", "sids_out", "score_out")),
                ("quantile", ctypes.c_double), ("recheck", ctypes.c_double)]


class _Op(ctypes.Structure):
    """``dynn_op``: one operator for FeatureState.op's native update."""

    _fields_ = [("position", ctypes.c_int64), ("phase", ctypes.c_int64),
                *((f, ctypes.c_void_p) for f in ("iv", "ivk", "decay", "hist", "alloc_slots", "alloc_prev")),
                ("n_alloc", ctypes.c_int64), ("acc_slots", ctypes.c_void_p), ("n_acc", ctypes.c_int64),
                ("frontier", ctypes.c_int64), ("stack_counter", ctypes.c_int64), ("replay", ctypes.c_void_p),
                ("match", ctypes.c_void_p), ("n_match", ctypes.c_int64)]


def _none() -> None:
    return None


class StateTable:
    """A :class:`FeatureState`'s arrays as the kernel's address table (``dynn_state`` in
    ``_native.c``), its per-call structure (``dynn_point``) and a buffer of rows for the policy.
    Holds references to every array it points to. Rebuilt when the state reallocates
    (``FeatureState._grow``) or indexes a new previous iteration (``_index_previous``)."""

    def __init__(self, st: Any) -> None:
        self.ratio = float(st._ratio)
        # the previous iteration's sorted keys (index * 2^32 + position) as per-index segments of positions
        keys = st._prev_keys
        pos = np.ascontiguousarray(keys & ((1 << 32) - 1), dtype=np.int64)
        off = np.zeros(len(st._prev_count) + 1, dtype=np.int64)
        np.cumsum(st._prev_count.astype(np.int64), out=off[1:])
        if off[-1] != len(keys):
            raise RuntimeError("pilot native: previous-iteration index inconsistent")
        arrays = [
            (st.active, np.bool_), (st.sid, np.int64), (st.kind, np.int64), (st.saved, np.float32),
            (st.persistent, np.float32), (st.log_bytes, np.float32), (st.born, np.int64),
            (st.born_phase, np.int64), (st.last, np.int64), (st.last_phase, np.int64), (st.count, np.float32),
            (st.count_phase, np.float32), (st.count_phase_of, np.int64), (st.acc_phase, np.float32),
            (st.producer_iv, np.float32), (st.has_producer, np.float32), (st.consumer_iv, np.float32),
            (st.stack_idx, np.int64), (st.stack_pos, np.int64), (st.announce, np.int64), (st.prev, np.int64),
            (st.pred, np.float64), (st.touched, np.bool_), (pos, np.int64), (off, np.int64),
            (st._prev_count, np.float32), (st._hist, np.float32),
        ]
        words = np.zeros(_STATE_WORDS, dtype=np.uint64)
        for i, (a, dt) in enumerate(arrays):
            if a.dtype != dt or not a.flags.c_contiguous:
                raise RuntimeError(f"pilot native: state array {i} is {a.dtype}, contiguous={a.flags.c_contiguous}")
            words[i] = a.ctypes.data
        words[31], words[32], words[34] = st._cap, len(keys), st._prev_len
        dbl = words.view(np.float64)
        dbl[35] = self.ratio
        dbl[36] = float(np.float32(np.log1p(self.ratio)))  # ctx log_bwd_fwd_ratio: np.log1p(ratio) as float32
        words[37] = len(st._prev_count)
        mirror = [(st.mirror_tgt, np.int64), (st._mir_pos, np.int64), (st._mir_off, np.int64), (st._mir_sid, np.int64)]
        for i, (a, dt) in enumerate(mirror):
            if a.dtype != dt or not a.flags.c_contiguous:
                raise RuntimeError(f"pilot native: mirror array {i} is {a.dtype}, contiguous={a.flags.c_contiguous}")
            words[38 + i] = a.ctypes.data
        words[42] = len(st._mir_sid)
        if st.hint_at.dtype != np.int64 or not st.hint_at.flags.c_contiguous:
            raise RuntimeError("pilot native: hint array is not contiguous int64")
        words[43] = st.hint_at.ctypes.data
        arrays += [*mirror, (st.hint_at, np.int64)]
        self.keep = arrays
        self.words = words
        self.addr = words.ctypes.data
        self.ntab = 0
        self.ensure(max(st._cap, st._prev_len, st.position) + 2)
        self.point = _Point()
        self.point_addr = ctypes.addressof(self.point)
        self.rows = np.zeros(max(st._cap, 64), dtype=np.int64)
        self.rows_addr = self.rows.ctypes.data
        self.op = _Op()
        self.op_addr = ctypes.addressof(self.op)
        self.op.hist = st._hist.ctypes.data
        self.op.decay = st._hist_decay.ctypes.data
        self.keep.append((st._hist_decay, np.float32))
        self.op_room(64)

    def op_room(self, n: int) -> None:
        """Buffers for an operator of up to ``n`` allocations and ``n`` accesses (:meth:`NativeKernel.op`)."""
        self.op_n = n
        # alloc slots, alloc prev, access slots, replay, match: ctypes arrays (a slice assignment from a
        # list costs a quarter of numpy's)
        self.op_bufs = [(ctypes.c_int64 * n)() for _ in range(5)]
        o, a = self.op, [ctypes.addressof(b) for b in self.op_bufs]
        o.alloc_slots, o.alloc_prev, o.acc_slots, o.replay, o.match = a

    def __reduce__(self) -> Any:  # addresses do not survive pickling: the state rebuilds its table
        return (_none, ())

    def ensure(self, need: int) -> None:
        """Tables of at least ``need`` entries (every integer argument of a logarithm is below it)."""
        if need <= self.ntab:
            return
        n = _table_size(need)
        l8, l4, l6 = _tables(n)
        # stack_est: np.log1p(span * ratio) / 8.0 with span a float64 integer, stored as float32
        lest = (np.log1p(np.arange(n, dtype=np.float64) * self.ratio) / 8.0).astype(np.float32)
        self.tabs = (l8, l4, l6, lest)
        for i, a in enumerate(self.tabs):
            self.words[27 + i] = a.ctypes.data
        self.words[33] = n
        self.ntab = n

    def set_point(self, st: Any, rows_addr: int, m: int, n_live: int) -> None:
        p = self.point
        p.pos = st.position
        p.phase = st.phase
        p.phase_start = st.phase_start
        p.frontier = st._frontier
        p.p_here, p.q = st._anchor
        p.stack_counter = st._stack_counter
        p.n_live = n_live
        p.hist_allocs = st._hist_allocs
        p.rows = rows_addr
        p.m = m
        p.nrem = -1
        p.mirror = st._mirror
        p.h_active = st._h_active
        if st._h_active:
            p.h_step, p.h_start, p.h_len = st._h_step, st._h_start, st._hint_len()


class ModelTable:
    """A model's folded weights (``PilotModel._folded``) as the kernel's ``dynn_model``."""

    def __init__(self, model: Any) -> None:
        fold = model._folded()
        w1, _, wx, bx = fold
        a = model.arrays
        k = a["W3"].shape[1]
        kp = -(-k // _LANES) * _LANES  # the last layer's outputs zero-padded to whole vectors
        w3 = np.zeros((a["W3"].shape[0], kp), dtype=np.float32)
        w3[:, :k] = a["W3"]
        b3 = np.zeros(kp, dtype=np.float32)
        b3[:k] = a["b3"]
        arrays = [np.ascontiguousarray(x, dtype=np.float32) for x in (w1, wx, bx, a["W2"], a["b2"], w3, b3)]
        bounds = [np.ascontiguousarray(x, dtype=np.float32) for x in model.bounds()]
        words = np.zeros(_MODEL_WORDS, dtype=np.uint64)
        for i, x in enumerate(arrays):
            words[i] = x.ctypes.data
        nf, h = arrays[0].shape
        words[7:12] = (nf, arrays[1].shape[0], h, k, kp)
        for i, x in enumerate(bounds):  # the input clamp: lo, hi, lo_ctx, hi_ctx
            words[12 + i] = x.ctypes.data
        arrays += bounds
        self.fold = fold
        self.keep = arrays
        self.words = words
        self.addr = words.ctypes.data
        self.k = int(k)

    def __reduce__(self) -> Any:  # addresses do not survive pickling: the model rebuilds its table
        return (_none, ())


class PolicyTable:
    """A :class:`~dynn_runtime.pilot.policy.PilotPolicy`'s side of a decision (``dynn_policy``): the
    bucket representatives of this iteration, ``due``, and the output buffers (storage ids,
    predictions) that the policy's heaps take (``NativeKernel.merge``)."""

    def __init__(self, lower: np.ndarray, quantile: float, recheck: float) -> None:
        self.q = _Policy()
        self.addr = ctypes.addressof(self.q)
        self.lower = np.ascontiguousarray(lower, dtype=np.float64)
        self.q.lower = self.lower.ctypes.data
        self.q.quantile = float(quantile)
        self.q.recheck = float(recheck)
        self.logreps: np.ndarray | None = None
        self.due: np.ndarray | None = None
        self.due_addr = 0
        self.grow(256)

    def __reduce__(self) -> Any:  # rebuilt with fresh addresses
        return (_policy_table, (self.lower, self.q.quantile, self.q.recheck, self.logreps, self.due))

    def grow(self, n: int) -> None:
        self.sids_out = np.zeros(n, dtype=np.int64)
        self.score_out = np.zeros(n, dtype=np.float64)
        self.q.sids_out = self.sids_out.ctypes.data
        self.q.score_out = self.score_out.ctypes.data
        self.n = n

    def set_logreps(self, logreps: np.ndarray) -> None:
        if logreps is not self.logreps:
            self.logreps = np.ascontiguousarray(logreps, dtype=np.float64)
            self.q.logreps = self.logreps.ctypes.data

    def set_due(self, due: np.ndarray) -> None:
        if due is not self.due:
            if due.dtype != np.float64 or not due.flags.c_contiguous:
                raise ValueError("pilot native: due must be a contiguous float64 array")
            self.due = due
            self.due_addr = self.q.due = due.ctypes.data


def _policy_table(lower: np.ndarray, quantile: float, recheck: float, logreps: np.ndarray | None,
                  due: np.ndarray | None) -> PolicyTable:
    t = PolicyTable(lower, quantile, recheck)
    if logreps is not None:
        t.set_logreps(logreps)
    if due is not None:
        t.set_due(due)
    return t


class NativeHeap:
    """:class:`~dynn_runtime.pilot.policy.PilotPolicy`'s eviction heap (``NextUsePolicy._res``) in
    the kernel (``dynn_heap``): entries ``(key, sid)`` popped in the order heapq pops the same
    tuples, each with its storage's slot so that a pop skips stale entries in C (the slot no longer
    holds that storage, or the key is not its current prediction ``-pred[slot]``). Pushes from
    Python are staged in arrays and enter the heap in one call before the next pop, ``len`` or
    compaction; a decision point's rows enter from the kernel (:meth:`NativeKernel.merge`)."""

    def __init__(self, kern: NativeKernel) -> None:
        self._lib = kern.lib
        h = kern.lib.dynn_heap_new()
        if not h:
            raise MemoryError("pilot native: no memory for the eviction heap")
        self.h = h
        self._keys, self._sids, self._slots = array("d"), array("q"), array("q")
        self._out = (ctypes.c_int64 * 3)()
        self._out_addr = ctypes.addressof(self._out)
        self._key = ctypes.c_double.from_buffer(self._out)

    def __del__(self) -> None:
        h, self.h = getattr(self, "h", None), None
        if h:
            self._lib.dynn_heap_free(h)

    def __reduce__(self) -> Any:  # the entries survive pickling; the heap is rebuilt in this process
        return (_heap_from, (self.entries(),))

    def push(self, key: float, sid: int, slot: int) -> None:
        self._keys.append(key)
        self._sids.append(sid)
        self._slots.append(slot)

    def _flush(self) -> None:
        n = len(self._keys)
        if n:
            if self._lib.dynn_heap_push(self.h, self._keys.buffer_info()[0], self._sids.buffer_info()[0],
                                        self._slots.buffer_info()[0], n):
                raise MemoryError("pilot native: no memory for the eviction heap")
            del self._keys[:], self._sids[:], self._slots[:]

    def __len__(self) -> int:
        if self._keys:
            self._flush()
        return self._lib.dynn_heap_len(self.h)

    def pop(self, state_addr: int) -> tuple[float, int, int] | None:
        """The least entry that is not stale against the state at ``state_addr``, or None."""
        if self._keys:
            self._flush()
        if not self._lib.dynn_heap_pop(self.h, state_addr, self._out_addr):
            return None
        return self._key.value, self._out[1], self._out[2]

    def compact(self, state_addr: int, n_slots: int) -> None:
        """Keep the entries that match their storage's prediction, once each."""
        if self._keys:
            self._flush()
        mark = np.empty(max(n_slots, 1), dtype=np.int64)
        self._lib.dynn_heap_compact(self.h, state_addr, mark.ctypes.data)

    def entries(self) -> list[tuple[float, int, int]]:
        """Every entry (key, sid, slot), in heap order (tests, pickling)."""
        n = len(self)
        keys, sids, slots = np.empty(n), np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
        self._lib.dynn_heap_dump(self.h, keys.ctypes.data, sids.ctypes.data, slots.ctypes.data)
        return list(zip(keys.tolist(), sids.tolist(), slots.tolist()))


def _heap_from(entries: list[tuple[float, int, int]]) -> NativeHeap:
    k = kernel()
    if k is None:
        raise RuntimeError(f"pilot native: unpickling an eviction heap needs the native kernel ({reason()})")
    h = NativeHeap(k)
    for e in entries:
        h.push(*e)
    return h


_V, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class NativeKernel:
    """The loaded library and the Python side of its calls."""

    def __init__(self, path: Path) -> None:
        lib = ctypes.CDLL(str(path))
        lib.dynn_pilot_layout.argtypes = [_V, _I]
        lib.dynn_pilot_layout.restype = _I
        lib.dynn_pilot_features.argtypes = [_V, _V, _V, _V, _V]
        lib.dynn_pilot_features.restype = _I
        lib.dynn_pilot_gather.argtypes = [_V, _V, _V, _V, _V, _V]
        lib.dynn_pilot_gather.restype = _I
        lib.dynn_pilot_score.argtypes = [_V, _V, _I, _V, _V, _D, _V, _V, _V, _V]
        lib.dynn_pilot_score.restype = _I
        lib.dynn_pilot_decide.argtypes = [_V, _V, _V, _V]
        lib.dynn_pilot_decide.restype = _I
        lib.dynn_pilot_select.argtypes = [_V, _V, _I, _I, _V, _V, _V]
        lib.dynn_pilot_select.restype = _I
        lib.dynn_pilot_op.argtypes = [_V, _V]
        lib.dynn_pilot_op.restype = _I
        lib.dynn_pilot_alloc.argtypes = [_V, _I, _I, _D, _D, _I, _I, _I, _I]
        lib.dynn_pilot_alloc.restype = _I
        lib.dynn_pilot_finish.argtypes = [_V, _V, _I, _V, _V, _V, _D, _D, _I, _V, _V]
        lib.dynn_pilot_finish.restype = _I
        lib.dynn_heap_new.argtypes = []
        lib.dynn_heap_new.restype = _V
        lib.dynn_heap_free.argtypes = [_V]
        lib.dynn_heap_free.restype = None
        lib.dynn_heap_len.argtypes = [_V]
        lib.dynn_heap_len.restype = _I
        lib.dynn_heap_push.argtypes = [_V, _V, _V, _V, _I]
        lib.dynn_heap_push.restype = _I
        lib.dynn_heap_pop.argtypes = [_V, _V, _V]
        lib.dynn_heap_pop.restype = _I
        lib.dynn_heap_compact.argtypes = [_V, _V, _V]
        lib.dynn_heap_compact.restype = _I
        lib.dynn_heap_dump.argtypes = [_V, _V, _V, _V]
        lib.dynn_heap_dump.restype = _I
        lib.dynn_pilot_merge.argtypes = [_V, _V, _V, _V, _V, _V, _I, _I, _V, _V, _V, _V, _V]
        lib.dynn_pilot_merge.restype = _I
        self.path = path
        self.lib = lib
        self._check_layout()
        self._features = lib.dynn_pilot_features
        self._gather = lib.dynn_pilot_gather
        self._score = lib.dynn_pilot_score
        self._decide = lib.dynn_pilot_decide
        self._select = lib.dynn_pilot_select
        self._op = lib.dynn_pilot_op
        self._alloc = lib.dynn_pilot_alloc
        self._n_rows = ctypes.c_int64(0)
        self._n_rows_addr = ctypes.addressof(self._n_rows)

    def __reduce__(self) -> Any:  # unpickled: this process's kernel (None when it has none)
        return (kernel, ())

    def _check_layout(self) -> None:
        from .features import _HINT_MAX, _THRESH, CAND_FEATURES, CTX_FEATURES, KINDS

        out = np.zeros(128, dtype=np.int64)
        n = self.lib.dynn_pilot_layout(out.ctypes.data, len(out))
        c = {name: i for i, name in enumerate(CAND_FEATURES)}
        x = {name: i for i, name in enumerate(CTX_FEATURES)}
        cols = ["kind_param", "saved", "persistent", "log_bytes", "accessed_this_iter", "log_age", "log_count",
                "log_count_phase", "acc_forward", "born_this_iter", "log_since_birth", "born_forward", "last_forward",
                "producer_iv0", "has_producer", "consumer_iv0", "on_stack", "log_stack_depth", "stack_top", "matched",
                "prev_used_again", "log_prev_dist", "log_prev_count", "occ_has_next", "log_occ_remaining",
                "log_occ_gap", "age0", "ext_by_order", "log_stack_span", "log_stack_est", "stack_overdue", "prev_le8",
                "occ_le8", "stack_le8", "mirror", "mirror_linked", "mirror_final", "log_mirror_span", "log_mirror_est",
                "mirror_le8", "hinted", "hint_done", "log_hint_steps", "log_hint_est", "hint_le8", "hint_read"]
        ctx = ["phase_forward", "log_in_phase", "has_history", "anchored_progress", "progress", "log_since_anchor",
               "hist_fast_iv0", "hist_slow_iv0", "hist_slow_allocs", "log_candidates", "log_bwd_fwd_ratio", "hints"]
        want = [_ABI, _STATE_WORDS, _POINT_WORDS, _MODEL_WORDS, _POLICY_WORDS, _OP_WORDS, _MAX_H, _MAX_K, len(CAND_FEATURES),
                len(CTX_FEATURES),
                len(KINDS), len(_THRESH), *_THRESH, *(c[k] for k in cols), _HINT_MAX,
                *(x[k] for k in ctx)]
        got = out[:n].tolist()
        if got != want:
            i = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            raise RuntimeError(f"{self.path.name}: its layout differs from this dynn_runtime's at entry {i} "
                               f"({got[i] if i < len(got) else None} vs {want[i] if i < len(want) else None}): "
                               "built from another _native.c?")
        if (ctypes.sizeof(_Point) != 8 * _POINT_WORDS or ctypes.sizeof(_Policy) != 8 * _POLICY_WORDS
                or ctypes.sizeof(_Op) != 8 * _OP_WORDS):
            raise RuntimeError("pilot native: ctypes structure sizes differ from _native.c's")

    # ---- FeatureState ---------------------------------------------------------------------------
    @staticmethod
    def table(st: Any) -> StateTable:
        t = st._native_tab
        if t is None:
            t = st._native_tab = StateTable(st)
        return t

    def _settle(self, st: Any, t: StateTable, rc: int, call: Any) -> None:
        """Call again until the kernel has what it asked for: bigger tables (code -1), the pending
        externals' counterparts (code 1 + n, computed in Python: ``FeatureState._ext_rem``)."""
        rem = None
        while rc:
            if rc == -1:
                need = max(st.position, st._prev_len, st._cap, t.point.m) + 2
                if need <= t.ntab or st.position < 0:
                    raise RuntimeError(f"pilot native kernel: no decision point (position {st.position})")
                t.ensure(need)
            elif rc == -4:
                raise IndexError(f"pilot native kernel: a row is not a slot of this state (0..{st._cap - 1})")
            elif rc > 0 and rem is None:
                rem = np.ascontiguousarray(st._ext_rem(int(rc) - 1), dtype=np.int64)
                t.point.rem = rem.ctypes.data
                t.point.nrem = len(rem)
            else:
                raise RuntimeError(f"pilot native kernel failed (code {rc})")
            rc = call()
        t.point.rem = None
        t.point.nrem = -1

    def features(self, st: Any, idx: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``FeatureState.features`` (see there)."""
        from .features import CAND_FEATURES, CTX_FEATURES

        if st.position < 0:  # no operator yet this iteration: not a decision point; numpy handles it
            return st.features_numpy(idx)
        if idx is None:
            idx = st.active_slots()
            n_live = len(idx)
        else:
            n_live = -1  # counted by the kernel, as features_numpy does
        idx = np.ascontiguousarray(idx, dtype=np.int64)
        m = len(idx)
        X = np.empty((m, len(CAND_FEATURES)), dtype=np.float32)
        ctx = np.empty(len(CTX_FEATURES), dtype=np.float32)
        sids = np.empty(m, dtype=np.int64)
        t = self.table(st)
        t.set_point(st, idx.ctypes.data, m, n_live)
        f, sa, pa, xa, ca, ia = self._features, t.addr, t.point_addr, X.ctypes.data, ctx.ctypes.data, sids.ctypes.data
        rc = f(sa, pa, xa, ca, ia)
        if rc:
            self._settle(st, t, rc, lambda: f(sa, pa, xa, ca, ia))
        return sids, X, ctx

    # ---- PilotModel -------------------------------------------------------------------------------
    @staticmethod
    def supports(model: Any) -> bool:
        """Whether the kernel takes this model's shape (the feature widths of this version, hidden
        width <= 256, <= 64 outputs); otherwise it is scored in numpy."""
        from .features import CAND_FEATURES, CTX_FEATURES

        a = model.arrays
        try:
            nf, h = a["W1c"].shape
            return (nf == len(CAND_FEATURES) and a["W1x"].shape == (len(CTX_FEATURES), h) and 0 < h <= _MAX_H
                    and a["W2"].shape == (h, h) and a["W3"].shape[0] == h
                    and 0 < -(-a["W3"].shape[1] // _LANES) * _LANES <= _MAX_K)
        except (KeyError, ValueError, AttributeError):
            return False

    def model_table(self, model: Any) -> ModelTable:
        t = model.__dict__.get("_native")
        if t is None or t.fold is not model._folded():
            t = model.__dict__["_native"] = ModelTable(model)
        return t

    def score(self, model: Any, X: np.ndarray, ctx: np.ndarray, logreps: np.ndarray,
              quantile: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``PilotModel.score`` (see there), and the most probable bucket of every row."""
        mt = self.model_table(model)
        X = np.ascontiguousarray(X, dtype=np.float32)
        ctx = np.ascontiguousarray(ctx, dtype=np.float32)
        logreps = np.ascontiguousarray(logreps, dtype=np.float64)
        m = len(X)
        P = np.empty((m, mt.k), dtype=np.float32)
        eld = np.empty(m, dtype=np.float64)
        kq = np.empty(m, dtype=np.int64)
        amax = np.empty(m, dtype=np.int64)
        rc = self._score(mt.addr, X.ctypes.data, m, ctx.ctypes.data, logreps.ctypes.data, float(quantile),
                         P.ctypes.data, eld.ctypes.data, kq.ctypes.data, amax.ctypes.data)
        if rc:
            raise RuntimeError(f"pilot native kernel: model shape not supported (code {rc})")
        return P, eld, kq, amax

    def alloc(self, st: Any, s: int, kind: int, saved: float, log_bytes: float, announce: int, position: int,
              prev: int) -> None:
        """``FeatureState.alloc``'s writes for slot ``s`` (see ``dynn_pilot_alloc``)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        if self._alloc(t.addr, s, kind, saved, log_bytes, announce, position, st.phase, prev):
            raise IndexError(f"pilot native kernel: slot {s} is not a slot of this state (0..{st._cap - 1})")

    def op(self, st: Any, position: int, phase: int, iv: Any, ivk: Any, alloc_slots: list[int],
           alloc_prev: list[int], acc_slots: list[int]) -> tuple[list[int], list[int]]:
        """``FeatureState.op``'s array update for one operator (see ``dynn_pilot_op``): ``iv`` and
        ``ivk`` are ``(array, address)`` pairs. Returns the replayed next use of every access (-1:
        none, or left to the caller) and the indices of the accesses that need
        ``FeatureState._match_external`` (their replay is the caller's, after the match)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        n = max(len(alloc_slots), len(acc_slots))
        if n > t.op_n:
            t.op_room(max(n, 2 * t.op_n))
        o, b = t.op, t.op_bufs
        o.position, o.phase = position, phase
        o.iv, o.ivk = iv[1], ivk[1]
        o.n_alloc = na = len(alloc_slots)
        if na:
            b[0][:na] = alloc_slots
            b[1][:na] = alloc_prev
        o.n_acc = nc = len(acc_slots)
        b[2][:nc] = acc_slots
        o.frontier, o.stack_counter = st._frontier, st._stack_counter
        rc = self._op(t.addr, t.op_addr)
        if rc:
            raise IndexError(f"pilot native kernel: a slot or counterpart is out of range (code {rc})")
        st._frontier, st._stack_counter = o.frontier, o.stack_counter
        nm = o.n_match
        return b[3][:nc], (b[4][:nm] if nm else ())

    # ---- PilotPolicy ------------------------------------------------------------------------------
    def select(self, st: Any, pt: PolicyTable, position: int, full: bool, skip_addr: int | None = None
               ) -> tuple[int, int]:
        """The live storages, and how many of them the policy scores now (their slots go to the
        state table's ``rows``): every one when ``full``, else those touched since scored or due
        (``pt.due``, as long as the state's arrays); none whose byte is set in the uint8 array at
        ``skip_addr`` (as long as the state's arrays; None: skip none)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        n_live = self._select(t.addr, pt.due_addr, position, full, skip_addr, t.rows_addr, self._n_rows_addr)
        return n_live, self._n_rows.value

    def gather(self, st: Any, rows_addr: int, m: int, n_live: int, X_addr: int, ctx_addr: int, sids_addr: int,
               slots_addr: int) -> None:
        """Rule 11's hand-off (``dynn_pilot_gather``): the feature rows of ``m`` slots (at
        ``rows_addr``) into ``X``, ``ctx``, ``sids`` (preallocated, at those addresses; ``features``
        without the allocations) under ``n_live`` live storages, the slots into ``slots``, and their
        touched flags cleared."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        t.set_point(st, rows_addr, m, n_live)
        f, sa, pa = self._gather, t.addr, t.point_addr
        rc = f(sa, pa, X_addr, ctx_addr, sids_addr, slots_addr)
        if rc:
            self._settle(st, t, rc, lambda: f(sa, pa, X_addr, ctx_addr, sids_addr, slots_addr))

    def finish(self, mt: ModelTable, X: np.ndarray, m: int, ctx: np.ndarray, logreps: np.ndarray,
               lower: np.ndarray, quantile: float, recheck: float, position: int, score: np.ndarray,
               due: np.ndarray) -> None:
        """``dynn_pilot_finish``: the network and the policy's arithmetic for ``m`` gathered rows,
        touching nothing but its arguments (the worker thread's call; the GIL is released)."""
        rc = self.lib.dynn_pilot_finish(mt.addr, X.ctypes.data, m, ctx.ctypes.data, logreps.ctypes.data,
                                        lower.ctypes.data, quantile, recheck, position, score.ctypes.data,
                                        due.ctypes.data)
        if rc:
            raise RuntimeError(f"pilot native kernel: model shape not supported (code {rc})")

    def new_heap(self) -> NativeHeap:
        return NativeHeap(self)

    def merge(self, st: Any, heap: NativeHeap, score_addr: int, due_in_addr: int | None, sids_addr: int,
              slots_addr: int, m: int, due: np.ndarray, away: np.ndarray, out: tuple[np.ndarray, np.ndarray]
              ) -> tuple[int, int]:
        """A decision point's ``m`` rows (scores, sids, slots at those addresses) into ``heap``
        (``dynn_pilot_merge``); ``due_in_addr`` not None: results back from the worker (rule 11), so
        rows whose storage moved on are left out and the others' ``pred`` and ``due`` are written.
        The rows whose byte in ``away`` is set go to ``out`` (sids, scores; room for ``m``). Returns
        (rows merged, away rows)."""
        t = st._native_tab
        if t is None:
            t = self.table(st)
        n = self._n_rows
        na = self.lib.dynn_pilot_merge(t.addr, heap.h, score_addr, due_in_addr, sids_addr, slots_addr, m,
                                       due_in_addr is not None, due.ctypes.data, away.ctypes.data,
                                       out[0].ctypes.data, out[1].ctypes.data, self._n_rows_addr)
        if na < 0:
            raise MemoryError("pilot native: no memory for the eviction heap")
        return n.value, na

    def decide(self, st: Any, model: Any, pt: PolicyTable, rows_addr: int | None, m: int, n_live: int) -> None:
        """Score ``m`` rows (slots at ``rows_addr``; None: the state table's ``rows`` from
        :meth:`select`) under ``n_live`` live storages (-1: count them): predictions to the state's
        ``pred``, the policy's ``due`` and ``pt``'s outputs; ``touched`` cleared."""
        mt = model.__dict__.get("_native")
        if mt is None or mt.fold is not model.__dict__.get("_fold"):
            mt = self.model_table(model)
        t = st._native_tab
        if t is None:
            t = self.table(st)
        if pt.n < m:
            pt.grow(max(m, 2 * pt.n))
        t.set_point(st, t.rows_addr if rows_addr is None else rows_addr, m, n_live)
        f, sa, pa, ma, qa = self._decide, t.addr, t.point_addr, mt.addr, pt.addr
        rc = f(sa, pa, ma, qa)
        if rc:
            self._settle(st, t, rc, lambda: f(sa, pa, ma, qa))
