"""The hook surface the runtime programs against, and the providers that deliver it.

The memory manager asks three things of PyTorch (:class:`HookClient`, implemented by
:class:`~dynn_runtime.runtime.manager.MemoryManager`):

``fetch(sids, where)``
    make these storages resident before this work runs;
``reclaim(nbytes, device) -> freed``
    free this many device bytes now (an allocation is waiting for them);
``lookahead(sids)``
    these storages are read next: start bringing them back.

Three providers deliver them, best first; :func:`select_provider` picks one at attach and
``MemoryManager.stats()["hook_provider"]`` / ``dynn doctor`` say which and why:

``patched``
    a torch built from ``patches/`` (``torch._C._dynn_*``, :mod:`dynn_runtime.native`). The CUDA
    caching allocator calls *reclaim* on an allocation it cannot satisfy, before raising
    out-of-memory; the autograd engine calls *fetch* right before a node runs (its saved
    tensors, indexed at pack time by the node's sequence number) and *lookahead* with the nodes
    that became ready since. Operator events still come from the event source underneath
    (``native`` or ``python``), which keeps the budget as below.
``native``
    the stock-PyTorch native extension (``dynn_runtime._C``, ``csrc/events.cpp``): *fetch* when
    an operator reads a storage that is away (a fault caught in C++); *reclaim* is the budget,
    kept after operators; no *lookahead* (the policy plans ahead from history).
``python``
    the ``TorchDispatchMode`` fallback: *fetch* before every operator; *reclaim* is the budget,
    kept before operators; no *lookahead*.

Rules the providers keep (tests/runtime/test_providers.py checks each):

1. A provider never moves a storage itself; it calls the client, which applies the policy
   and the copy invariants of manager.py.
2. ``patched``: the reclaim hook runs without the allocator's lock (patches/README.md), so the
   client's evictions free through the allocator re-entrantly; those frees are observed and
   count as reclaimed even when the client under-reports.
3. ``patched``: a fetch that cannot be served raises (the backward fails like a failing node);
   a look-ahead that fails is only logged (advice).
4. Only one provider is installed per manager, between attach and detach.

Example (selection, with a fake probe)::

    >>> from dynn_runtime.native import NativeFeatures
    >>> stock = NativeFeatures(available=False, reason="stock torch")
    >>> select_provider("cpu", "python", "asked for", probe_fn=lambda: stock).name
    'python'
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Protocol

from .._log import logger
from ..errors import ConfigError
from ..native import (
    EngineHooks,
    HookPath,
    NativeFeatures,
    NativeHooks,
    Preference,
    ReclaimRegistry,
    SavedTensorIndex,
    probe,
    select_path,
)
from ..native.protocol import ReadyNode
from ..residency import Status
from .events import no_mode

__all__ = [
    "HOOK_CHOICES",
    "Verb",
    "HookClient",
    "Provider",
    "PythonProvider",
    "NativeEventsProvider",
    "PatchedProvider",
    "select_provider",
    "ProviderClient",
]

#: what ``MemoryManager(hooks=...)`` accepts besides a :class:`Provider` instance
HOOK_CHOICES = ("auto", "stock", "patched")


class Verb(enum.Enum):
    FETCH = "fetch"
    RECLAIM = "reclaim"
    LOOKAHEAD = "lookahead"


class HookClient(Protocol):
    """What a provider may call (the runtime side of the surface)."""

    def hook_fetch(self, sids: Sequence[int], where: str) -> int:
        """Make ``sids`` resident now; returns the bytes brought back."""

    def hook_reclaim(self, nbytes: int, device: int) -> int:
        """Evict at least ``nbytes`` if the policy allows; returns the bytes released."""

    def hook_lookahead(self, sids: Sequence[int]) -> int:
        """Start prefetching ``sids`` within the budget; returns the bytes started."""

    def hook_sid(self, tensor: Any) -> int | None:
        """The managed storage id behind ``tensor`` (None: not managed)."""


class Provider:
    """One way of delivering the surface. Subclasses say what they deliver and how."""

    name: ClassVar[str]
    #: verb -> how this provider delivers it (missing: not delivered)
    delivers: ClassVar[dict[Verb, str]]

    def __init__(self) -> None:
        self.reason = ""
        self.event_source = ""

    def install(self, client: HookClient) -> None:
        """Connect to ``client`` (called at the end of attach)."""

    def uninstall(self) -> None:
        """Disconnect (called at detach); idempotent."""

    def wrap_pack(self, pack: Callable[[Any], Any]) -> Callable[[Any], Any] | None:
        """A pack hook that also does what this provider needs at pack time; None: not needed."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {
            "hook_provider": self.name,
            "hook_provider_reason": self.reason,
            "hook_delivers": {v.value: self.delivers.get(v) for v in Verb},
        }


