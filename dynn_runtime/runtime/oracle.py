"""The oracle's view of the future: this run matched, operator by operator, to a recorded trace of the
same inputs.

Persistent storages are matched by name, the rest by their position among the allocations and inputs
of the operator at the same position; a run that diverges from its trace warns once and its
predictions are wrong from there on (results stay correct: the oracle never discards live).

State: ``_trace``, ``_trace_it``, ``_trace_acc``, ``_oracle_map``, ``_persist_map``, ``_oracle_warned``.
"""

from __future__ import annotations

import warnings

from ..errors import PolicyError
from ..residency import next_access
from .storages import _PERSISTENT


class OracleAlignment:
    """``next_use`` from the recorded trace."""

    def next_use(self, sid: int) -> int | None:
        """The oracle's answer, from the recorded trace of the same inputs (None without one)."""
        tr = self._trace
        if tr is None:
            return None
        tsid = self._oracle_map.get(sid)
        if tsid is None:
            return self.position + 1  # unknown to the trace: keep it
        return next_access(self._trace_acc.get(tsid), self.position, self.st[sid].kind, len(self._trace_it.ops))

    def _map_oracle_persistent(self) -> None:
        tr = self._trace
        if tr is None:
            return
        if self._step_index >= len(tr.iterations):
            raise PolicyError(f"runtime: the oracle's trace has {len(tr.iterations)} iteration(s) but this is step "
                              f"{self._step_index}; record the trace with at least as many steps.")
        it = tr.iterations[self._step_index]
        self._trace_it = it
        self._trace_acc: dict[int, list[int]] = {}
        for j, op in enumerate(it.ops):
            for x in set(op.inputs) | set(op.outputs) | set(op.writes):
                self._trace_acc.setdefault(x, []).append(j)
        by_name = {s.name: s.sid for s in tr.storages.values() if s.name and s.kind in ("param", "buffer")}
        if not hasattr(self, "_persist_map"):
            self._persist_map: dict[int, int] = {}
        for sid, s in self.st.items():
            if s.name in by_name:
                self._persist_map[sid] = by_name[s.name]
        self._oracle_map = dict(self._persist_map)

    def _map_oracle_op(self, j: int, ins: list[int], allocs: list[int], name: str) -> None:
        it = self._trace_it
        if j >= len(it.ops) or it.ops[j].name != name:
            if not self._oracle_warned:
                self._oracle_warned = True
                got = it.ops[j].name if j < len(it.ops) else "the end of the iteration"
                warnings.warn(f"dynn-runtime: the oracle's trace diverges from this run at operator {j} ({name} here, "
                              f"{got} in the trace): it was not recorded from the same inputs; its predictions are "
                              "wrong from here on (results stay correct).", RuntimeWarning, stacklevel=4)
            return
        top = it.ops[j]
        for k, sid in enumerate(allocs):
            if k < len(top.allocs):
                self._oracle_map[sid] = top.allocs[k]
                if self.st[sid].kind in _PERSISTENT or self._in_optimizer:
                    self._persist_map[sid] = top.allocs[k]
        for k, sid in enumerate(ins):
            if sid not in self._oracle_map and k < len(top.inputs):
                self._oracle_map[sid] = top.inputs[k]
                if self.st[sid].kind in _PERSISTENT:
                    self._persist_map[sid] = top.inputs[k]
