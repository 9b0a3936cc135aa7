"""The live memory manager: trains a model within a device-memory budget on stock PyTorch.

How it works (the stock-PyTorch counterpart of the paper's patched fetch hooks):

* A ``TorchDispatchMode`` sees every ATen operator (forward, backward, optimizer) below
  autograd. Before an operator runs, every storage it touches is made resident (an in-flight
  prefetch is waited for; an offloaded storage is fetched on demand, a *stall*; a dropped one is
  recomputed), and room is made for its outputs, whose sizes come from running the operator on
  meta tensors once per shape signature. After it runs, its new storages are accounted and the
  policy is told (``on_alloc``, ``on_access``, ``on_op``) and asked what to move (``after_op``).
* A storage leaves the device *in place*: its bytes are copied to host memory and the storage is
  resized to zero. Every tensor and view on it (a ``Parameter``, an optimizer state, an activation
  autograd saved) keeps its identity and metadata; on the next access the storage is resized back
  and the bytes are copied in. So parameters, gradients, optimizer state and saved activations
  all come under one mechanism, and what comes back is the same bytes.
* ``saved_tensors_hooks`` tell the manager which storages autograd saved for backward (policies
  and the pilot's features use it); the packed object is a detached alias, so no reference cycle
  is created and the storage is still managed in place.
* Storage frees are seen through a weakref callback on each storage's Python object (storages
  keep their Python object for as long as they live).
* The mode is active from :meth:`MemoryManager.attach` to :meth:`MemoryManager.detach`, inside
  and outside :meth:`MemoryManager.step`, so any access between steps (evaluation, logging)
  fetches what it needs. ``state_dict()`` of the model and the optimizer first brings everything
  back (pre hooks), so a checkpoint never captures an offloaded (empty) storage.

On CUDA (invariants, each one a classic source of silent corruption):

1. A device-to-host copy runs on the D2H stream after an event recorded on the compute stream at
   eviction time (the data must be produced first). The source block is ``record_stream``-ed on the
   D2H stream and the storage released at once: the caching allocator does not recycle the block
   before the copy stream has passed the copy, and the host does not wait.
2. A host-to-device copy into a freshly resized storage runs on the H2D stream after an event
   recorded on the compute stream (the allocation is ordered there) and after the event of the
   copy that filled the host buffer; the destination is ``record_stream``-ed on the H2D stream.
3. The compute stream never uses a fetched storage before ``wait_event`` on its H2D event
   (no device-wide synchronize on the hot path).
4. A host buffer goes back to the pool only once every copy touching it has completed
   (:meth:`HostPool.release` with the copy's event).
5. A storage written while its host copy exists makes that copy stale; it is never fetched again.

Each rule is one call of the copy engine (:mod:`~dynn_runtime.runtime.copies`). On the CPU the same
code runs with synchronous copies and a *logical* budget: device bytes are accounted, offloaded
storages are truly released (resized to zero) and restored; with ``copies=FakeAsyncCopies()`` the
asynchronous paths run there too, against a late and unordered fake GPU that poisons what a missing
wait would corrupt (tests/runtime/test_fake_async.py).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import hints
from ..errors import BudgetError, ConfigError, PolicyError, internal_assert
from ..hints import Hint
from ..memory import format_bytes, parse_size
from ..policies.base import Policy, make_policy
from ..residency import IN_FLIGHT, Record, Residency, Status
from ..trace.format import Iteration, Op, Trace, read_trace
from ..trace.modules import ModuleTracker
from ..trace.recorder import IGNORED_OPS, AutogradNodes
from .copies import CudaCopies, SyncCopies
from .devicemem import default_budget, device_baseline
from .hostpool import HostBuffer, HostPool
from .lists import ListSplitter

__all__ = ["MemoryManager", "StepStats"]

_PHASES = ("forward", "backward", "optimizer", "forward")
_C_TAGS = (1, 2, 3)  # dynn_runtime._C's LOG_OP, LOG_ALLOC, LOG_FREE (checked by a test)

_PERSISTENT = ("param", "buffer", "opt_state")
_MOVABLE_ALWAYS = frozenset({"param", "buffer", "opt_state", "grad"})
_RANK = {k: i for i, k in enumerate(("param", "buffer", "opt_state", "grad", "activation", "input", "temp"))}

RESIDENT, OFFLOADING, HOST, FETCHING, DROPPED, ABSENT = (
    Status.RESIDENT, Status.OFFLOADING, Status.HOST, Status.FETCHING, Status.DROPPED, Status.ABSENT)


class _S(Record):
    """What the manager knows about one device storage, beyond what the simulator keeps too."""

    __slots__ = ("key", "ref", "host", "event", "name", "movable", "born_step", "fetch_event", "pf", "born_pos",
                 "obs")

    def __init__(self, sid: int, key: int, ref: Any, nbytes: int, kind: str, movable: bool, step: int) -> None:
        super().__init__(sid, nbytes, kind)
        self.key = key
        self.pf = False  # prefetched, not used since
        self.ref = ref  # weakref to the UntypedStorage
        self.host: HostBuffer | None = None
        self.event: Any = None  # completion of the last copy into or out of ``host``
        self.fetch_event: Any = None  # completion of an in-flight H2D copy
        self.name = ""
        self.movable = movable
        self.born_step = step
        self.born_pos = 0
        self.obs: Any = None  # the native observer, which must see the next access while a copy is in flight


@dataclass
class StepStats:
    """What the manager did during one step (or, summed, over all of them)."""

    step: int = 0
    ops: int = 0
    peak_device_bytes: int = 0
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_fetched_on_demand: int = 0
    evictions: int = 0
    stall_seconds: float = 0.0
    copy_seconds: float = 0.0
    policy_seconds: float = 0.0
    recomputed_ops: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    budget_overshoot_bytes: int = 0
    wall_seconds: float = 0.0
    decision_points: int = 0
    host_syncs: int = 0
    """Times the host waited for the GPU inside the step (a copy event, a pinned buffer still in a
    copy); the one synchronization that closes a step is not counted."""
    managed: bool = True

    def add(self, other: StepStats) -> None:
        for k in ("ops", "bytes_offloaded", "bytes_prefetched", "bytes_fetched_on_demand", "evictions",
                  "stall_seconds", "copy_seconds", "policy_seconds", "recomputed_ops", "prefetch_hits",
                  "prefetch_misses", "wall_seconds", "decision_points", "host_syncs"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.peak_device_bytes = max(self.peak_device_bytes, other.peak_device_bytes)
        self.budget_overshoot_bytes = max(self.budget_overshoot_bytes, other.budget_overshoot_bytes)


def _storage_key(st: torch.UntypedStorage) -> int:
    return st._cdata


def _u8(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no dispatch: set_ on a fresh tensor)."""
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(st, 0, (st.nbytes(),), (1,))
    return t


class _Mode(TorchDispatchMode):
    def __init__(self, mm: MemoryManager) -> None:
        super().__init__()
        self.mm = mm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        mm = self.mm
        outer, mm._in_dispatch = mm._in_dispatch, True
        try:
            return mm._dispatch(func, args, kwargs or {})
        finally:
            mm._in_dispatch = outer


