"""The live manager's storage table: which device storages it manages, what it knows of each, and
how births and deaths reach it.

A storage is known by its ``sid``. On the Python event source the table is keyed by the storage's
address and a weakref callback on its Python object reports its death (storages keep their Python
object for as long as they live), drained at the next operator; on the native source the observer
(``events.cpp``) keeps the table and logs births and deaths, read at decision points. A storage made
between steps by the program stays put (only model state and what a step creates may move), and
``kind`` only ever gets more specific (``_RANK``). A record is in ``st`` from its storage's birth
(``resident``) to its death, when it leaves ``st`` and only then becomes ``absent``: no record in
``st`` is absent, so the table is what the program holds.

State (set by :meth:`MemoryManager._reset_state`): ``st``, ``_key_sid``, ``_next_sid``, ``_dead``,
``_saved_pending``, ``_saved_unlogged``, ``_grad_pending``, ``_pinned``, ``_t0``, ``_slack_mark``; ``_tell_labels`` (set at attach:
the policy ``reads_labels``).
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch import nn

from ..errors import BudgetError
from ..residency import Record, Status
from .events import no_mode
from .hostpool import HostBuffer

RESIDENT, ABSENT = Status.RESIDENT, Status.ABSENT

#: kinds that live across steps (the oracle maps them by name; their late birth counts at the peak)
_PERSISTENT = ("param", "buffer", "opt_state")
#: kinds that may move even when the program made them between steps
_MOVABLE_ALWAYS = frozenset({"param", "buffer", "opt_state", "grad"})
_RANK = {k: i for i, k in enumerate(("param", "buffer", "opt_state", "grad", "activation", "input", "temp"))}


def settled(kind: str) -> tuple[str, ...]:
    """The kinds a label of ``kind`` leaves as they are (``_track``): its own and the more specific."""
    return tuple(k for k, r in _RANK.items() if r <= _RANK[kind])


class _S(Record):
    """What the manager knows about one device storage, beyond what the simulator keeps too."""

    __slots__ = ("key", "ref", "host", "event", "name", "movable", "born_step", "fetch_event", "pf", "born_pos",
                 "obs", "stream")

    def __init__(self, sid: int, key: int, ref: Any, nbytes: int, kind: str, movable: bool, step: int) -> None:
        super().__init__(sid, nbytes, kind)
        self.key = key
        self.pf = False  # prefetched, not used since
        self.ref = ref  # weakref to the UntypedStorage (Python source); None: the observer's (storage())
        self.host: HostBuffer | None = None
        self.event: Any = None  # completion of the last copy into or out of ``host``
        self.fetch_event: Any = None  # completion of an in-flight H2D copy
        self.name = ""
        self.movable = movable
        self.born_step = step
        self.born_pos = 0
        self.obs: Any = None  # the native observer, which must see the next access while a copy is in flight
        self.stream = 0  # Python source, CUDA: the stream id of its last access (the native observer keeps its own)

    def storage(self) -> Any:
        """The UntypedStorage, or None once it died: through the weak reference (Python source) or
        the observer (native source, where ``ref`` is None: no callable kept per storage)."""
        ref = self.ref
        if ref is not None:
            return ref()
        obs = self.obs
        return None if obs is None else obs.storage(self.sid)


def _mark_saved(s: _S) -> None:
    """Autograd saved ``s``. As in a trace, what the step made becomes an ``activation``, and an input
    from outside the step (the batch, made between steps, so never movable) stays an ``input``."""
    s.saved = True
    if s.kind == "temp" or (s.kind == "input" and s.movable):
        s.kind = "activation"


def _storage_key(st: torch.UntypedStorage) -> int:
    return st._cdata


def _u8(st: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage (no dispatch: set_ on a fresh tensor)."""
    t = torch.empty(0, dtype=torch.uint8, device=device)
    t.set_(st, 0, (st.nbytes(),), (1,))
    return t


