"""Policies that free activations and recompute them: checkpoint and DTR."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Literal

from .base import NO_CONTEXT, Action, IterationContext, Policy, register

_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_of(module: str) -> str:
    """The repeated block a module path belongs to: the prefix up to the first numbered child
    (``blocks.3.attn.qkv`` -> ``blocks.3``), else the top-level child (``head.fc`` -> ``head``)."""
    m = _BLOCK.match(module)
    if m:
        return m.group(1)
    return module.split(".", 1)[0]


@register
class CheckpointPolicy(Policy):
    """Like ``torch.utils.checkpoint`` around every repeated block (``layers.N``, ``blocks.N``, ...).

    Inside a checkpointed block the forward keeps nothing for backward: each activation the block
    produces is freed once the block's forward is done with it, except what leaves the block (its
    outputs, used by later forward operators). The first time backward needs any of them, the
    block's whole forward is re-run and all of them come back. Networks without numbered blocks
    are checkpointed per top-level child. Nothing else moves: over budget after that is
    out-of-memory.
    """

    name = "checkpoint"
    recomputes = "blocks"
    reads_modules = True
    reads_saved = True
    description = "recompute activations per block (torch.utils.checkpoint)"

    def begin_iteration(self, index: int, context: IterationContext = NO_CONTEXT) -> None:
        # The plan needs this iteration's operators ahead of time (the simulator); live, the
        # mechanism wraps the blocks in torch.utils.checkpoint instead (``recomputes = "blocks"``).
        self._block_ops: dict[str, list[int]] = {}
        self._drop_at: dict[int, list[int]] = {}
        self._sid_block: dict[int, str] = {}
        it = context.iteration
        if it is None:
            return
        ops = it.ops
        view = self.view
        forward_uses: dict[int, list[int]] = {}  # each storage's forward accesses, in order
        block_of_op = []
        for j, op in enumerate(ops):
            if op.phase == "forward":
                for sid in set(op.inputs) | set(op.outputs) | set(op.writes):
                    forward_uses.setdefault(sid, []).append(j)
            b = block_of(op.module) if op.phase == "forward" and op.module else ""
            block_of_op.append(b)
            if b:
                self._block_ops.setdefault(b, []).append(j)
        for b, positions in self._block_ops.items():
            for j in positions:
                for sid in ops[j].allocs:
                    self._sid_block[sid] = b
                    if not view.saved(sid):
                        continue
                    fwd = forward_uses.get(sid, ())
                    if fwd and all(block_of_op[k] == b for k in fwd):
                        self._drop_at.setdefault(fwd[-1], []).append(sid)

    def evict_mode(self, sid: int) -> Literal["offload", "drop"]:
        return "drop"

    def after_op(self, position: int) -> list[Action]:
        view = self.view
        return [Action("evict", sid) for sid in self._drop_at.get(position, ()) if view.status(sid) == "resident"]

    def recompute_group(self, sid: int) -> list[int] | None:
        b = self._sid_block.get(sid)
        return list(self._block_ops[b]) if b else [self.view.producer_of(sid)]


@register
class DTRPolicy(Policy):
    """Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021), h_DTR heuristic.

    On pressure, evict (free) the resident recomputable storage with the smallest
    ``h(t) = c(t) / (m(t) * s(t))``: ``c`` the time to rematerialize it *including* its evicted
    neighbourhood (every dropped or freed ancestor the recompute would have to rebuild first),
    ``m`` its size, ``s`` its staleness (time since last access). Accessing an evicted storage
    recomputes its producer, recursively. Candidates are sampled (every ``n // sqrt(n)``-th of the
    n candidates, deterministic) when there are more than ``sample_above``, as the prototype does.
    Parameters, gradients and optimizer state are never evicted (they cannot be recomputed).
    """

    name = "dtr"
    recomputes = "operators"
    description = "rematerialization with h = c/(m*s) including evicted neighbourhood cost"
    sample_above = 256

    def evict_mode(self, sid: int) -> Literal["offload", "drop"]:
        return "drop"

    def victims(self, need_bytes: int, exclude: set[int]) -> Iterator[int]:
        # Scored once per pressure event, then taken cheapest first: re-scoring after every
        # eviction (as the prototype does) makes the simulation quadratic in the candidates.
        view = self.view
        cands = [sid for sid in view.resident()
                 if sid not in exclude and view.nbytes(sid) > 0 and view.recomputable(sid)]
        if len(cands) > self.sample_above:
            step = max(1, int(len(cands) ** 0.5))
            cands = cands[::step]
        now = view.now()
        scored = []
        for sid in cands:
            staleness = max(now - view.last_access_time(sid), 1e-9)
            scored.append((view.recompute_cost(sid) / (view.nbytes(sid) * staleness), sid))
        scored.sort()
        for _, sid in scored:
            yield sid
