"""The Python event source: a ``TorchDispatchMode`` that runs the manager for every ATen operator.

The fallback where the native extension is not built or cannot load, and the reference the native
source is tested against. Before an operator runs, every storage it touches is made resident and
room is made for its outputs, sized by a meta-tensor run cached per shape signature
(:meth:`PythonSource._estimate_out`); after it runs, its new storages are accounted, its writes make
host copies stale, and the policy is told and asked what to move.

State: ``_mode``, ``_meta_cache``, ``_idiom_cache``, ``_nodes``, ``_in_dispatch``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import BudgetError
from ..memory import format_bytes
from ..residency import Status
from ..trace.format import Op
from ..trace.recorder import IGNORED_OPS
from .lists import is_list_operator
from .oom import UNDECLARED_WRITES, retryable
from .storages import _storage_key

RESIDENT = Status.RESIDENT


class _Mode(TorchDispatchMode):
    def __init__(self, mm: PythonSource) -> None:
        super().__init__()
        self.mm = mm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        mm = self.mm
        outer, mm._in_dispatch = mm._in_dispatch, True
        try:
            return mm._dispatch(func, args, kwargs or {})
        finally:
            mm._in_dispatch = outer


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


#: a compressed sparse layout's two index tensors, by the names of their accessors
_COMPRESSED = {torch.sparse_csr: ("crow_indices", "col_indices"), torch.sparse_csc: ("ccol_indices", "row_indices"),
               torch.sparse_bsr: ("crow_indices", "col_indices"), torch.sparse_bsc: ("ccol_indices", "row_indices")}


def _parts(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``, or for a sparse tensor the dense tensors its kernels read (a COO tensor's indices and
    values, a compressed one's index tensors and values): their storages may be away, as any other's
    (csrc/events.cpp's ``see_sparse_input`` does the same)."""
    layout = t.layout
    if layout is torch.strided:
        yield t
    elif layout is torch.sparse_coo:
        yield t._indices()
        yield t._values()
    elif layout in _COMPRESSED:
        for name in _COMPRESSED[layout]:
            yield getattr(t, name)()
        yield t.values()


def _tensors(args: Any, kwargs: Any) -> Iterator[torch.Tensor]:
    for a in itertools.chain(args, kwargs.values()):
        if isinstance(a, torch.Tensor):
            if a.layout is torch.strided:  # (every operator's path: no generator of _parts for it)
                yield a
            else:
                yield from _parts(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    if b.layout is torch.strided:
                        yield b
                    else:
                        yield from _parts(b)


def _tensors_out(out: Any) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors_out(o)


def _works(out: Any) -> list[Any]:
    """The ``Work`` objects a ``c10d::`` operator returned (as TorchScript objects), unboxed."""
    found: list[Any] = []
    stack = [out]
    while stack:
        o = stack.pop()
        if isinstance(o, (list, tuple)):
            stack.extend(o)
        elif isinstance(o, torch.ScriptObject):
            found.append(torch._C._distributed_c10d.Work.unbox(o))
    return found


def _signature(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.layout is not torch.strided:  # (no strides; its meta run fails, and its output is bounded)
            return (tuple(obj.shape), str(obj.layout), obj.dtype, obj.device.type)
        return (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.storage_offset(), obj.device.type)
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v)) for k, v in obj.items())
    if isinstance(obj, torch.Generator):
        return "generator"
    hash(obj)
    return obj


def _to_meta(obj: Any, floats: torch.dtype | None = None) -> Any:
    """``obj`` with every tensor replaced by a meta tensor of its shape and strides (floating ones
    of dtype ``floats`` where given)."""
    if isinstance(obj, torch.Tensor):
        dtype = floats if floats is not None and obj.is_floating_point() else obj.dtype
        return torch.empty_strided(tuple(obj.shape), tuple(obj.stride()), dtype=dtype, device="meta")
    if isinstance(obj, list):
        return [_to_meta(o, floats) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_to_meta(o, floats) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_meta(v, floats) for k, v in obj.items()}
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