class PythonProvider(Provider):
    name = "python"
    delivers: ClassVar[dict[Verb, str]] = {
        Verb.FETCH: "before every operator (TorchDispatchMode)",
        Verb.RECLAIM: "the budget, kept before operators",
    }


class NativeEventsProvider(Provider):
    name = "native"
    delivers: ClassVar[dict[Verb, str]] = {
        Verb.FETCH: "an operator reading an away storage (fault in dynn_runtime._C)",
        Verb.RECLAIM: "the budget, kept after operators",
    }


class PatchedProvider(Provider):
    """The patched build's hooks (``torch._C._dynn_*``); ``torch_c`` is injectable (tests pass a fake)."""

    name = "patched"
    delivers: ClassVar[dict[Verb, str]] = {
        Verb.FETCH: "autograd engine, right before a node runs (its saved tensors)",
        Verb.RECLAIM: "CUDA caching allocator, on an allocation it cannot satisfy",
        Verb.LOOKAHEAD: "autograd engine, the nodes that became ready",
    }

    def __init__(self, torch_c: Any = None, *, max_attempts: int = 3) -> None:
        super().__init__()
        if torch_c is None:
            import torch

            torch_c = torch._C
        self._c = torch_c
        self.reclaim = ReclaimRegistry(max_attempts)
        self.engine = EngineHooks()
        self.index = SavedTensorIndex()
        self._native: NativeHooks | None = None
        self._client: HookClient | None = None
        self._handles: list[Any] = []
        self.fetched_bytes = self.prefetched_bytes = self.reclaimed_bytes = 0
        self._adds = 0

    def install(self, client: HookClient) -> None:
        if self._native is not None:
            raise ConfigError("runtime: this PatchedProvider is installed already; one provider per manager.")
        self._client = client
        self._handles = [
            self.reclaim.set_hook(self._on_reclaim),
            self.engine.set_fetch_hook(self._on_fetch),
            self.engine.set_lookahead_hook(self._on_lookahead),
        ]
        self._native = NativeHooks(self.reclaim, self.engine, self._c).install()

    def uninstall(self) -> None:
        if self._native is None:
            return
        self._native.uninstall()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._native = None
        self._client = None

    #: index entries of nodes more than this many sequence numbers older than the newest are
    #: dropped: their backward never ran (the graph was freed), and sequence numbers only grow
    INDEX_WINDOW = 1 << 22

    def wrap_pack(self, pack: Callable[[Any], Any]) -> Callable[[Any], Any]:
        peek = self._c._dynn_peek_sequence_nr

        def packed(t: Any) -> Any:
            out = pack(t)
            client = self._client
            if client is None:
                return out
            # A pack hook runs right after its node was made: that node's number is the next-1.
            seq = int(peek()) - 1
            sid = client.hook_sid(t)
            # Not managed yet (a batch input the manager first sees later): resolved at fetch time
            # through a weak reference to the packed alias, which lives exactly as long as the graph.
            self.index.add(seq, sid if sid is not None else weakref.ref(out))
            self._adds += 1
            if self._adds % 4096 == 0:
                self.index.forget_below(seq - self.INDEX_WINDOW)
            return out

        return packed

    def _sids(self, handles: Iterable[Any]) -> list[int]:
        client, out = self._client, []
        for h in handles:
            if isinstance(h, int):
                out.append(h)
            elif client is not None and (obj := h()) is not None:
                sid = client.hook_sid(obj)
                if sid is not None:
                    out.append(sid)
        return list(dict.fromkeys(out))

    # -- trampolines (called by the native side, GIL held, no allocator or engine lock) ----------
    def _on_reclaim(self, request: Any) -> int:
        client = self._client
        if client is None:
            return 0
        freed = client.hook_reclaim(int(request.nbytes), int(request.device))
        self.reclaimed_bytes += freed
        return freed

    def _on_fetch(self, sequence_nr: int, name: str) -> None:
        client = self._client
        sids = self._sids(self.index.for_node(sequence_nr))
        if client is not None and sids:
            self.fetched_bytes += client.hook_fetch(sids, f"autograd node {name} (#{sequence_nr})")
        self.index.forget(sequence_nr)  # a node runs once per backward

    def _on_lookahead(self, nodes: list[ReadyNode]) -> None:
        client = self._client
        sids = self._sids(self.index.for_nodes(n.sequence_nr for n in nodes))
        if client is not None and sids:
            self.prefetched_bytes += client.hook_lookahead(sids)

    def stats(self) -> dict[str, Any]:
        r, e = self.reclaim.stats, self.engine.stats
        return {
            "reclaim_calls": r.calls, "reclaim_recovered": r.recovered, "reclaim_exhausted": r.exhausted,
            "reclaim_errors": r.errors, "reclaim_bytes_reported": r.bytes_reported,
            "reclaim_bytes_observed": r.bytes_observed, "fetch_calls": e.fetch_calls,
            "fetched_bytes": self.fetched_bytes, "lookahead_calls": e.lookahead_calls,
            "prefetched_bytes": self.prefetched_bytes, "saved_indexed": len(self.index),
        }


