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

Plus notifications (``on_access``, ``on_alloc``, ``on_free``, ``on_return``, ``on_op``, ``on_hint``, and
``on_operator``: one operator's allocations, accesses and ``on_op`` in one call; ``on_touches``: the
allocations, accesses and frees since the last decision point in one call, for a policy that reads
only recency, ``reads_operators = False``) for policies that keep
their own statistics or features, and ``begin_iteration(index, context)`` where a policy that plans (replay,
oracle, checkpoint) does so from an :class:`IterationContext` (the iterations before, the trace, and this
iteration's operators where the mechanism knows them ahead). ``on_op(position, op)`` comes after every operator ran, before ``after_op``,
with the operator's :class:`~dynn_runtime.trace.format.Op` record (name, idiom vector, phase,
module, the storages it read, wrote and allocated): the simulator passes the trace's record, the
live runtime the one it builds as the operator runs, so a policy that learns from the operator
stream (pilot) sees the same thing in both. Storages alive when an iteration starts are announced
by ``on_alloc(sid, -1)``. ``on_hint(hint)`` passes on what the workload said about its own near
future (:mod:`dynn_runtime.hints`), before the operator that follows it: the simulator from the
trace's hint records, the live runtime as the workload calls :func:`~dynn_runtime.hints.next_use`.

Policies register by name with :func:`register` and declare what they need (``requires``): a
trace of earlier iterations (``history``), knowledge of the future (``future``: only the oracle),
a trained pilot model (``pilot``), or a GPU (``gpu``). :func:`make_policy` checks those against
what the caller can provide and says what is missing. What a mechanism must do differently for a
policy is declared on its class too (``recomputes``, ``moves_nothing``, ``reads_operators``, ``sync_copies``,
``page_bytes``, ``reads_modules``, ``reads_saved``, ``reads_labels``, ``host_cost_as``): mechanisms read those, never a policy's name. A policy that lives outside this package
(the pilot) is named with :func:`register_lazy`: its module is imported on the first lookup of its
name, so this interface never imports its plug-ins.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, runtime_checkable

from ..errors import PolicyError, internal_assert

if TYPE_CHECKING:
    from ..trace.format import Iteration, Trace

__all__ = ["Action", "IterationContext", "MemoryView", "Policy", "PolicyRegistry", "SmallStorages", "register",
           "register_lazy", "tells_in_bulk", "OPERATOR", "TOUCH_ACCESS", "TOUCH_ALLOC", "TOUCH_FREE", "make_policy", "POLICIES", "policy_names", "policy_class"]

CAPABILITIES = frozenset({"history", "future", "pilot", "gpu"})


@dataclass(frozen=True)
class Action:
    """A proactive move: ``kind`` is ``"evict"`` or ``"prefetch"``."""

    kind: Literal["evict", "prefetch"]
    sid: int


@dataclass(frozen=True)
class IterationContext:
    """What the mechanism knows when an iteration starts (:meth:`Policy.begin_iteration`).

    The live runtime knows the iterations it has recorded (``history``, empty unless it records
    every operator) and, for the oracle, a recorded ``trace``; the simulator replaying a trace knows
    all three fields.
    """

    #: the iterations before this one, oldest first (each an :class:`~dynn_runtime.trace.format.Iteration`)
    history: Sequence[Iteration] = ()
    #: the trace those iterations belong to (its storage table), or None
    trace: Trace | None = None
    #: this iteration, operators included, where it is known before it runs (the simulator replaying
    #: a trace); None live, where the operators are seen only as they run
    iteration: Iteration | None = None
    #: whether the budget bound in the previous iteration (a victim search ran in it): the simulator,
    #: whose one iteration stands for one of a run under the same budget, says whether the previous
    #: iteration's peak was over it (False: no previous iteration); None live, where a policy that
    #: needs it saw for itself
    bound_before: bool | None = None


#: the context of an iteration nothing is known about (the live runtime before its first step)
NO_CONTEXT = IterationContext()