def _meta_out_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Bytes of fresh storage ``func`` allocates, from a run on meta tensors; None where no meta run
    can tell (data-dependent output shapes: ``nonzero``, ``unique``; no meta kernel). A meta kernel
    that accepts fewer dtypes than the device's kernel (``_grouped_mm``'s takes bfloat16 only) is
    run again with floating inputs in bfloat16, and floating outputs are sized in the inputs' dtype."""
    real = None  # the first floating input's dtype, looked up only when the plain meta run fails
    for cast in (None, torch.bfloat16):
        if cast is not None:
            real = next((t.dtype for t in _tensors(args, kwargs) if t.is_floating_point()), None)
            if real is None or real == cast:
                return None
        try:
            margs, mkwargs = _to_meta((args, kwargs), cast)
            mout = func(*margs, **mkwargs)
        except Exception:
            continue
        in_keys = {_storage_key(t.untyped_storage()) for t in _tensors(margs, mkwargs)}
        seen, est = set(), 0
        for t in _tensors_out(mout):
            if t.layout is not torch.strided:  # (a sparse result's parts are tracked where they are read)
                continue
            k = _storage_key(t.untyped_storage())
            if k in in_keys or k in seen:
                continue
            seen.add(k)
            n = t.untyped_storage().nbytes()
            if cast is not None and t.is_floating_point():
                n = n // t.element_size() * real.itemsize
            est += n
        return est
    return None


class PythonSource:
    """The operator hook of the Python event source."""

    #: operator signatures whose meta-run output size the Python source remembers (oldest go first)
    META_CACHE_ENTRIES = 1 << 16

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
        self._last_name = name
        collective = name.startswith("c10d::")
        est = 0 if collective else self._estimate_out(func, args, kwargs) or 0  # collectives work in place
        touched = sum(self.st[x].nbytes for x in ins) + est
        if (self._measuring and touched > self._largest_op[0]
                and not (self._lists is not None and is_list_operator(name))):  # (split: lists.py)
            self._largest_op = (touched, where)
        if not self._measure_step and self.budget is not None and touched > self.budget:
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
        rng = self._rng_before(func, args, kwargs)  # a random operator's generator, for a retry (oom.py)
        try:
            out = func(*args, **kwargs)
        except torch.OutOfMemoryError as exc:
            if not retryable(func):  # an in-place or out= operator may have written part of its result
                raise
            self._room_after_oom(str(exc), need, where, est)
            self._rng_restore(rng)  # the retry draws what the failed attempt drew
            try:  # once more (oom.py); a second OOM propagates with the first as its context
                out = func(*args, **kwargs)
            except torch.OutOfMemoryError as again:
                self._oom_retry_failed(str(again), where)
                raise
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
        if collective:
            self._hold_for_collective(set(ins).union(outs), _works(out))
        if self.used > (self.budget or 1 << 62) and not self._measure_step:
            try:
                self.make_room(0, need | set(outs), where)
            except BudgetError:
                pass  # the estimate was short: counted as an overshoot, not an error
        self._note_peak()
        j = self.position
        now = time.perf_counter() - self._t0
        stream = torch._C._cuda_getCurrentStream(self.device.index)[0] if self.cuda else 0
        if name == "aten::record_stream" and self.cuda:  # the tensor is in use on that stream (invariant 7)
            stream = args[1].stream_id
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
            s.stream = stream
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
        extra = UNDECLARED_WRITES.get(func._schema.name, ())
        for i, a in enumerate(func._schema.arguments):
            if (a.alias_info is not None and a.alias_info.is_write) or i in extra:
                v = args[i] if i < len(args) else kwargs.get(a.name)
                for t in _tensors(v if isinstance(v, (list, tuple)) else (v,), {}):
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
        est = _meta_out_bytes(func, args, kwargs)
        if key is not None:
            if len(self._meta_cache) >= self.META_CACHE_ENTRIES:  # shapes change every step in a DyNN
                del self._meta_cache[next(iter(self._meta_cache))]  # the oldest signature goes
            self._meta_cache[key] = est
        if est is None:
            est = _upper_bound(func, args, kwargs)
        return est
