"""When and where the pilot policy decides: decision points, the cost governor, the worker thread.

:class:`Scheduling` is the part of :class:`~dynn_runtime.pilot.policy.PilotPolicy` that chooses
them; what a decision computes is in :mod:`.policy`.

**Decision points** fall every ``decision_every`` operators and at every phase change (the feature
state's tick), and at the next operator once a small storage had to be offered as a victim.

**Idle decision points** (``defer_idle``, on by default: :class:`~.config.PilotPolicyConfig`). A
decision point's output is read only by a victim search (``victims()``, when the budget binds) and
by the prefetch heap of the storages this policy evicted (there is no proactive eviction). While
the policy is *idle* a due decision point is deferred, not run: counted (``deferred_idle``), its
scoring left for later, while the per-operator updates (features, provisional predictions, heap
entries) go on as before. Idle: no victim search so far in this iteration and none in the
previous one (seen by the policy live; told by the simulator, ``IterationContext.bound_before``, whose
one iteration stands for one of a run under the same budget), no decision point on the worker, an empty prefetch heap, and neither the online
refit nor the fallback (they read every decision point's rows: with them every point runs).
Nothing this policy evicted can be away then: storages become away only in a victim search, and
``begin_iteration`` forgets them. The first victim search after deferred points runs a full
rescoring (every live storage, as at a phase change; ``catch_ups``) before it yields its first
victim, on the issuing thread (never the worker, never put off by the governor): the runtime and
the simulator tell every notification before they ask for victims, so the state it scores is
current, and the features do not depend on earlier decision points, so its predictions are those
of a full rescoring there in a policy that never deferred. From that search on, and through the
next iteration, every decision point runs: under a budget that binds every iteration the
decisions from the iteration after the first search on are those of ``defer_idle=False``, the
reference (tests/pilot/test_pilot_idle.py).

**Idle steps.** An iteration that starts idle (and with nothing of the policy's away) needs
nothing from it before its first victim search, which catches up as above: the policy says so
(``PilotPolicy.idle_step``) and the live runtime tells it the step's events only there, all at
once, or never in a step where memory is never short (``Policy.idle_step``). The next iteration
then indexes the last one the policy was told (``begin_iteration``).

**Cost governor** (``max_share``): a decision point is put off while the inference time spent so
far exceeds ``max_share`` of the elapsed device time (``view.now()``: simulated seconds in the
simulator, wall seconds in the live runtime); a phase change's full rescoring waits for the next
allowed point. Between decision points storages keep their provisional or last predictions.

**Host time.** :attr:`Scheduling.host_seconds` is what the policy has spent on the host: measured
(inference and the per-operator update), or charged by a cost model ``host_cost=(per decision
point, per row scored, per operator)`` seconds, which makes a simulated run deterministic and lets
the simulator charge a calibrated machine (:mod:`dynn_runtime.sim.hostcost`). The governor reads
the same charge. The simulator's host timeline puts it on the thread that issues the operators, so
what it costs the iteration is what the device waits for, not the sum.

**Where inference runs** (``worker="auto"``, native backend). Deciding on the issuing thread costs
the iteration nothing while the device has enough issued work queued to run meanwhile; it is on the
critical path when the device waits for the host. So a decision point goes to a worker thread only
when ``view.device_slack()`` (the simulator: its device clock ahead of its host clock; the live
runtime: the CUDA event recorded at the previous call still pending) is under ``slack_margin``
times the decision's host cost (``host_cost``, or :data:`SYNC_COST`), and never a full rescoring:
at a phase change every prediction is replaced, and late ones cost most there. No slack known (an
untimed simulation, a CPU device): every decision is taken on the issuing thread, the synchronous
run exactly. ``worker=False`` never hands off.

A handed-off decision point: the issuing thread chooses the rows, gathers their feature rows and
clears their touched flags (the state changes under the worker, so the worker cannot read it), and
the worker runs the network and the policy's arithmetic (``dynn_pilot_finish``; ctypes releases
the GIL). The results are polled at the next ``on_op``, ``victims`` or ``after_op`` and merged
(``dynn_pilot_merge``), skipping every storage touched since the gather: its provisional
prediction is newer. A decision point that finds the previous one in flight waits for it (charged
as host time). Where the view keeps a host clock (``view.host_now()``, the simulator) the worker is
modelled on it with :data:`WORKER_COST`, so runs are deterministic and a free worker gives the
synchronous run exactly; elsewhere (the live runtime) it is a real thread.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import PolicyError

__all__ = ["Scheduling", "WORKER_COST", "HANDOFF_COST", "SYNC_COST"]

#: the worker's seconds per decision point and per row (``dynn_pilot_finish``) where it is modelled;
#: measured on the development CPU (docs/pilot-lab-notes.md, "Inference cost")
WORKER_COST = (8e-6, 0.26e-6)
#: the issuing thread's seconds per decision point and per row handed to the worker (gather and
#: merge), charged where ``host_cost`` is set; measured likewise
HANDOFF_COST = (8.2e-6, 0.065e-6)
#: the seconds per decision point and per row of deciding on the issuing thread, for the choice
#: between it and the worker when no ``host_cost`` says; measured likewise
SYNC_COST = (14e-6, 0.33e-6)


def seconds(value: Any, name: str, per: tuple[str, ...]) -> tuple[float, ...] | None:
    """A cost model option: None, or ``len(per)`` non-negative finite seconds (else PolicyError)."""
    if value is None:
        return None
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        out = ()
    if len(out) != len(per) or not all(math.isfinite(v) and v >= 0 for v in out):
        raise PolicyError(f"policies: pilot {name} must be {len(per)} non-negative seconds ({', '.join(per)}), "
                          f"got {value!r}.")
    return out


class Scheduling:
    """When and where :class:`~dynn_runtime.pilot.policy.PilotPolicy` decides (see the module
    docstring). A mixin: it reads the policy's state (``_state``, ``_kernel``, ``view``, the
    counters) and is not used alone."""

    #: with ``worker="auto"`` a decision point is taken on the issuing thread only when the device's
    #: queued work covers this many times its host cost: smaller margins use up slack that the
    #: dispatch of the next operators needs, larger ones hand off so often that late results cost
    #: decisions (docs/pilot-lab-notes.md, "Where inference runs")
    slack_margin: float = 10.0

    def _idle(self) -> bool:
        """Whether a decision point due now would be read by nobody yet (the module docstring's
        rule): then it is deferred (:meth:`_defer`)."""
        return (self.defer_idle and not self._searched and not self._searched_before and self._job is None
                and not self._rows and not self._off)

    def _defer(self, position: int) -> None:
        """An idle decision point: counted, its scoring left to the first victim search
        (:meth:`_searching`). The heaps keep taking the per-operator entries, so they are
        compacted here as a decision point would (stale entries past 4x the live storages)."""
        self.deferred_idle += 1
        self._stale = True
        self._last_decision = position
        self._compact_heaps(len(self._state._slot))

    def _searching(self) -> None:
        """A victim search begins: the first of the iteration rescores every live storage first
        when decision points were deferred, so that its victims are chosen on current
        predictions."""
        if self._searched:
            return
        self._searched = True
        if self._stale:
            self._stale = False
            self.catch_ups += 1
            self._full_due = True
            self._decision(self._state.position)

    @property
    def host_seconds(self) -> float:
        """Host seconds spent so far: the ``host_cost`` model's charge when one is set,
        else the measured inference and per-operator bookkeeping (``on_op``; the notifications'
        dictionary writes are not timed)."""
        if self.host_cost is None:
            return self.inference_s + self.bookkeeping_s + self.wait_s
        return self._inference_spent() + self.ops * self.host_cost[2]

    def _inference_spent(self) -> float:
        """Seconds of inference so far, as the governor counts them: measured, or the
        ``host_cost`` model's charge for the decision points and rows scored."""
        if self.host_cost is None:
            return self._spent + self.wait_s
        a, b, _ = self.host_cost
        ha, hb = self.handoff_cost
        return ((self.decisions - self.handoffs) * a + (self.candidates - self.handoff_rows) * b
                + self.handoffs * ha + self.handoff_rows * hb + self.wait_s)

    def _clock(self) -> float:
        return float(self.view.now())

    def _skip_small(self) -> bool:
        """Whether the small storages are left out of scoring now: yes, until one of them had to
        be offered as a victim in this run (memory is then so short that their order matters, so
        every later decision point scores them too)."""
        return self._small.fraction > 0 and not self.small_evicted

    def _decide(self, position: int, tick: bool) -> bool:
        """Whether operator ``position`` is a decision point: the feature state's rule (every
        ``decision_every`` operators, phase changes), or under a governor the same points
        put off while inference has used more than ``max_share`` of the elapsed device time."""
        ph = self._state.phase
        if ph != self._phase:
            self._phase = ph
            self._full_due = True
            tick = True
        if self._force_decision:
            self._force_decision = False
            tick = True
        if self.max_share is None:
            return tick
        due = self._full_due or position - self._last_decision >= self.decision_every
        if not due:
            return False
        if self._inference_spent() > self.max_share * (self._clock() - self._clock0):
            self.deferred += tick
            return False
        return True

    def _hand_off(self, m: int, full: bool) -> bool:
        """Whether a decision point of ``m`` rows (``full``: every live storage, at a phase change)
        goes to the worker: never when full,
        else only when the device has less work queued than ``slack_margin`` times what deciding
        here would take (``view.device_slack()``). No slack known (no host timeline, a CPU
        device): decide here."""
        if full:
            return False
        slack = self.view.device_slack()
        if slack is None:
            return False
        a, b = self.host_cost[:2] if self.host_cost is not None else SYNC_COST
        return slack < self.slack_margin * (a + b * m)

    def _submit(self, position: int, m: int, n_live: int) -> None:
        """Gather the ``m`` chosen rows' features here (the state changes under the worker), clear
        their touched flags (a storage touched before the results come back keeps its newer
        provisional prediction), and hand the network to the worker."""
        state, kern, pt = self._state, self._kernel, self._pt
        job = self._buf = self._buf.start(position, m, n_live)
        xa, ca, la, ia = job.addr[:4]
        kern.gather(state, state._native_tab.rows_addr, m, n_live, xa, ca, ia, la)
        self.candidates += m
        self.handoffs += 1
        self.handoff_rows += m
        mt = kern.model_table(self.model)
        args = (mt, job.X, m, job.ctx, pt.logreps, pt.lower, self.quantile, self.recheck, position, job.score, job.due)
        if self._pool is None and self.view.host_now() is None:
            # modelled where the view keeps a host clock (the simulator): runs stay deterministic
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dynn-pilot")
        if self._pool is not None:
            job.future = self._pool.submit(kern.finish, *args)
        else:
            # modelled (the simulator): computed now, visible once the worker would have finished it.
            # The worker starts once the issuing thread has gathered the rows: the host_cost charge,
            # or at once when the time is measured (a wall-clock time here would make runs vary)
            timer = self._timer
            t0 = timer()
            kern.finish(*args)
            self._finish_s = timer() - t0
            spent = 0.0 if self.host_cost is None else self.handoff_cost[0] + m * self.handoff_cost[1]
            a, b = self.worker_cost
            start = max(self.view.host_now() + spent, self._worker_free)
            job.ready = self._worker_free = start + a + b * m
        self._job = job
        if job.future is None and job.ready <= self.view.host_now():
            self._merge(job)  # a worker that costs nothing: the same run as deciding here

    def _ready(self, job: _Job) -> bool:
        if job.future is not None:
            return job.future.done()
        return self.view.host_now() >= job.ready

    def _wait(self, job: _Job) -> None:
        """Block until ``job`` is done: a real wait, or the modelled one charged as host time."""
        if job.future is not None:
            job.future.result()
            return
        lag = job.ready - self.view.host_now()
        if lag > 0:
            self.wait_s += lag

    def _merge(self, job: _Job) -> None:
        """The results into the cache (``pred``), ``due`` and both heaps, for the rows whose storage
        was not touched since they were gathered (``dynn_pilot_merge``)."""
        self._job = None
        if job.future is not None:
            job.future.result()  # re-raises what the worker raised
        if len(self._due) < self._state._cap:
            self._grow_due()
        _, _, la, ia, sa, da = job.addr
        self.merged += self._absorb(sa, da, ia, la, job.m, job.n_live)

    def _poll(self) -> None:
        """Merge the worker's results if they are in (read before evicting or prefetching)."""
        job = self._job
        if job is not None and self._ready(job):
            t0 = self._timer()
            self._merge(job)
            dt = self._timer() - t0
            self.inference_s += dt
            self._spent += dt