@runtime_checkable
class MemoryView(Protocol):
    """What a policy may read about the mechanism's state: every method a policy calls is listed here,
    and every mechanism's view (the simulator's :class:`~dynn_runtime.sim.engine.Simulator`, the live
    :class:`~dynn_runtime.runtime.manager.MemoryManager`) implements all of them.

    Positions are operator indices within the iteration; ``position`` is -1 before the first
    operator. ``phase`` is ``"forward"``, ``"backward"`` or ``"optimizer"``. Storages are named by
    their storage id (``sid``). A method whose answer needs knowledge a mechanism does not have says
    so by its documented neutral answer (None, False, infinity), never by being absent.
    """

    position: int
    phase: str
    #: in a victim search, the bytes under which the mechanism passes over what is offered (room
    #: made ahead of a need that may not come); 0 otherwise. A policy may leave such storages out.
    victim_floor: int

    def nbytes(self, sid: int) -> int:
        """Device bytes ``sid`` takes when resident."""
        ...

    def kind(self, sid: int) -> str:
        """``param``, ``buffer``, ``grad``, ``opt_state``, ``input``, ``activation`` or ``temp``."""
        ...

    def saved(self, sid: int) -> bool:
        """Autograd saved ``sid`` for the backward pass."""
        ...

    def status(self, sid: int) -> str:
        """A :class:`~dynn_runtime.residency.Status` value (``"resident"``, ``"host"``, ...)."""
        ...

    def resident(self) -> Iterable[int]:
        """The storages resident now (not in flight)."""
        ...

    def movable(self, sid: int) -> bool:
        """Whether the mechanism may move ``sid`` at all (the live runtime: not what the program
        holds for good, such as a step's outputs it keeps, nor storage it cannot resize). A victim
        search passes over one that is not: it would be refused. Neutral answer: True."""
        ...

    def evictable(self, sid: int) -> bool:
        """``status(sid) == "resident" and movable(sid)``: what a victim search asks of each
        candidate, in one call."""
        ...

    def offloaded(self) -> Iterable[int]:
        """The storages away from the device (on the host, or dropped for recompute)."""
        ...

    def last_access(self, sid: int) -> int:
        """Position of the last operator that read or wrote ``sid`` (-1: none yet)."""
        ...

    def last_access_time(self, sid: int) -> float:
        """:meth:`now` when ``sid`` was last accessed (0.0: never)."""
        ...

    def access_count(self, sid: int) -> int:
        """Operators that accessed ``sid`` so far."""
        ...

    def free_bytes(self) -> int:
        """Budget minus the device bytes held (in-flight copies included)."""
        ...

    def forward_done(self, sid: int) -> bool:
        """In the forward pass, and the forward pass will not read ``sid`` again (only autograd still
        holds it); False outside the forward pass."""
        ...

    def producer_of(self, sid: int) -> int | None:
        """Position of the operator that allocated ``sid`` this iteration; None where unknown (live)."""
        ...

    def recomputable(self, sid: int) -> bool:
        """``sid`` may be dropped and rebuilt by re-running its producer; False where the mechanism
        cannot rematerialise (live)."""
        ...

    def recompute_cost(self, sid: int) -> float:
        """Seconds to rebuild ``sid`` (its producer plus every dropped ancestor); infinity where it
        cannot be rebuilt."""
        ...

    def next_use(self, sid: int) -> int | None:
        """Position of the next access after the current one (a persistent storage's wraps to the
        next iteration), read from the future; None: never again, or the future is unknown (only
        policies that require ``future`` read it)."""
        ...

    def now(self) -> float:
        """Device-time clock in seconds: simulated time in the simulator, wall time in the live runtime
        (the pilot's cost governor spaces its decision points by it)."""
        ...

    def host_now(self) -> float | None:
        """The modelled clock of the thread that issues the operators, in seconds; None where the host
        is real (the live runtime): work a policy puts on another thread then takes real time, and a
        policy with a worker thread runs one instead of modelling it."""
        ...

    def device_slack(self) -> float | None:
        """Seconds of issued work the device has still to run before it would wait for the host; None
        where that is not known (no host timeline in the simulator, a CPU device live)."""
        ...

    def copy_seconds(self, nbytes: int, direction: Literal["d2h", "h2d"]) -> float | None:
        """Seconds a copy of ``nbytes`` takes on its copy engine once it starts (``"d2h"``: an offload,
        ``"h2d"``: a fetch): the link's fixed latency plus the bytes over its bandwidth; None where the
        link is not modelled (live)."""
        ...

    def link_backlog(self, direction: Literal["d2h", "h2d"]) -> float | None:
        """Seconds until the copy engine of ``direction`` has finished the copies queued on it now (0:
        idle); None where that is not known (live)."""
        ...


