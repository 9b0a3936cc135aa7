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
   eviction time, and one on the stream of the storage's last access where that is another (the
   data must be produced first). The source block is ``record_stream``-ed on the
   D2H stream and the storage released at once: the caching allocator does not recycle the block
   before the copy stream has passed the copy, and the host does not wait.
2. A prefetch (a host-to-device copy into a freshly resized storage) runs on the H2D stream after
   an event recorded on the compute stream (the allocation is ordered there) and after the event
   of the copy that filled the host buffer; the destination is ``record_stream``-ed on the H2D
   stream. A demand fetch, where the engine can, is copied on the compute stream itself after the
   event of the copy that filled the host buffer (``fetch_inline``: the same order, no event of
   its own).
3. The compute stream never uses a fetched storage before ``wait_event`` on its H2D event
   (no device-wide synchronize on the hot path).
4. A host buffer goes back to the pool only once every copy touching it has completed
   (:meth:`HostPool.release` with the copy's event; after a compute-stream fetch, the event of
   the copy that filled the buffer: the next copy that writes it is an eviction's, which waits for
   the compute stream, and so for the fetch).
5. A storage written while its host copy exists makes that copy stale; it is never fetched again.

Each rule is one call of the copy engine (:mod:`~dynn_runtime.runtime.copies`). On the CPU the same
code runs with synchronous copies and a *logical* budget: device bytes are accounted, offloaded
storages are truly released (resized to zero) and restored; with ``copies=FakeAsyncCopies()`` the
asynchronous paths run there too, against a late and unordered fake GPU that poisons what a missing
wait would corrupt (tests/runtime/test_fake_async.py).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, PolicyError, internal_assert
from ..hints import Hint
from ..memory import parse_size
from ..policies.base import NO_CONTEXT, Policy, make_policy
from ..residency import Status
from ..trace.format import Iteration, Op, Trace, read_trace
from ..trace.modules import ModuleTracker
from ..trace.recorder import AutogradNodes
from . import devicemem
from .blocks import _checkpoint_blocks, _is_compiled, checkpoint_modules, repeated_blocks
from .budget import Budget
from .controls import Controls, OpTimeline
from .copies import SyncCopies, cuda_copies
from .devicemem import default_budget
from .events import QUIET, no_mode
from .hostpool import HostPool
from .lists import ListSplitter
from .moves import Moves
from .native_source import NativeSource
from .oom import OutOfMemory
from .oracle import OracleAlignment
from .providers import HOOK_CHOICES, ProviderClient, select_provider
from .python_source import PythonSource, _Mode, _unpack
from .state import StateTransfer
from .steps import _LABELLED_TYPES, _SETTLED_GRAD, Steps, StepStats
from .storages import _S, StorageTable

__all__ = ["MemoryManager", "StepStats", "checkpoint_modules", "repeated_blocks"]

RESIDENT = Status.RESIDENT


class _Count:
    """The managed device bytes where no native observer counts them (the Python event source)."""

    __slots__ = ("used",)

    def __init__(self, used: int = 0) -> None:
        self.used = used


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """``attach``'s optimizer argument as a list: none, one, or a sequence of them."""
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    if isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        if len({id(o) for o in optimizer}) != len(optimizer):
            raise ConfigError("runtime: attach() was given the same optimizer twice; give each once.")
        return list(optimizer)
    raise ConfigError(f"runtime: attach()'s optimizer must be a torch.optim.Optimizer, a list of them or None; "
                      f"got {type(optimizer).__name__}.")


