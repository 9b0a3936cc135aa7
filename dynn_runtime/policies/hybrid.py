"""Recompute or copy, per victim: the swapping policies' eviction order, DTR's rematerialisation where
it costs the compute stream less than a copy would.

:class:`RecomputeOrCopy` is a mixin over a :class:`~dynn_runtime.policies.nextuse.NextUsePolicy`
(Belady over predicted next uses, prefetch into free memory). The victims and their order are the
base policy's; what the mixin decides is how each victim leaves (:meth:`RecomputeOrCopy.evict_mode`),
by comparing two estimates of the seconds the compute stream loses:

* **recompute**: :meth:`~dynn_runtime.policies.base.MemoryView.recompute_cost`, the victim's producer
  plus every dropped or freed ancestor the rebuild would have to re-run first (its chain), at the
  device profile's operator times, plus fetching the rebuild's inputs that are on the host. Paid
  once, on the compute stream, when the storage is next read. A storage predicted never to be read
  again costs nothing to drop. Only short rebuilds are allowed (:class:`RecomputeOrCopy`).
* **copy**: a victim is chosen because memory is short now, and an offload frees its bytes only
  when its copy lands, so the copy out counts whole
  (:meth:`~dynn_runtime.policies.base.MemoryView.copy_seconds`). The fetch back counts whole while
  a copy engine has a backlog (:meth:`~dynn_runtime.policies.base.MemoryView.link_backlog`: the
  link is the bottleneck, and a round trip costs its link time whatever the prefetch hides), else
  only its part longer than the time until the predicted next use (at most ``lookahead``
  operators, at the iteration's mean operator time so far). So a busy link makes copies dear and
  drops likely: "move when the link is free".

It drops (``"drop"``) when the recompute estimate is at most the copy estimate and the storage may
be rebuilt (:meth:`~dynn_runtime.policies.base.MemoryView.recomputable`: an activation or temporary
of this iteration, outside the optimizer step, not written in place since); otherwise it offloads.
The base policy's ``"discard"`` (the oracle's never-read-again) is not used: a rebuild may read what
the program never reads again; such a storage is dropped where it may be, at no estimated cost.

Where it runs: rematerialising arbitrary ATen operators is the simulator's only (``recomputes =
"operators"``, as ``dtr``): the live manager refuses these policies with a message naming the
alternatives. Not modelled by the estimates: the memory a rebuild needs while it runs, and an
input of the rebuild freed against the prediction (the engine charges both when they happen).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

from .base import NO_CONTEXT, IterationContext, register
from .nextuse import OraclePolicy

__all__ = ["RecomputeOrCopy", "HybridOraclePolicy"]

_INF = float("inf")
#: kinds that live across iterations: never freed before a rebuild reads them
_PERSISTENT = frozenset({"param", "buffer", "opt_state"})


class RecomputeOrCopy:
    """Mixin: each victim of a next-use policy is dropped or offloaded, whichever is cheaper.

    Rebuilds stay short. A victim is dropped only if its rebuild re-creates at most ``max_chain``
    storages (it and the ancestors that are dropped or freed now) and every held storage the rebuild
    reads (its *leaves*, on the device or the host) will still be held when it runs: predicted to be
    read again no earlier than the victim, or held across iterations (parameters, optimizer state),
    or, in the forward pass, saved by autograd (held into the backward pass, where the victim's next
    read is). A leaf of a storage dropped now is not dropped itself while that one is away. Unbounded
    chains would make one read re-run many operators and pin every input along them on the device
    while they run (what stops ``dtr`` at low budgets); a wrong prediction here makes a longer
    rebuild, never a wrong one (the engine rebuilds whatever is missing).
    """

    recomputes: ClassVar[Literal["operators"]] = "operators"
    #: the most storages one rebuild may re-create (the victim and its dropped or freed ancestors)
    max_chain: int = 8
    #: choices made so far in this run, by how the victim left (``drop``, ``offload``)
    choices: dict[str, int]

    def attach(self, view) -> None:  # noqa: ANN001  (the MemoryView of the mechanism)
        super().attach(view)
        self.choices = {"drop": 0, "offload": 0}
        #: per storage allocated this iteration (freed ones too), the storages its producer read
        self._reads: dict[int, tuple[int, ...]] = {}
        #: storages this policy dropped and has not seen back
        self._dropped: set[int] = set()
        #: per storage, how many dropped storages' rebuilds read it (not dropped while above 0)
        self._pinned: dict[int, int] = {}
        #: per dropped storage, the held storages its rebuild reads (pinned while it is away)
        self._leaves: dict[int, set[int]] = {}

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        super().begin_iteration(index, context)
        self._reads.clear()  # rebuilds re-run this iteration's operators only

    def on_op(self, position: int, op) -> None:  # noqa: ANN001  (an Op record)
        super().on_op(position, op)
        if op.allocs:
            reads = tuple(set(op.inputs) - set(op.allocs))
            for sid in op.allocs:
                self._reads[sid] = reads

    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        """The base policy's victims, then any other resident storage: a rebuild re-creates freed
        ancestors for its duration, which a policy that tracks the program's storages (the pilot's
        feature state) no longer knows, and they must be able to leave too."""
        offered: set[int] = set()
        inner = super().victims(need_bytes, exclude)
        try:
            for sid in inner:
                offered.add(sid)
                yield sid
        finally:
            inner.close()
        view = self.view
        for sid in list(view.resident()):
            if sid not in exclude and sid not in offered and view.status(sid) == "resident":
                yield sid

    def on_access(self, sid: int, position: int) -> None:
        super().on_access(sid, position)
        if sid in self._dropped:
            self._back(sid)

    def on_free(self, sid: int) -> None:
        super().on_free(sid)
        if sid in self._dropped:
            self._back(sid)
        # its reads stay known: a rebuild of a later storage may have to re-create it (a chain)

    def _back(self, sid: int) -> None:
        """``sid`` is no longer away as a drop (rebuilt, or freed): its rebuild's inputs may leave."""
        self._dropped.discard(sid)
        pinned = self._pinned
        for x in self._leaves.pop(sid, ()):
            n = pinned.get(x, 0) - 1
            if n > 0:
                pinned[x] = n
            else:
                pinned.pop(x, None)

    def _rebuild_plan(self, sid: int) -> tuple[int, set[int]] | None:
        """The storages a rebuild of ``sid`` would re-create (it and its dropped or freed ancestors)
        and the held storages it would read; None when that is more than ``max_chain`` storages or
        an ancestor's producer is unknown."""
        view = self.view
        seen: set[int] = set()
        leaves: set[int] = set()
        stack = [sid]
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            reads = self._reads.get(x)
            if reads is None or len(seen) > self.max_chain:
                return None
            for y in reads:
                if view.status(y) in ("dropped", "absent"):
                    stack.append(y)
                else:
                    leaves.add(y)
        return len(seen), leaves - seen

    def recompute_estimate(self, sid: int) -> float:
        """Seconds the compute stream spends rebuilding ``sid`` on its next read (infinity: it may
        not be dropped: not recomputable, a rebuild longer than ``max_chain``, an input that may be
        gone by then, or read by the rebuild of a storage dropped now)."""
        view = self.view
        if sid in self._pinned or not view.recomputable(sid):
            return _INF
        plan = self._rebuild_plan(sid)
        if plan is None:
            return _INF
        nu = self._nu(sid)
        fetch = 0.0
        forward = view.phase == "forward"
        for x in plan[1]:
            if self._nu(x) < nu and view.kind(x) not in _PERSISTENT and not (forward and view.saved(x)):
                return _INF  # the program may free it before the rebuild: the rebuild would grow
            if view.status(x) == "host":
                fetch += view.copy_seconds(view.nbytes(x), "h2d") or 0.0
        if nu == _INF:
            return 0.0  # predicted never read again: dropping it costs nothing unless the prediction is wrong
        return view.recompute_cost(sid) + fetch

    def copy_estimate(self, sid: int) -> float:
        """Seconds the compute stream loses to an offload of ``sid`` now and its fetch back.

        Memory is short now and an offload frees its bytes only when its copy lands: the copy out
        counts whole. The fetch back counts whole while a copy engine has a backlog (the link is
        the bottleneck: every byte on it delays the copies the compute stream waits for, so a
        round trip costs its link time whatever the prefetch hides), else only its part longer than
        the time until the predicted next use (at most ``lookahead`` operators, at the iteration's
        mean operator time so far), which a prefetch cannot hide. The backlog itself is not added:
        the copies queued ahead are waited for whether this one is dropped or not."""
        view = self.view
        nbytes = view.nbytes(sid)
        out = view.copy_seconds(nbytes, "d2h")
        if out is None:
            return 0.0  # the link is not modelled: offloading is the default
        nu = self._nu(sid)
        if nu == _INF:
            return out
        fetch = view.copy_seconds(nbytes, "h2d") or 0.0
        if (view.link_backlog("d2h") or 0.0) > 0.0 or (view.link_backlog("h2d") or 0.0) > 0.0:
            return out + fetch
        pos = max(view.position, 0)
        ahead = nu - pos if self.lookahead is None else min(nu - pos, self.lookahead)
        mean_op = view.now() / (pos + 1)
        return out + max(0.0, fetch - ahead * mean_op)

    def evict_mode(self, sid: int) -> Literal["offload", "drop", "discard"]:
        # the base policy's "discard" (never read again) is not taken: a rebuild may read what the
        # program does not; such a storage costs nothing to drop (recompute_estimate), where it may be
        if self.recompute_estimate(sid) <= self.copy_estimate(sid):
            mode = "drop"
            self._dropped.add(sid)
            leaves = self._leaves[sid] = self._rebuild_plan(sid)[1]
            pinned = self._pinned
            for x in leaves:
                pinned[x] = pinned.get(x, 0) + 1
        else:
            mode = "offload"
        self.choices[mode] += 1
        return mode


@register
class HybridOraclePolicy(RecomputeOrCopy, OraclePolicy):
    """The oracle's Belady order and prefetch, each victim dropped or offloaded by cost: the bound of
    ``hybrid`` (the pilot's predictions; :mod:`dynn_runtime.pilot.hybrid`)."""

    name = "hybrid_oracle"
    description = "oracle's order; per victim recompute when cheaper than the copy, else offload"
