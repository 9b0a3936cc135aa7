"""The native event source's Python side: what runs at its decision points.

``dynn_runtime._C``'s observer (``events.cpp``) calls :meth:`NativeSource._native_fault` when an
operator is about to read a storage that is away or in flight, :meth:`NativeSource._native_decide`
when the budget is exceeded after an operator or on the policy's periodic turn, and
:meth:`NativeSource._native_oom` when an operator's kernel ran out of device memory. They keep an error
instead of raising it through the C++ frames; it surfaces at the next forward or at the end of the
step. The operator log is read in batches (:meth:`NativeSource._native_parse`) and told to the policy
in log order: births and deaths between operators, and each operator in one
:meth:`~dynn_runtime.policies.base.Policy.on_operator` call (the separate calls of the Python
source, where the policy does not fuse them); the whole batch in one
:meth:`~dynn_runtime.policies.base.Policy.on_operators` call where the policy says no ``after_op``
of it would act (:meth:`NativeSource._native_operators`) or that it stops for those that may
(:class:`_AfterOps`), or in one
:meth:`~dynn_runtime.policies.base.Policy.on_touches` call for a policy that reads only recency.

State: ``_obs``, ``_names``, ``_idiom_by_name``, ``_pending_error``, ``_last_busy``, ``_last_outs``, ``_last_name``,
``_engaged``, ``_recency_read`` (the step whose log a compact parse read last).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable, Sequence

import torch

from ..errors import BudgetError, frames_of, internal_assert
from ..hints import Hint
from ..memory import format_bytes
from ..policies.base import OPERATOR, TOUCH_ACCESS, TOUCH_ALLOC, TOUCH_FREE, Policy, tells_in_bulk
from ..residency import Status
from ..trace.format import Op
from .controls import _PHASE_CODE
from .events import native_module
from .lists import is_list_operator

RESIDENT, ABSENT = Status.RESIDENT, Status.ABSENT

_PHASES = ("forward", "backward", "optimizer", "forward")
_PHASE_CODES = tuple(_PHASE_CODE[p] for p in _PHASES)  # the timeline's codes (OpTimeline)
_C_TAGS = (1, 2, 3)  # dynn_runtime._C's LOG_OP, LOG_ALLOC, LOG_FREE (checked by a test)


def _op_record(log: Sequence[int], i: int) -> tuple:
    """The operator record at word ``i`` of the native log (events.cpp's layout): its name id,
    phase-and-module word, autograd node, bytes in use, its inputs, outputs, writes and allocations
    as tuples (an ``Op`` record keeps them as they are), and the word where the next record starts."""
    _, name_id, pm, node, used, ni, no, nw, na = log[i:i + 9]
    k = i + 9
    ins = tuple(log[k:k + ni])
    k += ni
    outs = tuple(log[k:k + no])
    k += no
    writes = tuple(log[k:k + nw])
    k += nw
    return name_id, pm, node, used, ins, outs, writes, tuple(log[k:k + na]), k + na


class _Born:
    """A storage :meth:`NativeSource._native_operators` saw born in its batch, before it has a record:
    what the view answers for it (``nbytes``, ``kind``, ``saved``), where its record would start
    (``fresh``, ``pos``), the access fields the batch gave it, and whether it died in the batch."""

    __slots__ = ("nbytes", "kind", "saved", "fresh", "pos", "last_access", "count", "dead")

    def __init__(self, nbytes: int, kind: str, saved: bool, fresh: int, pos: int) -> None:
        self.nbytes = nbytes
        self.kind = kind
        self.saved = saved
        self.fresh = fresh
        self.pos = pos
        self.last_access = -1
        self.count = 0
        self.dead = False


class _AfterOps:
    """The ``after`` of an ``on_operators`` call that stops (:meth:`NativeSource._native_operators`
    with ``stops``): ``after(position, op)`` runs ``after_op(position)`` and applies its moves, as
    the per-operator loop does after telling operator ``position``.

    What that ``after_op`` and its moves read of the runtime is made what the loop shows there:
    the deaths logged up to that operator forgotten (``forget_dead`` on the batch's ``dead`` up to
    it, in log order, so ``_frees`` keeps the loop's order; the rest after the call), and the
    position, phase and name of the operator (the prefetch's peak and overshoot notes), put back
    to the batch's end after it. The rest of the batch's work is done already and is not read
    there: a storage away at the batch's start is never accessed or written in the batch (the
    access would have faulted, and a fault reads the log first), so its access fields and host
    copy are the loop's; a birth's record (made before the call) is of a storage that is not
    away; ``free_bytes`` reads the observer's count, which the parse does not change."""

    __slots__ = ("mm", "mod", "dead", "k")

    def __init__(self, mm: NativeSource, mod: object, dead: list) -> None:
        self.mm = mm
        self.mod = mod
        self.dead = dead
        self.k = 0  # dead[:k] forgotten

    def __call__(self, position: int, op: Op) -> None:
        mm, dead = self.mm, self.dead
        k = m = self.k
        while m < len(dead) and dead[m][1] <= position:  # logged before this operator's after_op
            m += 1
        if m > k:
            self.mod.forget_dead(mm, dead[k:m], _PARSE_CTX)
            self.k = m
        pos, phase, name = mm.position, mm.phase, mm._last_name
        mm.position, mm.phase, mm._last_name = position, op.phase, op.name
        try:
            mm._apply(mm.policy.after_op(position), set(op.inputs).union(op.outputs))
        finally:
            mm.position, mm.phase, mm._last_name = pos, phase, name


# what _C.parse_operators reads besides the manager (csrc/operators.cpp)
_PARSE_CTX = (OPERATOR, TOUCH_ALLOC, TOUCH_FREE, _PHASES, _PHASE_CODES, Op, _Born, internal_assert, ABSENT)


class _At(tuple):
    """Where a fault or a decision point is, ``(name, position, phase, after)``, as an error or a note
    says it (``str()``): its text is built only then, from the values taken when the fault or decision
    point began (one that moves nothing never needs it). A tuple: made without a Python frame."""

    __slots__ = ()

    def __str__(self) -> str:
        name, position, phase, after = self
        if position < 0:
            return f"operator {name} (between steps)"
        return f"{'after ' if after else ''}operator {name} (position {position}, {phase})"


class NativeSource:
    """Faults, decisions and the log of the native event source."""

    #: the pilot's bulk path makes the record of every storage born in a batch as it reads the birth
    #: (the reference), not only of those that outlive the batch
    records_in_batch = False
    #: what a step keeps per operator is taken out of Python's cyclic collector (False: left in it, the
    #: comparison of ``tools/pilot_batch_pair.py FAMILY N --switch untrack_history``)
    untrack_history = True
    #: the pilot's bulk path reads its batch in C (``_C.parse_operators``) where the extension is
    #: built; off, the Python loop of :meth:`_native_operators` (the reference)
    operators_in_c = True
    #: a batch of a policy that :meth:`~dynn_runtime.policies.base.Policy.stops_in_bulk` (some of its
    #: ``after_op`` calls may act) is read in C too and told in one ``on_operators`` call that stops
    #: for those calls (:class:`_AfterOps`); off (or ``operators_in_c`` off), one ``on_operator`` and
    #: one ``after_op`` per operator from the Python loop of :meth:`_native_parse_log` (the reference)
    stops_in_c = True
    #: CUDA storages' deaths are heard from the caching allocator where the observer can
    #: (``Observer.hear``, csrc/heard.h); off, swept for (the reference)
    hear_frees = True
    #: a module's post hook tags its forward's autograd nodes in C (``_C.tag_nodes``); off, Python's
    #: walk of ``trace/modules.py`` (the reference)
    tag_nodes_in_c = True
    #: the ``saved_tensors_hooks`` pack hook takes its common cases in the observer
    #: (``Observer.pack_saved``: a storage already labelled saved, or whose birth is unread); off,
    #: every pack runs :meth:`_pack` (the reference)
    pack_in_c = True
    #: a policy that reads labels hears each gradient's from the observer's post-accumulate-grad hook
    #: (``Observer.grad_ready``: a record already labelled, or a birth unread, costs no Python); off,
    #: :meth:`_grad_ready` on every parameter (the reference)
    grads_in_c = True
    #: room made ahead of the next operator (its reserve, ``Observer.max_made``) passes over victims
    #: under 1/256 of it (``Residency.make_room``'s ``scale``); off, every victim (the reference)
    reserve_floor = True
    #: a compact parse (the observer keeps the order) is skipped where the observer logged nothing
    #: since the last one (``Observer.log_pending``); off, every decision point reads the log (the
    #: reference)
    skip_empty_parse = True
    #: where the observer keeps the order and the step's log was read already, neither a fault nor
    #: a decision point reads the log before it makes room: the read is put off until something
    #: needs a record it would make (a victim search meeting a storage the manager has no record
    #: of, the step's end); off, every fault and decision point reads the log first (the reference)
    defer_parse = True

    def _native_fault(self, sids: list[int], ins: list[int], name: str) -> None:
        try:
            if self._measuring:
                self._fold_live_peak()
            self._fault(sids, ins, name)
            if self._measuring:
                self._fold_live_peak()
        except BaseException as exc:  # noqa: BLE001  (kept and raised at the next check: _raise_pending)
            self._keep_error(exc)

    def _native_decide(self, position: int) -> None:
        try:
            if self._measuring:
                self._fold_live_peak()
            self._decide(position)
            if self._measuring:
                self._fold_live_peak()
        except BaseException as exc:  # noqa: BLE001
            self._keep_error(exc)

    def _native_oom(self, message: str, ins: list[int], name: str, failed: bool) -> bool:
        """The kernel of operator ``name``, reading ``ins``, ran out of device memory (``message``):
        make room and return whether to run it again (events.cpp, invariant 11). ``failed``: the
        retry ran out too; the error propagates from the operator."""
        try:
            where = f"operator {name} (position {self._obs.position}, {self.phase})"
            if failed:
                self._oom_retry_failed(message, where)
                return False
            if not self._in_step:
                return False
            if self._measuring:
                self._fold_live_peak()
            if not self._measure_step:
                self._native_parse(in_step=True)  # the policy's view must be current before it picks victims
            self._room_after_oom(message, set(ins), where, self._obs.max_made)
            if self._measuring:
                self._fold_live_peak()
            return True
        except BaseException as exc:  # noqa: BLE001  (kept; the operator's OOM propagates)
            self._keep_error(exc)
            return False

    def _keep_error(self, exc: BaseException) -> None:
        """A handler's error, without its traceback: the frames of the operator's caller would keep
        the program's tensors alive until it is raised. Where it was raised is kept as a note (text,
        no frame), which tracebacks print and a bench row keeps (``errors.where_raised``)."""
        if self._pending_error is None:
            at = frames_of(exc, 6)
            if at:  # ``__notes__`` by hand: add_note is Python 3.11's
                exc.__notes__ = [*getattr(exc, "__notes__", ()), f"raised in a native event handler at {at}"]
        exc.__traceback__ = None
        exc.__context__ = None
        if self._pending_error is None:
            self._pending_error = exc

    def _raise_pending(self) -> None:
        exc, self._pending_error = self._pending_error, None
        if exc is not None:
            raise exc

    def _fault(self, sids: list[int], ins: list[int], name: str) -> None:
        """An operator is about to read storages that are away or in flight: bring them back (the
        kernel runs when this returns). ``ins`` are all its inputs: none of them may leave now."""
        in_step = self._in_step
        due = False
        if in_step and not self._measure_step:
            if self._can_defer_parse():
                # the order the victims come from is the observer's, current already; a storage born
                # since the last read has no record yet, and the first victim search that meets one
                # reads the log then (status), so the same storages move as after a read here
                due = self._parse_due = True
            else:
                self._native_parse(in_step=True)  # the policy's view must be current before it picks victims
        where = _At((name, self._obs.position if in_step else -1, self.phase, False))
        need = set(ins)
        error = None
        st = self.st
        if in_step and not self._measure_step:
            reads = back = 0
            for x in need:
                s = st.get(x)
                if s is not None:
                    reads += s.nbytes
                elif due:  # born since the last read: the observer's size is its record's
                    reads += self._born_size(x)
            for x in sids:
                s = st.get(x)
                if s is not None and s.status is not RESIDENT:
                    back += s.nbytes
            if reads > self.budget:
                error = BudgetError(
                    f"runtime: the budget {format_bytes(self.budget)} is smaller than what one operator needs: {where} "
                    f"reads {format_bytes(reads)}. Raise the budget to at least {format_bytes(reads)}.")
            # what comes back (``back``), and then the operator's output: room for both now, or the
            # output lands over the budget (after operators the reserve is the largest allocation;
            # events.cpp 6); the output's room, made ahead, passes over tiny victims (scale)
            try:
                if back:
                    self.make_room(back, need, where)
                reserve = self._obs.max_made
                self.make_room(back + reserve, need, where, scale=reserve if self.reserve_floor else 0)
            except BudgetError:
                pass  # what cannot move now: the fetches below decide
        for sid in sids:
            s = st.get(sid)
            if s is None:
                internal_assert(False, f"runtime: storage {sid} is away but unknown to the manager")
            if s.status is RESIDENT:
                continue
            try:
                self._fetch_now(s, exclude=need, where=where)
            except BudgetError:
                # The kernel must find its data. The operator itself fits (else ``error`` is set): what
                # fills the rest is resident and may not move (held by the program, in flight), so the
                # step goes on over the budget, as after any operator on this source, and says so.
                self._fetch_now(s, budgeted=False)
                if in_step and not self._measure_step:
                    self._overshoot(self.used - self.budget, f"bringing back what {where} reads")
        if error is not None:
            raise error

    def _decide(self, position: int) -> None:
        """After operator ``position``: the budget is exceeded, or the policy's periodic turn."""
        due = self._in_step and not self._measure_step and self._can_defer_parse() and self._last_op_known()
        if due:
            self._parse_due = True  # as at a fault: the first victim without a record reads the log
        else:
            self._native_parse(in_step=self._in_step)
        if not self._in_step or self._measure_step:
            return
        reserve = self._obs.max_made  # room for the next operator (events.cpp, invariant 6)
        if self.used + reserve > self.budget:
            where = _At((self._last_name, position, self.phase, True))
            st = self.st
            # a storage born since the last read has the observer's size, its record's
            busy = sum(st[x].nbytes if x in st else self._born_size(x) if due else 0 for x in self._last_busy)
            if busy > self.budget:
                raise BudgetError(
                    f"runtime: the budget {format_bytes(self.budget)} is smaller than what one operator needs: "
                    f"operator {self._last_name} (position {position}, {self.phase}) touches {format_bytes(busy)}. "
                    f"Raise the budget to at least {format_bytes(busy)}.")
            try:
                # the reserve is room ahead of a need that may not come (scale: not made of tiny
                # moves); what is over the budget now is made first, from every victim
                calls = [(reserve, reserve if self.reserve_floor else 0)]
                if self.used > self.budget:
                    calls.insert(0, (0, 0))
                for need, scale in calls:
                    try:
                        self.make_room(need, self._last_busy, where, scale=scale)
                    except BudgetError:
                        # what the operator read may leave too once it has run (an eviction waits for
                        # the stream of its last access); what it made stays, the program may read it
                        # next without an operator (``tolist``)
                        self.make_room(need, set(self._last_outs), where, scale=scale)
            except BudgetError:
                if type(self.policy).victims is Policy.victims and self.used > self.budget + reserve:
                    raise  # a policy that never moves anything, and over by more than one operator's allocation
                # the operator ran over (counted as an overshoot); the next decision point tries again

    def _native_parse(self, in_step: bool, light: bool = False) -> None:
        """Read the operator log since the last call: storages born and freed, and (in a step) each
        operator, told to the policy as the Python path tells it. ``light``: only the storages that
        outlive the batch, and the deaths of those the manager registered itself (a step that never
        needed a decision: the policy has nothing to learn from what fit).

        What the step keeps of the batch (its ``Op`` records, the lists of frees, first-seen storages
        and hints at its positions) is then taken out of Python's cyclic collector (``collector.cpp``:
        atomic values only), so that the history does not bring on full collections."""
        obs = self._obs
        if obs is None:
            return
        self._parse_due = False
        if self._read_already(in_step, light):
            return
        n_ops, first = len(self._ops), self.position
        try:
            self._native_parse_log(in_step, light)
        finally:
            if in_step and self.untrack_history:
                c = native_module()  # loaded: the observer is its
                c.untrack_records(self._ops, n_ops, Op)
                last = self.position
                c.untrack_lists(self._frees, first, last)
                c.untrack_lists(self._pre, first, last)
                c.untrack_lists(self._hints, first, last, Hint)

    def _can_defer_parse(self) -> bool:
        """A fault or a decision point may put its read of the log off (``defer_parse``): the observer
        keeps the policy's order (nothing the read tells goes to the policy), this step's log was
        read already (the first full read, which may wake the policy, has happened), no saved tensor
        waits for its birth to be read, and no collective ran since the last read (the read is what
        holds its storages on the device: ``Observer.held_pending``)."""
        obs = self._obs
        return (self.defer_parse and self._native_order and obs.recency_live
                and self._recency_read == self._step_index and self._engaged and self._held_at_start is None
                and not self._saved_unlogged and not obs.held_pending())

    def _born_size(self, sid: int) -> int:
        """The size of a storage born since the last read (what its record will say); 0 if the observer
        forgot it already."""
        try:
            return self._obs.nbytes(sid)
        except RuntimeError:
            return 0

    def _last_op_known(self) -> bool:
        """What a read would say of the last operator (``_last_busy``, ``_last_outs``, ``_last_name``,
        ``phase``), taken from the observer without reading the log; False where its name is new since
        the last read (only a read brings the names)."""
        name_id, phase, ins, outs = self._obs.last_op()
        if name_id < 0 or name_id >= len(self._names):
            return False
        self._last_busy = set(ins).union(outs)
        self._last_outs = outs
        self._last_name = self._names[name_id]
        self.phase = _PHASES[phase]
        return True

    def status(self, sid: int) -> str:
        """MemoryView: as :meth:`~dynn_runtime.residency.Residency.status`; a storage without a record
        while a read of the log is put off is read first (it may have been born since)."""
        s = self.st.get(sid)
        if s is None and self._parse_due:
            self._native_parse(in_step=self._in_step)
            s = self.st.get(sid)
        return "absent" if s is None else s.status._value_

    def evictable(self, sid: int) -> bool:
        """MemoryView: as :meth:`status` and :meth:`~.moves.Moves.movable` read it, in one call (lru's
        walk of the observer's order asks it of each candidate)."""
        s = self.st.get(sid)
        if s is None and self._parse_due:
            self._native_parse(in_step=self._in_step)
            s = self.st.get(sid)
        return s is not None and s.status is RESIDENT and s.movable

    def _read_already(self, in_step: bool, light: bool) -> bool:
        """The compact parse (the observer keeps the order) would read nothing and change nothing: it
        read the log already in this step, the observer logged nothing since (a fault right after a
        decision, a second look before a victim search), and no first full read of the step is due."""
        obs = self._obs
        return (self.skip_empty_parse and self._recency_read == self._step_index and not self._saved_unlogged
                and not obs.log_pending() and obs.recency_live and obs.position == self.position
                and (self._engaged and self._held_at_start is None
                     or not (in_step and not light and not self._measure_step)))

    def _native_parse_log(self, in_step: bool, light: bool) -> None:
        """:meth:`_native_parse`'s reading of the log."""
        obs = self._obs
        if in_step and not light and not self._measure_step:
            self._engaged = True
            if self._held_at_start is not None:  # an idle step's first full read (Steps._wake_policy)
                self._wake_policy()
        if self._saved_unlogged:
            self._resolve_saved_unlogged()  # before the births they belong to are read
        if self._native_order and obs.recency_live:
            self._native_recency_parse(light)
            return
        words, names = obs.take_log(light)
        if names:
            self._names.extend(names)
        if not words:
            return
        log = memoryview(words).cast("q")
        st = self.st
        pol = self.policy
        # the end of a step the policy sat out (light, never engaged) tells it no birth: the next
        # step's start announces what is held (deaths still go to it, _forget_native)
        tell = in_step and not self._measure_step and not (light and self._idle_step)
        measuring = in_step and self._measuring
        if (tell and not measuring and self._trace is None and not self.record_every_op
                and tells_in_bulk(type(pol))):
            self._native_touches(log.tolist())
            return
        if tell and not measuring and self._trace is None:
            if pol.operators_in_bulk():
                self._native_operators(log.tolist())
                return
            if (self.stops_in_c and self.operators_in_c and not self.records_in_batch and pol.stops_in_bulk()
                    and native_module() is not None):
                self._native_operators(log.tolist(), stops=True)
                return
        OP, ALLOC, FREE = _C_TAGS
        i, n = 0, len(log)
        while i < n:
            tag = log[i]
            if tag == OP:
                j = self.position
                name_id, pm, node, used, ins, outs, writes, allocs, i = _op_record(log, i)
                name = self._names[name_id]
                phase, module = _PHASES[pm & 3], pm >> 2
                self.phase = phase
                if writes:
                    self._drop_stale_hosts(writes)
                if in_step:
                    self._native_op(j, name, phase, module, node, ins, outs, writes, allocs, tell, measuring)
                    self._timeline.append((self._step_index, j, used, phase))
                    self.position = j + 1
            elif tag == ALLOC:
                sid, nb, fresh = log[i + 1], log[i + 2], log[i + 3]
                i += 4
                x = st.get(sid)
                if x is None:  # born between steps: the program's input to the next one (the trace's kind)
                    x = self._new_native(sid, "temp" if fresh and in_step else "input", nb, in_step, self.position)
                if in_step and not fresh:
                    pos = self.position
                    self._pre.setdefault(pos, []).append(sid)
                    if tell:
                        pol.on_alloc(sid, -1 if pos == 0 else pos)
            elif tag == FREE:
                i += 2
                self._forget_native(log[i - 1], in_step)
            else:
                internal_assert(False, f"runtime: corrupt native event log (tag {tag} at word {i})")

    def _native_touches(self, log: list[int]) -> None:
        """The in-step parse for a policy that :func:`~dynn_runtime.policies.base.tells_in_bulk`: the
        storages' births, accesses and deaths go to it in one
        :meth:`~dynn_runtime.policies.base.Policy.on_touches` call, in the order and with the
        arguments the per-operator path gives ``on_alloc``/``on_access``/``on_free`` (accesses in the
        same set order), before the decision this parse serves. No :class:`Op` record is built:
        ``history`` holds operators only with ``record_every_op`` (which takes the per-operator path),
        as after a step read compacted. What the per-operator path keeps per storage (``last_access``,
        ``count``, prefetch hits; a written storage's stale host copy dropped) and per operator (the
        timeline, ``_frees``/``_pre`` by position, collectives held) is kept the same here.

        A storage born in this batch gets its record only at the batch's end, if it is still alive:
        no Python code reads the table while the batch is read (handlers run between parses), and a
        birth's record changes no count on this source (the observer counts the bytes), so one born
        and dead within the batch needs none."""
        st = self.st
        names = self._names
        events: list[int] = []
        add = events.extend
        written: list[int] = []
        # born in this batch, no record yet: sid -> [fresh, nbytes, born position, last access, count]
        born: dict[int, list[int]] = {}
        timeline = self._timeline
        step = self._step_index
        cur = self._cur
        now = time.perf_counter() - self._t0
        busy: set[int] = self._last_busy
        outs = self._last_outs
        name = self._last_name
        OP, ALLOC, FREE = _C_TAGS
        i, n = 0, len(log)
        while i < n:
            tag = log[i]
            if tag == OP:
                j = self.position
                _, name_id, pm, _node, used, ni, no, nw, na = log[i:i + 9]
                k = i + 9 + ni + no
                outs = log[i + 9 + ni:k]
                busy = set(log[i + 9:i + 9 + ni]).union(outs)
                if nw:
                    written += log[k:k + nw]
                k += nw
                for sid in log[k:k + na]:  # on_operator's on_alloc: every allocation, tracked or not
                    x = st.get(sid)
                    if x is not None:
                        add((TOUCH_ALLOC, sid, j, x.nbytes))
                    else:
                        b = born.get(sid)
                        add((TOUCH_ALLOC, sid, j, 0 if b is None else b[1]))
                i = k + na
                for sid in busy:
                    s = st.get(sid)
                    if s is not None:
                        s.last_access = j
                        s.last_access_t = now
                        s.count += 1
                        if s.pf:
                            s.pf = False
                            cur.prefetch_hits += 1
                    else:
                        b = born.get(sid)
                        if b is None:
                            continue
                        b[3] = j
                        b[4] += 1
                    add((TOUCH_ACCESS, sid, j, 0))
                name = names[name_id]
                phase = self.phase = _PHASES[pm & 3]
                if name.startswith("c10d::"):  # the observer does not see the Work: held until the step ends
                    self._record_born(born, now)
                    self._hold_for_collective(busy, None)
                timeline.append((step, j, used, phase))
                self.position = j + 1
            elif tag == ALLOC:
                sid, nb, fresh = log[i + 1], log[i + 2], log[i + 3]
                i += 4
                x = st.get(sid)
                if x is not None:
                    nb = x.nbytes
                elif sid in born:
                    nb = born[sid][1]
                else:
                    born[sid] = [fresh, nb, self.position, -1, 0]
                if not fresh:
                    pos = self.position
                    self._pre.setdefault(pos, []).append(sid)
                    add((TOUCH_ALLOC, sid, -1 if pos == 0 else pos, nb))
            elif tag == FREE:
                sid = log[i + 1]
                i += 2
                b = born.pop(sid, None)
                if b is None:
                    self._forget_native(sid, True, events)
                else:  # what _forget_native does for a record that never left the device
                    self._saved_pending.discard(sid)
                    self._frees.setdefault(self.position, []).append(sid)
                    add((TOUCH_FREE, sid, 0, b[1]))
            else:
                internal_assert(False, f"runtime: corrupt native event log (tag {tag} at word {i})")
        self._record_born(born, now)
        self._last_busy = busy
        self._last_outs = outs
        self._last_name = name
        if written:  # before the decision reads them: no eviction keeps a stale host copy
            self._drop_stale_hosts(written)
        if events:
            t1 = time.perf_counter()
            self.policy.on_touches(events)
            cur.policy_seconds += time.perf_counter() - t1

    def _native_recency_parse(self, light: bool) -> None:
        """The in-step parse while the observer keeps the policy's order (``Policy.keep_order_in``:
        lru; csrc/recency.h): the operators' touches reached the order as they ran, so only the
        storage table changes are read, from the compacted log (births of the storages that outlive
        the batch, deaths of those the manager knows), with what the observer kept of the operators
        instead of their records: the timeline (kept only for a step that needed a decision, as on
        the other paths: ``light``), the storages written while they had a valid host copy, the
        collectives' storages and the last operator. Not kept here, as after a step read
        compacted: ``history``'s frees of storages born and dead within a batch, positions of
        births and frees finer than the batch's last operator, and the records' access fields (the
        view reads the observer's: :meth:`last_access`, :meth:`access_count`)."""
        obs = self._obs
        words, names = obs.take_log(True)
        if names:
            self._names.extend(names)
        timeline, stale, held, name_id, phase, ins, outs = obs.take_recency(not light)
        pos = obs.position
        if words:
            st = self.st
            told: list[int] = []  # the order was told in C++: _forget_native's events go nowhere
            log = memoryview(words).cast("q")
            OP, ALLOC, FREE = _C_TAGS
            pre: list[int] = []  # first seen as an input: _pre's at pos, in log order
            new = self._new_native
            i, n = 0, len(log)
            while i < n:
                tag = log[i]
                if tag == ALLOC:
                    sid, nb, fresh = log[i + 1], log[i + 2], log[i + 3]
                    i += 4
                    if sid not in st:
                        new(sid, "temp" if fresh else "input", nb, True, pos)
                    if not fresh:
                        pre.append(sid)
                elif tag == FREE:
                    self._forget_native(log[i + 1], True, told)
                    i += 2
                elif tag == OP:  # a full log (tests read it so): the operators are in `timeline` already
                    i += 9 + log[i + 5] + log[i + 6] + log[i + 7] + log[i + 8]
                else:
                    internal_assert(False, f"runtime: corrupt native event log (tag {tag} at word {i})")
            if pre:
                self._pre.setdefault(pos, []).extend(pre)
        if timeline and not light:
            self._timeline.extend_words(self._step_index, memoryview(timeline).cast("q"))
        if name_id >= 0:
            self._last_busy = set(ins).union(outs)
            self._last_outs = outs
            self._last_name = self._names[name_id]
            self.phase = _PHASES[phase]
        self.position = pos
        if stale:  # before the decision reads them: no eviction keeps a stale host copy
            self._drop_stale_hosts(stale)
        self._recency_read = self._step_index
        k = 0
        while k < len(held):  # the observer does not see a collective's Work: held until the step ends
            m = held[k]
            self._hold_for_collective(set(held[k + 1:k + 1 + m]), None)
            k += 1 + m

    def last_access(self, sid: int) -> int:
        if self._native_order:
            return self._obs.last_access(sid)
        return self.st[sid].last_access

    def access_count(self, sid: int) -> int:
        if self._native_order:
            return self._obs.access_count(sid)
        return self.st[sid].count

    def _native_operators(self, log: list[int], stops: bool = False) -> None:
        """The in-step parse for a policy that reads operators and said the batch may be told in
        bulk (:meth:`~dynn_runtime.policies.base.Policy.operators_in_bulk`: no ``after_op`` of the
        batch would act): the runtime's own work per event is the per-operator path's, in log order
        (``Op`` records, access fields, timeline, collectives), and the policy gets every event in
        one :meth:`~dynn_runtime.policies.base.Policy.on_operators` call.

        A storage born in the batch gets its record only if it outlives the batch, made before that
        call in birth order (so the table's order is the per-operator path's), with the access fields
        the batch gave it; one born and dead within the batch has none: during the call the view
        answers its size, kind and saved flag from ``recordless`` (what its record's birth would
        say: ``_new_native``'s labels), and it counts as known wherever a record would (``accessed``,
        its death told). The records of the storages that died in the batch are forgotten after
        that call, so the policy's view still answers for them (sids are never reused, so no birth
        in the batch can meet a dead record). ``records_in_batch`` makes every birth's record at
        once (the reference the tests compare with). ``operators_in_c``: the loop over the batch, the
        births' records and ``recordless`` entries run in ``dynn_runtime._C`` (``parse_operators``;
        ``forget_dead`` after the policy's call; csrc/operators.cpp), which make the same objects and
        writes in the same order; off, the Python code here (the reference).

        ``stops``: the policy :meth:`~dynn_runtime.policies.base.Policy.stops_in_bulk` (C parse only):
        the call gets an ``after`` (:class:`_AfterOps`) that the policy calls after each operator
        whose ``after_op`` may act, and which brings the view to what the per-operator loop shows
        there before that ``after_op`` and its moves run."""
        if self.records_in_batch:
            self._native_operators_recorded(log)
            return
        if self.operators_in_c:
            mod = native_module()
            if mod is not None:
                phase0 = self.phase
                events, dead, tl = mod.parse_operators(self, log, time.perf_counter() - self._t0, _PARSE_CTX)
                if tl:
                    self._timeline.extend_words(self._step_index, memoryview(tl).cast("q"))
                cur = self._cur
                after = _AfterOps(self, mod, dead) if stops else None
                t1 = time.perf_counter()
                try:
                    if events:
                        if after is None:
                            self.policy.on_operators(events, phase0)
                        else:
                            self.policy.on_operators(events, phase0, after)
                finally:
                    cur.policy_seconds += time.perf_counter() - t1
                    mod.forget_dead(self, dead if after is None or not after.k else dead[after.k:], _PARSE_CTX)
                return
        st = self.st
        names = self._names
        ops = self._ops
        tl: list[int] = []  # the timeline's entries, as (position, used, phase code) words
        cur = self._cur
        now = time.perf_counter() - self._t0
        saved_pending, grad_pending = self._saved_pending, self._grad_pending
        events: list[tuple] = []
        add = events.append
        # the deaths in log order: a record's sid, or a birth of this batch's _Born
        dead: list[tuple[int, int, _Born | None]] = []
        born: dict[int, _Born] = {}  # born in this batch, no record yet (alive or dead)
        phase0 = phase = self.phase
        busy: set[int] = self._last_busy
        last_outs = self._last_outs
        name = self._last_name
        mods = self._modules  # _op_of's reads, hoisted
        idioms = self._idiom_by_name
        OP, ALLOC, FREE = _C_TAGS
        i, n = 0, len(log)
        while i < n:
            tag = log[i]
            if tag == OP:
                j = self.position
                name_id, pm, node, used, ins, outs, writes, allocs, i = _op_record(log, i)
                name = names[name_id]
                phase, module = _PHASES[pm & 3], pm >> 2
                if writes:
                    self._drop_stale_hosts(writes)
                # _op_of, inline (Op's fields positional, in declaration order)
                iv = idioms.get(name)
                if mods is None:
                    path = ""
                else:
                    if phase == "backward":
                        module = mods.node_modules.get(node, 0)
                    paths = mods.paths
                    path = paths[module] if module < len(paths) else ""
                op = Op(name, self._idiom_of(name) if iv is None else iv, phase, path, ins, outs, writes, allocs,
                        0.0, 0, 0, node)
                ops.append(op)
                busy = set(ins).union(outs)
                last_outs = outs
                if name.startswith("c10d::"):  # the observer does not see the Work: held until the step ends
                    self._record_batch_born(born, dead, now)
                    self._hold_for_collective(busy, None)
                accessed = []
                for sid in busy:  # _accessed, for the records and the births of the batch
                    s = st.get(sid)
                    if s is not None:
                        s.last_access = j
                        s.last_access_t = now
                        s.count += 1
                        if s.pf:
                            s.pf = False
                            cur.prefetch_hits += 1
                        accessed.append(sid)
                    else:
                        b = born.get(sid)
                        if b is not None:
                            b.last_access = j
                            b.count += 1
                            accessed.append(sid)
                add((OPERATOR, j, op, accessed))
                tl += (j, used, _PHASE_CODES[pm & 3])
                self.position = j + 1
            elif tag == ALLOC:
                sid, nb, fresh = log[i + 1], log[i + 2], log[i + 3]
                i += 4
                if sid not in st and sid not in born:
                    # _new_native's labels (movable: a birth in a step), kept until the record or the death
                    if sid in saved_pending:
                        kind, saved = "activation", True
                    else:
                        kind, saved = "temp" if fresh else "input", False
                    if sid in grad_pending:
                        kind = "grad"
                    born[sid] = _Born(nb, kind, saved, fresh, self.position)
                if not fresh:
                    pos = self.position
                    self._pre.setdefault(pos, []).append(sid)
                    add((TOUCH_ALLOC, sid, -1 if pos == 0 else pos))
            elif tag == FREE:
                sid = log[i + 1]
                i += 2
                b = born.get(sid)
                if b is not None:
                    if not b.dead:
                        b.dead = True
                        dead.append((sid, self.position, b))
                        add((TOUCH_FREE, sid))
                elif sid in st:  # an unknown storage's death is told to nobody (_forget_native)
                    dead.append((sid, self.position, None))
                    add((TOUCH_FREE, sid))
                else:
                    saved_pending.discard(sid)
            else:
                internal_assert(False, f"runtime: corrupt native event log (tag {tag} at word {i})")
        self.phase = phase
        self._last_busy = busy
        self._last_outs = last_outs
        self._last_name = name
        if tl:
            self._timeline.extend_words(self._step_index, memoryview(array("q", tl)))
        recordless = self.recordless
        for sid, b in born.items():
            if b.dead:
                recordless[sid] = b
            else:
                x = self._new_native(sid, "temp" if b.fresh else "input", b.nbytes, True, b.pos)
                if b.count:
                    x.last_access, x.last_access_t, x.count = b.last_access, now, b.count
        t1 = time.perf_counter()
        try:
            if events:
                self.policy.on_operators(events, phase0)
        finally:
            cur.policy_seconds += time.perf_counter() - t1
            frees = self._frees
            for sid, pos, b in dead:  # _forget_native's work, the policy told already
                saved_pending.discard(sid)
                if b is not None:  # no record: nothing held, away or pinned
                    del recordless[sid]  # its own only (a handler the call reached may parse a batch too)
                    grad_pending.discard(sid)
                    frees.setdefault(pos, []).append(sid)
                    continue
                x = st.pop(sid, None)
                if x is None:  # forgotten meanwhile (the policy's call reached a handler that read the table)
                    continue
                if x.status is not ABSENT:
                    self.set_status(x, ABSENT)
                self._drop_host(x)
                frees.setdefault(pos, []).append(sid)
                self._pinned.discard(sid)

    def _record_batch_born(self, born: dict[int, _Born], dead: list[tuple[int, int, _Born | None]],
                           now: float) -> None:
        """The records of the storages :meth:`_native_operators` saw born so far, in birth order, the
        dead ones included (a collective's storages are held by their records): from here on they
        are the table's, and a death seen already is a record's."""
        for sid, b in born.items():
            x = self._new_native(sid, "temp" if b.fresh else "input", b.nbytes, True, b.pos)
            if b.count:
                x.last_access, x.last_access_t, x.count = b.last_access, now, b.count
        born.clear()
        for k, (sid, pos, b) in enumerate(dead):
            if b is not None:
                dead[k] = (sid, pos, None)

    def _native_operators_recorded(self, log: list[int]) -> None:
        """:meth:`_native_operators` with every birth's record made as it is read (the reference)."""
        st = self.st
        names = self._names
        ops = self._ops
        timeline = self._timeline
        step = self._step_index
        cur = self._cur
        now = time.perf_counter() - self._t0
        events: list[tuple] = []
        add = events.append
        dead: list[tuple[int, int]] = []
        phase0 = phase = self.phase
        busy: set[int] = self._last_busy
        last_outs = self._last_outs
        name = self._last_name
        OP, ALLOC, FREE = _C_TAGS
        i, n = 0, len(log)
        while i < n:
            tag = log[i]
            if tag == OP:
                j = self.position
                name_id, pm, node, used, ins, outs, writes, allocs, i = _op_record(log, i)
                name = names[name_id]
                phase, module = _PHASES[pm & 3], pm >> 2
                if writes:
                    self._drop_stale_hosts(writes)
                op = self._op_of(name, phase, module, node, ins, outs, writes, allocs)
                ops.append(op)
                busy = set(ins).union(outs)
                last_outs = outs
                if name.startswith("c10d::"):  # the observer does not see the Work: held until the step ends
                    self._hold_for_collective(busy, None)
                add((OPERATOR, j, op, self._accessed(busy, j, now)))
                timeline.append((step, j, used, phase))
                self.position = j + 1
            elif tag == ALLOC:
                sid, nb, fresh = log[i + 1], log[i + 2], log[i + 3]
                i += 4
                if st.get(sid) is None:
                    self._new_native(sid, "temp" if fresh else "input", nb, True, self.position)
                if not fresh:
                    pos = self.position
                    self._pre.setdefault(pos, []).append(sid)
                    add((TOUCH_ALLOC, sid, -1 if pos == 0 else pos))
            elif tag == FREE:
                sid = log[i + 1]
                i += 2
                if sid in st:  # an unknown storage's death is told to nobody (_forget_native)
                    dead.append((sid, self.position))
                    add((TOUCH_FREE, sid))
                else:
                    self._saved_pending.discard(sid)
            else:
                internal_assert(False, f"runtime: corrupt native event log (tag {tag} at word {i})")
        self.phase = phase
        self._last_busy = busy
        self._last_outs = last_outs
        self._last_name = name
        t1 = time.perf_counter()
        try:
            if events:
                self.policy.on_operators(events, phase0)
        finally:
            cur.policy_seconds += time.perf_counter() - t1
            frees = self._frees
            for sid, pos in dead:  # _forget_native's work, the policy told already
                self._saved_pending.discard(sid)
                x = st.pop(sid, None)
                if x is None:  # forgotten meanwhile (the policy's call reached a handler that read the table)
                    continue
                if x.status is not ABSENT:
                    self.set_status(x, ABSENT)
                self._drop_host(x)
                frees.setdefault(pos, []).append(sid)
                self._pinned.discard(sid)

    def _drop_stale_hosts(self, sids: Iterable[int]) -> None:
        """Storages written since their host copy was made (the observer clears ``host_valid`` on a
        write): the copy no longer equals the device bytes, so it is dropped, never used to evict.
        Only a resident one's: the observer clears the flag when it sees an operator that writes a
        storage away, before that operator's fault brings it back, and the copy is then the
        storage's only bytes (what the fault fetches; the kernel writes after it). A later eviction
        asks the observer again (:meth:`~.moves.Moves._evict`)."""
        st, obs = self.st, self._obs
        for sid in sids:
            x = st.get(sid)
            if x is not None and x.host is not None and x.status is RESIDENT and not obs.host_valid(sid):
                self._drop_host(x)

    def _record_born(self, born: dict[int, list[int]], now: float) -> None:
        """The records of the storages :meth:`_native_touches` saw born and alive, in birth order (the
        table's order is then the per-operator path's)."""
        for sid, (fresh, nb, pos, last, count) in born.items():
            x = self._new_native(sid, "temp" if fresh else "input", nb, True, pos)
            if count:
                x.last_access, x.last_access_t, x.count = last, now, count
        born.clear()

    def _forget_native(self, sid: int, in_step: bool, events: list[int] | None = None) -> None:
        """``sid`` died: forget it, and tell the policy now (or append it to ``events``, which
        :meth:`_native_touches` tells in bulk)."""
        self._saved_pending.discard(sid)
        x = self.st.pop(sid, None)
        if x is None:
            return
        if x.status is not ABSENT:
            self.set_status(x, ABSENT)
        self._drop_host(x)
        if in_step:
            self._frees.setdefault(self.position, []).append(sid)
        self._pinned.discard(sid)
        if events is None:
            self.policy.on_free(sid)
        else:
            events.extend((TOUCH_FREE, sid, 0, x.nbytes))

    def _native_op(self, j: int, name: str, phase: str, module: int, node: int, ins: tuple[int, ...],
                   outs: tuple[int, ...], writes: tuple[int, ...], allocs: tuple[int, ...], tell: bool,
                   measuring: bool) -> None:
        st = self.st
        if measuring and not (self._lists is not None and is_list_operator(name)):  # (split: lists.py)
            touched = sum(st[x].nbytes for x in ins if x in st) + sum(st[x].nbytes for x in allocs if x in st)
            if touched > self._largest_op[0]:
                self._largest_op = (touched, f"operator {name} (position {j}, {phase})")
        op = self._op_of(name, phase, module, node, ins, outs, writes, allocs)
        self._ops.append(op)
        self._last_busy = set(ins).union(outs)
        self._last_outs = outs
        self._last_name = name
        if name.startswith("c10d::"):  # the observer does not see the Work: held until the step ends
            self._hold_for_collective(self._last_busy, None)
        if not tell:
            return
        t0 = time.perf_counter()
        pol = self.policy
        accessed = self._accessed(self._last_busy, j, t0 - self._t0)
        self.position = j
        if self._trace is None:
            pol.on_operator(j, op, accessed)
        else:  # the oracle's view maps this operator's storages after their on_alloc, before on_op
            for sid in allocs:
                pol.on_alloc(sid, j)
            for sid in accessed:
                pol.on_access(sid, j)
            self._map_oracle_op(j, ins, allocs, name)
            pol.on_op(j, op)
        self._apply(pol.after_op(j), self._last_busy)
        self._cur.policy_seconds += time.perf_counter() - t0

    def _op_of(self, name: str, phase: str, module: int, node: int, ins: tuple[int, ...],
               outs: tuple[int, ...], writes: tuple[int, ...], allocs: tuple[int, ...]) -> Op:
        """The ``Op`` record of a logged operator (in backward its module is its autograd node's)."""
        mods = self._modules
        if mods is not None and phase == "backward":
            module = mods.node_modules.get(node, 0)
        iv = self._idiom_by_name.get(name)
        # positional: Op's fields in declaration order (name, idiom, phase, module, inputs, outputs,
        # writes, allocs, duration_s, flops, nbytes, node)
        return Op(name, self._idiom_of(name) if iv is None else iv, phase,
                  mods.paths[module] if mods is not None and module < len(mods.paths) else "",
                  ins, outs, writes, allocs, 0.0, 0, 0, node)

    def _accessed(self, busy: Iterable[int], j: int, now: float) -> list[int]:
        """Operator ``j`` touched ``busy``: the access fields of those the manager has a record of
        (last access, count, a prefetch's first use counted as a hit), which are returned."""
        st = self.st
        cur = self._cur
        accessed = []
        for sid in busy:
            s = st.get(sid)
            if s is None:
                continue
            s.last_access = j
            s.last_access_t = now
            s.count += 1
            if s.pf:
                s.pf = False
                cur.prefetch_hits += 1
            accessed.append(sid)
        return accessed

    def _idiom_of(self, name: str) -> tuple[int, ...]:
        iv = self._idiom_by_name.get(name)
        if iv is None:
            iv = ()
            try:
                ns, _, rest = name.partition("::")
                base, _, overload = rest.partition(".")
                packet = getattr(getattr(torch.ops, ns), base)
                func = getattr(packet, overload or "default")
                iv = self._idiom(func, name)
            except (AttributeError, RuntimeError):
                pass  # an operator torch.ops cannot name: no idiom vector
            self._idiom_by_name[name] = iv
        return iv
