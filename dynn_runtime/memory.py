"""Memory accounting in the vocabulary of ``torch.cuda.memory``, for CUDA and the CPU alike.

PyTorch has ``torch.cuda.max_memory_allocated`` but nothing like it for the CPU. On the CPU
:class:`LiveBytes` counts the bytes of every tensor *storage* that an operator creates inside
the region and that is still alive, through a ``TorchDispatchMode`` and a weakref finalizer on
each new storage (storages keep their Python object for as long as the C++ storage lives, so the
finalizer fires exactly when the last view of the storage dies). Views and in-place results
share their base's storage and are counted once.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "storage_nbytes", "state_bytes", "parse_size", "format_bytes"]


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage behind ``t`` (0 for tensors without real storage, e.g. meta)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


def state_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (parameters, gradients, optimizer state)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or key == 0:
            continue
        seen.add(key)
        total += storage_nbytes(t)
    return total


class _StorageWatch(TorchDispatchMode):
    """Counts live bytes of storages created under the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()

    def _died(self, key: int, nbytes: int) -> None:
        if key in self._ids:
            self._ids.discard(key)
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = id(st)
            if key in self._ids:
                continue
            n = st.nbytes()
            self._ids.add(key)
            self.live += n
            if self.live > self.peak:
                self.peak = self.live
            weakref.finalize(st, self._died, key, n)
        return out


class LiveBytes:
    """Context manager measuring the peak bytes allocated inside a region, above the level at entry.

    >>> with LiveBytes("cpu") as m:
    ...     x = torch.ones(1024)        # 4 KiB
    ...     y = x * 2                   # another 4 KiB
    ...     del x
    >>> m.peak_bytes
    8192
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._watch: _StorageWatch | None = None
        self._base = 0

    def __enter__(self) -> LiveBytes:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._watch = _StorageWatch()
            self._watch.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            assert self._watch is not None
            self._watch.__exit__(*exc)
            self.peak_bytes = self._watch.peak


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Parse ``"6GiB"``, ``"512MB"``, ``"1e9"`` or an int into bytes.

    >>> parse_size("6GiB"), parse_size("1.5kb"), parse_size(42)
    (6442450944, 1500, 42)
    """
    from .errors import ConfigError

    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"size: expected a non-negative number of bytes, got {text}.")
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise ConfigError(
            f"size: cannot read {text!r} as a size; expected a number with an optional unit "
            f"({', '.join(u for u in _UNITS if u)}), e.g. '6GiB' or '512MB'."
        )
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
