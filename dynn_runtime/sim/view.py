"""The simulator's read side: what it derives from the trace before it runs (who produces, reads and
first writes each storage; each operator's time) and the :class:`~dynn_runtime.policies.base.MemoryView`
members a policy reads from it. :class:`IterationView` is a mixin of
:class:`~dynn_runtime.sim.engine.Simulator`; the rest of the view (status, resident, nbytes...) is
:class:`~dynn_runtime.residency.Residency`'s.
"""

from __future__ import annotations

import bisect
import math
from typing import Any

from ..residency import Record, Status, next_access
from ..trace.format import Iteration, Trace
from .profiles import DeviceProfile, op_time

__all__ = ["IterationView"]

S = Status
#: kinds the simulator may drop and rebuild (with an in-iteration producer outside the optimizer step)
_RECOMPUTABLE_KINDS = frozenset({"activation", "temp"})


class _St(Record):
    __slots__ = ("ready_at", "chain_temp")

    def __init__(self, sid: int, nbytes: int, kind: str, saved: bool) -> None:
        super().__init__(sid, nbytes, kind, saved)
        self.ready_at = 0.0  # when the copy in flight lands
        self.chain_temp = False  # rebuilt only to recompute a dropped descendant


class IterationView:
    """The static analysis of one iteration and the policy-facing clock and future queries."""

    trace: Trace
    it: Iteration
    ops: list[Any]
    profile: DeviceProfile
    policy: Any
    st: dict[int, _St]
    position: int
    phase: str
    host_timeline: bool
    h: float
    t: float
    d2h_free: float
    h2d_free: float

    # ---- static analysis of the iteration ---------------------------------------------------
    def _prepare(self) -> None:
        tr, it = self.trace, self.it
        page = self.policy.page_bytes
        self.st: dict[int, _St] = {}
        self.true_nbytes: dict[int, int] = {}
        for s in tr.storages.values():
            b = s.nbytes if not page else max(page, math.ceil(s.nbytes / page) * page)
            self.st[s.sid] = _St(s.sid, b, s.kind, s.saved)
            self.true_nbytes[s.sid] = s.nbytes
        self.accesses: dict[int, list[int]] = {}
        self.producer: dict[int, int] = {}
        self.first_write: dict[int, int] = {}
        measured = self._measured_durations()
        self.op_time: list[float] = []
        for j, op in enumerate(self.ops):
            for sid in set(op.inputs) | set(op.outputs) | set(op.writes):
                self.accesses.setdefault(sid, []).append(j)
            for sid in op.allocs:
                self.producer[sid] = j
            for sid in op.writes:
                if sid not in op.allocs:
                    self.first_write.setdefault(sid, j)
            if measured:
                self.op_time.append(max(op.duration_s, self.profile.op_overhead_s * 0.2))
            else:
                dt = tr.storages[op.outputs[0]].dtype if op.outputs else "float32"
                self.op_time.append(op_time(op.flops, op.nbytes, dt, self.profile))
        self.forward_last_use: dict[int, int] = {}
        bwd = it.phase_starts.get("backward", len(self.ops))
        for sid, acc in self.accesses.items():
            k = bisect.bisect_left(acc, bwd)
            if k:
                self.forward_last_use[sid] = acc[k - 1]
        # storages alive when the iteration starts (parameters, optimizer state, the batch)
        self.initial: list[int] = it.live_at_start(tr)
        self.frees = it.frees
        self.hints = it.hints

    def _measured_durations(self) -> bool:
        h = self.trace.header
        dev = str(h.get("device", ""))
        return dev.startswith("cuda") and self.profile.name in str(h.get("device_name", "")).lower()

    # ---- MemoryView (what policies read; the rest is Residency's) --------------------------
    def now(self) -> float:
        return self.t

    def host_now(self) -> float:
        """The clock of the thread that issues the operators (the host timeline), in seconds: the host
        timeline's, or without one the device's (the host is taken to keep pace). A policy with work
        on another host thread (the pilot's worker) reads it to know what has finished."""
        return self.h if self.host_timeline else self.t

    def device_slack(self) -> float | None:
        """Seconds of issued work the device has still to run before it would wait for the host
        (on the host timeline: the device's clock ahead of the host's), or None without a host timeline (the
        host's time is not modelled). The pilot decides on the issuing thread when
        that hides the decision."""
        return max(0.0, self.t - self.h) if self.host_timeline else None

    def copy_seconds(self, nbytes: int, direction: str) -> float:
        """A copy's time on its engine once started: the profile's latency plus bytes over the link
        (the engine's ``_copy_d2h``/``_copy_h2d``, unified memory's fault path aside)."""
        p = self.profile
        return p.copy_latency_s + nbytes / (p.d2h_bytes_per_s if direction == "d2h" else p.h2d_bytes_per_s)

    def link_backlog(self, direction: str) -> float:
        """Seconds until the copy engine of ``direction`` is free of the copies queued on it now."""
        free = self.d2h_free if direction == "d2h" else self.h2d_free
        return max(0.0, free - self.t)

    def forward_done(self, sid: int) -> bool:
        """The forward pass will not touch ``sid`` again (its Python references are gone)."""
        return self.phase == "forward" and self.forward_last_use.get(sid, -1) <= self.position

    def module_of(self, position: int) -> str:
        return self.ops[position].module

    def phase_of(self, position: int) -> str:
        return self.ops[position].phase

    def producer_of(self, sid: int) -> int | None:
        return self.producer.get(sid)

    def recomputable(self, sid: int) -> bool:
        s = self.st[sid]
        j = self.producer.get(sid)
        if j is None or s.kind not in _RECOMPUTABLE_KINDS or self.ops[j].phase == "optimizer":
            return False
        w = self.first_write.get(sid)
        return w is None or w > self.position

    def recompute_cost(self, sid: int) -> float:
        """Time to rematerialize ``sid``: its producer plus every dropped or freed ancestor (DTR's e*)."""
        seen: set[int] = set()
        total = 0.0
        stack = [sid]
        while stack:
            x = stack.pop()
            j = self.producer.get(x)
            if j is None or j in seen:
                continue
            seen.add(j)
            total += self.op_time[j]
            for inp in self.ops[j].inputs:
                if self.st[inp].status in (S.DROPPED, S.ABSENT) and inp in self.producer:
                    stack.append(inp)
        return total

    def next_use(self, sid: int) -> int | None:
        """Next access after the current position; persistent storages wrap to the next iteration."""
        return next_access(self.accesses.get(sid), self.position, self.st[sid].kind, len(self.ops))