class MemoryManager(Residency):
    """Keep a training loop's device memory within ``budget`` by moving tensors as ``policy`` says.

    ``budget``: bytes (int), a size string (``"6GiB"``), or a float in (0, 1]: that fraction of the
    workload's unmanaged peak, which the manager measures during the first :meth:`step` (that step
    runs unmanaged, so it must fit on the device); left out, :func:`default_budget` (on CUDA the
    device's free memory less a headroom). ``policy``: a registered policy name (``none``,
    ``save_on_cpu``, ``lru``, ``replay``, ``oracle``, ``pilot``, ``checkpoint``, ``dtr``) or a
    :class:`~dynn_runtime.policies.base.Policy`. ``device``: where the model trains (default: CUDA
    if available, else the CPU, where the budget is logical).

    Options: ``host_budget`` (bytes or size string; the most host memory offloaded tensors may use;
    default unlimited), ``async_copies`` (False: every copy on the compute stream, synchronous),
    ``pin_memory`` (pinned host pool on CUDA), ``hard_cap`` (CUDA: also cap the caching allocator
    with ``torch.cuda.set_per_process_memory_fraction`` at the budget), ``trace`` (a recorded trace
    of the same inputs: the ``oracle`` policy reads the future from it), ``policy_options``,
    ``copies`` (a copy engine of :mod:`~dynn_runtime.runtime.copies`; tests pass ``FakeAsyncCopies``
    to run the asynchronous paths on the CPU), ``record_every_op`` (every operator in :meth:`timeline`
    and ``history`` on the native source too, at the cost of reading every step's log in full).
    """

    #: hard_cap: of the cap, what the managed storages leave to what the allocator holds beyond them
    #: (temporaries inside operators, rounding): (bytes, fraction of the cap), the larger applies,
    #: until a managed step has measured it (the allocator's peak over the storages' peak, x1.25).
    CAP_HEADROOM = (8 << 20, 0.25)
    #: operators the timeline keeps (the oldest go first); bounded so a long run's memory stays flat
    TIMELINE_ENTRIES = 1 << 20
    #: operator signatures whose meta-run output size the Python source remembers (oldest go first)
    META_CACHE_ENTRIES = 1 << 16

    def __init__(
        self,
        budget: int | str | float | None = None,
        policy: str | Policy = "lru",
        device: str | torch.device | None = None,
        *,
        host_budget: int | str | None = None,
        async_copies: bool = True,
        pin_memory: bool = True,
        hard_cap: bool = False,
        trace: str | Trace | None = None,
        policy_options: dict | None = None,
        history: int = 2,
        events: str = "auto",
        decide_every: int = 32,
        copies: Any = None,
        record_every_op: bool = False,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"runtime: cannot read the device {device!r}; use 'cuda', 'cuda:N' or 'cpu'.") from None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("runtime: device='cuda' but CUDA is not available here; use device='cpu' "
                                  "(a logical budget) or run on a machine with a GPU.")
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type != "cpu":
            raise ConfigError(f"runtime: device {self.device} is not supported; use 'cuda' or 'cpu'.")
        self._budget_spec = budget
        if budget is None:
            budget = default_budget(self.device)
        self.budget: int | None = self._parse_budget(budget)
        provides = {"history", "pilot"} | ({"gpu"} if self.device.type == "cuda" else set())
        self._trace: Trace | None = None
        if trace is not None:
            self._trace = trace if isinstance(trace, Trace) else read_trace(trace)
            provides.add("future")
        try:
            self.policy = make_policy(policy, provides=provides, **(policy_options or {}))
        except PolicyError as exc:
            if "future" in str(exc):
                raise PolicyError(
                    "runtime: the oracle policy reads the future from a recorded trace of the same inputs: pass "
                    "MemoryManager(..., trace=PATH) (record it with `dynn trace WORKLOAD -o PATH` using the same "
                    "seed and steps)."
                ) from None
            raise
        if self.policy.name == "dtr":
            raise PolicyError(
                "runtime: dtr is available in the simulator only. Rematerialising arbitrary ATen operators live "
                "would have to keep every evicted tensor's producer inputs alive and re-run kernels whose results "
                "are not bit-reproducible on CUDA (atomics), so it could not promise the same numbers. Use "
                "policy='checkpoint' (torch.utils.checkpoint per block) or an offloading policy (lru, pilot).")
        self.cuda = self.device.type == "cuda"
        if copies is None:
            copies = CudaCopies(self.device, pin_memory) if async_copies and self.cuda else SyncCopies()
        self._copies = copies
        self.async_copies = bool(copies.asynchronous)
        self.hard_cap = hard_cap
        self.cap_bytes: int | None = None  # hard_cap: the allocator's cap; the budget is what the storages get
        self.unmanaged_bytes = 0  # hard_cap: device bytes outside the managed storages grown since the cap was set
        self._outside0 = 0  # hard_cap: device bytes outside the managed storages when the cap was set
        self.cap_headroom_bytes: int | None = None  # hard_cap: measured by the last managed step
        self.pool = HostPool(parse_size(host_budget) if host_budget is not None else None,
                             pin=self.cuda and pin_memory)
        self.history_len = history
        self.history: list[Iteration] = []
        from .events import resolve

        self._events_requested = events
        resolve(events)  # an unknown name is an error now, not at attach
        self.decide_every = int(decide_every)
        #: every operator of every step in :meth:`timeline` and ``history``, also of a step the native
        #: source would read compacted (one that never needed a decision); the Python source always does
        self.record_every_op = bool(record_every_op)
        self._reset_state()

    # ---- configuration ----------------------------------------------------------------------
    @staticmethod
    def _parse_budget(budget: int | str | float) -> int | None:
        if isinstance(budget, bool):
            raise BudgetError("runtime: the budget must be bytes, a size string like '6GiB', or a fraction in (0, 1].")
        if isinstance(budget, float):
            if not 0 < budget <= 1:
                raise BudgetError(f"runtime: a fractional budget must be in (0, 1], got {budget}; pass bytes or a "
                                  "size string ('6GiB') for an absolute budget.")
            return None  # measured in the first step
        if isinstance(budget, str) and "/" in budget:
            num, _, den = budget.partition("/")
            try:
                frac = float(num) / float(den)
            except (ValueError, ZeroDivisionError):
                raise BudgetError(f"runtime: cannot read the budget {budget!r}; expected e.g. '1/8', '6GiB', 0.25.") from None
            return MemoryManager._parse_budget(frac)
        try:
            b = parse_size(budget)
        except ConfigError as exc:
            raise BudgetError(f"runtime: cannot read the budget {budget!r} ({exc}); expected bytes, a size string "
                              "like '6GiB', or a fraction in (0, 1].") from None
        if b <= 0:
            raise BudgetError(f"runtime: the budget must be positive, got {budget!r}.")
        return b

    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def budget_fraction(self) -> float | None:
        spec = self._budget_spec
        if isinstance(spec, float):
            return spec
        if isinstance(spec, str) and "/" in spec:
            num, _, den = spec.partition("/")
            return float(num) / float(den)
        return None

    @property
    def used(self) -> int:
        """Managed device bytes now (native: the observer's count, invariant 2 of events.cpp)."""
        obs = self._obs
        return obs.used if obs is not None else self._used

    @used.setter
    def used(self, value: int) -> None:
        internal_assert(self._obs is None, "runtime: the native path counts device bytes itself")
        self._used = value

    def _reset_state(self) -> None:
        self._obs: Any = None
        self._used = 0
        self._init_residency()
        self.event_source = "python"
        self.event_reason = ""
        self._names: list[str] = []
        self._idiom_by_name: dict[str, tuple[int, ...]] = {}
        self._saved_pending: set[int] = set()
        self._engaged = False
        self._pending_error: BaseException | None = None
        self._last_busy: set[int] = set()
        self._last_name = ""
        self.st: dict[int, _S] = {}
        self._key_sid: dict[int, int] = {}
        self._next_sid = 1
        self._dead: list[int] = []
        self.position = 0
        self.phase = "forward"
        self._in_step = False
        self._attached = False
        self._passthrough = False
        self._mode: _Mode | None = None
        self._step_index = 0
        self._cur = StepStats()
        self.steps: list[StepStats] = []
        self._measure_step = False
        self._ops: list[Op] = []
        self._nodes = AutogradNodes()
        self._frees: dict[int, list[int]] = {}
        self._pre: dict[int, list[int]] = {}
        self._hints: dict[int, list[Hint]] = {}
        self._meta_cache: dict[Any, int | None] = {}
        self._idiom_cache: dict[str, tuple[int, ...]] = {}
        self._handles: list[Any] = []
        self._lists: ListSplitter | None = None
        self._pinned: set[int] = set()  # pin(): storages the policy never moves
        self._streaming = False  # this state_dict() streams tensors out to host copies (_state_dict_pre)
        self._warned_streaming = False
        self._modules: ModuleTracker | None = None
        self._saved_hooks: Any = None
        self._in_optimizer = False
        self._seen_backward = False
        self._t0 = time.perf_counter()
        #: device_slack's mark: a CUDA event on the compute stream and the host time it was recorded
        self._slack_mark: tuple[Any, float] | None = None
        self._pending_stalls: list[tuple[Any, Any]] = []
        self._oracle_map: dict[int, int] = {}
        self._oracle_warned = False
        self._largest_op: tuple[int, str] = (0, "")
        self._budget_problem = ""
        self._in_dispatch = False
        self._checkpointed: list[nn.Module] = []
        self._peak_pos = 0
        self.measured_peak: int | None = None
        # (step, position, device bytes, phase), the last TIMELINE_ENTRIES operators
        self._timeline: collections.deque[tuple[int, int, int, str]] = collections.deque(maxlen=self.TIMELINE_ENTRIES)

    # ---- attach / detach --------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> MemoryManager:
        """Bring ``model``'s parameters and buffers, its gradients and ``optimizer``'s state, and every
        activation created while attached under management. Returns ``self``."""
        if self._attached:
            raise ConfigError("runtime: this MemoryManager is already attached; detach() it first.")
        if _is_compiled(model):
            warnings.warn(
                "dynn-runtime: the model (or a submodule) is compiled with torch.compile; the memory manager "
                "leaves compiled modules alone (no budget, no offloading) because compiled graphs bypass its "
                "operator hooks. Attach the uncompiled module to manage it.", RuntimeWarning, stacklevel=2)
            self._passthrough = True
            self._attached = True
            self.model, self.optimizer = model, optimizer
            return self
        self.model, self.optimizer = model, optimizer
        from .events import native_module, resolve

        self.event_source, self.event_reason = resolve(self._events_requested)
        if self.event_source == "native" and _QUIET:
            if self._events_requested == "native":
                raise ConfigError("runtime: another MemoryManager is attached with the native event source (one per "
                                  "process); detach it first, or pass events='auto' or 'python'.")
            self.event_source = "python"
            self.event_reason = "another MemoryManager holds the native event source (one per process)"
        if self.event_source == "native" and self._trace is not None:
            # The oracle aligns this run to a trace the recorder wrote through a dispatch mode, which
            # changes the backward's operators (autograd picks out-of-place variants under a mode).
            self.event_source = "python"
            self.event_reason = "the oracle aligns to a trace recorded through the Python dispatch path"
        if self.event_source == "native":
            self._obs = native_module().Observer(self.device.type, -1 if self.device.index is None
                                                 else self.device.index)
        for name, p in model.named_parameters():
            sid = self._track(p, "param", fresh=False)
            if sid is not None:
                self.st[sid].name = name
        for name, b in model.named_buffers():
            sid = self._track(b, "buffer", fresh=False)
            if sid is not None:
                self.st[sid].name = name
        if optimizer is not None:
            self._mark_optimizer_state()
            self._handles.append(optimizer.register_step_pre_hook(self._opt_pre))
            self._handles.append(optimizer.register_step_post_hook(self._opt_post))
            self._handles.append(optimizer.register_state_dict_pre_hook(lambda *a: self._state_dict_pre()))
            self._handles.append(optimizer.register_state_dict_post_hook(
                lambda opt, sd: self._state_dict_post(sd.get("state", {}))))
        self._handles.append(model.register_state_dict_pre_hook(lambda *a, **k: self._state_dict_pre()))
        self._handles.append(model.register_state_dict_post_hook(
            lambda module, sd, prefix, meta: self._state_dict_post(sd) if not prefix else None))
        if self.policy.name == "checkpoint":
            # Live, the checkpoint policy is torch.utils.checkpoint itself around every repeated
            # block: the blocks keep nothing for backward and re-run their forward when it needs it.
            self._checkpointed = _checkpoint_blocks(model)
        self._modules = ModuleTracker(model)
        self._modules.on_root_forward = self._root_forward
        pol = type(self.policy)
        if self._obs is None or pol.reads_modules:
            self._modules.install()
        else:  # the native path tracks modules only for a policy that reads them; the phase needs the root
            self._handles.append(model.register_forward_pre_hook(lambda *a: self._root_forward()))
        if self._obs is None or pol.reads_saved:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saved_hooks.__enter__()
        if self.hard_cap and self.cuda and self.budget is not None:
            self._apply_hard_cap()
        if self.pool.pin and self.pool.budget is not None:
            self.pool.reserve(self.pool.budget)  # pinned at attach, not during a step
        self._lists = ListSplitter(self._list_limit)
        self._lists.install()
        self.policy.attach(self)
        # operators between attach and the first step may need room too: the policy starts with
        # an empty plan (no history) until the first step begins
        self.policy.begin_iteration(-1, {"history": [], "trace": None, "runtime": self})
        if self._obs is not None:
            if self._modules is not None:
                self._modules.on_module = self._obs.set_module
            try:
                self._obs.start(self._native_fault, self._native_decide)
            except RuntimeError as exc:
                self._attached = True
                self.detach()
                raise ConfigError(f"runtime: {exc}") from None
            _QUIET.append(self._obs)
        else:
            self._mode = _Mode(self)
            self._mode.__enter__()
        self._attached = True
        return self

    def detach(self) -> None:
        """Stop managing: every offloaded or dropped storage comes back, hooks are removed, and the
        host pool is released. Tensors are where and what they were, bit for bit."""
        if not self._attached:
            return
        if self._passthrough:
            self._attached = False
            return
        try:
            self.restore_all()
        finally:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
                self._mode = None
            if self._obs is not None:
                self._obs.stop()
                if self._obs in _QUIET:
                    _QUIET.remove(self._obs)
            if self._saved_hooks is not None:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks = None
            if self._modules is not None:
                self._modules.remove()
            for h in self._handles:
                h.remove()
            self._handles = []
            if self._lists is not None:
                self._lists.remove()
            for m in self._checkpointed:
                del m.forward  # back to the class's forward
            self._checkpointed = []
            self._sync()
            for s in self.st.values():
                self._drop_host(s)
            self.pool.close()
            if self.hard_cap and self.cuda:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            for s in self.st.values():
                s.obs = None
            if self._obs is not None:
                self._used = self._obs.used
            self._obs = None
            self._attached = False

    def __enter__(self) -> MemoryManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()

    def restore_all(self) -> None:
        """Bring every managed storage back to the device (e.g. before saving a checkpoint)."""
        with _no_mode():
            self._copies.sync()  # copies in flight may hold the last reference to a storage: settle first
            self._drain()
            for s in list(self.st.values()):
                if s.status in (HOST, DROPPED, FETCHING) and s.ref() is not None:
                    self._fetch_now(s, budgeted=False)
            self._sync()

    def _state_dict_pre(self) -> None:
        """Before ``state_dict()``: everything comes back if it fits the budget (the state dict then
        holds the device tensors, as without the manager). If not, nothing is fetched here and
        :meth:`_state_dict_post` streams the tensors out to host copies instead."""
        away = sum(s.nbytes for s in self.st.values() if s.status in (HOST, DROPPED, FETCHING))
        self._streaming = self.budget is not None and not self._measure_step and self.used + away > self.budget
        if not self._streaming:
            self.restore_all()

    def _state_dict_post(self, sd: dict) -> None:
        """After ``state_dict()`` when the state does not fit the budget: every managed tensor becomes a
        CPU copy (from its host copy if it is away, else copied now), so code that reads the state dict
        without the dispatcher (``torch.save``) never meets an empty storage, within the budget."""
        if not self._streaming:
            return
        self._streaming = False
        if not self._warned_streaming:
            self._warned_streaming = True
            warnings.warn("dynn-runtime: the state does not fit the budget on the device, so state_dict() holds "
                          "CPU copies of the managed tensors (load_state_dict copies them back as usual).",
                          RuntimeWarning, stacklevel=4)
        with _no_mode():
            self._drain()
            stack = [sd]
            while stack:
                d = stack.pop()
                for k, v in d.items():
                    if isinstance(v, dict):
                        stack.append(v)
                    elif isinstance(v, torch.Tensor) and v.device == self.device:
                        sid = self._sid(v)
                        if sid is not None:
                            d[k] = self._host_copy(v, self.st[sid])

    def _host_copy(self, t: torch.Tensor, s: _S) -> torch.Tensor:
        """A CPU tensor with ``t``'s values, read from ``s``'s host copy if it is away."""
        if s.status == FETCHING:
            st = s.ref()
            if st is not None:
                self._finish_fetch(s, st)
        if s.status == RESIDENT:
            return t.detach().to("cpu", copy=True)
        internal_assert(s.host is not None and s.host_valid, f"runtime: storage {s.sid} is away without a host copy")
        if s.event is not None:
            s.event.synchronize()
        raw = s.host.tensor  # the storage's bytes; t is a view into them
        out = torch.empty(0, dtype=t.dtype)
        out.set_(raw.untyped_storage(), raw.storage_offset() // t.element_size() + t.storage_offset(),
                 t.shape, t.stride())
        return out.clone()

    def pin(self, *objs: torch.Tensor | nn.Module) -> int:
        """Keep these tensors, or every parameter and buffer of these modules, on the device for as
        long as the manager is attached: the policy never moves them (one that is away now comes back).
        For storages read outside the dispatcher, where no fault can bring them back: Triton or
        extension kernels, CUDA graphs. Returns the bytes pinned; :meth:`unpin` undoes it."""
        moved = 0
        with _no_mode():
            self._drain()
            for t in self._pin_targets(objs):
                sid = self._sid(t)
                if sid is None or sid in self._pinned:
                    continue
                s = self.st[sid]
                if s.status != RESIDENT:
                    self._fetch_now(s, budgeted=True, exclude={sid}, where="pin()")
                self._pinned.add(sid)
                moved += s.nbytes
        return moved

    def unpin(self, *objs: torch.Tensor | nn.Module) -> None:
        """The policy may move these again."""
        with _no_mode():
            for t in self._pin_targets(objs):
                sid = self._sid(t)
                if sid is not None:
                    self._pinned.discard(sid)

    @staticmethod
    def _pin_targets(objs: tuple) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for o in objs:
            if isinstance(o, nn.Module):
                out += [*o.parameters(), *o.buffers()]
            elif isinstance(o, torch.Tensor):
                out.append(o)
            else:
                raise ConfigError(f"runtime: pin() takes tensors and modules, got {type(o).__name__}.")
        return out

    def offload(self, *tensors: torch.Tensor) -> int:
        """Move the storages behind ``tensors`` off the device now (they come back on their next
        use). Returns the bytes that left. Tensors the manager does not manage are ignored."""
        moved = 0
        with _no_mode():
            self._drain()
            for t in tensors:
                sid = self._sid(t)
                if sid is not None and self._evict(self.st[sid]):
                    moved += self.st[sid].nbytes
        return moved

    # ---- steps ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator[MemoryManager]:
        """One training iteration: positions restart, the policy plans, statistics are kept."""
        if not self._attached:
            raise ConfigError("runtime: call attach(model, optimizer) before step().")
        if self._in_step:
            raise ConfigError("runtime: step() does not nest; end the current step first.")
        if self._passthrough:
            t0 = time.perf_counter()
            yield self
            self.steps.append(StepStats(step=len(self.steps), wall_seconds=time.perf_counter() - t0, managed=False))
            return
        try:
            self._begin_step()
        except BaseException:
            # e.g. a BudgetError making room at the start of the step: close the step it opened,
            # so the manager is between steps and usable; the first error is the one raised
            with contextlib.suppress(Exception):
                self._end_step(False)
            self._leave_step()
            raise
        ok = False
        measuring = self._measure_step
        try:
            yield self
            ok = True
        except torch.OutOfMemoryError as exc:
            if not measuring:
                raise
            raise BudgetError(
                f"runtime: a fractional budget ({self._budget_spec!r}) runs the first step unmanaged to measure the "
                "peak, and that step ran out of device memory: the model does not fit without the manager. Give "
                "the budget in bytes (budget='20GiB'), or leave it out (the device's free memory less a headroom)."
            ) from exc
        finally:
            try:
                self._end_step(ok)
            finally:
                self._leave_step()

    def _leave_step(self) -> None:
        """Between steps, whatever happened in the step (idempotent)."""
        self._in_step = False
        hints._stop(self)
        if self._obs is not None:
            self._obs.set_in_step(False)
            self._obs.set_phase(-1)
            self._obs.set_budget(0)

    def _begin_step(self) -> None:
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                "runtime: a managed step cannot be captured into a CUDA graph (torch.cuda.graph, "
                "torch.compile(mode='reduce-overhead')): replays run without the manager, so a storage it "
                "moved would be read empty. Capture outside mm.step(), and mm.pin() what the graph reads.")
        self._drain()
        obs = self._obs
        if obs is not None:
            obs.sweep()
            self._native_parse(in_step=False, light=True)  # between steps: the program's work, not the step's
        self._cur = StepStats(step=self._step_index)
        self._measure_step = self.budget is None
        self._peak_pos = 0
        self.position = 0
        self.phase = "forward"
        self._seen_backward = False
        self._in_optimizer = False
        self._ops = []
        self._frees = {}
        self._pre = {}
        self._hints: dict[int, list[Hint]] = {}
        self._oracle_map = {}
        self._in_step = True
        self._engaged = False
        if obs is not None:
            obs.set_in_step(True)
            obs.set_seen_backward(False)
            obs.set_phase(-1)
            measuring = self.budget is None
            obs.set_budget(0 if measuring else self.budget)
            obs.set_sweep_every(1 if measuring else 0)  # the measured peak must be exact
            acts = type(self.policy).after_op is not Policy.after_op
            obs.set_decide_every(self.decide_every if acts and not measuring else 0)
        self._t_step = time.perf_counter()
        self._pool_syncs0 = self.pool.syncs
        if self.cap_bytes is not None:
            torch.cuda.reset_peak_memory_stats(self.device)  # _measure_cap_headroom reads the step's peak
        self._cur.peak_device_bytes = self.used
        with _no_mode():
            ctx = {"history": list(self.history), "trace": self._trace, "runtime": self}
            self.policy.begin_iteration(self._step_index, ctx)
            for sid, s in list(self.st.items()):
                if s.status != ABSENT:
                    self.policy.on_alloc(sid, -1)
            self._map_oracle_persistent()
            if not self._measure_step and self.used > self.budget:
                # what the program holds between steps may exceed the budget (after the measuring
                # step, or a budget lowered by hand): get within it before the step starts
                self.make_room(0, set(), "the start of the step")
            self._cur.peak_device_bytes = self.used
            if obs is not None:
                obs.reset_peak()
                self._decisions0 = obs.decisions
        hints._listen(self)

    def _end_step(self, ok: bool) -> None:
        hints._stop(self)
        obs = self._obs
        error = None
        if obs is not None:
            with _no_mode():
                obs.sweep()
                self._native_parse(in_step=True, light=not (self._engaged or self._measure_step or self.record_every_op))
            obs.set_in_step(False)
            obs.set_phase(-1)
            obs.set_budget(0)
            obs.set_decide_every(0)
            obs.set_sweep_every(0)
            if obs.peak > self._cur.peak_device_bytes:
                self._cur.peak_device_bytes = obs.peak
                self._peak_pos = obs.peak_position
            self._cur.decision_points = obs.decisions - self._decisions0
            if self.budget is not None and not self._measure_step:
                self._cur.budget_overshoot_bytes = max(self._cur.budget_overshoot_bytes, obs.peak - self.budget)
            error, self._pending_error = self._pending_error, None  # raised once the step is closed
        self._in_step = False
        self._cur.host_syncs += self.pool.syncs - self._pool_syncs0
        with _no_mode():
            self._copies.sync()  # the step's copies complete before its storages are judged
            self._drain()
            # What the step made and the program still holds (the loss, outputs it keeps) goes back
            # on the device, and stays put from now on: it is the program's now, not the step's.
            for s in list(self.st.values()):
                if s.kind not in _MOVABLE_ALWAYS:
                    if s.status != RESIDENT:
                        try:
                            self._fetch_now(s, budgeted=True, exclude={s.sid})
                        except BudgetError:
                            self._fetch_now(s, budgeted=False)  # over budget (an overshoot) beats losing it
                    s.movable = False
            self._sync()
            self._resolve_stalls()
        cur = self._cur
        cur.ops = self._obs.position if self._obs is not None else self.position
        cur.wall_seconds = time.perf_counter() - self._t_step
        if ok:
            self.history.append(Iteration(index=self._step_index, ops=self._ops, frees=self._frees,
                                          pre_allocs=self._pre, hints=self._hints))
            del self.history[:-self.history_len]
        self._ops = []
        if self._measure_step and ok:
            frac = self.budget_fraction
            # State the step created after its peak and keeps (the optimizer's first moments) is
            # there at every later step's peak: count it, or "1/8" would really mean less.
            late = sum(x.nbytes for x in self.st.values()
                       if x.born_step == self._step_index and x.born_pos > self._peak_pos and x.kind in _PERSISTENT)
            self.measured_peak = cur.peak_device_bytes + late
            self.budget = max(1, int(self.measured_peak * frac))
            cur.managed = False
            if self._largest_op[0] > self.budget:
                need, where = self._largest_op
                self._budget_problem = (
                    f"runtime: a budget of {frac:g} of the measured peak ({format_bytes(self.budget)}) is smaller "
                    f"than what one operator needs: {where} touches {format_bytes(need)} at once. Raise the "
                    f"budget to at least {need / max(self.measured_peak, 1):.3f} (or {format_bytes(need)}).")
            if self.hard_cap and self.cuda:
                self._apply_hard_cap()
        elif self.hard_cap and self.cuda and self.cap_bytes is not None:
            if ok:
                self._measure_cap_headroom()
            self._fit_to_cap()  # what the step left outside the storages (workspaces it created) counts next step
        self._measure_step = False
        self.steps.append(cur)
        self._step_index += 1
        if self._budget_problem:
            msg, self._budget_problem = self._budget_problem, ""
            raise BudgetError(msg)
        if error is not None:
            raise error

    def stats(self) -> dict[str, Any]:
        """Totals over the managed steps (a fractional budget's measuring step is in ``per_step`` only)
        and the per-step records (``torch.cuda.memory`` vocabulary)."""
        total = StepStats(step=-1)
        for s in self.steps:
            if s.managed:  # a measuring step ran unmanaged: its peak is the measurement, not a result
                total.add(s)
        out = {k: v for k, v in total.__dict__.items() if k not in ("step", "managed")}
        out.update(
            steps=len(self.steps),
            measuring_steps=sum(1 for s in self.steps if not s.managed),
            budget_bytes=self.budget,
            hard_cap_bytes=self.cap_bytes,
            unmanaged_bytes=self.unmanaged_bytes if self.cap_bytes is not None else None,
            outside_at_cap_bytes=self._outside0 if self.cap_bytes is not None else None,
            cap_headroom_bytes=self.cap_headroom_bytes,
            measured_peak_bytes=self.measured_peak,
            policy=self.policy.name,
            device=str(self.device),
            device_bytes_now=self.used,
            host_bytes_in_use=self.pool.in_use,
            host_bytes_peak=self.pool.peak_in_use,
            host_pinned=self.pool.pinned,
            managed_storages=len(self.st),
            event_source=self.event_source,
            largest_allocation_bytes=self._obs.max_made if self._obs is not None else None,
            event_source_reason=self.event_reason,
            list_calls_split=self._lists.calls_split if self._lists is not None else 0,
            per_step=[dict(s.__dict__) for s in self.steps],
        )
        if self.cuda:
            out["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return out

    def timeline(self) -> list[tuple[int, int, int, str]]:
        """(step, operator position, managed device bytes after it, phase) for the last
        ``TIMELINE_ENTRIES`` operators."""
        return list(self._timeline)

    # ---- hooks ------------------------------------------------------------------------------
    def _root_forward(self) -> None:
        if not torch._C._current_autograd_node():
            self.phase = "forward"
            self._seen_backward = False
            if self._obs is not None:
                self._obs.set_seen_backward(False)
                self._raise_pending()  # a decision point's error surfaces at the next forward

    def _opt_pre(self, *args: Any) -> None:
        self._in_optimizer = True
        if self._obs is not None:
            self._obs.set_phase(2)
        self._mark_kind_of_grads()

    def _opt_post(self, *args: Any) -> None:
        self._mark_optimizer_state()
        self._in_optimizer = False
        if self._obs is not None:
            self._obs.set_phase(-1)

    def _mark_kind_of_grads(self) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                self._track(p.grad, "grad", fresh=False)

    def _mark_optimizer_state(self) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self._track(v, "opt_state", fresh=False)

    # ---- workload hints (dynn_runtime.hints): to the policy, before the next operator ----------
    def _hint_step(self) -> None:
        self._give_hint(Hint("step"))

    def _hint_use(self, tensors: list[torch.Tensor], steps: int | None) -> None:
        sids: list[int] = []
        for t in tensors:
            sid = self._track(t, "input", fresh=False)
            if sid is not None and sid not in sids:
                sids.append(sid)
        if sids:
            self._give_hint(Hint("use", tuple(sids), steps))

    def _give_hint(self, h: Hint) -> None:
        self._hints.setdefault(self.position, []).append(h)
        if type(self.policy).on_hint is not Policy.on_hint:  # a policy that reads hints
            with _no_mode():
                self.policy.on_hint(h)

    def _pack(self, t: torch.Tensor) -> Any:
        if self._obs is not None:
            sid = self._obs.sid_of(t) if type(t) in (torch.Tensor, nn.Parameter) else -1
            sid = None if sid < 0 else sid
        else:
            sid = self._sid(t)
        if sid is not None and sid not in self.st:
            self._saved_pending.add(sid)  # born since the log was last read
        elif sid is not None:
            s = self.st[sid]
            s.saved = True
            if s.kind in ("temp", "input"):
                s.kind = "activation"
        return t.detach()

    # ---- storages ---------------------------------------------------------------------------
    def _sid(self, t: torch.Tensor) -> int | None:
        obs = self._obs
        if obs is not None:
            if type(t) not in (torch.Tensor, nn.Parameter):
                return None
            sid = obs.sid_of(t)
            if sid < 0:
                return None
            if sid not in self.st:
                self._native_parse(in_step=self._in_step)  # born since the log was last read
            return sid if sid in self.st else None
        if t.device != self.device or t.layout != torch.strided or type(t) not in (torch.Tensor, nn.Parameter):
            return None
        return self._key_sid.get(_storage_key(t.untyped_storage()))

    def _track(self, t: torch.Tensor, kind: str, fresh: bool) -> int | None:
        """The manager's id of ``t``'s storage, registering it if new (``kind`` only ever gets more specific)."""
        if not isinstance(t, torch.Tensor) or t.device != self.device or t.layout != torch.strided:
            return None
        if type(t) not in (torch.Tensor, nn.Parameter):
            return None  # tensor subclasses (DTensor, fake, ...) manage their own storage
        if self._obs is not None:
            return self._track_native(t, kind)
        if self._dead:  # a dead storage's address may be reused by a new one: forget the dead first
            self._drain()
        st = t.untyped_storage()
        key = _storage_key(st)
        sid = self._key_sid.get(key)
        if sid is not None:
            s = self.st[sid]
            if _RANK[kind] < _RANK[s.kind]:
                s.kind = kind
                if kind in _MOVABLE_ALWAYS and not s.movable:
                    s.movable = st.resizable()
            return sid
        n = st.nbytes()
        if n == 0:
            return None
        if not fresh and self.budget is not None and not self._measure_step and self.used + n > self.budget:
            # A storage made where the manager could not see it (``torch.tensor``, a C++ kernel
            # outside the dispatcher): make room before accounting it, so the budget still holds.
            try:
                if self._in_dispatch:
                    self.make_room(n, set(), "a storage created outside the dispatcher")
                else:
                    with _no_mode():
                        self.make_room(n, set(), "a storage created outside the dispatcher")
            except BudgetError:
                pass  # counted as an overshoot by _note_peak
        sid = self._next_sid
        self._next_sid += 1
        ref = weakref.ref(st, self._make_dead_cb(sid))
        # Only what the manager owns moves: model state, and what a step creates. A tensor the
        # program makes between steps (a batch, a metric) is accounted but stays put, so code
        # that reads raw memory outside the dispatcher (``.numpy()``, printing) never meets an
        # offloaded storage.
        movable = st.resizable() and (self._in_step or kind in _MOVABLE_ALWAYS)
        s = _S(sid, key, ref, n, kind, movable=movable, step=self._step_index)
        s.born_pos = self.position
        self.st[sid] = s
        self._key_sid[key] = sid
        self.set_status(s, RESIDENT)
        if self._in_step:
            if fresh:
                pass  # the caller announces it with its operator position
            else:
                self._pre.setdefault(self.position, []).append(sid)
                with _no_mode():
                    self.policy.on_alloc(sid, -1 if self.position == 0 else self.position)
        self._note_peak()
        return sid

    def _track_native(self, t: torch.Tensor, kind: str) -> int | None:
        sid = self._obs.track(t)
        if sid < 0:
            return None
        s = self.st.get(sid)
        if s is None:
            s = self._new_native(sid, kind, self._obs.nbytes(sid), t.untyped_storage().resizable()
                                 and (self._in_step or kind in _MOVABLE_ALWAYS), self._obs.position)
        elif _RANK[kind] < _RANK[s.kind]:
            s.kind = kind
            if kind in _MOVABLE_ALWAYS and not s.movable:
                s.movable = t.untyped_storage().resizable()
        return sid

    def _new_native(self, sid: int, kind: str, nbytes: int, movable: bool, born: int) -> _S:
        obs = self._obs
        s = _S(sid, sid, functools.partial(obs.storage, sid), nbytes, kind, movable=movable, step=self._step_index)
        s.obs = obs
        self.set_status(s, RESIDENT)  # the observer counted its bytes already (_account)
        s.born_pos = born
        if sid in self._saved_pending:
            self._saved_pending.discard(sid)
            s.saved = True
            if kind in ("temp", "input"):
                s.kind = "activation"
        self.st[sid] = s
        return s

    def _make_dead_cb(self, sid: int) -> Any:
        dead = self._dead

        def cb(_ref: Any) -> None:  # may run in any thread, at any time: only record it
            dead.append(sid)

        return cb

    def _drain(self) -> None:
        """Account the storages the program freed since the last look."""
        while self._dead:
            sid = self._dead.pop()
            s = self.st.pop(sid, None)
            if s is None:
                continue
            if self._key_sid.get(s.key) == sid:
                del self._key_sid[s.key]
            if s.status is not ABSENT:
                self.set_status(s, ABSENT)
            self._drop_host(s)
            if self._in_step:
                self._frees.setdefault(self.position, []).append(sid)
            self._pinned.discard(sid)
            self.policy.on_free(sid)

    def _drop_host(self, s: _S) -> None:
        if s.host is not None:
            self.pool.release(s.host, s.event)
            s.host = None
        s.host_valid = False

    def _note_peak(self) -> None:
        cur = self._cur
        if self.used > cur.peak_device_bytes:
            cur.peak_device_bytes = self.used
            self._peak_pos = self.position
        if self.budget is not None and not self._measure_step and self.used > self.budget:
            cur.budget_overshoot_bytes = max(cur.budget_overshoot_bytes, self.used - self.budget)

    # ---- MemoryView (what policies read; the rest is Residency's) ------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def device_slack(self) -> float | None:
        """Roughly how many seconds of issued work the GPU has still to run (the pilot's rule 12
        decides on this thread when that hides the decision), or None on a CPU device, where the
        operators run on this thread. Each call records an event on the compute stream and queries
        the previous call's: still pending, the GPU has not reached what was issued then, and the
        time since is the estimate; done, 0 (the GPU is keeping up with this thread)."""
        if self.device.type != "cuda":
            return None
        now = time.perf_counter()
        mark, self._slack_mark = self._slack_mark, None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._slack_mark = (ev, now)
        if mark is None or mark[0].query():
            return 0.0
        return now - mark[1]

    def forward_done(self, sid: int) -> bool:
        """Only autograd (and the manager) still refer to ``sid``: the forward pass is done with it."""
        s = self.st.get(sid)
        if s is None or self.phase != "forward":
            return False
        st = s.ref()
        if st is None:
            return False
        # one count for the preserved storage object, one for the detached alias autograd holds
        return torch._C._storage_Use_Count(st._cdata) <= 2

    def recomputable(self, sid: int) -> bool:
        return False

    def recompute_cost(self, sid: int) -> float:
        return float("inf")

    def producer_of(self, sid: int) -> int | None:
        return None

    def next_use(self, sid: int) -> int | None:
        """The oracle's answer, from the recorded trace of the same inputs (None without one)."""
        tr = self._trace
        if tr is None:
            return None
        tsid = self._oracle_map.get(sid)
        if tsid is None:
            return self.position + 1  # unknown to the trace: keep it
        acc = self._trace_acc.get(tsid)
        if not acc:
            return None
        k = bisect.bisect_right(acc, self.position)
        if k < len(acc):
            return acc[k]
        if self.st[sid].kind in _PERSISTENT:
            return len(self._trace_it.ops) + acc[0]
        return None

    # ---- oracle: matching this run to the recorded trace --------------------------------------
    def _map_oracle_persistent(self) -> None:
        tr = self._trace
        if tr is None:
            return
        if self._step_index >= len(tr.iterations):
            raise PolicyError(f"runtime: the oracle's trace has {len(tr.iterations)} iteration(s) but this is step "
                              f"{self._step_index}; record the trace with at least as many steps.")
        it = tr.iterations[self._step_index]
        self._trace_it = it
        self._trace_acc: dict[int, list[int]] = {}
        for j, op in enumerate(it.ops):
            for x in set(op.inputs) | set(op.outputs) | set(op.writes):
                self._trace_acc.setdefault(x, []).append(j)
        by_name = {s.name: s.sid for s in tr.storages.values() if s.name and s.kind in ("param", "buffer")}
        if not hasattr(self, "_persist_map"):
            self._persist_map: dict[int, int] = {}
        for sid, s in self.st.items():
            if s.name in by_name:
                self._persist_map[sid] = by_name[s.name]
        self._oracle_map = dict(self._persist_map)

    def _map_oracle_op(self, j: int, ins: list[int], allocs: list[int], name: str) -> None:
        it = self._trace_it
        if j >= len(it.ops) or it.ops[j].name != name:
            if not self._oracle_warned:
                self._oracle_warned = True
                got = it.ops[j].name if j < len(it.ops) else "the end of the iteration"
                warnings.warn(f"dynn-runtime: the oracle's trace diverges from this run at operator {j} ({name} here, "
                              f"{got} in the trace): it was not recorded from the same inputs; its predictions are "
                              "wrong from here on (results stay correct).", RuntimeWarning, stacklevel=4)
            return
        top = it.ops[j]
        for k, sid in enumerate(allocs):
            if k < len(top.allocs):
                self._oracle_map[sid] = top.allocs[k]
                if self.st[sid].kind in _PERSISTENT or self._in_optimizer:
                    self._persist_map[sid] = top.allocs[k]
        for k, sid in enumerate(ins):
            if sid not in self._oracle_map and k < len(top.inputs):
                self._oracle_map[sid] = top.inputs[k]
                if self.st[sid].kind in _PERSISTENT:
                    self._persist_map[sid] = top.inputs[k]

    # ---- moving storages ----------------------------------------------------------------------
    def _evict(self, s: _S) -> bool:
        """Move a resident storage off the device. False if it cannot leave."""
        if s.status != RESIDENT or not s.movable or s.sid in self._pinned:
            return False
        st = s.ref()
        if st is None:
            return False
        obs = self._obs
        if obs is not None:
            if not st.resizable():
                s.movable = False
                return False
            if s.host_valid and not obs.host_valid(s.sid):  # written since its host copy was made
                self._drop_host(s)
        mode = self.policy.evict_mode(s.sid)
        if mode == "drop":
            return False  # recompute at runtime: not supported; the policy must offload
        # "discard" (the oracle's never-used-again) is never honoured live: the trace could be wrong,
        # and a wrong discard loses data. Offload instead.
        t0 = time.perf_counter()
        if s.host_valid and s.host is not None:
            self._release_device(s, st)
            self.set_status(s, HOST)
        else:
            if s.host is None or s.host.nbytes != s.nbytes:
                self._drop_host(s)
                s.host = self.pool.alloc(s.nbytes)
            src = _u8(st, self.device)
            s.event = self._copies.to_host(src, s.host.tensor)
            del src
            s.host_valid = True
            if obs is not None:
                obs.set_host_valid(s.sid, True)
            # Released now, stream-ordered (copies.py): the block is not reused before the copy
            # has read it, so the host never waits for an eviction.
            self._release_device(s, st)
            self.set_status(s, HOST)
            self._cur.bytes_offloaded += s.nbytes
        self._cur.evictions += 1
        dt = time.perf_counter() - t0
        self._cur.copy_seconds += dt
        if not self.async_copies:
            self._cur.stall_seconds += dt
        return True

    def _release_device(self, s: _S, st: torch.UntypedStorage) -> None:
        self._copies.release(st)
        if self._obs is not None:
            self._obs.set_away(s.sid, True)

    def _reap(self) -> None:
        """Offloads whose copies have landed release their device bytes; prefetches that landed
        stay FETCHING until first use (the compute stream still has to wait on their event)."""
        if not self.async_copies:
            return
        for s in list(self.fetching.values()):
            if s.fetch_event is not None and s.fetch_event.query():
                st = s.ref()
                if st is not None:
                    self._finish_fetch(s, st)

    def _fetch_now(self, s: _S, budgeted: bool = True, exclude: set[int] | None = None, where: str = "") -> None:
        """Make ``s`` resident now (a demand fetch: the compute stream waits for it)."""
        st = s.ref()
        internal_assert(st is not None, f"runtime: storage {s.sid} is needed but was freed")
        if s.status == RESIDENT:
            return
        if s.status == FETCHING:
            self._finish_fetch(s, st)
            return
        internal_assert(s.status == HOST and s.host is not None and s.host_valid,
                         f"runtime: storage {s.sid} is {s.status} without a valid host copy")
        if budgeted:
            self.make_room(s.nbytes, (exclude or set()) | {s.sid},
                            f"{where or 'an access'} (fetching a {format_bytes(s.nbytes)} {s.kind} back)")
        t0 = time.perf_counter()
        self._start_fetch(s, st)
        self._finish_fetch(s, st)
        self._cur.prefetch_misses += 1
        self._cur.bytes_fetched_on_demand += s.nbytes
        dt = time.perf_counter() - t0
        self._cur.copy_seconds += dt
        if not self.async_copies:
            self._cur.stall_seconds += dt

    def _start_fetch(self, s: _S, st: torch.UntypedStorage) -> None:
        self._copies.allocate(st, s.nbytes)
        if self._obs is not None:
            self._obs.set_away(s.sid, False)
        dst = _u8(st, self.device)
        ev = self._copies.to_device(s.host.tensor, dst, s.event)
        del dst
        if self.async_copies:
            s.fetch_event = ev
            s.event = ev
            self.set_status(s, FETCHING)
        else:
            s.fetch_event = None
            self.set_status(s, RESIDENT)
        self._note_peak()

    def _finish_fetch(self, s: _S, st: torch.UntypedStorage) -> None:
        """A fetched storage becomes usable: the compute stream waits on its copy (invariant 3)."""
        if s.fetch_event is not None:
            if not s.fetch_event.query():  # a demand fetch or a late prefetch: time the wait on the GPU
                pair = self._copies.timed_wait(s.fetch_event)
                if pair is not None:
                    self._pending_stalls.append(pair)
            else:
                self._copies.compute_waits(s.fetch_event)
            s.fetch_event = None
        if s.status is FETCHING:  # synchronous copies land resident (_start_fetch)
            self.set_status(s, RESIDENT)

    def _prefetch(self, s: _S) -> None:
        st = s.ref()
        if st is None or s.status != HOST or not s.host_valid:
            return
        if self.used + s.nbytes > self.budget:
            return
        t0 = time.perf_counter()
        self._start_fetch(s, st)
        s.pf = True
        self._cur.bytes_prefetched += s.nbytes
        dt = time.perf_counter() - t0
        self._cur.copy_seconds += dt
        if not self.async_copies:
            self._cur.stall_seconds += dt

    # ---- making room: Residency.make_room's hooks, on real copies ---------------------------------
    def _room_before(self, need: int) -> bool:
        if self._obs is not None and self._obs.sweep():  # storages that died since the last look
            self._native_parse(in_step=self._in_step)
            if self.fits(need):
                return True
        self._reap()
        return False

    def _evict_for_room(self, s: _S) -> bool:
        return self._evict(s)

    def _land_fetch(self) -> bool:
        """Make in-flight prefetches usable (the compute stream waits on them; they become
        evictable); False if none was in flight."""
        fetch = list(self.fetching.values())
        for s in fetch:
            st = s.ref()
            if st is not None:
                self._finish_fetch(s, st)
        self._reap()
        return bool(fetch)

    def _land_offload(self) -> None:
        internal_assert(False, "runtime: an eviction releases its device bytes at once (stream-ordered), so no "
                               "offload is ever pending")

    def _out_of_memory(self, need: int, exclude: set[int], where: str) -> None:
        held = sum(self.st[x].nbytes for x in exclude if x in self.st)
        raise BudgetError(
            f"runtime: out of memory under policy {self.policy.name!r} at {where}: {format_bytes(need)} more needed, "
            f"{format_bytes(self.used)} of {format_bytes(self.budget)} in use ({format_bytes(held)} of it needed by "
            "this operator) and nothing the policy may move. Raise the budget, or use a policy that moves more "
            "(lru, pilot).")

    def _account(self, delta: int) -> None:
        if self._obs is None:  # the native observer counts device bytes itself (events.cpp, invariant 2)
            self._used += delta

    def _status_changed(self, s: Record, old: Status, new: Status) -> None:
        obs = s.obs
        if obs is not None and new is not ABSENT and (old in IN_FLIGHT or new in IN_FLIGHT):
            obs.set_watch(s.sid, new in IN_FLIGHT)

    def _sync(self) -> None:
        self._copies.sync()
        if self.async_copies:
            self._reap()
        self.pool.poll()

    def _list_limit(self) -> int | None:
        """The most bytes one list operator (``_foreach_*``, fused optimizers) may touch in one call:
        half the budget, so a slice and what must stay resident fit together (lists.py)."""
        if self.budget is None or self._measure_step:
            return None
        return max(1, self.budget // 2)

    def _resolve_stalls(self) -> None:
        for before, after in self._pending_stalls:
            self._cur.stall_seconds += before.elapsed_time(after) * 1e-3
        self._pending_stalls = []

    def _apply_hard_cap(self) -> None:
        """Cap the caching allocator: the budget is this manager's share of the device, on top of what
        the process held outside the managed storages when the cap was set. The storages get the
        budget less what grows outside them since (cuBLAS workspaces of new streams) and less
        ``CAP_HEADROOM`` for the allocator's rounding and segments that one live block keeps reserved."""
        if self.cap_bytes is None:
            self.cap_bytes = self.budget
            with _no_mode():
                self._outside0 = max(0, device_baseline(self.device) - self.used)
        total = torch.cuda.get_device_properties(self.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, (self.cap_bytes + self._outside0) / total), self.device)
        self._fit_to_cap()

    def _fit_to_cap(self) -> None:
        cap = self.cap_bytes
        grown = max(0, torch.cuda.memory_allocated(self.device) - self.used - self._outside0)
        fixed, frac = self.CAP_HEADROOM
        self.unmanaged_bytes = grown
        room = self.cap_headroom_bytes if self.cap_headroom_bytes is not None else max(fixed, int(cap * frac))
        self.budget = max(1, cap - grown - room)

    def _measure_cap_headroom(self) -> None:
        """After a managed step under the cap: what the allocator peaked at beyond the storages."""
        peak = torch.cuda.max_memory_allocated(self.device)
        beyond = peak - (self._outside0 + self.unmanaged_bytes + self._cur.peak_device_bytes)
        fixed, _ = self.CAP_HEADROOM
        self.cap_headroom_bytes = max(fixed, int(max(0, beyond) * 1.25) + (2 << 20))

    # ---- the native event source (events.py): Python at decision points only ----------------------
    def _native_fault(self, sids: list[int], ins: list[int], name: str) -> None:
        try:
            self._fault(sids, ins, name)
        except BaseException as exc:  # noqa: BLE001  (kept and raised at the next check: _raise_pending)
            self._keep_error(exc)

    def _native_decide(self, position: int) -> None:
        try:
            self._decide(position)
        except BaseException as exc:  # noqa: BLE001
            self._keep_error(exc)

    def _keep_error(self, exc: BaseException) -> None:
        """A handler's error, without its traceback: the frames of the operator's caller would keep
        the program's tensors alive until it is raised."""
        exc.__traceback__ = None
        exc.__context__ = None
        if self._pending_error is None:
            self._pending_error = exc

    def _raise_pending(self) -> None:
        exc, self._pending_error = self._pending_error, None
        if exc is not None:
            raise exc

    def _fault(self, sids: list[int], ins: list[int], name: str) -> None:
        """An operator is about to read storages that are away or in flight: bring them back (the
        kernel runs when this returns). ``ins`` are all its inputs: none of them may leave now."""
        in_step = self._in_step
        if in_step and not self._measure_step:
            self._native_parse(in_step=True)  # the policy's view must be current before it picks victims
        where = (f"operator {name} (position {self._obs.position}, {self.phase})" if in_step
                 else f"operator {name} (between steps)")
        need = set(ins)
        error = None
        if in_step and not self._measure_step:
            reads = sum(self.st[x].nbytes for x in need if x in self.st)
            if reads > self.budget:
                error = BudgetError(
                    f"runtime: the budget {format_bytes(self.budget)} is smaller than what one operator needs: {where} "
                    f"reads {format_bytes(reads)}. Raise the budget to at least {format_bytes(reads)}.")
        for sid in sids:
            s = self.st.get(sid)
            internal_assert(s is not None, f"runtime: storage {sid} is away but unknown to the manager")
            if s.status == RESIDENT:
                continue
            try:
                self._fetch_now(s, exclude=need, where=where)
            except BudgetError:
                # The kernel must find its data. The operator itself fits (else ``error`` is set): what
                # fills the rest is resident and may not move (held by the program, in flight), so the
                # step goes on over the budget, as after any operator on this source, and says so.
                self._fetch_now(s, budgeted=False)
                if in_step and not self._measure_step:
                    self._cur.budget_overshoot_bytes = max(self._cur.budget_overshoot_bytes, self.used - self.budget)
        if error is not None:
            raise error

    def _decide(self, position: int) -> None:
        """After operator ``position``: the budget is exceeded, or the policy's periodic turn."""
        self._native_parse(in_step=self._in_step)
        if not self._in_step or self._measure_step:
            return
        reserve = self._obs.max_made  # room for the next operator (events.cpp, invariant 6)
        if self.used + reserve > self.budget:
            where = f"after operator {self._last_name} (position {position}, {self.phase})"
            busy = sum(self.st[x].nbytes for x in self._last_busy if x in self.st)
            if busy > self.budget:
                raise BudgetError(
                    f"runtime: the budget {format_bytes(self.budget)} is smaller than what one operator needs: "
                    f"operator {self._last_name} (position {position}, {self.phase}) touches {format_bytes(busy)}. "
                    f"Raise the budget to at least {format_bytes(busy)}.")
            try:
                self.make_room(reserve, self._last_busy, where)
            except BudgetError:
                if type(self.policy).victims is Policy.victims and self.used > self.budget + reserve:
                    raise  # a policy that never moves anything, and over by more than one operator's allocation
                # the operator ran over (counted as an overshoot); the next decision point tries again

    def _native_parse(self, in_step: bool, light: bool = False) -> None:
        """Read the operator log since the last call: storages born and freed, and (in a step) each
        operator, told to the policy as the Python path tells it. ``light``: only the storages that
        outlive the batch (a step that never needed a decision: the policy has nothing to learn
        from what fit)."""
        obs = self._obs
        if obs is None:
            return
        if in_step and not light and not self._measure_step:
            self._engaged = True
        words, names = obs.take_log(light)
        if names:
            self._names.extend(names)
        if light:  # the compacted log drops a birth and death seen together, even of storages known here
            for sid in [x for x in self.st if not obs.alive(x)]:
                self._forget_native(sid, in_step)
        if not words:
            return
        log = memoryview(words).cast("q")
        st = self.st
        pol = self.policy
        tell = in_step and not self._measure_step
        measuring = in_step and self._measure_step
        OP, ALLOC, FREE = _C_TAGS
        i, n = 0, len(log)
        while i < n:
            tag = log[i]
            if tag == OP:
                j = self.position
                ni, no, nw, na = log[i + 5], log[i + 6], log[i + 7], log[i + 8]
                k = i + 9
                ins = log[k:k + ni].tolist()
                outs = log[k + ni:k + ni + no].tolist()
                writes = log[k + ni + no:k + ni + no + nw].tolist()
                allocs = log[k + ni + no + nw:k + ni + no + nw + na].tolist()
                name = self._names[log[i + 1]]
                phase, module, node, used = _PHASES[log[i + 2] & 3], log[i + 2] >> 2, log[i + 3], log[i + 4]
                i = k + ni + no + nw + na
                self.phase = phase
                for sid in writes:
                    x = st.get(sid)
                    if x is not None and x.host is not None and not obs.host_valid(sid):
                        self._drop_host(x)
                if in_step:
                    self._native_op(j, name, phase, module, node, ins, outs, writes, allocs, tell, measuring)
                    self._timeline.append((self._step_index, j, used, phase))
                    self.position = j + 1
            elif tag == ALLOC:
                sid, nb, fresh = log[i + 1], log[i + 2], log[i + 3]
                i += 4
                x = st.get(sid)
                if x is None:
                    x = self._new_native(sid, "temp" if fresh else "input", nb, in_step, self.position)
                if in_step and not fresh:
                    pos = self.position
                    self._pre.setdefault(pos, []).append(sid)
                    if tell:
                        pol.on_alloc(sid, -1 if pos == 0 else pos)
            elif tag == FREE:
                i += 2
                self._forget_native(log[i - 1], in_step)
            else:
                internal_assert(False, f"runtime: corrupt native event log (tag {tag} at word {i})")

    def _forget_native(self, sid: int, in_step: bool) -> None:
        self._saved_pending.discard(sid)
        x = self.st.pop(sid, None)
        if x is None:
            return
        if x.status is not ABSENT:
            self.set_status(x, ABSENT)
        self._drop_host(x)
        if in_step:
            self._frees.setdefault(self.position, []).append(sid)
        self._pinned.discard(sid)
        self.policy.on_free(sid)

    def _native_op(self, j: int, name: str, phase: str, module: int, node: int, ins: list[int], outs: list[int],
                   writes: list[int], allocs: list[int], tell: bool, measuring: bool) -> None:
        st = self.st
        if measuring:
            touched = sum(st[x].nbytes for x in ins if x in st) + sum(st[x].nbytes for x in allocs if x in st)
            if touched > self._largest_op[0]:
                self._largest_op = (touched, f"operator {name} (position {j}, {phase})")
        mods = self._modules
        if mods is not None and phase == "backward":
            module = mods.node_modules.get(node, 0)
        op = Op(name=name, idiom=self._idiom_of(name), phase=phase,
                module=mods.paths[module] if mods is not None and module < len(mods.paths) else "",
                inputs=tuple(ins), outputs=tuple(outs), writes=tuple(writes), allocs=tuple(allocs), duration_s=0.0,
                flops=0, nbytes=0, node=node)
        self._ops.append(op)
        self._last_busy = set(ins).union(outs)
        self._last_name = name
        if not tell:
            return
        t0 = time.perf_counter()
        pol = self.policy
        now = t0 - self._t0
        for sid in allocs:
            pol.on_alloc(sid, j)
        cur = self._cur
        for sid in self._last_busy:
            s = st.get(sid)
            if s is None:
                continue
            s.last_access = j
            s.last_access_t = now
            s.count += 1
            if s.pf:
                s.pf = False
                cur.prefetch_hits += 1
            pol.on_access(sid, j)
        if self._trace is not None:
            self._map_oracle_op(j, ins, allocs, name)
        self.position = j
        pol.on_op(j, op)
        self._apply(pol.after_op(j), self._last_busy)
        cur.policy_seconds += time.perf_counter() - t0

    def _idiom_of(self, name: str) -> tuple[int, ...]:
        iv = self._idiom_by_name.get(name)
        if iv is None:
            iv = ()
            try:
                ns, _, rest = name.partition("::")
                base, _, overload = rest.partition(".")
                packet = getattr(getattr(torch.ops, ns), base)
                func = getattr(packet, overload or "default")
                iv = self._idiom(func, name)
            except (AttributeError, RuntimeError):
                pass  # an operator torch.ops cannot name: no idiom vector
            self._idiom_by_name[name] = iv
        return iv

    # ---- the operator hook ------------------------------------------------------------------
    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self._dead:
            self._drain()
        name = func.name()
        if name in IGNORED_OPS:
            return func(*args, **kwargs)
        if not self._in_step:
            return self._dispatch_between_steps(func, args, kwargs, name)
        ins: list[int] = []
        for a in _tensors(args, kwargs):
            sid = self._track(a, "input", fresh=False)
            if sid is not None and sid not in ins:
                ins.append(sid)
        need = set(ins)
        where = (f"operator {name} (position {self.position}, {self.phase})" if self._in_step
                 else f"operator {name} (between steps)")
        est = self._estimate_out(func, args, kwargs) or 0
        touched = sum(self.st[x].nbytes for x in ins) + est
        if self._measure_step or self.budget is None:
            if touched > self._largest_op[0]:
                self._largest_op = (touched, where)
        elif touched > self.budget:
            raise BudgetError(
                f"runtime: the budget {format_bytes(self.budget)} is smaller than what one operator needs: {where} "
                f"reads {format_bytes(touched - est)} and creates {format_bytes(est)}. Raise the budget to at least "
                f"{format_bytes(touched)}.")
        for sid in ins:
            s = self.st.get(sid)
            if s is None:
                continue
            if s.status != RESIDENT:
                self._fetch_now(s, exclude=need, where=where)
            if s.pf:
                s.pf = False
                self._cur.prefetch_hits += 1
        if est and not self._measure_step:
            self.make_room(est, need, where)
        out = func(*args, **kwargs)
        node = self._nodes()
        if self._dead:
            self._drain()
        allocs: list[int] = []
        outs: list[int] = []
        for t in _tensors_out(out):
            key_known = self._sid(t)
            sid = self._track(t, "temp", fresh=True)
            if sid is None:
                continue
            if key_known is None and sid not in allocs:
                allocs.append(sid)
            if sid not in outs:
                outs.append(sid)
        writes = self._note_writes(func, args, kwargs)
        if self.used > (self.budget or 1 << 62) and not self._measure_step:
            try:
                self.make_room(0, need | set(outs), where)
            except BudgetError:
                pass  # the estimate was short: counted as an overshoot, not an error
        self._note_peak()
        j = self.position
        now = time.perf_counter() - self._t0
        pol = self.policy
        t0 = time.perf_counter()
        # the mode is popped while __torch_dispatch__ runs: policy work does not re-enter it
        for sid in allocs:
            pol.on_alloc(sid, j)
        for sid in set(ins).union(outs):
            s = self.st.get(sid)
            if s is None:
                continue
            s.last_access = j
            s.last_access_t = now
            s.count += 1
            pol.on_access(sid, j)
        phase = self._current_phase()
        mod = self._modules.current(phase == "backward") if self._modules else 0
        op = Op(name=name, idiom=self._idiom(func, name), phase=phase,
                module=self._modules.paths[mod] if self._modules else "", inputs=tuple(ins), outputs=tuple(outs),
                writes=tuple(writes), allocs=tuple(allocs), duration_s=0.0, flops=0, nbytes=0, node=node)
        self._ops.append(op)
        if self._trace is not None:
            self._map_oracle_op(j, ins, allocs, name)
        pol.on_op(j, op)
        actions = pol.after_op(j) if self.budget is not None and not self._measure_step else []
        self._apply(actions, need | set(outs))
        self._cur.policy_seconds += time.perf_counter() - t0
        self._timeline.append((self._step_index, j, self.used, self.phase))
        self.position = j + 1
        return out

    def _note_writes(self, func: Any, args: tuple, kwargs: dict) -> list[int]:
        """Managed storages ``func`` wrote: their host copies are stale now (invariant 5)."""
        writes = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(t, torch.Tensor):
                        sid = self._sid(t)
                        if sid is not None:
                            writes.append(sid)
                            s = self.st[sid]
                            if s.host is not None:
                                self._drop_host(s)
                            st = t.untyped_storage()
                            if st.nbytes() != s.nbytes:  # out= resized it
                                self.used += st.nbytes() - s.nbytes
                                s.nbytes = st.nbytes()
        return writes

    def _dispatch_between_steps(self, func: Any, args: tuple, kwargs: dict, name: str) -> Any:
        """Outside a step the program's own work is not budgeted and its tensors are not managed;
        what it touches of the managed state is fetched first, and writes to it are noted."""
        for a in _tensors(args, kwargs):
            sid = self._sid(a)
            if sid is None:
                continue
            s = self.st[sid]
            if s.status != RESIDENT:
                try:
                    self._fetch_now(s, exclude={sid}, where=f"operator {name} (between steps)")
                except BudgetError:
                    self._fetch_now(s, budgeted=False)  # over budget between steps beats failing
        out = func(*args, **kwargs)
        self._note_writes(func, args, kwargs)
        self._note_peak()
        return out

    def _current_phase(self) -> str:
        if self._in_optimizer:
            self.phase = "optimizer"
        elif torch._C._current_autograd_node() is not None:
            self.phase = "backward"
            self._seen_backward = True
        elif not self._seen_backward:
            self.phase = "forward"
        return self.phase

    def _apply(self, actions: list[Any], busy: set[int]) -> None:
        for a in actions:
            s = self.st.get(a.sid)
            if s is None:
                continue
            if a.kind == "evict":
                if a.sid not in busy:
                    self._evict(s)
            elif a.kind == "prefetch" and s.status == HOST:
                self._prefetch(s)

    def _idiom(self, func: Any, name: str) -> tuple[int, ...]:
        iv = self._idiom_cache.get(name)
        if iv is None:
            from ..idioms import idiom_vector

            iv = tuple(idiom_vector(func).as_tuple())
            self._idiom_cache[name] = iv
        return iv

    def _estimate_out(self, func: Any, args: tuple, kwargs: dict) -> int | None:
        """Bytes of fresh storage ``func`` will allocate, from a meta-tensor run cached by signature."""
        try:
            key = (func, _signature(args), _signature(kwargs))
        except TypeError:
            key = None
        if key is not None and key in self._meta_cache:
            est = self._meta_cache[key]
            return _upper_bound(func, args, kwargs) if est is None else est
        est = None
        try:
            margs, mkwargs = _to_meta((args, kwargs))
            mout = func(*margs, **mkwargs)
            in_keys = {_storage_key(t.untyped_storage()) for t in _tensors(margs, mkwargs)}
            seen = set()
            est = 0
            for t in _tensors_out(mout):
                k = _storage_key(t.untyped_storage())
                if k in in_keys or k in seen:
                    continue
                seen.add(k)
                est += t.untyped_storage().nbytes()
        except Exception:  # data-dependent output shapes (nonzero, unique, ...), or no meta kernel
            est = None
        if key is not None:
            if len(self._meta_cache) >= self.META_CACHE_ENTRIES:  # shapes change every step in a DyNN
                del self._meta_cache[next(iter(self._meta_cache))]  # the oldest signature goes
            self._meta_cache[key] = est
        if est is None:
            est = _upper_bound(func, args, kwargs)
        return est


# ---- helpers --------------------------------------------------------------------------------
def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


#: the started native observer (one per process), suspended by :func:`_no_mode`
_QUIET: list[Any] = []


@contextlib.contextmanager
def _no_mode() -> Iterator[None]:
    """Run the manager's own tensor work without re-entering its dispatch mode or being observed."""
    obs = _QUIET[-1] if _QUIET else None
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


def _tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b
    for a in kwargs.values():
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _tensors_out(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors_out(o)


def _signature(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.storage_offset(), obj.device.type)
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, torch.Generator):
        return "generator"
    hash(obj)
    return obj


def _to_meta(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty_strided(tuple(obj.shape), tuple(obj.stride()), dtype=obj.dtype, device="meta")
    if isinstance(obj, list):
        return [_to_meta(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_to_meta(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_meta(v) for k, v in obj.items()}
    if isinstance(obj, torch.Generator):
        return None  # a meta kernel may still draw from a generator it is given: never let it
    if isinstance(obj, torch.device):
        return torch.device("meta")  # _to_copy(..., device=cuda) and factories: sized on meta too
    return obj


def _upper_bound(func: Any, args: tuple, kwargs: dict) -> int:
    """Output bytes of an operator whose output shape depends on the data: its worst case."""
    ts = list(_tensors(args, kwargs))
    if not ts:
        return 0
    big = max(ts, key=lambda t: t.numel())
    name = func.name()
    if name.startswith("aten::nonzero") or name.startswith("aten::argwhere"):
        return big.numel() * max(1, big.dim()) * 8
    if "unique" in name:
        return big.numel() * (big.element_size() + 16)
    # masked_select and friends: at most every element; otherwise the inputs' size, a guess that
    # the post-operator check corrects (recorded as an overshoot if it was short)
    return sum(t.numel() * t.element_size() for t in ts)


def repeated_blocks(model: nn.Module) -> tuple[list[str], list[nn.Module]]:
    """The blocks of ``model``'s outermost ``nn.ModuleList`` objects (the repeated blocks; lists
    nested in a block are not separate) and those lists' names."""
    lists: list[str] = []
    blocks: list[nn.Module] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and not any(name.startswith(w + ".") for w in lists):
            lists.append(name)
            blocks.extend(m)
    return lists, blocks


def checkpoint_modules(modules: list[nn.Module]) -> None:
    """Run each module's forward under non-reentrant ``torch.utils.checkpoint`` when gradients are
    on (an instance attribute over the class's forward: ``del m.forward`` undoes it)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    def run(fwd: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return fwd(*args, **kwargs)
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    for m in modules:
        m.forward = functools.partial(run, m.forward)


def _checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """Checkpoint every repeated block; a model without one is checkpointed per top-level child."""
    blocks = repeated_blocks(model)[1]
    if not blocks:
        blocks = [c for c in model.children() if any(p.requires_grad for p in c.parameters())]
    checkpoint_modules(blocks)
    return blocks


def _is_compiled(model: nn.Module) -> bool:
    for m in model.modules():
        if type(m).__name__ == "OptimizedModule" or hasattr(m, "_orig_mod"):
            return True
        fwd = getattr(m, "forward", None)
        if fwd is not None and hasattr(fwd, "_torchdynamo_orig_callable"):
            return True
    return False


