"""Backward mirrors forward: the feature state's map from a backward operator to the forward
position whose gradient it computes.

Every operator carries its autograd node (:attr:`~dynn_runtime.trace.format.Op.node`: in forward
the node it created, in backward the node that ran it), so a backward operator names the forward
operator whose gradient it computes, and the forward position backward has reached (the *mirror*)
is known exactly. A storage that forward accessed is next used in backward when the mirror passes
its latest forward access below the mirror (the backward of the operator that read it). A storage
that backward allocates is taken for the gradient of the mirrored forward operator's input of the
nearest size at least its own, accumulated into when the mirror passes that input's forward
accesses, then consumed at the first. A gradient that the backward of its target's producer
passes on unchanged (``add``, ``index_add``'s ``self``) then follows that producer's input of the
nearest size at least its own, the first on ties. Trace-agnostic: any autograd workload has nodes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Any

import numpy as np

from .._log import logger
from .kernel import pack_module
from .layout import KEY_BASE

__all__ = ["MirrorState"]

#: how many producers down a pass-through gradient is followed at once (bounds the work per operator)
_PASS_DEPTH = 8


class MirrorState:
    """The mirror half of :class:`~dynn_runtime.pilot.features.FeatureState` (see the module
    docstring); a mixin over the state's arrays, not used alone."""

    native_index: bool  # FeatureState's

    def _reset_mirror(self) -> None:
        self._mirror = -1  # forward position of the node backward is running; -1: none yet
        self._fwd_log: list[tuple[int, Any]] = []  # (position, operator) of forward since the last backward
        self._fwd_node: dict[int, tuple[int, tuple[int, ...]]] = {}  # node -> (position, inputs)
        self._fwd_freed: dict[int, float] = {}  # log_bytes of storages forward freed
        self._mir_index: dict[int, int] = {}
        self._mir_sid = np.zeros(0, dtype=np.int64)
        self._mir_pos = np.zeros(0, dtype=np.int64)
        self._mir_off = np.zeros(1, dtype=np.int64)
        self._mir_keys = np.zeros(0, dtype=np.int64)
        self._mir_first = np.zeros(0, dtype=np.int64)
        self._fwd_ops: dict[int, Any] = {}  # forward position -> operator, for relinking
        self._relink: list[tuple[int, int, int, int]] = []  # heap of (-first access of target, slot, sid, target)
        if self._native_tab is not None:  # the kernel's table points at the new segments
            self._native_tab.set_mirror(self)

    def _log_forward(self, position: int, op: Any) -> None:
        """Index a forward operator for the mirror: ``(position, op)`` onto ``_fwd_log``, out of the
        cyclic collector where ``kernel/pack.c`` is built (its ``log_forward``, as its walk logs
        them: the pair lives into backward, and holds nothing that could close a cycle)."""
        if self.native_index:
            mod = pack_module()
            if mod is not None:
                mod.log_forward(self._fwd_log, position, op)
                return
        self._fwd_log.append((position, op))

    def _build_mirror(self) -> None:
        """Backward starts: index the forward accesses since the last backward (several forward and
        backward passes in one step: each backward mirrors its own forward) per storage, as sorted
        segments of positions, and point every live storage that forward accessed at its own segment."""
        log = self._fwd_log
        nodes = self._fwd_node
        for p, op in log:
            node = getattr(op, "node", -1)
            if node >= 0:
                nodes[node] = (p, op.inputs)
        if log and not nodes and not self._warned_nodes:
            self._warned_nodes = True
            logger.warning("pilot: no forward operator of this iteration carries an autograd node (a trace "
                           "recorded before schema 2?), so backward has no mirror  and the pilot "
                           "predicts backward less well. Re-record the trace with this dynn-runtime.")
        sids, pos = self._access_positions(log)
        uniq, first, inv = np.unique(sids, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # segments in first-access order
        rank = np.empty(len(uniq), dtype=np.int64)
        rank[order] = np.arange(len(uniq))
        idx = rank[inv] if len(sids) else np.zeros(0, dtype=np.int64)
        keys = np.sort(idx * KEY_BASE + pos)
        self._mir_keys = keys
        self._mir_pos = np.ascontiguousarray(keys % KEY_BASE)
        self._mir_sid = np.ascontiguousarray(uniq[order])
        self._mir_off = np.zeros(len(uniq) + 1, dtype=np.int64)
        np.cumsum(np.bincount(idx, minlength=len(uniq)), out=self._mir_off[1:])
        self._mir_index = dict(zip(self._mir_sid.tolist(), range(len(uniq))))
        self._mir_first = self._mir_pos[self._mir_off[:-1]]
        mi = self._mir_index
        for sid, s in self._slot.items():
            self.mirror_tgt[s] = mi.get(sid, -1)
        self._fwd_ops = dict(log)
        self._relink = []
        self._fwd_log = []
        self._mirror = -1
        if self._native_tab is not None:  # the kernel's table points at the new segments
            self._native_tab.set_mirror(self)

    def _access_positions(self, log: list[tuple[int, Any]]) -> tuple[np.ndarray, np.ndarray]:
        """Every storage each logged operator touches, in the order of the set of its inputs, outputs
        and writes, and the operator's position beside it: ``kernel/pack.c``'s ``access_positions``
        where it is built and ``native_index`` is set, else in Python (the reference)."""
        if self.native_index:
            mod = pack_module()
            if mod is not None:
                sids, pos = mod.access_positions(log)
                return np.frombuffer(sids, dtype=np.int64), np.frombuffer(pos, dtype=np.int64)
        acc = [{*op.inputs, *op.outputs, *op.writes} for _, op in log]
        sids = np.fromiter(itertools.chain.from_iterable(acc), dtype=np.int64)
        pos = np.repeat(np.fromiter((p for p, _ in log), dtype=np.int64, count=len(log)),
                        np.fromiter(map(len, acc), dtype=np.int64, count=len(acc)))
        return sids, pos

    def _nearest_input(self, own: float, inputs: Any, exclude: int = -1) -> int:
        """Mirror segment of the input of the nearest size at least ``own`` (the first on ties), or -1."""
        mi, slot, lb, freed = self._mir_index, self._slot, self.log_bytes, self._fwd_freed
        best, best_lb = -1, math.inf
        for f in inputs:
            t = mi.get(f)
            if t is None or t == exclude:
                continue
            fs = slot.get(f)
            f_lb = lb[fs] if fs is not None else freed.get(f)
            if f_lb is not None and own <= f_lb < best_lb:
                best, best_lb = t, f_lb
        return best

    def _link(self, allocs: Any, inputs: Any) -> None:
        """Storages a backward operator allocated follow the mirrored forward operator's input of the
        nearest size at least their own (its gradient, or a piece of it)."""
        slot = self._slot
        for sid in allocs:
            s = slot.get(sid)
            if s is None:
                continue
            t = self._nearest_input(self.log_bytes[s], inputs)
            self.mirror_tgt[s] = t
            if t >= 0:
                heapq.heappush(self._relink, (-int(self._mir_first[t]), s, sid, t))

    def _pass_through(self, mirror: int) -> None:
        """A gradient outlives the backward of its target's producer when that operator passes it on
        unchanged (``add``, ``index_add``'s ``self``, views): once the mirror reaches the producer, a
        linked storage follows the producer's input of the nearest size at least its own, the first
        on ties (``self``), and so on down while the mirror has passed that one's producer too."""
        heap, first, ops, msid = self._relink, self._mir_first, self._fwd_ops, self._mir_sid
        while heap and -heap[0][0] >= mirror:
            _, s, sid, t = heapq.heappop(heap)
            if self.sid[s] != sid or self.mirror_tgt[s] != t:
                continue  # freed, or linked again since
            for _ in range(_PASS_DEPTH):
                op = ops.get(int(first[t]))
                tsid = int(msid[t])
                if op is None or (tsid not in op.allocs and tsid not in op.outputs):
                    break  # not produced by forward (the batch, a parameter): its gradient ends here
                nt = self._nearest_input(self.log_bytes[s], op.inputs, exclude=t)
                if nt < 0:
                    break
                t = nt
                if first[t] < mirror:
                    heapq.heappush(heap, (-int(first[t]), s, sid, t))
                    break
            if self.mirror_tgt[s] != t:
                self.mirror_tgt[s] = t
                self.touched[s] = True
