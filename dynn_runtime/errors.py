"""Error types of dynn-runtime.

Every message starts with the subsystem that raised it, says what was expected
and what was found, and how to fix it. Internal invariants go through
:func:`internal_assert`, whose failure asks for a bug report instead of
blaming the user.
"""

from __future__ import annotations

import traceback

__all__ = [
    "DynnError",
    "WorkloadError",
    "ConfigError",
    "TraceError",
    "BudgetError",
    "PolicyError",
    "PilotError",
    "NativeError",
    "HostMemoryError",
    "frames_of",
    "internal_assert",
    "where_raised",
]


class DynnError(RuntimeError):
    """Base class of every error dynn-runtime raises on purpose."""


class WorkloadError(DynnError):
    """A workload could not be found, loaded or run (unknown name, bad ``file.py:function``)."""


class ConfigError(DynnError, ValueError):
    """A configuration value is out of range or of the wrong type."""


class TraceError(DynnError):
    """A trace file is missing, truncated, corrupt, or of an unsupported schema."""


class BudgetError(DynnError):
    """A memory budget is malformed or too small for the workload."""


class PolicyError(DynnError):
    """A policy is unknown or its requirements are not met."""


class PilotError(DynnError):
    """A pilot-model weights file is corrupt or does not match this version."""


class NativeError(DynnError):
    """The patched-PyTorch build or its native hooks misbehaved."""


class HostMemoryError(DynnError, MemoryError):
    """The host (CPU) memory budget for offloaded tensors is exhausted."""


def internal_assert(cond: bool, msg: str) -> None:
    """Check an internal invariant; a failure is a bug in dynn-runtime, not in the caller's code."""
    if not cond:
        raise AssertionError(
            f"dynn-runtime internal error: {msg}. This is a bug; please report it with the command that "
            "triggered it and the output of `dynn doctor`."
        )




def _short_path(filename: str) -> str:
    """A source file as its package path (``dynn_runtime/runtime/moves.py``, ``torch/...``)."""
    path = filename.replace("\\", "/")
    cut = max(path.rfind(f"/{pkg}/") for pkg in ("dynn_runtime", "torch", "models", "tests", "tools"))
    return path[cut + 1:] if cut >= 0 else path.rsplit("/", 1)[-1]


def frames_of(exc: BaseException, frames: int = 4) -> str:
    """The innermost ``frames`` frames of ``exc``'s traceback, innermost first (``file:line function``,
    joined by ``<``); "" without a traceback."""
    tb = traceback.extract_tb(exc.__traceback__)[-frames:] if exc.__traceback__ is not None else []
    return " < ".join(f"{_short_path(f.filename)}:{f.lineno} {f.name}" for f in reversed(tb))


def where_raised(exc: BaseException, frames: int = 4) -> str:
    """Where ``exc`` came from, in one line: the innermost frames of its traceback, its notes (an error
    a native event source's handler kept carries its frames in one: the traceback itself is dropped),
    then each error it was raised from or during, by type, first line and frames. What a bench row
    keeps of a failure, so that a run's report says which path failed."""
    parts: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    link = ""
    while e is not None and id(e) not in seen and len(seen) < 4:
        seen.add(id(e))
        at = frames_of(e, frames)
        head = f"at {at}" if at else "no traceback"
        if link:
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            head = f"{link} {type(e).__name__}: {first} ({head})"
        notes = getattr(e, "__notes__", None) or ()  # set by add_note (3.11) or by hand (3.10)
        parts.append(head + "".join(f"; {n}" for n in notes))
        if e.__cause__ is not None:
            e, link = e.__cause__, "from"
        elif e.__context__ is not None and not e.__suppress_context__:
            e, link = e.__context__, "during"
        else:
            e = None
    return " | ".join(parts)
