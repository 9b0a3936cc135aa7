"""Record training iterations of any workload as a trace of ATen operators and storage lifetimes.

Mechanism (why each piece is there):

* A ``TorchDispatchMode`` sees every ATen operator below autograd: forward, backward and the
  optimizer step alike. Every tensor argument and result is resolved to its *storage*; a storage
  keeps its Python object while it lives, so ``id(storage)`` is a stable key and a weakref
  finalizer on it marks the free. Views and in-place results resolve to the storage they touch.
* Module paths: global forward pre/post hooks keep a stack of the running modules. For the
  backward pass the post hook tags the autograd nodes a module created (a walk from its outputs
  that stops at nodes already tagged by inner modules), and the mode reads the tag of the node
  being executed (``torch._C._current_autograd_node()``).
* Kinds: parameters and buffers are registered up front; ``saved_tensors_hooks`` marks storages
  saved for backward; gradients and optimizer state are marked after their phase ends.
* Durations: wall clock around the kernel on the CPU; CUDA event pairs on CUDA, resolved when
  the iteration ends (no synchronisation inside the iteration).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .. import hints
from .._version import __version__
from ..errors import TraceError
from ..workload import load_workload, make_optimizer, to_device, train_step, workload_name
from .format import MAGIC, SCHEMA_VERSION, TraceWriter
from .modules import ModuleTracker

__all__ = ["TraceRecorder", "record", "RecordResult", "IGNORED_OPS"]

#: operators neither recorded nor managed: they make views or read metadata, never touch storage bytes
IGNORED_OPS = frozenset({"aten::detach", "aten::lift_fresh", "prim::device", "prim::layout", "prim::dtype"})


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    fn = flop_registry.get(func.overloadpacket)
    if fn is None:
        return 0
    try:
        return int(fn(*args, **kwargs, out_val=out))
    except Exception:  # a flop formula that does not fit this overload: count it as memory-bound
        return 0


class AutogradNodes:
    """Which autograd node an operator belongs to; call it right after the operator ran in a
    ``TorchDispatchMode``. In backward: the node that ran it. In forward: the node it created, if it
    created one (autograd makes the node before the call reaches the mode, so the thread's sequence
    counter has already moved past it; an op that created none leaves the counter where it was).
    Returns the node's sequence number, or -1 (no node: no grad, not differentiable).

    Backward runs the node of each forward operator, so the pair maps a backward operator to the
    forward operator whose gradient it computes (the pilot's *mirror*, docs/pilot.md).

    "Created" is judged against the last node the thread had made when this object was made or
    :meth:`begin` last ran (at each step's or iteration's start): a node made before, or by work
    outside the mode, is never an operator's, so an iteration's nodes do not depend on what ran
    before it. The native event source keeps the same rule (csrc/events.cpp, invariant 15).
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self.begin()

    def begin(self) -> None:
        """From now on, only nodes made after this call are an operator's."""
        self._last = torch._C._autograd._get_sequence_nr() - 1

    def __call__(self) -> int:
        node = torch._C._current_autograd_node()
        if node is not None:
            q = node._sequence_nr()
            return q if q < (1 << 62) else -1  # AccumulateGrad nodes carry UINT64_MAX
        q = torch._C._autograd._get_sequence_nr() - 1
        if q > self._last:
            self._last = q
            return q
        return -1


class TraceRecorder(TorchDispatchMode):
    """Records ops and storage lifetimes into a list of records; ``TraceWriter`` streams them out.

    Use :func:`record` for whole workloads; the class is public for custom loops::

        rec = TraceRecorder(model, device="cpu")
        rec.begin_iteration(0)
        with rec.phase("forward"):
            loss = model(x).sum()
        ...
        records = rec.end_iteration()
    """

    def __init__(self, model: nn.Module, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.device = torch.device(device)
        self.model = model
        self.records: list[dict] = []
        self._sids: dict[int, int] = {}
        self._next_sid = 1
        self._opdefs: dict[str, int] = {}
        self._modules = ModuleTracker(model, on_new=lambda mid, path: self.records.append(
            {"t": "M", "m": mid, "path": path}))
        self._phase = "forward"
        self._active = False
        self._closed = False
        self._cuda_events: list[tuple[dict, Any, Any]] = []
        self._saved_ctx: Any = None
        self._nodes = AutogradNodes()
        self.n_ops = 0
        self._register_model_state()

    # ---- storages ---------------------------------------------------------------------------
    def _sid_of(self, t: torch.Tensor, kind: str = "temp", name: str = "", new: bool = False) -> int | None:
        if t.layout != torch.strided or t.device.type == "meta":
            return None
        st = t.untyped_storage()
        key = id(st)
        sid = self._sids.get(key)
        if sid is not None:
            return sid
        sid = self._next_sid
        self._next_sid += 1
        self._sids[key] = sid
        rec = {"t": "A", "s": sid, "b": st.nbytes(), "dt": str(t.dtype).removeprefix("torch."), "k": kind}
        if name:
            rec["n"] = name
        if not new:
            rec["pre"] = 1
        if t.device != self.device:
            rec["dev"] = str(t.device)
        self.records.append(rec)
        weakref.finalize(st, self._freed, key, sid)
        return sid

    def _freed(self, key: int, sid: int) -> None:
        if self._sids.get(key) == sid:
            del self._sids[key]
        # Frees between iterations are kept too: the reader places them after the last op of the
        # iteration before, which is when they happened.
        if not self._closed:
            self.records.append({"t": "F", "s": sid})

    def _register_model_state(self) -> None:
        for name, p in self.model.named_parameters():
            self._sid_of(p, "param", name)
        for name, b in self.model.named_buffers():
            self._sid_of(b, "buffer", name)
        # These records precede the first iteration mark; they are replayed into it.
        self._pending_pre = self.records
        self.records = []

    def mark_kind(self, t: torch.Tensor, kind: str) -> None:
        sid = self._sid_of(t, kind)
        if sid is not None:
            self.records.append({"t": "K", "s": sid, "k": kind})

    def mark_grads(self, model: nn.Module) -> None:
        """Mark every parameter's gradient ``grad`` (after backward)."""
        for p in model.parameters():
            if p.grad is not None:
                self.mark_kind(p.grad, "grad")

    def mark_optimizer_state(self, opt: torch.optim.Optimizer) -> None:
        """Mark every tensor of the optimizer's state ``opt_state`` (after its step)."""
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.mark_kind(v, "opt_state")

    # ---- interning --------------------------------------------------------------------------
    def _opdef(self, func: Any) -> int:
        name = func.name()
        oid = self._opdefs.get(name)
        if oid is None:
            from ..idioms import idiom_vector

            oid = len(self._opdefs) + 1
            self._opdefs[name] = oid
            self.records.append({"t": "D", "o": oid, "name": name, "iv": list(idiom_vector(func).as_tuple())})
        return oid

    def _current_module(self) -> int:
        return self._modules.current(self._phase == "backward")

    # ---- the dispatch hook ------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cuda = self.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = func(*args, **kwargs)
            end.record()
        else:
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            dt = time.perf_counter() - t0
        if not self._active:
            return out
        name = func.name()
        if name in IGNORED_OPS:
            return out
        in_flat, _ = tree_flatten((args, kwargs))
        out_flat, _ = tree_flatten(out)
        ins: list[int] = []
        nbytes = 0
        for t in in_flat:
            if isinstance(t, torch.Tensor):
                sid = self._sid_of(t, "input")
                if sid is not None and sid not in ins:
                    ins.append(sid)
                nbytes += t.numel() * t.element_size()
        outs: list[int] = []
        allocs: list[int] = []
        for t in out_flat:
            if isinstance(t, torch.Tensor):
                fresh = id(t.untyped_storage()) not in self._sids if t.layout == torch.strided else False
                sid = self._sid_of(t, "temp", new=True)
                if sid is None:
                    continue
                if fresh and sid not in allocs:
                    allocs.append(sid)
                if sid not in outs:
                    outs.append(sid)
                nbytes += t.numel() * t.element_size()
        writes = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(v, torch.Tensor):
                    sid = self._sid_of(v)
                    if sid is not None:
                        writes.append(sid)
        rec: dict[str, Any] = {"t": "O", "o": self._opdef(func), "m": self._current_module(), "i": ins, "x": outs}
        if writes:
            rec["w"] = writes
        if allocs:
            rec["a"] = allocs
        fl = _flops(func, args, kwargs, out)
        if fl:
            rec["f"] = fl
        rec["by"] = nbytes
        q = self._nodes()
        if q >= 0:
            rec["q"] = q
        if cuda:
            self._cuda_events.append((rec, start, end))
        else:
            rec["d"] = round(dt * 1e6, 2)
        self.records.append(rec)
        self.n_ops += 1
        return out

    # ---- iteration control ------------------------------------------------------------------
    def begin_iteration(self, index: int, facts: dict | None = None) -> None:
        self.records.append({"t": "I", "i": index, "facts": facts or {}})
        if self._pending_pre:
            self.records.extend(self._pending_pre)
            self._pending_pre = []
        self._active = True
        self._nodes.begin()
        self._modules.install()
        self._saved_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_ctx.__enter__()
        self.__enter__()
        hints._listen(self)

    # ---- workload hints (dynn_runtime.hints) ------------------------------------------------
    def _hint_step(self) -> None:
        self.records.append({"t": "T"})

    def _hint_use(self, tensors: list[torch.Tensor], steps: int | None) -> None:
        sids: list[int] = []
        for t in tensors:
            sid = self._sid_of(t, "input")
            if sid is not None and sid not in sids:
                sids.append(sid)
        if sids:
            self.records.append({"t": "U", "s": sids, "n": -1 if steps is None else steps})

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = self._sid_of(t, "input")
        if sid is not None:
            self.records.append({"t": "S", "s": sid})
        return t

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def end_iteration(self, facts: dict | None = None) -> list[dict]:
        hints._stop(self)
        self.__exit__(None, None, None)
        self._saved_ctx.__exit__(None, None, None)
        self._modules.remove()
        if self._cuda_events:
            torch.cuda.synchronize(self.device)
            for rec, start, end in self._cuda_events:
                rec["d"] = round(start.elapsed_time(end) * 1e3, 2)
            self._cuda_events = []
        self.records.append({"t": "E", "facts": facts or {}})
        self._active = False
        out, self.records = self.records, []
        return out

    def close(self) -> list[dict]:
        """Stop recording; returns the records produced since the last iteration ended (frees)."""
        self._closed = True
        out, self.records = self.records, []
        return out


@dataclass
class _Phase:
    rec: TraceRecorder
    name: str

    def __enter__(self) -> None:
        self.rec._phase = self.name
        self.rec.records.append({"t": "P", "p": self.name})

    def __exit__(self, *exc: Any) -> None:
        pass


@dataclass
class RecordResult:
    path: Path
    iterations: int
    ops: int
    losses: list[float] = field(default_factory=list)
    traced_seconds: list[float] = field(default_factory=list)


def record(
    workload: str | Any,
    path: str | Path,
    steps: int = 1,
    preset: str = "tiny",
    seed: int = 0,
    device: str = "cpu",
    overrides: dict | None = None,
    on_step: Callable[[int], None] | None = None,
    header_extra: dict | None = None,
) -> RecordResult:
    """Train ``steps`` iterations of ``workload`` under the recorder and write the trace to ``path``.

    ``header_extra`` adds (or replaces) header fields, e.g. how the values were produced."""
    import dataclasses

    if steps < 1:
        raise TraceError(f"trace: steps must be at least 1, got {steps}.")
    spec = workload if isinstance(workload, str) else getattr(workload, "family", type(workload).__name__)
    wl = load_workload(workload, preset=preset, seed=seed, **(overrides or {})) if isinstance(workload, str) else workload
    dev = torch.device(device)
    torch.manual_seed(seed)
    model = wl.model
    # Moving a model already on the device would swap fake parameters (dynn_runtime.trace.fake)
    # for copies, which their weak references forbid.
    if any(t.device != dev for t in (*model.parameters(), *model.buffers())):
        model = model.to(dev)
    opt = make_optimizer(wl, model.parameters())
    cfg = getattr(wl, "config", None)
    header = {
        "t": "H", "magic": MAGIC, "schema": SCHEMA_VERSION, "dynn_runtime": __version__, "torch": torch.__version__,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "workload": workload_name(spec), "preset": preset, "seed": seed,
        "config": _jsonable(dataclasses.asdict(cfg)) if dataclasses.is_dataclass(cfg) else {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    header.update(header_extra or {})
    rec = TraceRecorder(model, dev)
    res = RecordResult(path=Path(path), iterations=steps, ops=0)
    with TraceWriter(path) as w:
        w.write(header)
        for step in range(steps):
            batch = to_device(wl.make_batch(step), dev)
            t0 = time.perf_counter()
            rec.begin_iteration(step)
            try:
                loss_value = train_step(wl, model, opt, batch, phase=rec.phase,
                                        after_backward=lambda: rec.mark_grads(model),
                                        after_optimizer=lambda: rec.mark_optimizer_state(opt)).detach()
                del batch  # freed inside the iteration, as the program's own loop would
            finally:
                facts = wl.step_facts() if callable(getattr(wl, "step_facts", None)) else {}
                w.write_many(rec.end_iteration(_jsonable(facts)))
            res.losses.append(float(loss_value))  # outside the iteration: not the workload's op
            del loss_value
            res.traced_seconds.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step(step)
        res.ops = rec.n_ops
        w.write_many(rec.close())
    return res


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (int, float, str, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return str(obj)


@dataclass
class Overhead:
    workload: str
    preset: str
    untraced_s: float
    traced_s: float

    @property
    def ratio(self) -> float:
        return self.traced_s / self.untraced_s


def measure_overhead(workload: str, preset: str = "small", steps: int = 3, seed: int = 0) -> Overhead:
    """Median step time traced vs untraced, interleaved in one process on the same batches.

    The traced time covers the recorder's dispatch hook, module hooks and saved-tensor hooks; the
    serialisation of records (done once per iteration) is included as well.
    """
    import statistics
    import tempfile

    wl = load_workload(workload, preset=preset, seed=seed)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    plain, traced = [], []
    with tempfile.TemporaryDirectory() as tmp:
        rec = TraceRecorder(model)
        with TraceWriter(Path(tmp) / "t.jsonl.gz") as w:
            for step in range(steps + 1):  # step 0 warms up (optimizer state, allocator)
                batch = wl.make_batch(step)
                t0 = time.perf_counter()
                train_step(wl, model, opt, batch)
                t1 = time.perf_counter()
                rec.begin_iteration(step)
                train_step(wl, model, opt, batch, phase=rec.phase)
                w.write_many(rec.end_iteration())
                t2 = time.perf_counter()
                if step:
                    plain.append(t1 - t0)
                    traced.append(t2 - t1)
            w.write_many(rec.close())
    return Overhead(workload, preset, statistics.median(plain), statistics.median(traced))