class _Job:
    """A decision point on the worker: the gathered rows and the results' buffers, kept
    from one decision point to the next (one is in flight at a time) and grown as needed."""

    __slots__ = ("position", "m", "n_live", "cap", "slots", "X", "ctx", "sids", "score", "due", "addr",
                 "ready", "future")

    def __init__(self, cap: int = 256) -> None:
        from .features import CAND_FEATURES, CTX_FEATURES

        self.position = self.m = self.n_live = 0
        self.cap = cap
        self.X = np.empty((cap, len(CAND_FEATURES)), dtype=np.float32)
        self.ctx = np.empty(len(CTX_FEATURES), dtype=np.float32)
        self.slots = np.empty(cap, dtype=np.int64)
        self.sids = np.empty(cap, dtype=np.int64)
        self.score = np.empty(cap, dtype=np.float64)
        self.due = np.empty(cap, dtype=np.float64)
        #: the buffers' addresses: X, ctx, slots, sids, score, due
        self.addr = tuple(a.ctypes.data for a in (self.X, self.ctx, self.slots, self.sids, self.score, self.due))
        self.ready = 0.0
        self.future: Any = None

    def start(self, position: int, m: int, n_live: int) -> _Job:
        """This buffer set for a decision point of ``m`` rows (a bigger one if it has no room)."""
        job = self if m <= self.cap else _Job(max(m, 2 * self.cap))
        job.position, job.m, job.n_live = position, m, n_live
        job.ready, job.future = 0.0, None
        return job

    def __reduce__(self) -> Any:  # the rows in flight are not state worth keeping: a fresh buffer set
        return _Job, (self.cap,)
