"""Safe fallback for the pilot on a network it was not trained on: judge its predictions online.

A :class:`RecallJudge` measures, while the user's network trains, the window recall
(:mod:`~dynn_runtime.pilot.training.evaluate`'s metric) of several next-use predictors on the
run's own accesses: at a decision point each predictor ranks the live storages; once the next
``window`` operators have run, the storages accessed in them are known, and each predictor's
share of them among the same number it ranked soonest is its recall at that decision point. The
judge keeps the last ``horizon`` decision points and names the predictor to follow
(:meth:`RecallJudge.choice`): the model unless another one's recent recall beats it by ``margin``.

The pilot policy's ``fallback=True`` uses it per decision point with the model, ``replay``
(the previous iteration's access pattern position for position, :class:`~dynn_runtime.policies.nextuse.ReplayPolicy`)
and ``lru`` (a storage is needed again as long after as it was last used). Nothing here reads
the future: a decision point is judged only after its window has run.

An :class:`ExactReplay` says where replay's plan has held to the operator so far in the iteration;
there the fallback's model side takes replay's prediction (see the class).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RecallJudge", "ExactReplay", "FALLBACKS", "op_key"]

#: the predictors the pilot may fall back to, in order of preference on a tie
FALLBACKS = ("replay", "lru")


@dataclass
class _Pending:
    position: int
    sids: np.ndarray
    scores: dict[str, np.ndarray]
    seen: set[int] = field(default_factory=set)


class RecallJudge:
    """Online window recall of the predictors ``methods`` (the first is the one to beat)."""

    def __init__(self, methods: tuple[str, ...] = ("pilot", *FALLBACKS), window: int = 64, horizon: int = 4,
                 margin: float = 0.02, metric: str = "rank") -> None:
        if metric not in ("rank", "f1"):
            raise ValueError(f"RecallJudge metric is 'rank' or 'f1', got {metric!r}")
        self.metric = metric
        if not methods:
            raise ValueError("RecallJudge needs at least one method")
        self.methods = methods
        self.window = int(window)
        self.horizon = int(horizon)
        self.margin = float(margin)
        self._pending: deque[_Pending] = deque()
        #: per method, (hits, relevant) of the last ``horizon`` judged decision points
        self._recent: dict[str, deque[tuple[int, float]]] = {m: deque(maxlen=self.horizon) for m in methods}
        #: per method, hits and relevant over the whole run (reports)
        self.totals: dict[str, list[float]] = {m: [0, 0] for m in methods}
        self.judged = 0

    def access(self, sid: int, position: int) -> None:
        """``sid`` was accessed at ``position``: it counts for every open decision point whose window holds it."""
        for p in self._pending:
            if p.position < position <= p.position + self.window:
                p.seen.add(sid)

    def decision(self, position: int, sids: np.ndarray, scores: dict[str, np.ndarray]) -> None:
        """Each method's predicted next-use positions (soonest first; ``inf`` for never) of ``sids`` at
        ``position``; the decision points whose window has closed are judged first."""
        self.close(position)
        self._pending.append(_Pending(position, np.asarray(sids), {m: np.asarray(scores[m], dtype=np.float64)
                                                                  for m in self.methods}))

    def close(self, position: int | None = None) -> None:
        """Judge the open decision points whose window ended before ``position`` (None: all of them,
        at the end of an iteration, whose accesses are all the window can still hold)."""
        while self._pending and (position is None or self._pending[0].position + self.window < position):
            self._judge(self._pending.popleft())

    def _judge(self, p: _Pending) -> None:
        if not p.seen:
            return
        inwin = np.fromiter((int(s) in p.seen for s in p.sids.tolist()), dtype=bool, count=len(p.sids))
        k = int(inwin.sum())
        if not k:
            return
        self.judged += 1
        for m in self.methods:
            if self.metric == "rank":
                top = np.argsort(p.scores[m], kind="stable")[:k]
                hits, rel = int(inwin[top].sum()), k
            else:  # predicted within the window by position: true positives over (k + predicted) / 2
                said = p.scores[m] <= p.position + self.window
                hits, rel = int((said & inwin).sum()), (k + int(said.sum())) / 2
            self._recent[m].append((hits, rel))
            self.totals[m][0] += hits
            self.totals[m][1] += rel

    def forget(self) -> None:
        """Drop the recent records (the run's totals stay): what was judged says nothing about what
        comes next (an iteration with no previous one, where replay has no plan and the model no
        alignment, against one that has both)."""
        for recent in self._recent.values():
            recent.clear()

    def recall(self, method: str) -> float | None:
        """``method``'s window recall over the last ``horizon`` judged decision points (None: none yet)."""
        recent = self._recent[method]
        rel = sum(k for _, k in recent)
        return sum(h for h, _ in recent) / rel if rel else None

    def choice(self) -> str:
        """The predictor to follow now: the first method unless another's recent recall is higher by
        more than ``margin`` (then the best of those)."""
        first = self.methods[0]
        base = self.recall(first)
        if base is None:
            return first
        best, best_r = first, base + self.margin
        for m in self.methods[1:]:
            r = self.recall(m)
            if r is not None and r > best_r:
                best, best_r = m, r
        return best


def op_key(name: str, module: str) -> tuple[str, str]:
    """An operator as :class:`ExactReplay` compares sequences: its module and its name with the
    in-place and out-of-place variants made one (``aten::add_.Tensor`` and ``aten::add.Tensor``).
    Autograd picks between them per step as references allow (a gradient accumulated in place where
    nothing else holds it); either runs at the same position, and what each allocates is checked
    per storage.

    >>> op_key("aten::add_.Tensor", "fc") == op_key("aten::add.Tensor", "fc")
    True
    >>> op_key("aten::__and__.Tensor", "")
    ('aten::__and__.Tensor', '')
    """
    base, dot, overload = name.partition(".")
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return base + dot + overload, module


class ExactReplay:
    """Where ``replay``'s positional plan (:class:`~dynn_runtime.policies.nextuse.ReplayPolicy`) is
    exact so far in the iteration: while every operator has been the one at the same position of
    replay's timeline (the previous iteration's operators as planned; name and module,
    :func:`op_key`), a storage born at its counterpart's position whose every access here fell on
    one of its counterpart's positions is *on plan*, and replay's next use for it is,
    as far as anything run says, the true one. A storage alive at the iteration's start (a
    parameter, optimizer state), matched by identity, is on plan until an access falls elsewhere, but
    only for a next use within ``near`` operators and before the position where the last iteration
    fell out of step with its predecessor: the operators run so far vouch for the ones just ahead,
    not for a later phase that a network choosing its path per step (routing, dropped layers) may
    run differently. Elsewhere (another sequence, a shifted access, a storage replay has no match
    for) nothing is on plan. Fed the policy's notifications."""

    def __init__(self, replay: Any, near: int = 64) -> None:
        self.replay = replay
        self.near = int(near)
        self._keys: list[tuple[str, str]] = []
        self._on: dict[int, bool] = {}
        #: storages alive at the iteration's start (parameters, optimizer state, what the program holds)
        self._start: set[int] = set()
        self._position = -1
        #: where the last iteration fell out of step with its predecessor (None: it did not, or
        #: had none to compare with); below it, this one is expected in step too
        self._lost_at: int | None = None
        self._compared = False
        self._reach = math.inf
        #: every operator so far was the previous iteration's at its position
        self.in_sync = False

    def begin_iteration(self, timeline: Sequence[Any]) -> None:
        """A new iteration, expected to run ``timeline`` (replay's: the previous iteration's operators
        as planned; empty where there is none)."""
        self._reach = math.inf if not self._compared or self._lost_at is None else self._lost_at
        self._keys = [op_key(op.name, op.module) for op in timeline]
        self.in_sync = self._compared = bool(self._keys)
        self._lost_at = None
        self._on.clear()
        self._start.clear()
        self._position = -1

    def alloc(self, sid: int, position: int) -> None:
        if position < 0:  # alive at the start: matched by identity, on plan until an access says not
            self._start.add(sid)
            return
        # the replay matched a storage born here by the allocating operator's position: born on plan
        self._on[sid] = self.replay.plan(sid) is not None

    def access(self, sid: int, position: int) -> None:
        acc = self.replay.plan(sid)
        ok = acc is not None and self._on.get(sid, True)  # alive at the start: on plan until an access says not
        if ok:
            k = bisect.bisect_left(acc, position)
            ok = k < len(acc) and acc[k] == position
        self._on[sid] = ok

    def free(self, sid: int) -> None:
        self._on.pop(sid, None)
        self._start.discard(sid)

    def op(self, position: int, op: Any) -> None:
        self._position = position
        if self.in_sync:
            keys = self._keys
            self.in_sync = position < len(keys) and keys[position] == op_key(op.name, op.module)
            if not self.in_sync:
                self._lost_at = position

    def exact(self, sid: int) -> bool:
        """``sid`` is on plan and the iteration in step with the previous one (alive at the start:
        and its match's next access near enough, see the class)."""
        if not self.in_sync:
            return False
        if sid in self._start:
            if not self._on.get(sid, True):
                return False
            acc = self.replay.plan(sid)
            if acc is None:
                return False
            k = bisect.bisect_right(acc, self._position)
            return k < len(acc) and acc[k] - self._position <= self.near and acc[k] < self._reach
        return self._on.get(sid, False)
