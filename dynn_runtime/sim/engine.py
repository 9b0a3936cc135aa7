"""Trace-driven simulation of a memory policy on a device under a memory budget.

Invariants the engine keeps (tests and docs/simulator.md name them in bold):

- **State machine.** Every storage is in one :class:`~dynn_runtime.residency.Status`; transitions go
  through :meth:`~dynn_runtime.residency.Residency.set_status` (the state machine the live runtime
  uses too), which rejects any transition not in :data:`~dynn_runtime.residency.TRANSITIONS`.
- **Budget.** Device bytes held = RESIDENT + OFFLOADING (the device copy lives until the copy ends)
  + FETCHING (space is reserved when the copy starts), and never exceed the budget: when room is
  needed the engine asks the policy for victims (:meth:`~dynn_runtime.residency.Residency.make_room`,
  the live runtime's loop); if they are not enough the operator is out of memory, never over.
- **Operands resident.** Before an operator runs, everything it reads or writes is resident: an
  in-flight prefetch is waited for (stall), an offloaded storage is fetched on demand (stall, a
  prefetch miss), a dropped one is recomputed (its producer re-run, recursively; recompute time).
- **Copy engines.** Copies run on two copy engines, one per direction, each serial, overlapping
  compute and each other; ``sync_copies`` policies put them on the compute stream instead, as
  ``torch.autograd.graph.save_on_cpu`` and unified-memory faults do.
- **Clean copies.** Evicting a storage whose host copy is still valid (fetched and not written
  since) costs no copy; a policy that sees the future (the oracle) may *discard* a storage that is
  never read again, also without a copy, and the engine checks the future before it honours that.
  A policy that also recomputes operators never discards: a rebuild may read what the program does
  not, so such a storage is dropped where it is recomputable and offloaded otherwise.
- **Recomputable.** A storage can be dropped for recompute only if it is an activation or temporary
  produced in this iteration, outside the optimizer step, and not written in place since.
- **Engagement.** The manager engages only when the iteration does not fit: if the unmanaged peak
  is within the budget, every policy behaves like ``none`` (nothing moves, nothing is recomputed),
  as the live manager does.
- **Host timeline** (``host_timeline=True``; off by default). Eager PyTorch issues operators from one
  host thread ahead of the device, and a policy decides on that thread. The host clock advances by
  the dispatch time per operator (the profile's floor, capped by an operator's own time where that
  is shorter; or the number given as ``host_timeline``, the host's whatever the kernel) and by the
  policy's own host time (:attr:`Policy.host_seconds`, read before each operator); an operator
  starts on the device no earlier than the host issues it (the gap is ``host_wait_s``). A host
  synchronisation (an operator in ``HOST_SYNC_OPS`` outside the optimizer step, whose step counters
  live on the host) brings the host to the device's clock. A policy that spends no host time never
  lets the host lead the device (each operator's time includes the floor), so its iteration time
  is the same as without the timeline. Not modelled: the launch queue's depth limit, and the host
  time of copies and recomputation.
- **Host cost** (``host_cost=``, a :class:`~dynn_runtime.sim.hostcost.HostCost`; none by default;
  it turns the host timeline on). The live manager runs on the issuing thread: before each operator
  is issued the host clock advances by ``per_op_s`` (the event path, nothing moving), by
  ``per_decision_s`` for each decision point since the previous operator (a ``victims()`` call, or
  an ``after_op()`` that returned actions: :attr:`SimResult.decision_points`) and by ``per_move_s``
  for each storage moved since (evicted, prefetched, fetched on demand: :attr:`SimResult.moves`).
  It is charged whether or not the manager engages, because the live manager sees every operator
  either way; only the policy's own share (``policy_per_op_s``) waits, in an iteration the policy
  sits out (``Policy.idle_step``), for its first victim search, where the operators before it are
  charged it at once. With zero figures the run is the host timeline's exactly.

Time: ``compute`` is the sum of operator times (measured on the profile's GPU, or the roofline of
:func:`~dynn_runtime.sim.profiles.op_time` for traces recorded elsewhere); the iteration time is the
compute stream's clock at the end: compute + stalls + recompute (+ host waits on the host timeline).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ..budget import Budget
from ..errors import BudgetError, ConfigError, TraceError, internal_assert
from ..policies.base import IterationContext, Policy, make_policy
from ..residency import HOLDS_DEVICE as _HOLDS_DEVICE
from ..residency import Residency, Status
from ..trace.format import SCHEMA_VERSION, Trace
from .hostcost import HostCost
from .profiles import DeviceProfile, get_profile
from .result import SimResult
from .view import IterationView, _St

__all__ = ["Status", "SimResult", "Simulator", "simulate", "unmanaged_peak"]


S = Status
#: what the simulator offers a policy: the recorded past, the future (replaying a trace), and the
#: operator stream a pilot model learns from (the pilot policy itself checks that its weights exist)
SIM_PROVIDES = ("history", "future", "pilot")
#: operators whose result the host reads (the host timeline): the host waits for the device there
HOST_SYNC_OPS = frozenset({"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::bincount",
                           "aten::masked_select", "aten::unique", "aten::_unique2", "aten::is_nonzero",
                           "aten::equal", "aten::repeat_interleave"})


class _OOM(Exception):
    """Infeasible: args are (bytes needed, optional reason)."""


def unmanaged_peak(trace: Trace, iteration: int = -1) -> int:
    """Peak device bytes of one iteration with everything resident (PyTorch alone)."""
    return Simulator(trace, "none", budget_bytes=None, iteration=iteration).run().peak_bytes


class Simulator(IterationView, Residency):
    """Replays one iteration of ``trace`` against ``policy`` under ``budget_bytes`` on ``profile``."""

    #: a rematerialization chain longer than this is reported infeasible (DTR's failure mode)
    MAX_RECOMPUTE_DEPTH = 200  # three Python frames per level: stays under the interpreter limit

    def __init__(
        self,
        trace: Trace,
        policy: str | Policy,
        budget_bytes: int | None,
        profile: str | DeviceProfile = "h100",
        iteration: int = -1,
        policy_options: dict | None = None,
        host_timeline: bool | float = False,
        host_cost: HostCost | None = None,
    ) -> None:
        if not trace.iterations:
            raise TraceError("sim: the trace has no iterations.")
        schema = trace.header.get("schema")
        if not isinstance(schema, int) or schema > SCHEMA_VERSION:
            raise TraceError(f"sim: trace schema version {schema} is not supported (this dynn-runtime reads up to "
                             f"{SCHEMA_VERSION}); upgrade dynn-runtime or re-record the trace.")
        n = len(trace.iterations)
        idx = iteration if iteration >= 0 else n + iteration
        if not 0 <= idx < n:
            raise ConfigError(f"sim: iteration {iteration} is out of range; the trace has {n} iteration(s).")
        if budget_bytes is not None and Budget.parse(budget_bytes, "sim").bytes is None:
            raise BudgetError(f"sim: Simulator takes the budget in bytes, got {budget_bytes!r}; simulate() also "
                              "takes a fraction of the unmanaged peak.")
        self.trace = trace
        self.profile = get_profile(profile)
        self.policy = make_policy(policy, provides=SIM_PROVIDES, **(policy_options or {}))
        self.it = trace.iterations[idx]
        self.history = trace.iterations[:idx]
        self.budget = budget_bytes if budget_bytes is not None else 1 << 62
        self.ops = self.it.ops
        self.position = 0
        self.phase = "forward"
        if host_cost is not None and not isinstance(host_cost, HostCost):
            raise ConfigError(f"sim: host_cost takes a HostCost (dynn_runtime.sim.hostcost) or None, got {host_cost!r}.")
        #: host cost: the manager's own host cost (None: not charged)
        self.host_cost = host_cost
        #: host timeline: a host clock issues the operators; dispatch seconds per operator (None: the profile's floor)
        self.host_timeline = host_timeline is not False or host_cost is not None
        self.h = self.t = 0.0  # host timeline: the host's clock (host_now); the device's (set again by run)
        self.dispatch_s: float | None = None
        if not isinstance(host_timeline, bool):
            d = float(host_timeline) if isinstance(host_timeline, (int, float)) else math.nan
            if not math.isfinite(d) or d < 0:
                raise ConfigError("sim: host_timeline takes True, False or the host's dispatch seconds per "
                                  f"operator (>= 0), got {host_timeline!r}.")
            self.dispatch_s = d
        self._prepare()

    # ---- state transitions ------------------------------------------------------------------
    def _set(self, sid: int, new: Status) -> None:
        self.set_status(self.st[sid], new)

    def _stall_until(self, t: float) -> None:
        if t > self.t:
            self.stall += t - self.t
            self.t = t

    def _reap(self) -> None:
        """Copies that have landed by now: offloads release their device bytes, prefetches become
        resident (and so evictable again)."""
        for s in [x for x in self.offloading.values() if x.ready_at <= self.t]:
            self.set_status(s, S.HOST)
        for s in [x for x in self.fetching.values() if x.ready_at <= self.t]:
            self.set_status(s, S.RESIDENT)

    def _copy_d2h(self, nbytes: int) -> float:
        p = self.profile
        dur = p.copy_latency_s + nbytes / p.d2h_bytes_per_s
        if self.policy.sync_copies:
            self._stall_until(self.t + dur)
            return self.t
        start = max(self.t, self.d2h_free)
        self.d2h_free = start + dur
        return self.d2h_free

    def _copy_h2d(self, nbytes: int) -> float:
        p = self.profile
        if self.policy.page_bytes:  # unified memory: fault batches per 2 MiB chunk plus migration
            chunks = math.ceil(nbytes / (2 << 20))
            dur = chunks * p.uvm_fault_s + nbytes / (p.uvm_bytes_per_s or p.h2d_bytes_per_s)
            self._stall_until(self.t + dur)
            return self.t
        dur = p.copy_latency_s + nbytes / p.h2d_bytes_per_s
        if self.policy.sync_copies:
            self._stall_until(self.t + dur)
            return self.t
        start = max(self.t, self.h2d_free)
        self.h2d_free = start + dur
        return self.h2d_free

    def _evict(self, sid: int) -> bool:
        s = self.st[sid]
        if s.status is not S.RESIDENT:
            return False
        mode = self.policy.evict_mode(sid)
        if mode == "discard" and self.policy.recomputes == "operators":
            # the program never reads it again, but a rebuild of a dropped descendant may: a
            # recomputable storage is dropped (rebuilt if so), any other kept on the host
            mode = "drop" if self.recomputable(sid) else "offload"
        if mode == "discard":
            # only a policy that sees the future may discard, and only what the future never reads
            if "future" not in self.policy.requires or self.next_use(sid) is not None:
                mode = "offload"
            else:
                self._set(sid, S.DROPPED)
                self.evictions += 1
                self.moves += 1
                return True
        if mode == "drop":
            if not self.recomputable(sid):
                return False
            self._set(sid, S.DROPPED)
        elif s.host_valid:
            self._set(sid, S.HOST)  # clean copies: clean copy on the host already
        else:
            s.ready_at = self._copy_d2h(s.nbytes)
            self.bytes_offloaded += s.nbytes
            s.host_valid = True
            self._set(sid, S.OFFLOADING)
            if s.ready_at <= self.t:
                self._set(sid, S.HOST)
        self.evictions += 1
        self.moves += 1
        return True

    # ---- making room: Residency.make_room's hooks, on the simulated clock ------------------------
    def _victims(self, short: int, exclude: set[int]) -> Any:
        self.decision_points += 1
        self._searched = True
        return self.policy.victims(short, exclude)

    def _room_before(self, need: int) -> bool:
        self._reap()
        return False

    def _evict_for_room(self, s: _St) -> bool:
        if not self._evict(s.sid):
            return False
        self.decisions += 1
        return True

    def _land_fetch(self) -> bool:
        # prefetches in flight hold space: let the earliest land, then it may be evicted
        self._stall_until(min(x.ready_at for x in self.fetching.values()))
        self._reap()
        return True

    def _land_offload(self) -> None:
        self._stall_until(min(x.ready_at for x in self.offloading.values()))
        self._reap()

    def _out_of_memory(self, need: int, exclude: set[int], where: str) -> None:
        raise _OOM(need)

    def _ensure(self, sid: int, exclude: set[int], depth: int = 0) -> None:
        s = self.st[sid]
        if s.status is S.RESIDENT:
            return
        if s.status is S.OFFLOADING:  # still on the device: cancel the eviction
            self._set(sid, S.RESIDENT)
            return
        if s.status is S.FETCHING:
            if s.ready_at > self.t:
                self.prefetch_late += 1
            self._stall_until(s.ready_at)
            self.prefetch_hits += 1
            self._set(sid, S.RESIDENT)
            return
        if s.status is S.HOST:
            self.make_room(s.nbytes, exclude)
            self.prefetch_misses += 1
            self.moves += 1
            self.bytes_fetched += s.nbytes
            self._stall_until(self._copy_h2d(s.nbytes))
            self._set(sid, S.FETCHING)
            self._set(sid, S.RESIDENT)
            return
        # DROPPED, or ABSENT but needed to rebuild a dropped descendant
        internal_assert(sid in self.producer, f"sim: storage {sid} ({s.status.value}) is needed but cannot be rebuilt")
        if depth >= self.MAX_RECOMPUTE_DEPTH:
            raise _OOM(0, f"recompute chain deeper than {self.MAX_RECOMPUTE_DEPTH} operators")
        self._recompute(sid, exclude, depth)

    def _recompute(self, sid: int, exclude: set[int], depth: int) -> None:
        positions = self.policy.recompute_group(sid) or [self.producer[sid]]
        key = (positions[0], positions[-1], len(positions))
        if key in self._rebuilding:  # this group is mid-rebuild further up: re-run just the producer
            positions = [self.producer[sid]]
            key = (positions[0], positions[0], 1)
        self._rebuilding.add(key)
        try:
            self._rerun(sid, positions, exclude, depth)
        finally:
            self._rebuilding.discard(key)

    def _rerun(self, sid: int, positions: list[int], exclude: set[int], depth: int) -> None:
        produced = {x for j in positions for x in self.ops[j].allocs}
        keep = set(exclude) | {sid}
        for j in positions:
            op = self.ops[j]
            for inp in op.inputs:
                if inp in produced:
                    continue
                keep.add(inp)
                if self.st[inp].status is S.ABSENT:
                    self.st[inp].chain_temp = True
                self._ensure(inp, keep, depth + 1)
        rebuilt = [x for x in produced if self.st[x].status in (S.DROPPED,) or x == sid
                   or (self.st[x].chain_temp and self.st[x].status is S.ABSENT)]
        self.make_room(sum(self.st[x].nbytes for x in rebuilt if self.st[x].status not in _HOLDS_DEVICE), keep)
        cost = sum(self.op_time[j] for j in positions)
        self.t += cost
        self.recompute_t += cost
        self.recomputed_ops += len(positions)
        for x in rebuilt:
            if self.st[x].status not in _HOLDS_DEVICE:
                self._set(x, S.RESIDENT)
                if not self.st[x].chain_temp:
                    # back on the device, written by the rebuild: the policy sees it as accessed, so
                    # one that keeps its own candidates (the pilot's heaps) may evict it again
                    self.policy.on_access(x, self.position)
        if depth == 0:  # chain temporaries the program had freed go again once the chain is done
            for x, s in self.st.items():
                if s.chain_temp:
                    s.chain_temp = False
                    if s.status in _HOLDS_DEVICE and x != sid:
                        self._set(x, S.ABSENT)

    def _free(self, sid: int) -> None:
        s = self.st[sid]
        if s.status is not S.ABSENT:
            self._set(sid, S.ABSENT)
        s.host_valid = False
        self.policy.on_free(sid)

    def _apply(self, actions: Iterable[Any]) -> None:
        for a in actions:
            s = self.st.get(a.sid)
            if s is None:
                continue
            if a.kind == "evict":
                if self._evict(a.sid):
                    self.decisions += 1
            elif a.kind == "prefetch" and s.status is S.HOST and self.used + s.nbytes <= self.budget:
                s.ready_at = self._copy_h2d(s.nbytes)
                self.bytes_fetched += s.nbytes
                self._set(a.sid, S.FETCHING)
                self.decisions += 1
                self.moves += 1

    # ---- the run ----------------------------------------------------------------------------
    def run(self) -> SimResult:
        self.t = self.stall = self.recompute_t = 0.0
        self.host_wait = self.policy_host = 0.0
        self.d2h_free = self.h2d_free = 0.0
        self._init_residency()
        self._rebuilding: set[tuple[int, int, int]] = set()
        self.bytes_offloaded = self.bytes_fetched = 0
        self.decisions = self.evictions = self.recomputed_ops = self.decision_points = self.moves = 0
        self.host_cost_s = 0.0
        self.prefetch_hits = self.prefetch_misses = self.prefetch_late = 0
        compute = sum(self.op_time)
        peak_none = self._unmanaged_peak()
        managed = peak_none > self.budget and not self.policy.moves_nothing
        policy = self.policy if managed else make_policy("none")
        if not managed:  # page rounding belongs to the policy that is not in force
            for sid, b in self.true_nbytes.items():
                self.st[sid].nbytes = b
        saved_policy, self.policy = self.policy, policy
        try:
            policy.attach(self)
            # only where a policy acts (``none`` stands in otherwise): a walk over the previous iteration
            bound_before = managed and bool(self.history) and self.history[-1].footprint_peak(self.trace) > self.budget
            policy.begin_iteration(self.it.index, IterationContext(history=self.history, trace=self.trace,
                                                                   iteration=self.it, bound_before=bound_before))
            # an iteration the policy sits out until its first victim search: its own per-operator
            # cost is not charged before it (HostCost.policy_per_op_s; the live runtime's idle step)
            self._idle = policy.idle_step() if managed else saved_policy.idles_unbound
            self._searched = False  # a victim search has run (_victims)
            reason = ""
            feasible = True
            try:
                self._run_ops()
            except _OOM as exc:
                feasible = False
                j = self.position
                op = self.ops[j] if 0 <= j < len(self.ops) else None
                where = f"{op.name} in {op.module or '<top>'} ({op.phase})" if op else "the iteration start"
                if len(exc.args) > 1:
                    reason = f"infeasible at op {j} ({where}): {exc.args[1]}"
                else:
                    reason = (
                        f"out of memory at op {j} ({where}): needs {exc.args[0]} more bytes with "
                        f"{self.used} of {self.budget} in use and nothing left that {policy.name} may evict"
                    )
        finally:
            self.policy = saved_policy
        return SimResult(
            policy=saved_policy.name, budget_bytes=self.budget, profile=self.profile.name, feasible=feasible,
            reason=reason, iter_time_s=self.t if feasible else math.inf, compute_time_s=compute,
            stall_time_s=self.stall, recompute_time_s=self.recompute_t, bytes_offloaded=self.bytes_offloaded,
            bytes_fetched=self.bytes_fetched, peak_bytes=self.peak, unmanaged_peak_bytes=peak_none,
            decisions=self.decisions, evictions=self.evictions, recomputed_ops=self.recomputed_ops,
            prefetch_hits=self.prefetch_hits, prefetch_misses=self.prefetch_misses, ops=len(self.ops),
            managed=managed, host_wait_s=self.host_wait, policy_host_s=self.policy_host,
            decision_points=self.decision_points, moves=self.moves, host_cost_s=self.host_cost_s,
            host_cost_source=self.host_cost.source if self.host_cost is not None else "",
        )

    def _unmanaged_peak(self) -> int:
        nb = self.true_nbytes
        live = sum(nb[s] for s in self.initial)
        peak = live
        for j, op in enumerate(self.ops):
            for sid in self.frees.get(j, ()):
                live -= nb[sid]
            live += sum(nb[s] for s in op.allocs)
            peak = max(peak, live)
        return peak

    def _run_ops(self) -> None:
        pol = self.policy
        self.position = -1  # before the first operator: an access at position 0 is still ahead (next_use)
        for sid in self.initial:
            self.make_room(self.st[sid].nbytes, set())
            self._set(sid, S.RESIDENT)
            self.st[sid].host_valid = self.st[sid].kind in ("param", "buffer")
            pol.on_alloc(sid, -1)
        host = self.host_timeline
        h = seen = self.h = 0.0  # host timeline: the host's clock, and the policy's host seconds already on it
        floor = self.profile.op_overhead_s if self.dispatch_s is None else self.dispatch_s
        hc = self.host_cost
        dp_seen = mv_seen = 0  # host cost: decision points and moves already on the host clock
        idle_ops = 0  # operators of an idle start, whose policy share is charged at the first search
        for j, op in enumerate(self.ops):
            self.position = j
            self.phase = op.phase
            for sid in self.frees.get(j, ()):
                self._free(sid)
            for hint in self.hints.get(j, ()):  # (not ``h``: that is the host's clock)
                pol.on_hint(hint)
            allocs = op.allocs
            need = set(op.inputs) | set(op.writes) | (set(op.outputs) - set(allocs))
            for sid in need:
                self._ensure(sid, need)
            self.make_room(sum(self.st[s].nbytes for s in allocs), need)
            for sid in allocs:
                self._set(sid, S.RESIDENT)
                pol.on_alloc(sid, j)
            if host:
                spent = pol.host_seconds
                h += spent - seen
                seen = spent
                if hc is not None:  # host cost: the manager's work before this operator is issued
                    charge = hc.charge(1, self.decision_points - dp_seen, self.moves - mv_seen)
                    dp_seen, mv_seen = self.decision_points, self.moves
                    if self._idle and self._searched:  # the idle start's operators, told at the search
                        self._idle = False
                        charge += idle_ops * hc.policy_per_op_s
                    elif self._idle:
                        charge -= hc.policy_per_op_s
                        idle_ops += 1
                    h += charge
                    self.host_cost_s += charge
                if h > self.t:  # the device has run dry: it waits for the host to issue this operator
                    self.host_wait += h - self.t
                    self.t = h
                # dispatch: the floor is part of each operator's time, so an operator measured shorter
                # dispatched in less; a dispatch time given as host_timeline is the host's, whatever the kernel
                h += floor if self.dispatch_s is not None else min(floor, self.op_time[j])
            self.t += self.op_time[j]
            if host:
                if op.name in HOST_SYNC_OPS and op.phase != "optimizer":
                    h = max(h, self.t)
                self.h = h
            for sid in need.union(allocs):
                s = self.st[sid]
                s.last_access = j
                s.last_access_t = self.t
                s.count += 1
                pol.on_access(sid, j)
            for sid in op.writes:
                self.st[sid].host_valid = False
            pol.on_op(j, op)
            actions = pol.after_op(j)
            if actions:
                self.decision_points += 1
                self._apply(actions)
        self.position = len(self.ops)
        for sid in self.frees.get(len(self.ops), ()):
            self._free(sid)
        if host:
            self.policy_host = float(pol.host_seconds)
            if hc is not None:  # after the last operator: still host time
                charge = hc.charge(0, self.decision_points - dp_seen, self.moves - mv_seen)
                if self._idle and self._searched:
                    charge += idle_ops * hc.policy_per_op_s
                self.host_cost_s += charge


def simulate(
    trace: Trace,
    policy: str | Policy,
    budget: int | float | str | Budget,
    profile: str | DeviceProfile = "h100",
    iteration: int = -1,
    policy_options: dict | None = None,
    host_timeline: bool | float = False,
    host_cost: HostCost | None = None,
) -> SimResult:
    """Simulate ``policy`` on one iteration of ``trace``.

    ``budget`` is bytes (int), a fraction in (0, 1] of the iteration's unmanaged peak (float), or
    any spelling :meth:`~dynn_runtime.budget.Budget.parse` reads (``"6GiB"``, ``"1/4"``).
    ``host_timeline``: put the policy's host time on a host clock that issues the operators (the host timeline);
    a number is the host's dispatch seconds per operator (default: the profile's per-operator floor).
    ``host_cost``: the live manager's own host cost per operator and per decision point (the host cost;
    :func:`~dynn_runtime.sim.hostcost.host_cost_for` gives the calibrated one); turns the timeline on.
    """
    spec = Budget.parse(budget, "sim")
    budget = spec.bytes if spec.bytes is not None else spec.resolve(unmanaged_peak(trace, iteration))
    return Simulator(trace, policy, budget, profile, iteration, policy_options, host_timeline, host_cost).run()
