"""Where the memory manager's operator events come from.

Two sources, one contract (before a kernel reads a storage, the manager has made it resident; after
an operator, the manager can account what it created and let the policy decide):

``native``
    :mod:`dynn_runtime._C`'s ``Observer`` (``dynn_runtime/csrc/events.cpp``): a boxed fallback on a
    dispatch key of its own, included on the attaching thread (autograd's threads inherit it), sees
    each operator once as its caller called it (operators a kernel calls internally never reach it,
    at no cost). It keeps the storage table, the byte count and the operator log in C++, and calls
    Python only at decision points: an operator reads a storage that is away (a fault), the budget
    is exceeded after an operator, or every ``decide_every`` operators for a policy that acts ahead
    of need. The log is read in batches there.
``python``
    A ``TorchDispatchMode`` that runs the manager's Python for every ATen operator. The fallback
    where the extension was not built or cannot load, and the reference the native path is tested
    against.

``events="auto"`` (the default) takes ``native`` where the extension loads, else ``python`` with one
warning; ``DYNN_EVENTS=python`` in the environment makes ``auto`` take ``python``. The budget is
exact on ``python`` and soft on ``native`` (kept after operators: an operator larger than any before
it overshoots once; docs/runtime.md). ``dynn doctor`` and ``MemoryManager.stats()["event_source"]``
say which is in use and why.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["EVENT_SOURCES", "QUIET", "native_module", "native_reason", "no_mode", "resolve"]

EVENT_SOURCES = ("auto", "native", "python")

#: the interface version of dynn_runtime._C this package speaks (``ABI`` in csrc/events.cpp)
NATIVE_ABI = 27

_module: Any = None
_reason = ""
_loaded = False
_warned = False


def native_module() -> Any | None:
    """``dynn_runtime._C`` if it loads, else None (:func:`native_reason` says why)."""
    global _module, _reason, _loaded
    if not _loaded:
        _loaded = True
        try:
            import importlib

            _module = importlib.import_module("dynn_runtime._C")
            _reason = "the native event source (dynn_runtime._C) is built and loads"
            if getattr(_module, "ABI", None) != NATIVE_ABI:
                _reason = (f"dynn_runtime._C was built from other sources (ABI {getattr(_module, 'ABI', None)}, "
                           f"this package needs {NATIVE_ABI}); rebuild it: `pip install --no-build-isolation -e .`")
                _module = None
            elif problem := _module.problem():
                _module = None
                _reason = f"dynn_runtime._C loads but cannot start: {problem}"
        except ImportError as exc:
            _module = None
            _reason = (f"dynn_runtime._C did not load ({exc}); it is built at install against the installed torch "
                       "(`pip install --no-build-isolation -e .` with a C++ compiler)")
    return _module


def native_reason() -> str:
    native_module()
    return _reason


def resolve(requested: str) -> tuple[str, str]:
    """The event source to use for ``requested`` (``auto``, ``native``, ``python``) and why."""
    from ..errors import ConfigError

    if requested not in EVENT_SOURCES:
        raise ConfigError(f"runtime: events={requested!r} is not one of {', '.join(EVENT_SOURCES)}.")
    if requested == "python":
        return "python", "asked for (events='python')"
    forced = os.environ.get("DYNN_EVENTS", "").strip().lower()
    if requested == "auto" and forced == "python":
        return "python", "DYNN_EVENTS=python in the environment"
    if native_module() is not None:
        return "native", _reason
    if requested == "native":
        raise ConfigError(f"runtime: events='native' but {_reason}. Use events='python' (the dispatch path).")
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"dynn-runtime: {_reason}; using the Python event path (a fixed Python cost per operator).",
                      RuntimeWarning, stacklevel=3)
    return "python", _reason


#: the started native observer (one per process), suspended by :func:`no_mode`
QUIET: list[Any] = []


@contextlib.contextmanager
def no_mode() -> Iterator[None]:
    """Run the manager's own tensor work without re-entering its dispatch mode or being observed."""
    obs = QUIET[-1] if QUIET else None
    if obs is not None:
        obs.suspend()
    try:
        if torch._C._len_torch_dispatch_stack():
            with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
                yield
        else:
            with torch.no_grad():
                yield
    finally:
        if obs is not None:
            obs.resume()