class MemoryManager(Controls, Steps, StateTransfer, PythonSource, NativeSource, OutOfMemory, OracleAlignment,
                    StorageTable, Moves, Budget, ProviderClient):
    """Keep a training loop's device memory within ``budget`` by moving tensors as ``policy`` says.

    ``budget``: bytes (int), a size string (``"6GiB"``), or a float in (0, 1]: that fraction of the
    workload's unmanaged peak, which the manager measures during the first ``measure_steps``
    :meth:`step` calls (default 1; those steps run unmanaged, so they must fit on the device: on
    CUDA they run under its free memory); left out, :func:`default_budget` (on CUDA the device's
    free memory less a headroom). A dynamic network's first step need not reach its peak (a
    dynamic-depth model's first batch may run few layers, and Adam makes state only for the
    parameters that had a gradient): measure over more steps, or give bytes. ``policy``: a
    registered policy name (``none``, ``save_on_cpu``, ``lru``, ``replay``, ``oracle``, ``pilot``,
    ``checkpoint``, ``dtr``) or a :class:`~dynn_runtime.policies.base.Policy`. ``device``: where
    the model trains (default: CUDA if available, else the CPU, where the budget is logical).

    Options: ``host_budget`` (bytes or size string; the most host memory offloaded tensors may use;
    default unlimited), ``async_copies`` (False: every copy on the compute stream, synchronous),
    ``pin_memory`` (pinned host pool on CUDA), ``hard_cap`` (CUDA: also cap the caching allocator
    with ``torch.cuda.set_per_process_memory_fraction`` at the budget), ``trace`` (a recorded trace
    of the same inputs: the ``oracle`` policy reads the future from it), ``policy_options``,
    ``copies`` (a copy engine of :mod:`~dynn_runtime.runtime.copies`; tests pass ``FakeAsyncCopies``
    to run the asynchronous paths on the CPU), ``record_every_op`` (every operator in :meth:`timeline`
    and ``history`` on the native source too, at the cost of reading every step's log in full), ``hooks``
    (``auto``: the patched PyTorch's allocator and engine hooks where they can run, else the event
    source's; ``stock``; ``patched``: those hooks or an error; or a provider of :mod:`~dynn_runtime.runtime.providers`).
    """

    #: operators the timeline keeps (the oldest go first); bounded so a long run's memory stays flat
    TIMELINE_ENTRIES = 1 << 20
    #: CUDA copies through the C++ engine (``copies.native_copies``: one call per copy) where the
    #: extension loads, instead of :class:`~dynn_runtime.runtime.copies.CudaCopies` (the reference,
    #: and the engine where the extension does not load). Both pass the same GPU tests.
    copies_in_c = True
    #: the C++ engine's non-blocking copies as one ``cudaMemcpyAsync`` each (``csrc/copies_cuda.h``)
    #: where the build has CUDA's headers; off, ``Tensor.copy_`` (which also records an event in the
    #: pinned host allocator per copy)
    raw_copies = True

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
        hooks: Any = "auto",
        measure_steps: int = 1,
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
        if isinstance(measure_steps, bool) or not isinstance(measure_steps, int) or measure_steps < 1:
            raise ConfigError(f"runtime: measure_steps must be a whole number of steps, at least 1; got {measure_steps!r}.")
        #: steps a fractional budget's peak is measured over, and the largest peak they measured so far
        self.measure_steps = measure_steps
        self._measured: list[int] = []
        self.optimizers: list[torch.optim.Optimizer] = []  # attach()'s, whose state is managed
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
        if self.policy.recomputes == "operators":
            raise PolicyError(
                f"runtime: {self.policy.name} is available in the simulator only. Rematerialising arbitrary ATen "
                "operators live would have to keep every evicted tensor's producer inputs alive and re-run kernels whose results "
                "are not bit-reproducible on CUDA (atomics), so it could not promise the same numbers. Use "
                "policy='checkpoint' (torch.utils.checkpoint per block) or an offloading policy (lru, pilot).")
        # a policy that may ask for "drop" is asked per eviction (the base class always offloads)
        self._asks_mode = type(self.policy).evict_mode is not Policy.evict_mode
        self.cuda = self.device.type == "cuda"
        if copies is None:
            copies = (cuda_copies(self.device, pin_memory, self.copies_in_c, self.raw_copies) if async_copies and self.cuda
                      else SyncCopies())
        self._copies = copies
        self.async_copies = bool(copies.asynchronous)
        self._copy_storages = bool(getattr(copies, "takes_storages", False))
        self._fetch_inline = self.async_copies and hasattr(copies, "fetch_inline")  # copies.py
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
        if isinstance(hooks, str) and hooks not in HOOK_CHOICES:
            raise ConfigError(f"runtime: hooks={hooks!r} is not one of {', '.join(HOOK_CHOICES)} (or a Provider).")
        self._hooks_requested = hooks
        self._reset_state()

    # ---- configuration ----------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._attached

    def _set_used(self, value: int) -> None:
        internal_assert(self._obs is None, "runtime: the native path counts device bytes itself")
        self._books.used = value

    # read per make-room and per move: the getter is C (attrgetter), no Python frame
    used = property(attrgetter("_books.used"), _set_used, doc=(
        "Managed device bytes now (native: the observer's count, invariant 2 of events.cpp; else "
        "the manager's own, ``_books``, a :class:`_Count`)."))

    def _reset_state(self) -> None:
        self._obs: Any = None
        self.provider: Any = None  # the hook provider (providers.py), chosen at attach
        self._books: Any = _Count()  # what ``used`` reads: a _Count, or the native observer
        self._init_residency()
        self.event_source = "python"
        self.event_reason = ""
        self._names: list[str] = []
        self._idiom_by_name: dict[str, tuple[int, ...]] = {}
        self._saved_pending: set[int] = set()
        self._grad_pending: set[int] = set()
        # records made movable in a step, of a kind that is not always movable: what a successful
        # step's end must bring back and make unmovable (Steps._end_step); only a step makes such a
        # record, and a kind only ever gets more specific, so no other record needs that
        self._transient: list[Any] = []
        self._saved_unlogged: list[tuple[int, torch.Tensor]] = []
        self._tell_labels = False
        self._engaged = False
        self._idle_step = False  # Steps._begin_step: the policy sits this step out until memory is short
        self._held_at_start: list[int] | None = None  # ... and the storages held at its start, untold
        self._pending_error: BaseException | None = None
        self._last_busy: set[int] = set()
        self._recency_read = -1  # the step whose log a compact parse read last (NativeSource)
        self._parse_due = False  # a fault or a decision point put its read of the log off (NativeSource.defer_parse)
        self._last_outs: Sequence[int] = ()  # the last operator's outputs (made or written)
        self._last_name = ""
        self._native_order = False  # the observer keeps the policy's order (attach)
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
        #: this step measures the peak for a fractional budget (``_measuring``), unmanaged where the
        #: device gives no budget for it (``_measure_step``: the CPU); the live bytes' peak so far
        #: (resident + away: what PyTorch alone would hold) and the operator it came at
        self._measuring = False
        self._measure_step = False
        self._live_peak = self._live_pos = 0
        self._ops: list[Op] = []
        self._nodes = AutogradNodes()
        self._frees: dict[int, list[int]] = {}
        self._pre: dict[int, list[int]] = {}
        self._hints: dict[int, list[Hint]] = {}
        #: id of an optimizer state tensor -> (weak reference to it, its storage id, None), or (its weak
        #: reference, None, its device) for one on a device the manager does not manage: labelled already
        self._opt_marked: dict[int, tuple[Any, int | None, Any]] = {}
        self._grad_params: list[torch.nn.Parameter] = []
        self._meta_cache: dict[Any, int | None] = {}
        self._idiom_cache: dict[str, tuple[int, ...]] = {}
        self._handles: list[Any] = []
        self._lists: ListSplitter | None = None
        self._pinned: set[int] = set()  # pin(): storages the policy never moves
        #: storages a collective still in flight reads or writes (sid -> collectives), and those collectives
        self._held: dict[int, int] = {}
        self._collectives: list[tuple[tuple[Any, ...] | None, tuple[int, ...]]] = []
        self._streaming = False  # this state_dict() streams tensors out to host copies (_state_dict_pre)
        self._warned_streaming = False
        self._modules: ModuleTracker | None = None
        self._saved_hooks: Any = None
        #: the saved-tensor hooks serve the policy's labels alone, and are pushed for each step it does
        #: not sit out (Steps._begin_step); else pushed at attach
        self._saved_per_step = False
        self._saved_entered = False
        self._modules_per_step = False  # the module hooks serve the policy alone (native source)
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
        self._oom_evicted = 0  # bytes the last room after an out-of-memory error evicted (oom.py)
        self._oom_failed: tuple = ()  # (where, the error's first line, bytes evicted): a retry ran out too
        self._no_prefetch = False  # a prefetch ran out of device memory in this step: no more start (moves.py)
        self._walked_at = 0  # the host pool's handed_out at the last walk of the observer's table (moves.py)
        self._cap_short = 0  # hard cap: the most the allocator lacked when it ran out in this step (budget.py)
        self._in_dispatch = False
        self._checkpointed: list[nn.Module] = []
        self._peak_pos = 0
        self.measured_peak: int | None = None
        # (step, position, device bytes, phase), the last TIMELINE_ENTRIES operators
        self._timeline = OpTimeline(self.TIMELINE_ENTRIES)

    # ---- attach / detach --------------------------------------------------------------------
    def attach(self, model: nn.Module,
               optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> MemoryManager:
        """Bring ``model``'s parameters and buffers, its gradients and ``optimizer``'s state, and every
        activation created while attached under management. Returns ``self``. ``optimizer`` may be
        several (a GAN's generator and discriminator, each with its own; ``model`` then holds both
        networks, an ``nn.ModuleDict`` say): the state of one left out is not moved."""
        if self._attached:
            raise ConfigError("runtime: this MemoryManager is already attached; detach() it first.")
        optimizers = _optimizers(optimizer)
        if _is_compiled(model):
            warnings.warn(
                "dynn-runtime: the model (or a submodule) is compiled with torch.compile; the memory manager "
                "leaves compiled modules alone (no budget, no offloading) because compiled graphs bypass its "
                "operator hooks. Attach the uncompiled module to manage it.", RuntimeWarning, stacklevel=2)
            self._passthrough = True
            self._attached = True
            self.model, self.optimizer, self.optimizers = model, optimizer, optimizers
            return self
        self.model, self.optimizer, self.optimizers = model, optimizer, optimizers
        self._opt_marked = {}  # storage ids restart with each attach's observer
        from .events import native_module, resolve

        self.event_source, self.event_reason = resolve(self._events_requested)
        if self.event_source == "native" and QUIET:
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
            self._obs.hear = self._obs.hear and self.hear_frees
            self._counts_held = False  # the observer counts device bytes (events.cpp, invariant 2)
            self._books = self._obs
        self.provider = select_provider(str(self.device), self.event_source, self.event_reason,
                                        hooks=self._hooks_requested)
        # the parameters the model has at attach, the ones whose gradients each step labels "grad"
        self._grad_params = list(model.parameters())
        # a policy that reads labels is told them as they change, and each gradient's as autograd
        # accumulates it (else gradients are labelled when the optimizer starts)
        self._tell_labels = type(self.policy).reads_labels
        if self._tell_labels:
            ready = self._grad_ready
            if self._obs is not None and self.grads_in_c:  # the common cases in the observer, the rest in _label_grad
                self._obs.set_grad_labels(self.st, self._grad_pending, _SETTLED_GRAD, self._label_grad)
                ready = self._obs.grad_ready
            for p in self._grad_params:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(ready))
        for name, p in model.named_parameters():
            sid = self._track(p, "param", fresh=False)
            if sid is not None:
                self.st[sid].name = name
        for name, b in model.named_buffers():
            sid = self._track(b, "buffer", fresh=False)
            if sid is not None:
                self.st[sid].name = name
        if optimizers:
            self._mark_optimizer_state()
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._opt_pre))
            self._handles.append(opt.register_step_post_hook(self._opt_post))
            self._handles.append(opt.register_state_dict_pre_hook(lambda *a: self._state_dict_pre()))
            self._handles.append(opt.register_state_dict_post_hook(
                lambda opt, sd: self._state_dict_post(sd.get("state", {}))))
        self._handles.append(model.register_state_dict_pre_hook(lambda *a, **k: self._state_dict_pre()))
        self._handles.append(model.register_state_dict_post_hook(
            lambda module, sd, prefix, meta: self._state_dict_post(sd) if not prefix else None))
        if self.policy.recomputes == "blocks":
            # Live, the checkpoint policy is torch.utils.checkpoint itself around every repeated
            # block: the blocks keep nothing for backward and re-run their forward when it needs it.
            self._checkpointed = _checkpoint_blocks(model)
        # the native source reads node tags from node_modules only: its walk need not tag node metadata
        native_walk = self._obs is not None and self.tag_nodes_in_c
        self._modules = ModuleTracker(model, tagger=native_module().tag_nodes if native_walk else None)
        pol = type(self.policy)
        # On the native source modules are tracked only for a policy that reads them, and not in a
        # step it sits out with room (Steps._begin_step); the phase needs the root's forward always
        self._modules_per_step = self._obs is not None and pol.reads_modules
        if self._obs is None:
            self._modules.on_root_forward = self._root_forward
            self._modules.install()
        else:
            self._handles.append(model.register_forward_pre_hook(lambda *a: self._root_forward()))
            if self._modules_per_step:
                self._modules.install()
        pack = self.provider.wrap_pack(self._pack)  # the patched provider indexes saved tensors by node
        if self._obs is None or pol.reads_saved or pack is not None:
            # On the native source without a provider's pack the hooks only label saved storages for
            # the policy: a step it sits out does without them (each saved tensor costs autograd a
            # Python call to pack and one to unpack, whatever the hook does)
            self._saved_per_step = pack is None and self._obs is not None
            if self._saved_per_step and self.pack_in_c:
                self._obs.set_saved(self.st, self._saved_pending, _LABELLED_TYPES, self._pack)
                pack = self._obs.pack_saved
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(pack or self._pack, _unpack)
            if not self._saved_per_step:
                self._enter_saved(True)
        if self.hard_cap and self.cuda and self.budget is not None:
            self._apply_hard_cap()
        if self.pool.pin and self.pool.budget is not None:
            self.pool.reserve(self.pool.budget)  # pinned at attach, not during a step
        self._lists = ListSplitter(self._list_limit, self._measuring_now)
        self._lists.install()
        self.policy.attach(self)
        # the observer keeps the policy's order where the policy hands it over (lru): no
        # per-operator touches reach Python (native_source.py, _native_recency_parse)
        self._native_order = (self._obs is not None and not self.record_every_op
                              and self.policy.keep_order_in(self._obs))
        # operators between attach and the first step may need room too: the policy starts with
        # an empty plan (no history) until the first step begins
        self.policy.begin_iteration(-1, NO_CONTEXT)
        if self._obs is not None:
            if self._modules is not None:
                self._modules.on_module = self._obs.set_module
            try:
                self._obs.start(self._native_fault, self._native_decide, self._native_oom)
            except RuntimeError as exc:
                self._attached = True
                self.detach()
                raise ConfigError(f"runtime: {exc}") from None
            QUIET.append(self._obs)
        else:
            self._mode = _Mode(self)
            self._mode.__enter__()
        self._attached = True
        self.provider.install(self)
        return self

    def detach(self) -> None:
        """Stop managing: hooks are removed and the host pool is released. Every storage that is away
        comes back to the device, bit for bit. When they do not all fit the device's free memory, the
        parameters, buffers, gradients and optimizer state among them become CPU tensors with the
        same values instead (one warning): nothing is lost, and the model is then partly on the CPU.
        If a storage could be neither brought back nor moved, BudgetError is raised and the manager
        stays attached, every tensor as it was."""
        if not self._attached:
            return
        if self._passthrough:
            self._attached = False
            return
        if self.hard_cap and self.cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)  # the cap was the manager's
        try:
            with no_mode():
                self._copies.sync()  # copies in flight may hold the last reference to a storage: settle first
                self._drain()
                if self.away <= devicemem.device_room(self.device):
                    self._restore()
                else:
                    self._away_to_cpu()
        except BaseException:
            if self.cap_bytes is not None:
                self._apply_hard_cap()  # still attached: the cap stays
            raise
        self._teardown()

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """Between two steps: this thread runs as if no manager were attached, and everything comes
        back on exit. The observer is suspended on the thread (native) or the dispatch mode is off
        (Python), and the global module hooks, the ``saved_tensors_hooks`` and the list splitter
        are removed. For the overhead bench, which times PyTorch alone on its own copy of the
        model between the managed steps, so that the two sides of a pair run seconds apart at
        most. Nothing this manager holds may be used inside: a storage that is away would not be
        brought back."""
        if not self._attached or self._passthrough:
            yield
            return
        internal_assert(not self._in_step, "runtime: _paused() between steps only")
        obs, mods, lists = self._obs, self._modules, self._lists
        saved = self._saved_entered
        hooked = mods is not None and mods.installed
        if obs is not None:
            obs.suspend()
        if hooked:
            mods.remove()
        if saved:
            self._enter_saved(False)
        if lists is not None:
            lists.remove()
        try:
            if self._mode is not None:
                with torch.utils._python_dispatch._disable_current_modes():
                    yield
            else:
                yield
        finally:
            if lists is not None:
                lists.install()
            if saved:
                self._enter_saved(True)
            if hooked:
                mods.install()
            if obs is not None:
                obs.resume()

    def _enter_saved(self, on: bool) -> None:
        """Push (``on``) or pop the manager's saved-tensor hooks, if they are not so already. They are
        popped only where they were pushed last: attach and detach, or a step's start and end (a
        user's own hooks inside a step are pushed and popped within it)."""
        if on != self._saved_entered and self._saved_hooks is not None:
            if on:
                self._saved_hooks.__enter__()
            else:
                self._saved_hooks.__exit__(None, None, None)
            self._saved_entered = on

    def _teardown(self) -> None:
        if self.provider is not None:
            self.provider.uninstall()
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        if self._obs is not None:
            self._obs.stop()
            if self._obs in QUIET:
                QUIET.remove(self._obs)
        self._enter_saved(False)
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
        for s in self.st.values():
            s.obs = None
        if self._obs is not None:
            self._books = _Count(self._obs.used)
        if self._native_order:
            self.policy.release_order()
            self._native_order = False
        self._obs = None
        self._counts_held = True
        self._attached = False
        # last: the manager is detached whatever the policy's threads raise on their way out
        self.policy.close()

    def __enter__(self) -> MemoryManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()