class Policy:
    """Base class: keeps everything resident and never moves anything (that is ``none``)."""

    name: ClassVar[str] = "base"
    #: capabilities this policy needs from the caller
    requires: ClassVar[frozenset[str]] = frozenset()
    #: copies happen on the compute stream (torch's save_on_cpu) or in the fault path (UVM): no overlap
    sync_copies: ClassVar[bool] = False
    #: reads which module an operator ran in (``Op.module``): the mechanism tracks modules for it
    reads_modules: ClassVar[bool] = False
    #: reads which storages autograd saved (``view.saved``): the mechanism hooks saved tensors for it
    reads_saved: ClassVar[bool] = False
    #: keeps a storage's kind and saved flag from its announcement and wants them as early as the
    #: mechanism can know them: the live runtime labels gradients as autograd accumulates them and
    #: calls :meth:`on_label` when a label changes after the announcement
    reads_labels: ClassVar[bool] = False
    #: page-granular demand migration (UVM); None for tensor-granular policies
    page_bytes: ClassVar[int | None] = None
    #: what this policy rebuilds instead of copying: ``"operators"`` (any dropped storage's producer,
    #: recursively: the simulator only, since live ATen kernels are not all bit-reproducible) or
    #: ``"blocks"`` (a repeated block's forward: live, ``torch.utils.checkpoint`` around each block)
    recomputes: ClassVar[Literal["operators", "blocks"] | None] = None
    #: never moves anything (PyTorch alone): the mechanism need not engage it even over budget
    moves_nothing: ClassVar[bool] = False
    #: reads each operator as it runs; False: only the order of its storages' allocations, accesses
    #: and frees, which a mechanism may then tell in bulk at its decision points (:meth:`on_touches`,
    #: :func:`tells_in_bulk`)
    reads_operators: ClassVar[bool] = True
    description: ClassVar[str] = ""
    #: the registered policy whose calibrated host cost (:mod:`dynn_runtime.sim.hostcost`) stands for
    #: this one's, where it would run the same bookkeeping in the live manager; None: its own name
    host_cost_as: ClassVar[str | None] = None
    #: host (CPU) seconds this policy has spent deciding so far, cumulative. The simulator's host
    #: timeline (:mod:`dynn_runtime.sim.engine`) puts it on the clock that issues the
    #: operators; a policy that does not account for itself reports 0.
    host_seconds: float = 0.0

    def __init__(self, **options: Any) -> None:
        if options:
            raise PolicyError(f"policies: {self.name} takes no options, got {sorted(options)}.")
        self.view: MemoryView | None = None

    # -- life cycle --------------------------------------------------------------------------
    def attach(self, view: MemoryView) -> None:
        """Called once by the mechanism before the first iteration."""
        self.view = view

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        """An iteration starts; ``context`` carries what the mechanism knows (history, trace)."""

    def idle_step(self) -> bool:
        """Asked right after :meth:`begin_iteration`: True if nothing this policy would do in the
        iteration matters until memory is first short (its first :meth:`victims` call): no
        ``after_op`` of it would act before then, and what its notifications build is read only
        by that call. The live runtime then reads the step's operator log only where it must (a
        decision the budget forces, a fault, a hook that needs the table) and tells the policy
        everything since the step began there, in order; a step that never needs one is read
        light (as a step of a policy that never acts ahead): the policy is told the deaths of
        the storages it knows and, at the next step's start, what the program holds, but not the
        step's operators, whose ``history`` entry is then empty. Default: False."""
        return False

    #: whether :meth:`idle_step` holds at the start of an iteration that follows one in which memory
    #: was never short: the simulator, which runs ``none`` in an iteration whose peak fits, charges
    #: such a policy's iteration without its own per-operator cost (``HostCost.policy_per_op_s``)
    idles_unbound: bool = False

    def close(self) -> None:
        """Called by the live manager at detach: work the policy runs on threads of its own (a
        background refit, a worker) completes and the threads end, so none outlives the run and
        competes with what runs next. A later ``attach`` may start them again."""

    def keep_order_in(self, observer: Any) -> bool:
        """The live runtime's native event source offers ``observer`` (``dynn_runtime._C.Observer``)
        to keep this policy's order of storages as the operators run, in C++; a policy that can
        hand its order over does so and returns True, and from then on the runtime tells it no
        per-operator touches (the observer applies them) until :meth:`release_order`. Default: False."""
        return False

    def release_order(self) -> None:
        """The observer that kept this policy's order goes (detach): the policy keeps its own again,
        empty (storage ids restart with the next observer)."""

    # -- decisions ---------------------------------------------------------------------------
    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        return iter(())

    def after_op(self, position: int) -> list[Action]:
        return []

    def evict_mode(self, sid: int) -> Literal["offload", "drop", "discard"]:
        return "offload"

    def recompute_group(self, sid: int) -> list[int] | None:
        """Positions to re-run, in order, to rebuild the dropped ``sid`` (a whole block, for
        checkpointing); None: its producer alone."""
        return None

    # -- notifications -----------------------------------------------------------------------
    def on_access(self, sid: int, position: int) -> None:
        pass

    def on_alloc(self, sid: int, position: int) -> None:
        pass

    def on_free(self, sid: int) -> None:
        pass

    def on_return(self, sid: int) -> None:
        """``sid`` is resident again after being away or in flight (a fetch landed, an offload was
        cancelled, a dropped storage was rebuilt), whether or not an access follows. Every mechanism
        calls it (:meth:`~dynn_runtime.residency.Residency.set_status`, on each transition into
        ``resident`` from anything but ``absent``), before any later victim search."""

    def on_op(self, position: int, op: Any) -> None:
        """Operator ``position`` ran; ``op`` is its :class:`~dynn_runtime.trace.format.Op` record."""

    def on_operator(self, position: int, op: Any, accessed: Sequence[int]) -> None:
        """All of one operator's notifications in one call: ``on_alloc(sid, position)`` for each
        of ``op.allocs``, ``on_access(sid, position)`` for each of ``accessed`` (the storages it
        read or wrote that the mechanism tracks, each once), then ``on_op(position, op)``.

        This default makes exactly those calls, in that order; a policy overrides it only to do
        the same work with less overhead (the pilot: the live runtime's native event source reads
        its operator log in batches and tells each operator through this method). An override
        must leave the policy in the state those calls would.
        """
        for sid in op.allocs:
            self.on_alloc(sid, position)
        for sid in accessed:
            self.on_access(sid, position)
        self.on_op(position, op)

    def on_hint(self, hint: Any) -> None:
        """The workload gave a :class:`~dynn_runtime.hints.Hint` before the next operator."""

    def on_label(self, sid: int) -> None:
        """``view.kind(sid)`` or ``view.saved(sid)`` says more than when ``sid`` was announced (live
        only, to a policy that ``reads_labels``: autograd saved it, it became a parameter's gradient or
        optimizer state). The simulator never calls it: a trace's labels are its storages' final ones
        from the start."""

    def on_touches(self, events: Sequence[int]) -> None:
        """Allocations, accesses and frees since the last decision point, in the order they happened,
        told at once (only to a policy that :func:`tells_in_bulk`): a flat sequence of quadruples
        ``kind, sid, position, nbytes`` where ``kind`` is :data:`TOUCH_ACCESS`, :data:`TOUCH_ALLOC` or
        :data:`TOUCH_FREE` (``nbytes``: the storage's size, which the view may no longer know for one
        freed since). The mechanism calls it before it asks for victims or actions, so the policy decides
        on the same knowledge as with the per-operator calls.

        This default makes those calls (``on_access``, ``on_alloc``, ``on_free``) in that order; an
        override must leave the policy in the state they would."""
        cls = type(self)
        if cls.on_access is Policy.on_access and cls.on_alloc is Policy.on_alloc and cls.on_free is Policy.on_free:
            return  # nobody listens (none)
        on_access, on_alloc, on_free = self.on_access, self.on_alloc, self.on_free
        for i in range(0, len(events), 4):
            kind, sid = events[i], events[i + 1]
            if kind == TOUCH_ACCESS:
                on_access(sid, events[i + 2])
            elif kind == TOUCH_ALLOC:
                on_alloc(sid, events[i + 2])
            else:
                on_free(sid)

    def operators_in_bulk(self) -> bool:
        """Whether the operators since the last decision point may be told now in one
        :meth:`on_operators` call instead of one :meth:`on_operator` and one :meth:`after_op` per
        operator: a policy answers True only when none of those ``after_op`` calls would return an
        action or change its state. Asked by the live runtime's native source before each batch."""
        return False

    def stops_in_bulk(self) -> bool:
        """Whether the operators since the last decision point may be told in one
        :meth:`on_operators` call with ``after`` where :meth:`operators_in_bulk` says False: the
        policy then calls ``after(position, op)`` right after telling each operator whose
        ``after_op`` may return an action or change its state, and at no other operator would
        ``after_op`` do either. Asked by the live runtime's native source before each batch that
        does not go in bulk. Default: False."""
        return False

    def on_operators(self, events: Sequence[tuple[Any, ...]], phase: str, after: Any = None) -> None:
        """The events of a batch (only after :meth:`operators_in_bulk` said True), in the order they
        happened: ``(OPERATOR, position, op, accessed)`` as :meth:`on_operator`'s arguments,
        ``(TOUCH_ALLOC, sid, position)`` a storage that appeared between operators (``on_alloc``),
        ``(TOUCH_FREE, sid)`` (``on_free``); ``phase`` is the view's phase before the first one (after an
        operator it is that operator's). The view's storages stay known until the call returns, the
        dead ones included; the view's ``phase`` and ``position`` are not those of each event.

        ``after`` (only after :meth:`stops_in_bulk` said True): the mechanism's
        ``after(position, op)``, which runs ``after_op(position)`` and applies its actions with the
        view as the per-operator calls show it there; the policy calls it right after telling each
        operator whose ``after_op`` may act or change its state, and only there.

        This default makes those calls in that order (no ``after_op`` without ``after``: the policy
        said it would not act; with it, after every operator); an override must leave the policy in
        the state they would."""
        for ev in events:
            if ev[0] == OPERATOR:
                self.on_operator(ev[1], ev[2], ev[3])
                if after is not None:
                    after(ev[1], ev[2])
            elif ev[0] == TOUCH_ALLOC:
                self.on_alloc(ev[1], ev[2])
            else:
                self.on_free(ev[1])