def select_provider(
    device: str,
    event_source: str,
    event_reason: str,
    *,
    hooks: str | Provider = "auto",
    probe_fn: Callable[[], NativeFeatures] = probe,
    cuda_available: bool | None = None,
) -> Provider:
    """The best provider for ``device`` given the resolved event source, with its reason set.

    ``hooks``: ``auto`` (patched where the probe and the device allow it, else the event
    source's provider), ``stock`` (never the patched hooks), ``patched`` (the patched hooks or a
    NativeError saying why not), or a :class:`Provider` instance used as is (tests).
    """
    base: Provider = NativeEventsProvider() if event_source == "native" else PythonProvider()
    base.event_source = event_source
    if isinstance(hooks, Provider):
        hooks.event_source = event_source
        hooks.reason = hooks.reason or "given to the manager"
        return hooks
    if hooks not in HOOK_CHOICES:
        raise ConfigError(f"runtime: hooks={hooks!r} is not one of {', '.join(HOOK_CHOICES)} (or a Provider).")
    if hooks == "stock":
        base.reason = f"stock hooks asked for (hooks='stock'); events: {event_reason}"
        return base
    prefer = Preference.REQUIRE_NATIVE if hooks == "patched" else Preference.AUTO
    feats = probe_fn()
    choice = select_path(feats, device, prefer=prefer, cuda_available=cuda_available)
    if choice.path is HookPath.NATIVE:
        p = PatchedProvider()
        p.event_source = event_source
        p.reason = f"{choice.reason}; operator events: {event_source}"
        logger.info("runtime: hook provider patched (%s)", p.reason)
        return p
    base.reason = f"patched hooks unavailable ({choice.reason}); events: {event_reason}"
    return base


HOST, FETCHING, RESIDENT = Status.HOST, Status.FETCHING, Status.RESIDENT


class ProviderClient:
    """The runtime side of the surface (:class:`HookClient`), mixed into ``MemoryManager``.

    Each verb goes through the manager's own mechanism (rule 1): a fetch is a demand fetch
    (``_fetch_now``: room made per the policy, the compute stream waits), a reclaim evicts the
    policy's victims, a look-ahead is a budgeted prefetch.
    """

    def _hook_settle(self) -> None:
        self._drain()
        if self._obs is not None:  # storages born since the operator log was last read
            self._native_parse(in_step=self._in_step)

    def hook_sid(self, tensor: Any) -> int | None:
        if self._obs is not None:
            import torch

            sid = self._obs.sid_of(tensor) if type(tensor) in (torch.Tensor, torch.nn.Parameter) else -1
            return None if sid < 0 else sid
        return self._sid(tensor)

    def hook_fetch(self, sids: Sequence[int], where: str) -> int:
        brought = 0
        with no_mode():
            self._hook_settle()
            need = set(sids)
            for sid in sids:
                s = self.st.get(sid)
                if s is None or s.storage() is None or s.status not in (HOST, FETCHING):
                    continue
                self._fetch_now(s, exclude=need, where=where)
                brought += s.nbytes
        return brought

    def hook_reclaim(self, nbytes: int, device: int) -> int:
        if not self._attached or (self.cuda and device != self.device.index):
            return 0
        freed = 0
        with no_mode():
            self._hook_settle()
            busy = set(self._last_busy)  # what the operator in flight reads stays
            for sid in self._victims(nbytes, busy):
                s = self.st.get(sid)
                if s is None or sid in busy or not self._evict(s):
                    continue
                freed += s.nbytes
                if freed >= nbytes:
                    break
        return freed

    def hook_lookahead(self, sids: Sequence[int]) -> int:
        started = 0
        with no_mode():
            self._hook_settle()
            for sid in sids:
                s = self.st.get(sid)
                if s is None or s.status != HOST:
                    continue
                self._prefetch(s)
                if s.status in (FETCHING, RESIDENT):
                    started += s.nbytes
        return started
