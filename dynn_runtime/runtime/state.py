"""State leaving the manager: everything brought back to the device, or streamed out to host copies.

``restore_all()`` and ``detach()`` bring what is away back when it fits the device's free memory;
``detach()`` otherwise puts the parameters, buffers, gradients and optimizer state that are away on
the CPU, read from their host copies. ``state_dict()`` of the model and the optimizer (pre and post
hooks) brings everything back when it fits the budget, and otherwise leaves CPU copies in the state
dict, so a checkpoint is written within the budget and never captures an empty storage.

State: ``_streaming``, ``_warned_streaming``.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from ..errors import BudgetError, internal_assert
from ..memory import format_bytes
from ..residency import Status
from . import devicemem
from .events import no_mode
from .storages import _S

__all__ = ["StateTransfer"]

RESIDENT, HOST, FETCHING, DROPPED = Status.RESIDENT, Status.HOST, Status.FETCHING, Status.DROPPED


class StateTransfer:
    """Bringing the managed state back, or out to the CPU."""

    def restore_all(self) -> None:
        """Bring every managed storage back to the device, budget or not. Raises BudgetError, having
        moved nothing, when they do not fit the device's free memory (a checkpoint needs no
        restore: ``state_dict()`` under the manager streams host copies when the state does not fit)."""
        with no_mode():
            self._copies.sync()  # copies in flight may hold the last reference to a storage: settle first
            self._drain()
            room = devicemem.device_room(self.device)
            if self.cap_bytes is not None and self.cuda:
                room = min(room, self.cap_bytes + self._outside0 + self.unmanaged_bytes - self.used)
            if self.away > room:
                raise BudgetError(
                    f"runtime: restore_all() needs {format_bytes(self.away)} more on {self.device} and "
                    f"{format_bytes(max(room, 0))} is free; nothing was moved. To save a checkpoint, call state_dict() "
                    "under the manager (it streams host copies when the state does not fit); detach() leaves what "
                    "does not fit on the CPU.")
            self._restore()

    def _restore(self) -> None:
        for s in list(self.st.values()):
            if s.status in (HOST, DROPPED, FETCHING) and s.storage() is not None:
                self._fetch_now(s, budgeted=False)
        self._sync()

    def _state_tensors(self) -> list[tuple[torch.Tensor, Any]]:
        """The model's parameters and buffers, their gradients and the optimizer's state, each with a
        function that puts another tensor in its place."""
        out: list[tuple[torch.Tensor, Any]] = []

        def put_data(t: torch.Tensor) -> Any:
            return lambda v: setattr(t, "data", v)

        for p in self.model.parameters():
            out.append((p, put_data(p)))
            if p.grad is not None:
                out.append((p.grad, put_data(p.grad)))
        for m in self.model.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    out.append((b, functools.partial(m._buffers.__setitem__, name)))
        for opt in self.optimizers:
            for state in opt.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        out.append((v, functools.partial(state.__setitem__, k)))
        return out

    def _away_to_cpu(self) -> None:
        """detach() when what is away does not fit the device: the state tensors on those storages
        become CPU tensors read from their host copies (all checked first: nothing moves unless every
        away storage has a tensor to put it in)."""
        owners: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        for t, put in self._state_tensors():
            sid = self._sid(t)
            if sid is not None and self.st[sid].status in (HOST, DROPPED):
                owners.setdefault(sid, []).append((t, put))
        away = [s for s in self.st.values() if s.status in (HOST, DROPPED) and s.storage() is not None]
        orphans = [s for s in away if s.sid not in owners]
        if orphans:
            raise BudgetError(
                f"runtime: detach() cannot bring back {format_bytes(self.away)} that is off the device "
                f"({format_bytes(devicemem.device_room(self.device))} free on {self.device}), and {len(orphans)} of those "
                f"storages ({format_bytes(sum(s.nbytes for s in orphans))}) hold no parameter, buffer, gradient or "
                "optimizer state that could move to the CPU instead. The manager stays attached and nothing moved: "
                "free device memory (drop tensors the program still holds) and detach() again.")
        n = 0
        for sid, pairs in owners.items():
            s = self.st[sid]
            for t, put in pairs:
                put(self._host_copy(t, s))
                n += 1
        warnings.warn(
            f"dynn-runtime: the managed state does not fit the free memory of {self.device} "
            f"({format_bytes(self.away)} away, {format_bytes(devicemem.device_room(self.device))} free), so detach() left "
            f"{n} tensors of it on the CPU with the same values: the model is now partly on the CPU.",
            RuntimeWarning, stacklevel=3)

    def _state_dict_pre(self) -> None:
        """Before ``state_dict()``: everything comes back if it fits the budget (the state dict then
        holds the device tensors, as without the manager). If not, nothing is fetched here and
        :meth:`_state_dict_post` streams the tensors out to host copies instead."""
        away = sum(s.nbytes for s in self.st.values() if s.status in (HOST, DROPPED, FETCHING))
        self._streaming = self.budget is not None and not self._measure_step and self.used + away > self.budget
        if not self._streaming:
            self.restore_all()

    def _state_dict_post(self, sd: dict) -> None:
        """After ``state_dict()`` when the state does not fit the budget: every managed tensor becomes a
        CPU copy (from its host copy if it is away, else copied now), so code that reads the state dict
        without the dispatcher (``torch.save``) never meets an empty storage, within the budget."""
        if not self._streaming:
            return
        self._streaming = False
        if not self._warned_streaming:
            self._warned_streaming = True
            warnings.warn("dynn-runtime: the state does not fit the budget on the device, so state_dict() holds "
                          "CPU copies of the managed tensors (load_state_dict copies them back as usual).",
                          RuntimeWarning, stacklevel=4)
        with no_mode():
            self._drain()
            stack = [sd]
            while stack:
                d = stack.pop()
                for k, v in d.items():
                    if isinstance(v, dict):
                        stack.append(v)
                    elif isinstance(v, torch.Tensor) and v.device == self.device:
                        sid = self._sid(v)
                        if sid is not None:
                            d[k] = self._host_copy(v, self.st[sid])

    def _host_copy(self, t: torch.Tensor, s: _S) -> torch.Tensor:
        """A CPU tensor with ``t``'s values, read from ``s``'s host copy if it is away."""
        if s.status == FETCHING:
            st = s.storage()
            if st is not None:
                self._finish_fetch(s, st)
        if s.status == RESIDENT:
            return t.detach().to("cpu", copy=True)
        internal_assert(s.host is not None and s.host_valid, f"runtime: storage {s.sid} is away without a host copy")
        if s.event is not None:
            s.event.synchronize()
        raw = s.host.tensor  # the storage's bytes; t is a view into them
        out = torch.empty(0, dtype=t.dtype)
        out.set_(raw.untyped_storage(), raw.storage_offset() // t.element_size() + t.storage_offset(),
                 t.shape, t.stride())
        return out.clone()