#: kinds of :meth:`Policy.on_touches` events, and of :meth:`Policy.on_operators`' (OPERATOR)
TOUCH_ACCESS, TOUCH_ALLOC, TOUCH_FREE = 0, 1, 2
OPERATOR = 3

#: the per-operator hooks a policy that :func:`tells_in_bulk` must leave as :class:`Policy` has them
_PER_OPERATOR = ("on_op", "on_operator", "after_op", "on_hint")


def tells_in_bulk(cls: type[Policy]) -> bool:
    """Whether a mechanism may tell ``cls`` its storages' allocations, accesses and frees in bulk
    (:meth:`Policy.on_touches`) instead of per operator: it declares ``reads_operators = False`` and
    overrides none of the per-operator hooks (a subclass that adds one reads operators again)."""
    return not cls.reads_operators and all(getattr(cls, m) is getattr(Policy, m) for m in _PER_OPERATOR)


class SmallStorages:
    """Which storages are too small to be worth moving first: those under ``fraction`` of the
    largest footprint (bytes of live storages) seen so far in the run when they were allocated.

    A copy costs a fixed latency (``copy_latency_s``, ~10 us: launch, event, allocator) plus its
    bytes over the link, so moving a storage of a few KiB costs the latency and frees nothing that
    matters. Victim policies offer them only after every larger candidate (a second tier, in the
    policy's own order), so they leave only when nothing larger can (the effect on the small grid:
    docs/benchmarks.md, "Small storages"). The footprint is the running maximum (seeded from the previous iteration where the
    context carries it: :meth:`begin_iteration`), so nothing depends on the budget. A storage is
    classed when it is allocated (or announced) and again at every access, never while it is away:
    one evicted as a large one is not taken for a small one until it is back.
    """

    __slots__ = ("fraction", "_bytes", "_small", "_live", "_peak")

    def __init__(self, fraction: float) -> None:
        self.fraction = float(fraction)
        self._bytes: dict[int, int] = {}
        self._small: set[int] = set()
        self._live = 0
        self._peak = 0

    @property
    def threshold(self) -> float:
        """Bytes under which a storage allocated now is small (0: none is)."""
        return self.fraction * self._peak

    def begin_iteration(self, context: IterationContext) -> None:
        """Seed the running maximum with the previous iteration's footprint when this policy has
        counted nothing yet and the context has it (``history`` and a ``trace`` with the storage
        table: the simulator, which replays one iteration with a fresh policy)."""
        if self._peak:
            return  # counted as it ran (a live policy): no walk over a growing trace every iteration
        history, trace = context.history, context.trace
        if history and trace is not None and trace.storages:
            self._peak = history[-1].footprint_peak(trace)

    def alloc(self, sid: int, nbytes: int) -> bool:
        """Count ``sid`` live (again, when it is announced again) and class it; returns whether it
        is small."""
        old = self._bytes.get(sid)
        if old is not None:
            self._live -= old
        self._bytes[sid] = nbytes
        self._live += nbytes
        if self._live > self._peak:
            self._peak = self._live
        return self.access(sid)

    def access(self, sid: int) -> bool:
        """Class ``sid`` again (it is resident: it was just used); returns whether it is small."""
        if self._bytes.get(sid, 0) < self.fraction * self._peak:
            self._small.add(sid)
            return True
        self._small.discard(sid)
        return False

    def free(self, sid: int) -> None:
        self._live -= self._bytes.pop(sid, 0)
        self._small.discard(sid)

    def small(self, sid: int) -> bool:
        return sid in self._small


