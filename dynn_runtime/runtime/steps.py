"""One training step under the manager: opening and closing it, the phase hooks, and the first
step that measures the peak for a fractional budget.

:meth:`Steps.step` is the user's context manager. Whatever happens inside, even an exception while the
step opens or closes, the manager ends between steps and usable (:meth:`Steps._leave_step`). At the
end of a step its copies complete, collectives are released, what the program still holds from it
comes back to the device and stays put (after a failed step it stays where it is: the error's
traceback holds it), and statistics are kept (:class:`StepStats`). Phases come
from the model's root forward pre-hook (forward), autograd's current node (backward) and the
optimizer's step pre/post hooks (optimizer).

State: ``_in_step``, ``_step_index``, ``_cur``, ``steps``, ``history``, ``_measuring``,
``_measure_step``, ``_live_peak``, ``_live_pos``, ``_peak_pos``, ``phase``,
``_in_optimizer``, ``_seen_backward``, ``_hints``.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .. import hints
from .._log import logger
from ..errors import BudgetError, ConfigError
from ..hints import Hint
from ..memory import format_bytes
from ..policies.base import TOUCH_ALLOC, IterationContext, Policy, tells_in_bulk
from ..residency import Status
from ..trace.format import Iteration
from .devicemem import default_budget
from .events import no_mode
from .storages import _MOVABLE_ALWAYS, _PERSISTENT, settled

__all__ = ["StepStats", "Steps"]

RESIDENT = Status.RESIDENT
#: what the optimizer hooks' native walks pass over (Observer.grads_to_label, state_to_label)
_SETTLED_GRAD, _SETTLED_STATE = settled("grad"), settled("opt_state")
_LABELLED_TYPES = (torch.Tensor, torch.nn.Parameter)  # the types _track registers


@dataclass
class StepStats:
    """What the manager did during one step (or, summed, over all of them)."""

    step: int = 0
    ops: int = 0
    peak_device_bytes: int = 0
    bytes_offloaded: int = 0
    bytes_prefetched: int = 0
    bytes_fetched_on_demand: int = 0
    evictions: int = 0
    stall_seconds: float = 0.0
    """Synchronous copies: their wall time. Asynchronous ones: the compute stream's waits for the
    fetches that had not landed when it needed them (``late_fetches``), timed on the device (CUDA
    events bracketing a sample of the waits, ``late_fetches_timed``, scaled up to all), so a copy
    that lands while the host is still issuing the operator costs nothing here."""
    late_fetches: int = 0
    """Asynchronous copies: fetches (on demand, or a prefetch not landed yet) the compute stream was
    made to wait for; their waits' time is in ``stall_seconds``."""
    late_fetches_timed: int = 0
    """The late fetches whose waits were timed on the device (the step's first, then one in
    ``MemoryManager.time_late_every``): ``stall_seconds`` scales their time up to all of them."""
    copy_seconds: float = 0.0
    policy_seconds: float = 0.0
    recomputed_ops: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    budget_overshoot_bytes: int = 0
    budget_overshoot_at: str = ""
    """Where the largest overshoot happened (operator, position, phase), "" without one."""
    wall_seconds: float = 0.0
    """The host's time from the step's start to its end. A step whose copies were still in flight at
    its end waited for them (and for the device's work before them); one that moved nothing waited
    for nothing, so on CUDA its kernels may still be running when it ends."""
    decision_points: int = 0
    host_syncs: int = 0
    """Times the host waited for the GPU inside the step (a copy event, a pinned buffer still in a
    copy); the one synchronization that closes a step is not counted."""
    managed: bool = True
    oom_retries: int = 0
    """Operators and fetches retried after the caching allocator ran out inside them, once room was
    made (runtime/oom.py)."""
    prefetches_dropped: int = 0
    """Prefetches dropped because the caching allocator ran out for them (their storages were then
    fetched on demand; runtime/moves.py)."""
    left_on_host: int = 0
    """Storages the program holds at the step's end that could not come back (the allocator ran out
    twice for one): they stay on the host, their copy valid, and come back at their next access."""
    table_sweeps: int = 0
    """Walks of the native observer's table for storages that died, from the step's start to its
    end (its own sweeps included): every operator of a measuring step; else only where a death
    would not be heard (csrc/events.cpp, invariant 9)."""
    idle: bool = False
    """The policy sat the step out (``Policy.idle_step``; memory was never short in it and nothing
    needed the log read before its end): its operator log was read light, no operator told."""

    def add(self, other: StepStats) -> None:
        for k in ("ops", "bytes_offloaded", "bytes_prefetched", "bytes_fetched_on_demand", "evictions",
                  "stall_seconds", "late_fetches", "late_fetches_timed", "copy_seconds", "policy_seconds",
                  "recomputed_ops", "prefetch_hits", "prefetch_misses", "wall_seconds", "decision_points", "host_syncs",
                  "oom_retries", "prefetches_dropped", "left_on_host", "table_sweeps"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.peak_device_bytes = max(self.peak_device_bytes, other.peak_device_bytes)
        if other.budget_overshoot_bytes > self.budget_overshoot_bytes:
            self.budget_overshoot_bytes = other.budget_overshoot_bytes
            self.budget_overshoot_at = f"step {other.step}, {other.budget_overshoot_at}"


class Steps:
    """``step()`` and what runs at its edges and phase changes."""

    @contextlib.contextmanager
    def step(self) -> Iterator[Any]:
        """One training iteration: positions restart, the policy plans, statistics are kept."""
        if not self._attached:
            raise ConfigError("runtime: call attach(model, optimizer) before step().")
        if self._in_step:
            raise ConfigError("runtime: step() does not nest; end the current step first.")
        if self._passthrough:
            t0 = time.perf_counter()
            yield self
            self.steps.append(StepStats(step=len(self.steps), wall_seconds=time.perf_counter() - t0, managed=False))
            return
        try:
            self._begin_step()
        except BaseException:
            # e.g. a BudgetError making room at the start of the step: close the step it opened,
            # so the manager is between steps and usable; the first error is the one raised
            with contextlib.suppress(Exception):
                self._end_step(False)
            self._leave_step()
            raise
        ok = False
        measuring, first_budget = self._measuring, self.budget
        try:
            yield self
            ok = True
        except torch.OutOfMemoryError as exc:
            if not measuring:
                error = self._oom_error()  # a retry ran out too: say what to change
                if error is None:
                    raise
                raise error from exc
            raise BudgetError(
                f"runtime: a fractional budget ({self._budget_spec!r}) measures the peak in its first steps, run "
                + ("unmanaged" if first_budget is None else f"under the device's free memory ({format_bytes(first_budget)})")
                + ", and that step ran out of device memory. Give the budget in bytes (budget='20GiB'), or leave it "
                "out (the device's free memory less a headroom)."
            ) from exc
        finally:
            try:
                self._end_step(ok)
            finally:
                self._leave_step()

    def _leave_step(self) -> None:
        """Between steps, whatever happened in the step (idempotent)."""
        self._in_step = False
        hints._stop(self)
        if self._obs is not None:
            self._obs.set_in_step(False)
            self._obs.set_phase(-1)
            self._obs.set_budget(0)

    def _first_step_budget(self) -> int | None:
        """A fractional budget's measuring step runs under the device's free memory (what the
        managed storages may take of it, :func:`default_budget`), so a model that does not fit the
        device is measured too; None (unmanaged) on the CPU, where there is no device limit."""
        if not self.cuda:
            return None
        with no_mode():
            outside = max(0, torch.cuda.memory_allocated(self.device) - self.used)
        return max(1, default_budget(self.device) - outside)

    def _fold_live_peak(self) -> None:
        """Native source, measuring step: take the observer's peaks since the last fold, of device
        bytes and of live bytes (resident + away, events.cpp invariant 8: what PyTorch alone would
        hold). Called before and after a decision point moves anything."""
        obs = self._obs
        peak, pos = obs.peak, obs.peak_position or obs.position
        cur = self._cur
        if peak > cur.peak_device_bytes:
            cur.peak_device_bytes, self._peak_pos = peak, pos
        if obs.live_peak > self._live_peak:
            self._live_peak, self._live_pos = obs.live_peak, obs.live_peak_position or obs.position
        obs.reset_peak()

    def _begin_step(self) -> None:
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise ConfigError(
                "runtime: a managed step cannot be captured into a CUDA graph (torch.cuda.graph, "
                "torch.compile(mode='reduce-overhead')): replays run without the manager, so a storage it "
                "moved would be read empty. Capture outside mm.step(), and mm.pin() what the graph reads.")
        self._drain()
        obs = self._obs
        if obs is not None:
            self._sweeps0 = obs.sweeps
            obs.sweep()
            self._native_parse(in_step=False, light=True)  # between steps: the program's work, not the step's
            self._forget_pending()
        self._cur = StepStats(step=self._step_index)
        self._oom_failed = ()
        self._no_prefetch = False
        self._cap_short = 0
        self._measuring = self.budget is None  # a fractional budget: this step measures the peak
        if self._measuring:
            self.budget = self._first_step_budget()
        self._measure_step = self.budget is None  # ... and runs unmanaged
        self._live_peak, self._live_pos = self.used + self.away, 0
        self._peak_pos = 0
        self.position = 0
        self.phase = "forward"
        self._seen_backward = False
        self._in_optimizer = False
        self._ops = []
        self._frees = {}
        self._pre = {}
        self._hints: dict[int, list[Hint]] = {}
        self._oracle_map = {}
        self._in_step = True
        self._engaged = False
        self._recency_read = -1
        self._parse_due = False
        self._idle_step = False
        self._nodes.begin()  # a step's operators' autograd nodes are those it made (AutogradNodes)
        if self._modules is not None:
            self._modules.prune()  # the module tags of the graphs of steps before the last
        if obs is not None:
            obs.set_in_step(True)
            obs.set_seen_backward(False)
            obs.set_phase(-1)
            measuring = self.budget is None
            obs.set_budget(0 if measuring else self.budget)
            obs.set_sweep_every(1 if self._measuring else 0)  # the measured peak must be exact
            acts = type(self.policy).after_op is not Policy.after_op
            obs.set_decide_every(self.decide_every if acts and not measuring else 0)
            if self._native_order:  # the order learns what the policy is told (not a measuring step's)
                obs.set_recency_live(not self._measure_step and not self._measuring)
        self._t_step = time.perf_counter()
        self._pool_syncs0 = self.pool.syncs
        if self.cap_bytes is not None:
            torch.cuda.reset_peak_memory_stats(self.device)  # _measure_cap_headroom reads the step's peak
        self._cur.peak_device_bytes = self.used
        with no_mode():
            ctx = IterationContext(history=list(self.history), trace=self._trace)
            self.policy.begin_iteration(self._step_index, ctx)
            pol = self.policy
            # what the program holds, told to a policy that listens: now, or where an idle step first
            # needs the policy (_wake_policy)
            listens = type(pol).on_alloc is not Policy.on_alloc
            # a policy with nothing to do until memory is short: no periodic turn, the log read where
            # something needs it (Policy.idle_step; the first full read or victim search ends it)
            self._idle_step = (obs is not None and not self._measure_step and not self._measuring
                               and not self.record_every_op and self._trace is None
                               and type(pol).after_op is not Policy.after_op and pol.idle_step())
            if self._idle_step:
                obs.set_decide_every(0)
                self._held_at_start = list(self.st) if listens else None
            elif listens:
                self._announce()
            # A step the policy sits out with the last step's peak within the budget runs without the
            # hooks that only feed it (saved-tensor labels, module ids), even if it wakes: then the
            # policy decides this step without them
            self._policy_hooks(not (self._idle_step and bool(self.steps)
                                    and self.steps[-1].peak_device_bytes <= self.budget))
            self._map_oracle_persistent()
            if not self._measure_step and self.used > self.budget:
                # what the program holds between steps may exceed the budget (after the measuring
                # step, or a budget lowered by hand): get within it before the step starts
                self.make_room(0, set(), "the start of the step")
            self._cur.peak_device_bytes = self.used
            if obs is not None:
                obs.reset_peak()
                self._decisions0 = obs.decisions
        if not self._idle_step:
            self._listen_hints()

    def _policy_hooks(self, on: bool) -> None:
        """The saved-tensor hooks and the module hooks where they serve the policy alone (the native
        source): pushed and installed (``on``), or not, for the step that starts."""
        if self._saved_per_step:
            self._enter_saved(on)
        mods = self._modules
        if self._modules_per_step and mods.installed != on:
            if on:
                mods.install()
            else:
                mods.remove()
                self._obs.set_module(0)

    def _listen_hints(self) -> None:
        # A hint costs the workload a storage lookup per tensor here; only a policy that reads hints
        # (overrides ``on_hint``) or a complete ``history`` (``record_every_op``) is worth that. An
        # idle step's hints would find the policy behind the log: it listens from its first victim
        # search on (_victims).
        if self.record_every_op or type(self.policy).on_hint is not Policy.on_hint:
            hints._listen(self)

    def _announce(self, held: list[int] | None = None) -> None:
        """Tell the policy the storages ``held`` at the step's start (None: every record of the
        table, none of which is absent) as ``on_alloc(sid, -1)`` calls, or the same calls in one
        ``on_touches`` for a policy that takes them in bulk, or, where the observer keeps the
        policy's order, to that order in one ``recency_announce`` (the sizes the observer's table
        has), which reads the table's keys in place."""
        pol, st = self.policy, self.st
        if self._native_order:  # the observer keeps the policy's order: told there, in one call
            self._obs.recency_announce(st if held is None else [sid for sid in held if sid in st])
            return
        items = st.items() if held is None else ((sid, st[sid]) for sid in held if sid in st)
        if tells_in_bulk(type(pol)):
            events: list[int] = []
            add = events.extend
            for sid, s in items:
                add((TOUCH_ALLOC, sid, -1, s.nbytes))
            pol.on_touches(events)
        else:
            on_alloc = pol.on_alloc
            for sid, _ in list(items):  # a snapshot: the table may change under a policy's call
                on_alloc(sid, -1)

    def _wake_policy(self) -> None:
        """An idle step needs the policy from now on (its log read in full, or a victim search): the
        storages held at the step's start are told first, then what the caller tells."""
        held, self._held_at_start = self._held_at_start, None
        if held:  # (one the table no longer has is not announced)
            self._announce(held)

    def _victims(self, short: int, exclude: set[int]) -> Any:
        """The policy's victims (Residency.make_room); the first ends an idle step: the policy acts
        from now on (its periodic turn, hints). Every caller in a step read the log first, so the
        policy has been told the step so far (but a search at the step's start)."""
        if self._idle_step:
            self._idle_step = False
            self._wake_policy()
            if self._obs is not None:
                self._obs.set_decide_every(self.decide_every)
            self._listen_hints()
        return self.policy.victims(short, exclude)

    def _end_step(self, ok: bool) -> None:
        hints._stop(self)
        if self._saved_per_step:
            self._enter_saved(False)
        obs = self._obs
        error = None
        if obs is not None:
            with no_mode():
                obs.sweep()
                self._native_parse(in_step=True, light=not (self._engaged or self._measuring or self.record_every_op))
            if self._native_order:
                obs.set_recency_live(False)
            self._forget_pending()
            if self._measuring:
                self._fold_live_peak()
            obs.set_in_step(False)
            obs.set_phase(-1)
            obs.set_budget(0)
            obs.set_decide_every(0)
            obs.set_sweep_every(0)
            if obs.peak > self._cur.peak_device_bytes:
                self._cur.peak_device_bytes = obs.peak
                self._peak_pos = obs.peak_position
            self._cur.decision_points = obs.decisions - self._decisions0
            self._cur.table_sweeps = obs.sweeps - self._sweeps0
            self._cur.idle = self._idle_step and not self._engaged
            self._idle_step = False
            self._held_at_start = None  # never needed: the next step's start tells them again
            if self.budget is not None and not self._measure_step:
                self._overshoot(obs.peak - self.budget, f"the step's peak, operator position {obs.peak_position}")
            error, self._pending_error = self._pending_error, None  # raised once the step is closed
            if isinstance(error, torch.OutOfMemoryError):  # a fault's fetch ran out, and again when retried
                said = self._oom_error()
                if said is not None:
                    said.__cause__ = error
                    error = said
        self._in_step = False
        self._cur.host_syncs += self.pool.syncs - self._pool_syncs0
        with no_mode():
            if self._copies_outstanding():
                self._copies.sync()  # the step's copies complete before its storages are judged
            self._release_collectives(wait=True)
            self._drain()
            # What the step made and the program still holds (the loss, outputs it keeps) goes back
            # on the device, and stays put from now on: it is the program's now, not the step's.
            # After a failed step (an error in it, or one a handler kept) it stays where it is,
            # movable: the error's traceback holds the frames of the failed forward or backward and
            # so their tensors, which need not fit the budget (nor a hard cap) together; each comes
            # back at its next access.
            if ok and error is None:
                left = 0
                st = self.st
                for s in self._transient:  # (a record that died since: skipped)
                    if s.kind not in _MOVABLE_ALWAYS and st.get(s.sid) is s:
                        if s.status != RESIDENT and not self._fetch_back(s):
                            left += 1
                        s.movable = False
                self._transient = []
                if left:
                    logger.warning("runtime: %d storage(s) the program holds after step %d stay on the host: the "
                                   "caching allocator ran out bringing them back, also after room was made. "
                                   "They come back at their next access.", left, self._step_index)
            else:  # the next successful step's end does it; what died meanwhile is let go
                self._transient = [s for s in self._transient if self.st.get(s.sid) is s]
            if self._copies_outstanding():  # (the fetches just issued among them)
                self._sync()
            self._resolve_stalls()
        cur = self._cur
        cur.ops = self._obs.position if self._obs is not None else self.position
        cur.wall_seconds = time.perf_counter() - self._t_step
        if ok:
            self.history.append(Iteration(index=self._step_index, ops=self._ops, frees=self._frees,
                                          pre_allocs=self._pre, hints=self._hints))
            del self.history[:-self.history_len]
        self._ops = []
        if self._measuring and not ok:
            self.budget = None  # the next step measures again
        elif self._measuring and len(self._measured) + 1 < self.measure_steps:
            self._measured.append(self._later_peak(cur))  # measuring goes on next step
            self.measured_peak = max(self._measured)
            self.budget = None
            cur.managed = False
        elif self._measuring:
            frac = self.budget_fraction
            self.measured_peak = max(self._measured + [self._later_peak(cur)])
            self._measured = []
            self.budget = max(1, int(self.measured_peak * frac))
            cur.managed = False
            need, where = self._largest_op
            entry, fn = self._lists.largest_entry if self._lists is not None else (0, "")
            if entry > need:  # a list operator runs in slices of at least one entry (lists.py)
                need, where = entry, f"one entry of torch.{fn}'s lists (the least a slice of the call holds)"
            if need > self.budget:
                self._budget_problem = (
                    f"runtime: a budget of {frac:g} of the measured peak ({format_bytes(self.budget)}) is smaller "
                    f"than what one operator needs: {where} touches {format_bytes(need)} at once. Raise the "
                    f"budget to at least {need / max(self.measured_peak, 1):.3f} (or {format_bytes(need)}).")
            if self.hard_cap and self.cuda:
                self._apply_hard_cap()
        elif self.hard_cap and self.cuda and self.cap_bytes is not None:
            self._measure_cap_headroom(ok)
            self._fit_to_cap()  # what the step left outside the storages (workspaces it created) counts next step
        self._measure_step = self._measuring = False
        self.steps.append(cur)
        self._step_index += 1
        if self._budget_problem:
            msg, self._budget_problem = self._budget_problem, ""
            raise BudgetError(msg)
        if error is not None:
            raise error

    def _later_peak(self, cur: StepStats) -> int:
        """The peak the steps after this measuring one reach, from what it held at each operator.
        State it created and keeps (the optimizer's moments, made in its first ``step()``) is there
        from the start of every later step, so each point of this step counts with the state born
        after it: the forward's activations meet the moments next step. Left out, "1/2" of a model
        whose moments are made after its activations' peak would really be a smaller share."""
        step = self._step_index
        born = sorted((x.born_pos, x.nbytes) for x in self.st.values()
                      if x.born_step == step and x.kind in _PERSISTENT)
        at = [b[0] for b in born]
        after = list(itertools.accumulate(reversed([b[1] for b in born])))[::-1] + [0]  # bytes born from i on

        def late(pos: int) -> int:  # bytes of the state born after operator ``pos``
            return after[bisect.bisect_right(at, pos)]

        best = max(self._live_peak + late(self._live_pos), cur.peak_device_bytes + late(self._peak_pos))
        if born:
            for pos, used in self._timeline.of_step(step):
                if used + late(pos) > best:
                    best = used + late(pos)
        return best

    def _fetch_back(self, s: Any) -> bool:
        """End of a step: bring ``s``, which the program holds, back on the device; within the budget
        where room can be made, else over it (an overshoot beats losing it). False where the
        allocator ran out for it, also once room was made (oom.py): ``s`` then stays on the host with
        its valid copy (its next access fetches it), counted in ``StepStats.left_on_host``."""
        where = "the end of the step"
        if s.storage() is None:
            # it died since the step's last sweep (what only a copy in flight still held, in a copy
            # engine that keeps its storages: FakeAsyncCopies): nothing to bring back; swept later
            return True
        try:
            try:
                self._fetch_now(s, budgeted=True, exclude={s.sid}, where=where, retry=True)
            except BudgetError:
                self._fetch_now(s, budgeted=False, where=where, retry=True)
        except torch.OutOfMemoryError:
            self._cur.left_on_host += 1
            return False
        return True

    def _root_forward(self) -> None:
        if not torch._C._current_autograd_node():
            self.phase = "forward"
            self._seen_backward = False
            if self._obs is not None:
                self._obs.set_seen_backward(False)
                self._raise_pending()  # a decision point's error surfaces at the next forward

    def _forget_pending(self) -> None:
        """After a sweep and the log read: each storage alive is in ``st``, so a pending label's
        storage died unread."""
        self._saved_pending.clear()
        self._saved_unlogged.clear()
        self._grad_pending.clear()

    def _opt_pre(self, *args: Any) -> None:
        self._in_optimizer = True
        if self._obs is not None:
            self._obs.set_phase(2)
        self._mark_kind_of_grads()

    def _opt_post(self, *args: Any) -> None:
        self._mark_optimizer_state()
        self._in_optimizer = False
        if self._obs is not None:
            self._obs.set_phase(-1)

    def _mark_kind_of_grads(self) -> None:
        """Label the gradients "grad", as :meth:`_label_grad` does one. On the native source the
        observer walks the parameters (``grads_to_label``): a gradient born since the log was read
        waits in ``_grad_pending`` for its birth to be read, and only one that the label would
        change comes back here."""
        track, obs = self._track, self._obs
        if obs is None:
            for p in self._grad_params:
                if p.grad is not None:
                    track(p.grad, "grad", fresh=False)
            return
        for g in obs.grads_to_label(self._grad_params, self.st, self._grad_pending, _SETTLED_GRAD):
            track(g, "grad", fresh=False)

    def _mark_optimizer_state(self) -> None:
        """Label the attached optimizers' state tensors "opt_state". On the native source the observer walks
        the state (``state_to_label``) and hands back only what the label would change (optimizers
        update their state in place, so after the first step: nothing). A tensor the manager does
        not manage (Adam's step counters on the host of a CUDA manager) stays where it is. On the
        Python source one already labelled is skipped while the same tensor object is there and its
        storage tracked, so that a step costs a dictionary lookup per state tensor."""
        if not self.optimizers:
            return
        obs, st = self._obs, self.st
        if obs is not None:
            new = [v for opt in self.optimizers
                   for v in obs.state_to_label(opt.state, st, _LABELLED_TYPES, _SETTLED_STATE)]
            if new and self._in_step and any(obs.sid_of(v) not in st for v in new):
                # born since the log was read (the first step's state): read it first, so that
                # each record has its birth's position (the measured peak counts state born after
                # the peak as late), not this hook's
                with no_mode():
                    self._native_parse(in_step=True)
            for v in new:
                self._track(v, "opt_state", fresh=False)
            return
        seen, tensor = self._opt_marked, torch.Tensor
        get = seen.get
        for state in (x for opt in self.optimizers for x in opt.state.values()):
            for v in state.values():
                if type(v) is not tensor:
                    continue
                mark = get(id(v))
                if mark is not None and mark[0]() is v and (mark[1] in st or mark[2] == v.device):
                    continue
                sid = self._track(v, "opt_state", fresh=False)
                if sid is not None:
                    seen[id(v)] = (weakref.ref(v), sid, None)
                elif v.device != self.device:  # the manager's device carries its index (cuda:N)
                    seen[id(v)] = (weakref.ref(v), None, v.device)
        if len(seen) > 2 * len(self.st) + 64:  # forget marks of state tensors long gone
            self._opt_marked = {k: m for k, m in seen.items() if m[0]() is not None}

    def _hint_step(self) -> None:
        self._give_hint(Hint("step"))

    def _hint_use(self, tensors: list[torch.Tensor], steps: int | None) -> None:
        sids: list[int] = []
        for t in tensors:
            sid = self._track(t, "input", fresh=False)
            if sid is not None and sid not in sids:
                sids.append(sid)
        if sids:
            self._give_hint(Hint("use", tuple(sids), steps))

    def _give_hint(self, h: Hint) -> None:
        self._hints.setdefault(self.position, []).append(h)
        if type(self.policy).on_hint is not Policy.on_hint:
            with no_mode():
                self.policy.on_hint(h)

