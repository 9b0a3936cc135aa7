"""Assign an idiom vector to every operator registered in the running torch.

Lookups are cached by the operator's name, so the trace recorder's hot path
(``idiom_vector(func)`` inside ``__torch_dispatch__``) costs a dictionary hit after the first call.

How overloads of one base name combine (for :func:`all_vectors` and for base-name lookups such as
``idiom_vector("add")``): the base name takes the vector of its **primary overload**, the first
of its overloads in this order:

1. overloads that take or return a tensor before those that do not (``add.Tensor`` before the
   TorchScript scalar ``add.int``);
2. functional overloads before ``out=`` ones (an ``out=`` overload only adds the accumulate flag);
3. the default overload (``""``), then ``Tensor``, then the rest by name.

One exception: ``where`` takes ``where.self`` (the default overload is the legacy
``where(condition)``, an alias of ``nonzero(as_tuple=True)``).

This is the overload a user reaches by calling the operator with tensors, and the one the paper's
table names. A specific overload (``"add_.Tensor"``, an ``OpOverload``) always gets its own vector.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

import torch

from .._log import logger
from ..errors import ConfigError
from .rules import apply_rules, facts_from_op
from .vector import IdiomVector

__all__ = ["idiom_vector", "all_vectors", "operator_names", "overloads_of"]


@functools.cache
def _registry() -> dict[str, dict[str, tuple[str, ...]]]:
    """namespace -> base name -> overload names ("" for default), from the dispatcher."""
    out: dict[str, dict[str, list[str]]] = {}
    for qual in torch._C._dispatch_get_all_op_names():
        ns, sep, rest = qual.partition("::")
        if not sep:
            continue
        base, _, overload = rest.partition(".")
        out.setdefault(ns, {}).setdefault(base, []).append(overload)
    return {ns: {b: tuple(sorted(set(o))) for b, o in d.items()} for ns, d in out.items()}


def operator_names(namespace: str = "aten") -> tuple[str, ...]:
    """Sorted base names of every operator registered under ``namespace``.

    Example::

        >>> from dynn_runtime.idioms import operator_names
        >>> "convolution" in operator_names()
        True
    """
    return tuple(sorted(_registry().get(namespace, {})))


def overloads_of(base: str, namespace: str = "aten") -> tuple[str, ...]:
    """Overload names of one base name (``""`` is the default overload)."""
    return _registry().get(namespace, {}).get(base, ())


def _resolve(namespace: str, base: str, overload: str) -> Any:
    ns = getattr(torch.ops, namespace)
    packet = getattr(ns, base)
    return getattr(packet, overload or "default")


# Base names whose default overload is not the one tensor code calls: `where(condition)` is the
# legacy nonzero-as-tuple form, `where.self` the select everyone uses.
_PREFERRED_OVERLOAD = {"where": "self"}


def _overload_rank(namespace: str, base: str, overload: str) -> tuple:
    try:
        facts = facts_from_op(_resolve(namespace, base, overload))
    except (AttributeError, RuntimeError):
        return (2, 2, 2, overload)
    tensorish = facts.n_tensor_args + facts.n_tensor_returns > 0
    name_rank = 0 if overload == "" else 1 if overload == "Tensor" else 2
    return (0 if tensorish else 1, 1 if facts.out else 0, name_rank, overload)


@functools.cache
def _primary_overload(namespace: str, base: str) -> str:
    overloads = overloads_of(base, namespace)
    preferred = _PREFERRED_OVERLOAD.get(base) if namespace == "aten" else None
    if preferred in overloads:
        return preferred
    return min(overloads, key=lambda o: _overload_rank(namespace, base, o))


def _unknown(name: str, namespace: str) -> ConfigError:
    names = operator_names(namespace)
    base = name.partition(".")[0]
    close = difflib.get_close_matches(base, names, n=5, cutoff=0.6)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return ConfigError(
        f"idioms: unknown operator {name!r}: expected an operator registered in torch "
        f"{torch.__version__} under '{namespace}::' (base name, 'base.overload' or "
        f"'{namespace}::base'), found none by that name.{hint} "
        "List them all with `dynn idioms`."
    )


def _split(name: str) -> tuple[str, str, str | None]:
    """'aten::add_.Tensor' -> ('aten', 'add_', 'Tensor'); overload None means 'base name only'."""
    s = name.strip()
    namespace = "aten"
    if "::" in s:
        namespace, _, s = s.partition("::")
    base, dot, overload = s.partition(".")
    if not dot:
        return namespace, base, None
    return namespace, base, "" if overload == "default" else overload


# Bounded LRU: torch registers ~3.6k overloads, so 8192 entries never evict in practice.
@functools.lru_cache(maxsize=8192)
def _vector_by_name(name: str) -> IdiomVector:
    namespace, base, overload = _split(name)
    known = overloads_of(base, namespace)
    if not known:
        raise _unknown(name, namespace)
    if overload is None:
        overload = _primary_overload(namespace, base)
    elif overload not in known:
        choices = ", ".join(o or "default" for o in known)
        raise ConfigError(
            f"idioms: operator {namespace}::{base} has no overload {overload or 'default'!r}; "
            f"expected one of: {choices}."
        )
    try:
        op = _resolve(namespace, base, overload)
    except (AttributeError, RuntimeError) as exc:  # registered in the dispatcher, no Python binding
        raise ConfigError(
            f"idioms: operator {name!r} is registered but torch.ops cannot load it ({exc}); "
            "pass an OpOverload instead."
        ) from None
    return apply_rules(facts_from_op(op))


@functools.lru_cache(maxsize=8192)
def _vector_by_overload(qualified: str, overload: str) -> IdiomVector:
    # OpOverload._name is 'aten::relu' for the default overload and 'aten::add.Tensor' otherwise.
    if overload == "default":
        return _vector_by_name(qualified + ".default")
    return _vector_by_name(qualified)


def idiom_vector(op: Any) -> IdiomVector:
    """The idiom vector of one operator.

    ``op`` may be a ``torch._ops.OpOverload`` (what ``__torch_dispatch__`` receives as ``func``),
    a ``torch._ops.OpOverloadPacket`` (``torch.ops.aten.add``), or a string: ``"aten::convolution"``,
    ``"convolution"``, ``"convolution.default"``, ``"add_.Tensor"``. A base name (no overload)
    gets the vector of its primary overload (see the module docstring). Results are cached by the
    operator's name; a repeated call is a cache hit.

    Raises :class:`~dynn_runtime.errors.ConfigError` for a name no registered operator has, with
    close names suggested.

    Example::

        >>> import torch
        >>> from dynn_runtime.idioms import idiom_vector
        >>> idiom_vector("add_").as_tuple()
        (0, 1, 0, 0, 0, 0)
        >>> idiom_vector(torch.ops.aten.transpose.int).as_tuple()
        (1, 0, 0, 0, 0, 0)
        >>> v = idiom_vector("aten::convolution")
        >>> v.as_tuple(), v.source
        ((0, 1, 0, 1, 1, 2), 'override:convolution')
    """
    if isinstance(op, str):
        return _vector_by_name(op)
    overload = getattr(op, "_overloadname", None)
    if overload is not None:
        return _vector_by_overload(op._name, overload)
    qualified = getattr(op, "_qualified_op_name", None)
    if qualified is not None:  # OpOverloadPacket
        return _vector_by_name(qualified)
    raise ConfigError(
        f"idioms: idiom_vector expects an OpOverload, an OpOverloadPacket or an operator name, "
        f"found {type(op).__name__}: {op!r}."
    )


@functools.lru_cache(maxsize=4)
def _all_vectors(namespace: str) -> dict[str, IdiomVector]:
    out: dict[str, IdiomVector] = {}
    skipped = 0
    for base in operator_names(namespace):
        try:
            out[base] = _vector_by_name(f"{namespace}::{base}")
        except ConfigError:
            skipped += 1
    if skipped:
        logger.debug("idioms: %d %s operators have no Python binding; skipped", skipped, namespace)
    return out


def all_vectors(namespace: str = "aten") -> dict[str, IdiomVector]:
    """Vectors of every operator registered under ``namespace``, keyed by base name (sorted).

    Base names are the ATen names without namespace or overload, as the paper's table names
    them; each takes its primary overload's vector (module docstring). Deterministic: the same
    torch build always gives the same dictionary.

    Example::

        >>> from dynn_runtime.idioms import all_vectors
        >>> vecs = all_vectors()
        >>> vecs["mm"].as_tuple(), vecs["mm"].source
        ((0, 1, 0, 1, 1, 0), 'matmul')
    """
    return dict(_all_vectors(namespace))


def cache_info() -> Any:
    """Hit/miss statistics of the per-name lookup cache (``functools`` ``CacheInfo``)."""
    return _vector_by_name.cache_info()


def overload_cache_info() -> Any:
    """Hit/miss statistics of the ``OpOverload`` lookup cache (the dispatch hot path)."""
    return _vector_by_overload.cache_info()
