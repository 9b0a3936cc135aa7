"""List operators split into chunks that fit the budget.

``torch._foreach_*``, ``torch._fused_*`` (Adam's and AdamW's ``fused=True``) and
``torch._amp_foreach_non_finite_check_and_unscale_`` (``GradScaler.unscale_``) take one tensor per
parameter: Adam's CUDA default, ``clip_grad_norm_`` and ``zero_grad`` touch every gradient in one
operator, which no budget below the whole parameter set can hold. Each of these operators works
index by index (entry ``i`` of the output depends only on entry ``i`` of each list argument), so
running it on consecutive slices of its lists computes the same bits as running it once.

While a manager is attached, its :class:`ListSplitter` keeps these functions in the ``torch``
namespace replaced (where optimizers, ``clip_grad_norm_`` and ``GradScaler`` look them up at call time) with
wrappers that pass a call through unchanged when its tensors fit ``limit()`` bytes, and otherwise
run it slice by slice, each slice an ordinary operator to the event source. Calls through
``torch.ops.aten`` are not seen (the operator then has to fit whole).

A manager's measuring step runs every call whole (there is no budget yet) and asks whether the
budget it is about to set can hold each operator. A list operator need not fit whole, only its
largest entry (a slice is at least one): while ``measuring()`` says so, the wrappers keep that in
``largest_entry``, and the manager leaves list operators out of its own largest-operator check
(:func:`is_list_operator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .events import native_module

__all__ = ["ListSplitter", "is_list_operator", "list_function_names"]

#: one-dimensional tensor arguments that carry one scalar per list entry (``scalars: Tensor``)
_TENSOR_SCALARS = ("_foreach_addcdiv", "_foreach_addcmul")


#: the ``torch`` functions the wrappers replace: these prefixes, and GradScaler's unscale
_PREFIXES = ("_foreach_", "_fused_")
_UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"


def list_function_names() -> list[str]:
    return sorted(n for n in dir(torch) if n.startswith(_PREFIXES) or n == _UNSCALE)


def is_list_operator(name: str) -> bool:
    """Whether the ATen operator ``name`` (``aten::_foreach_add_.List``) is one the wrappers split,
    when it is called through the ``torch`` namespace."""
    base = name.split("::", 1)[-1]
    return base.startswith(_PREFIXES) or base.split(".", 1)[0] == _UNSCALE


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class ListSplitter:
    """The wrappers, installed while at least one splitter is active: ``limit()`` gives the most
    bytes one call may touch (None: never split), the smallest of the active limits applies.
    ``calls_split`` counts the calls this splitter's limit split. While ``measuring()`` (and no
    limit applies), ``largest_entry`` keeps the most bytes one entry of a call touched, and the
    call's function name."""

    _active: list[ListSplitter] = []
    _saved: dict[str, Any] = {}

    def __init__(self, limit: Callable[[], int | None], measuring: Callable[[], bool] | None = None) -> None:
        self.limit = limit
        self.measuring = measuring
        self.calls_split = 0
        self.largest_entry: tuple[int, str] = (0, "")

    def install(self) -> None:
        cls = type(self)
        if not cls._active:
            for name in list_function_names():
                orig = getattr(torch, name)
                cls._saved[name] = orig
                setattr(torch, name, _wrap(name, orig))
        cls._active.append(self)

    def remove(self) -> None:
        cls = type(self)
        if self in cls._active:
            cls._active.remove(self)
        if not cls._active:
            for name, orig in cls._saved.items():
                setattr(torch, name, orig)
            cls._saved = {}

    @classmethod
    def _limit(cls) -> tuple[int | None, ListSplitter | None]:
        best: tuple[int | None, ListSplitter | None] = (None, None)
        for sp in cls._active:
            lim = sp.limit()
            if lim is not None and (best[0] is None or lim < best[0]):
                best = (lim, sp)
        return best

    @classmethod
    def _measure(cls, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A call that runs whole: the splitters that measure keep its largest entry."""
        measuring = [sp for sp in cls._active if sp.measuring is not None and sp.measuring()]
        if not measuring:
            return
        n = _list_length(args, kwargs)
        if n < 1:
            return
        top = max(_per_entry(name, n, args, kwargs))
        for sp in measuring:
            if top > sp.largest_entry[0]:
                sp.largest_entry = (top, name)


def _list_length(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The length of the call's tensor lists (0: none)."""
    return next((len(a) for a in (*args, *kwargs.values())
                 if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)), 0)


def _per_entry(name: str, n: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """The bytes each of the ``n`` entries of a call touches: its tensor in every list argument,
    and, for an out-of-place function, its result (as large as its tensor in the first list)."""
    per = [0] * n
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)) and len(a) == n:
            for i, t in enumerate(a):
                per[i] += _nbytes(t)
    if not name.endswith("_"):
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and len(a) == n)
        for i, t in enumerate(first):
            per[i] += _nbytes(t)
    return per


def _wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
    tensor_scalars = name.startswith(_TENSOR_SCALARS)

    def call(*args: Any, **kwargs: Any) -> Any:
        limit, owner = ListSplitter._limit()
        if limit is None:
            ListSplitter._measure(name, args, kwargs)
            return orig(*args, **kwargs)
        n = _list_length(args, kwargs)
        if n < 2:
            return orig(*args, **kwargs)
        total = _total_nbytes(name, n, (*args, *kwargs.values()))
        if total is not None and total <= limit:  # the sum of `per` below, summed natively
            return orig(*args, **kwargs)
        per = _per_entry(name, n, args, kwargs)
        if sum(per) <= limit:
            return orig(*args, **kwargs)
        owner.calls_split += 1
        bounds, lo, acc = [], 0, 0
        for i, b in enumerate(per):
            if i > lo and acc + b > limit:
                bounds.append((lo, i))
                lo, acc = i, 0
            acc += b
        bounds.append((lo, n))

        def piece(a: Any, lo: int, hi: int) -> Any:
            if isinstance(a, (list, tuple)) and len(a) == n:
                return a[lo:hi]
            if tensor_scalars and isinstance(a, torch.Tensor) and a.dim() == 1 and a.numel() == n:
                return a[lo:hi]
            return a

        outs = [orig(*[piece(a, lo, hi) for a in args], **{k: piece(v, lo, hi) for k, v in kwargs.items()})
                for lo, hi in bounds]
        return _join(outs)

    call.__wrapped__ = orig  # type: ignore[attr-defined]
    call.__name__ = name
    return call


def _total_nbytes(name: str, n: int, args: tuple[Any, ...]) -> int | None:
    """What ``sum(per)`` in ``call`` comes to, each list summed by the extension
    (``_C.list_nbytes``); None where it is not built or a list holds a tensor subclass."""
    c = native_module()
    if c is None:
        return None
    measured = [a for a in args if isinstance(a, (list, tuple)) and len(a) == n]
    if not name.endswith("_"):  # out of place: the results are as large as the first list
        measured.append(measured[0])
    total = 0
    for a in measured:
        b = c.list_nbytes(a)
        if b < 0:
            return None
        total += b
    return total


def _join(outs: list[Any]) -> Any:
    first = outs[0]
    if first is None:
        return None
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (list, tuple)):
        return tuple(_join([o[k] for o in outs]) for k in range(len(first)))  # several lists (fused, out of place)
    if isinstance(first, (list, tuple)):
        return type(first)(t for o in outs for t in o)
    raise TypeError(f"runtime: cannot join the results of a split list operator ({type(first).__name__})")