class PolicyRegistry(MutableMapping[str, "type[Policy]"]):
    """Registered policies by name, in registration order.

    An entry is a class (:func:`register`) or the path of the module that registers it
    (:func:`register_lazy`). Looking a lazy name up imports that module, whose ``@register``
    replaces the entry in place (the order stays the registration order). Listing names,
    ``len`` and ``in`` import nothing. Assigning a class to a name registers it as :func:`register`
    does, without the capability check (tests patch the registry that way).
    """

    def __init__(self) -> None:
        self._entries: dict[str, type[Policy] | str] = {}

    def __getitem__(self, name: str) -> type[Policy]:
        entry = self._entries[name]
        if isinstance(entry, str):
            importlib.import_module(entry)
            entry = self._entries[name]
            internal_assert(not isinstance(entry, str),
                             f"policies: importing {entry} did not register a policy named {name!r}")
        return entry

    def __setitem__(self, name: str, cls: type[Policy]) -> None:
        self._entries[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def add_lazy(self, name: str, module: str) -> None:
        if not isinstance(self._entries.get(name), type):  # an entry already resolved stays
            self._entries[name] = module


POLICIES = PolicyRegistry()


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name``."""
    bad = cls.requires - CAPABILITIES
    if bad:
        raise PolicyError(f"policies: {cls.__name__} requires unknown capabilities {sorted(bad)}; "
                          f"known: {sorted(CAPABILITIES)}.")
    POLICIES[cls.name] = cls
    return cls


def register_lazy(name: str, module: str) -> None:
    """Make policy ``name`` available without importing ``module`` (dotted path) now: the first
    lookup of ``name`` in :data:`POLICIES` (or :func:`make_policy`) imports it, and its
    ``@register`` class takes the entry."""
    POLICIES.add_lazy(name, module)


def policy_names() -> list[str]:
    return list(POLICIES)


def policy_class(policy: str | Policy) -> type[Policy] | None:
    """The class of a registered policy name (importing a lazy one), or of a policy instance; None
    for an unknown name (:func:`make_policy` says which names exist)."""
    if isinstance(policy, Policy):
        return type(policy)
    return POLICIES.get(policy)


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