class StorageTable:
    """Registering, naming and forgetting storages; the MemoryView answers that need the live objects."""

    def _sid(self, t: torch.Tensor) -> int | None:
        obs = self._obs
        if obs is not None:
            if type(t) not in (torch.Tensor, nn.Parameter):
                return None
            sid = obs.sid_of(t)
            if sid < 0:
                return None
            if sid not in self.st:
                self._native_parse(in_step=self._in_step)  # born since the log was last read
            return sid if sid in self.st else None
        if t.device != self.device or t.layout != torch.strided or type(t) not in (torch.Tensor, nn.Parameter):
            return None
        return self._key_sid.get(_storage_key(t.untyped_storage()))

    def _track(self, t: torch.Tensor, kind: str, fresh: bool) -> int | None:
        """The manager's id of ``t``'s storage, registering it if new (``kind`` only ever gets more specific)."""
        if type(t) not in (torch.Tensor, nn.Parameter):
            return None  # not a tensor, or a subclass (DTensor, fake, ...) that manages its own storage
        if self._obs is not None:  # the observer tests device and layout natively
            return self._track_native(t, kind)
        if t.device != self.device or t.layout != torch.strided:
            return None
        if self._dead:  # a dead storage's address may be reused by a new one: forget the dead first
            self._drain()
        st = t.untyped_storage()
        key = _storage_key(st)
        sid = self._key_sid.get(key)
        if sid is not None:
            s = self.st[sid]
            if _RANK[kind] < _RANK[s.kind]:
                s.kind = kind
                if kind in _MOVABLE_ALWAYS and not s.movable:
                    s.movable = st.resizable()
                self._labelled(sid)
            return sid
        n = st.nbytes()
        if n == 0:
            return None
        if not fresh and self.budget is not None and not self._measure_step and self.used + n > self.budget:
            # A storage made where the manager could not see it (``torch.tensor``, a C++ kernel
            # outside the dispatcher): make room before accounting it, so the budget still holds.
            try:
                if self._in_dispatch:
                    self.make_room(n, set(), "a storage created outside the dispatcher")
                else:
                    with no_mode():
                        self.make_room(n, set(), "a storage created outside the dispatcher")
            except BudgetError:
                pass  # counted as an overshoot by _note_peak
        sid = self._next_sid
        self._next_sid += 1
        ref = weakref.ref(st, self._make_dead_cb(sid))
        # Only what the manager owns moves: model state, and what a step creates. A tensor the
        # program makes between steps (a batch, a metric) is accounted but stays put, so code
        # that reads raw memory outside the dispatcher (``.numpy()``, printing) never meets an
        # offloaded storage.
        movable = st.resizable() and (self._in_step or kind in _MOVABLE_ALWAYS)
        s = _S(sid, key, ref, n, kind, movable, self._step_index)
        if movable and kind not in _MOVABLE_ALWAYS:
            self._transient.append(s)
        s.born_pos = self.position
        self.st[sid] = s
        self._key_sid[key] = sid
        self.set_status(s, RESIDENT)
        if self._in_step:
            if fresh:
                pass  # the caller announces it with its operator position
            else:
                self._pre.setdefault(self.position, []).append(sid)
                with no_mode():
                    self.policy.on_alloc(sid, -1 if self.position == 0 else self.position)
        self._note_peak()
        return sid

    def _track_native(self, t: torch.Tensor, kind: str) -> int | None:
        sid = self._obs.track(t)
        if sid < 0:
            return None
        s = self.st.get(sid)
        if s is None:
            s = self._new_native(sid, kind, self._obs.nbytes(sid), t.untyped_storage().resizable()
                                 and (self._in_step or kind in _MOVABLE_ALWAYS), self._obs.position)
        elif _RANK[kind] < _RANK[s.kind]:
            s.kind = kind
            if kind in _MOVABLE_ALWAYS and not s.movable:
                s.movable = t.untyped_storage().resizable()
            self._labelled(sid)
        return sid

    def _new_native(self, sid: int, kind: str, nbytes: int, movable: bool, born: int) -> _S:
        obs = self._obs
        s = _S(sid, sid, None, nbytes, kind, movable, self._step_index)  # positional: one per birth read
        if movable and kind not in _MOVABLE_ALWAYS:
            self._transient.append(s)
        s.obs = obs
        self.set_status(s, RESIDENT)  # the observer counted its bytes already (_account)
        s.born_pos = born
        if sid in self._saved_pending:
            self._saved_pending.discard(sid)
            _mark_saved(s)
        if sid in self._grad_pending:  # labelled by the optimizer's pre-hook before its birth was read
            self._grad_pending.discard(sid)
            if _RANK["grad"] < _RANK[s.kind]:
                s.kind = "grad"
                if not s.movable:
                    storage = obs.storage(sid)
                    s.movable = storage is not None and storage.resizable()
        self.st[sid] = s
        return s

    def _make_dead_cb(self, sid: int) -> Any:
        dead = self._dead

        def cb(_ref: Any) -> None:  # may run in any thread, at any time: only record it
            dead.append(sid)

        return cb

    def _drain(self) -> None:
        """Account the storages the program freed since the last look."""
        while self._dead:
            sid = self._dead.pop()
            s = self.st.pop(sid, None)
            if s is None:
                continue
            if self._key_sid.get(s.key) == sid:
                del self._key_sid[s.key]
            if s.status is not ABSENT:
                self.set_status(s, ABSENT)
            self._drop_host(s)
            if self._in_step:
                self._frees.setdefault(self.position, []).append(sid)
            self._pinned.discard(sid)
            self.policy.on_free(sid)

    def _drop_host(self, s: _S) -> None:
        if s.host is not None:
            self.pool.release(s.host, s.event)
            s.host = None
        s.host_valid = False

    def _note_peak(self) -> None:
        cur = self._cur
        used = self.used  # (native: the observer's count, read once; nothing here frees a storage)
        if used > cur.peak_device_bytes:
            cur.peak_device_bytes = used
            self._peak_pos = self.position
        if self._measuring and used + self.away > self._live_peak:
            self._live_peak, self._live_pos = used + self.away, self.position
        if self.budget is not None and not self._measure_step and used > self.budget:
            self._overshoot(used - self.budget,
                            f"operator {self._last_name} (position {self.position}, {self.phase})")

    def _overshoot(self, nbytes: int, where: str) -> None:
        """The step went ``nbytes`` over the budget at ``where``: kept if it is the step's largest."""
        cur = self._cur
        if nbytes > cur.budget_overshoot_bytes:
            cur.budget_overshoot_bytes, cur.budget_overshoot_at = nbytes, where

    def _pack(self, t: torch.Tensor) -> Any:
        if self._obs is not None:
            sid = self._obs.sid_of(t) if type(t) in (torch.Tensor, nn.Parameter) else -1
            if sid < 0:
                if self._in_step and type(t) is torch.Tensor and t.device == self.device:
                    # an output saved by the operator that makes it (layer norm's statistics, softmax):
                    # autograd packs it before the observer has logged the operator; looked up again
                    # once it has (the references last about one operator: autograd holds them anyway)
                    if self._saved_unlogged:
                        self._resolve_saved_unlogged()
                    self._saved_unlogged.append((self._obs.position, t))
                return t.detach()
        else:
            sid = self._sid(t)
        if sid is not None and sid not in self.st:
            self._saved_pending.add(sid)  # born since the log was last read
        elif sid is not None:
            s = self.st[sid]
            if not s.saved:
                _mark_saved(s)
                self._labelled(sid)
        return t.detach()

    def _resolve_saved_unlogged(self) -> None:
        """The outputs :meth:`_pack` met before the observer logged them, now that it has: labelled saved
        (when their birth is read, or now if it was)."""
        obs = self._obs
        now = obs.position  # operators before it are logged
        pending, self._saved_unlogged = self._saved_unlogged, []
        for position, t in pending:
            if position >= now:
                self._saved_unlogged.append((position, t))
                continue
            sid = obs.sid_of(t)
            if sid < 0:
                continue
            s = self.st.get(sid)
            if s is None:
                self._saved_pending.add(sid)
            elif not s.saved:
                _mark_saved(s)
                self._labelled(sid)

    def _labelled(self, sid: int) -> None:
        """``sid``'s kind or saved flag changed after the policy was told of it: a policy that reads
        labels is told now (in a step it is told of; at a step's start every storage is announced
        again with its labels as they are then)."""
        if self._tell_labels and self._in_step and not self._measure_step:
            with no_mode():
                self.policy.on_label(sid)

    def _grad_ready(self, p: torch.Tensor) -> None:
        """A parameter's gradient was accumulated (autograd's post-accumulate-grad hook, installed for
        a policy that reads labels): labelled "grad" now, not when the optimizer starts."""
        if self._in_step and p.grad is not None:
            self._label_grad(p.grad)

    def _label_grad(self, g: torch.Tensor) -> None:
        """Label the gradient ``g`` "grad". On the native source, one whose birth the manager has not
        read yet is labelled when it reads it (``_new_native``); one that dies first is never
        registered in Python at all."""
        obs = self._obs
        if obs is not None and type(g) is torch.Tensor:
            sid = obs.sid_of(g)
            if sid >= 0 and sid not in self.st:
                self._grad_pending.add(sid)
                return
        self._track(g, "grad", fresh=False)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def host_now(self) -> None:
        """None: the host is real here (a policy's worker thread takes real time; nothing is modelled)."""
        return None

    def copy_seconds(self, nbytes: int, direction: str) -> None:
        """None: the live link is not modelled (its copies take real time)."""
        return None

    def link_backlog(self, direction: str) -> None:
        """None: the copies queued on the live streams are not timed."""
        return None

    def device_slack(self) -> float | None:
        """Roughly how many seconds of issued work the GPU has still to run (the pilot decides on the
        issuing thread when that hides the decision), or None on a CPU device, where the
        operators run on this thread. Each call records an event on the compute stream and queries
        the previous call's: still pending, the GPU has not reached what was issued then, and the
        time since is the estimate; done, 0 (the GPU is keeping up with this thread)."""
        if self.device.type != "cuda":
            return None
        now = time.perf_counter()
        mark, self._slack_mark = self._slack_mark, None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._slack_mark = (ev, now)
        if mark is None or mark[0].query():
            return 0.0
        return now - mark[1]

    def forward_done(self, sid: int) -> bool:
        """Only autograd (and the manager) still refer to ``sid``: the forward pass is done with it."""
        s = self.st.get(sid)
        if s is None or self.phase != "forward":
            return False
        st = s.storage()
        if st is None:
            return False
        # one count for the preserved storage object, one for the detached alias autograd holds
        return torch._C._storage_Use_Count(st._cdata) <= 2

    def recomputable(self, sid: int) -> bool:
        return False

    def recompute_cost(self, sid: int) -> float:
        return float("inf")

    def producer_of(self, sid: int) -> int | None:
        return None
