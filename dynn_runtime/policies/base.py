"""The one policy interface of dynn-runtime, served by the simulator and the live runtime alike.

A policy decides; a mechanism (the simulator's engine or the live memory manager) acts. The
mechanism owns where every tensor storage is (resident, in flight, on the host, dropped) and what
time it is; the policy sees that through a :class:`MemoryView` and answers three questions:

1. ``victims(need_bytes, exclude)``: memory is short by ``need_bytes``; which resident storages
   should leave, best first? (Never the ones in ``exclude``: the operator about to run needs them.)
   Returning nothing means "I have nothing to give": the mechanism reports out-of-memory.
2. ``after_op(position)``: at a decision point, anything to move proactively? A list of
   :class:`Action` (evict now, prefetch now).
3. ``evict_mode(sid)``: leave by ``"offload"`` (copy to host, fetch back later), ``"drop"`` (free,
   recompute on access) or ``"discard"`` (free, never needed again: only for policies that see the
   future; the mechanism verifies it).

Plus notifications (``on_access``, ``on_alloc``, ``on_free``, ``on_op``) for policies that keep
their own statistics or features, and ``begin_iteration`` where a policy that plans (replay,
oracle) does so. ``on_op(position, op)`` comes after every operator ran, before ``after_op``,
with the operator's :class:`~dynn_runtime.trace.format.Op` record (name, idiom vector, phase,
module, the storages it read, wrote and allocated): the simulator passes the trace's record, the
live runtime the one it builds as the operator runs, so a policy that learns from the operator
stream (pilot) sees the same thing in both. Storages alive when an iteration starts are announced
by ``on_alloc(sid, -1)``.

Policies register by name with :func:`register` and declare what they need (``requires``): a
trace of earlier iterations (``history``), knowledge of the future (``future``: only the oracle),
a trained pilot model (``pilot``), or a GPU (``gpu``). :func:`make_policy` checks those against
what the caller can provide and says what is missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from ..errors import PolicyError

__all__ = ["Action", "MemoryView", "Policy", "register", "make_policy", "POLICIES", "policy_names"]

CAPABILITIES = frozenset({"history", "future", "pilot", "gpu"})


@dataclass(frozen=True)
class Action:
    """A proactive move: ``kind`` is ``"evict"`` or ``"prefetch"``."""

    kind: Literal["evict", "prefetch"]
    sid: int


class MemoryView(Protocol):
    """What a policy may read about the mechanism's state. Positions are operator indices."""

    position: int
    phase: str

    def nbytes(self, sid: int) -> int: ...
    def kind(self, sid: int) -> str: ...
    def saved(self, sid: int) -> bool: ...
    def status(self, sid: int) -> str: ...
    def resident(self) -> Iterable[int]: ...
    def offloaded(self) -> Iterable[int]: ...
    def last_access(self, sid: int) -> int: ...
    def access_count(self, sid: int) -> int: ...
    def free_bytes(self) -> int: ...
    def recomputable(self, sid: int) -> bool: ...
    def recompute_cost(self, sid: int) -> float: ...
    def next_use(self, sid: int) -> int | None: ...
    def now(self) -> float:
        """Device-time clock in seconds: simulated time in the simulator, wall time in the live runtime
        (the pilot's cost governor spaces its decision points by it)."""
        ...


class Policy:
    """Base class: keeps everything resident and never moves anything (that is ``none``)."""

    name: ClassVar[str] = "base"
    #: capabilities this policy needs from the caller
    requires: ClassVar[frozenset[str]] = frozenset()
    #: copies happen on the compute stream (torch's save_on_cpu) or in the fault path (UVM): no overlap
    sync_copies: ClassVar[bool] = False
    #: page-granular demand migration (UVM); None for tensor-granular policies
    page_bytes: ClassVar[int | None] = None
    description: ClassVar[str] = ""

    def __init__(self, **options: Any) -> None:
        if options:
            raise PolicyError(f"policies: {self.name} takes no options, got {sorted(options)}.")
        self.view: MemoryView | None = None

    # -- life cycle --------------------------------------------------------------------------
    def attach(self, view: MemoryView) -> None:
        """Called once by the mechanism before the first iteration."""
        self.view = view

    def begin_iteration(self, index: int, context: dict | None = None) -> None:
        """An iteration starts; ``context`` carries what the mechanism knows (history, trace)."""

    # -- decisions ---------------------------------------------------------------------------
    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        return iter(())

    def after_op(self, position: int) -> list[Action]:
        return []

    def evict_mode(self, sid: int) -> Literal["offload", "drop", "discard"]:
        return "offload"

    # -- notifications -----------------------------------------------------------------------
    def on_access(self, sid: int, position: int) -> None:
        pass

    def on_alloc(self, sid: int, position: int) -> None:
        pass

    def on_free(self, sid: int) -> None:
        pass

    def on_op(self, position: int, op: Any) -> None:
        """Operator ``position`` ran; ``op`` is its :class:`~dynn_runtime.trace.format.Op` record."""


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name``."""
    bad = cls.requires - CAPABILITIES
    if bad:
        raise PolicyError(f"policies: {cls.__name__} requires unknown capabilities {sorted(bad)}; "
                          f"known: {sorted(CAPABILITIES)}.")
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return list(POLICIES)


def make_policy(name: str | Policy, provides: Iterable[str] = ("history", "future", "pilot"),
                **options: Any) -> Policy:
    """Instantiate a registered policy, checking that the caller ``provides`` what it ``requires``.

    The default is what the simulator provides. ``pilot`` means "can feed the pilot model the
    operator stream" (``on_op``); the pilot policy itself checks that its weights file exists."""
    if isinstance(name, Policy):
        return name
    cls = POLICIES.get(name)
    if cls is None:
        raise PolicyError(f"policies: unknown policy {name!r}; registered: {', '.join(POLICIES)}.")
    missing = cls.requires - set(provides)
    if missing:
        raise PolicyError(
            f"policies: {name} needs {', '.join(sorted(missing))}, which this caller does not provide "
            "(e.g. 'future' is only known to the simulator replaying a recorded trace; 'pilot' needs "
            "trained weights)."
        )
    return cls(**options)
