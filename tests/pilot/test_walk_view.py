"""The training-data walk's view is a complete MemoryView: what it cannot know it answers with the
protocol's documented neutral answers, as the live runtime does."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from dynn_runtime.pilot.training.data import _WalkView
from dynn_runtime.policies.base import MemoryView


def _trace():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
    from builder import TB

    tb = TB()
    tb.storage("w", 100, "param", persistent_from=0)
    tb.iteration([("f", "forward", "m", ["w"], [("a", 200, "activation", True)], ["a"])])
    return tb.trace()


def test_walk_view_implements_every_member():
    view = _WalkView(_trace())
    members = set(MemoryView.__annotations__) | {k for k, v in vars(MemoryView).items()
                                                 if callable(v) and not k.startswith("_")}
    missing = sorted(m for m in members if not hasattr(view, m))
    assert not missing, f"_WalkView lacks {missing}"
    assert isinstance(view, MemoryView)
    assert view.host_now() is None and view.device_slack() is None and view.producer_of(0) is None
    assert view.next_use(0) is None and not view.recomputable(0) and view.recompute_cost(0) == math.inf
    assert not view.forward_done(0) and view.last_access_time(0) == 0.0
