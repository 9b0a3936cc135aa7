"""replay's plan: the previous iteration's operators as this one will run them."""

from __future__ import annotations

import pytest

from dynn_runtime.policies.base import IterationContext
from dynn_runtime.policies.nextuse import ReplayPolicy
from dynn_runtime.trace.format import Iteration, Op


def _op(name: str, phase: str = "forward", inputs=(), outputs=(), writes=(), allocs=()) -> Op:
    return Op(name=name, idiom=(), phase=phase, module="", inputs=tuple(inputs), outputs=tuple(outputs),
              writes=tuple(writes), allocs=tuple(allocs), duration_s=0.0, flops=0, nbytes=0)


class _View:
    """What ReplayPolicy reads: kinds and liveness of storages, and the position."""

    def __init__(self, kinds: dict[int, str]) -> None:
        self.kinds = kinds
        self.position = 0
        self.victim_floor = 0

    def status(self, sid: int) -> str:
        return "resident" if sid in self.kinds else "absent"

    def movable(self, sid: int) -> bool:
        return True

    def kind(self, sid: int) -> str:
        return self.kinds[sid]


def _replay(prev: Iteration, kinds: dict[int, str]) -> tuple[ReplayPolicy, _View]:
    view = _View(kinds)
    pol = ReplayPolicy()
    pol.small_fraction = 0  # one tier: no sizes needed
    pol.view = view  # the plan reads only the view's kinds, liveness and position
    pol.begin_iteration(1, IterationContext(history=(prev,)))
    return pol, view


def _first_step() -> Iteration:
    """A first step: parameter 1 used in forward, then an optimizer that makes its state (a step
    counter 10 made outside the dispatcher and first marked by ``detach_``, moment 11 by
    ``zeros_like``) and updates it; activation 20 freed in the step."""
    ops = [
        _op("aten::mm", inputs=(1,), outputs=(20,), allocs=(20,)),                 # 0
        _op("aten::sum", inputs=(20,), outputs=(21,), allocs=(21,)),               # 1: 21 is freed
        _op("aten::detach_", "optimizer", inputs=(10,), outputs=(10,), writes=(10,)),  # 2: makes state
        _op("aten::zeros_like", "optimizer", inputs=(1,), outputs=(11,), allocs=(11,)),  # 3: makes state
        _op("aten::add_", "optimizer", inputs=(10,), outputs=(10,), writes=(10,)),       # 4
        _op("aten::lerp_", "optimizer", inputs=(11,), outputs=(11,), writes=(11,)),      # 5
        _op("aten::add_", "optimizer", inputs=(1, 11), outputs=(1,), writes=(1,)),       # 6
    ]
    return Iteration(index=0, ops=ops, frees={2: [20, 21]}, pre_allocs={2: [10]})


def test_the_operators_that_made_state_alive_now_are_not_planned_again():
    kinds = {1: "param", 10: "opt_state", 11: "opt_state"}
    pol, view = _replay(_first_step(), kinds)
    assert [op.name for op in pol.timeline] == ["aten::mm", "aten::sum", "aten::add_", "aten::lerp_", "aten::add_"]
    for sid in (1, 10, 11):
        pol.on_alloc(sid, -1)
    view.position = 1  # after forward: the optimizer's updates are the next two operators
    assert (pol.predict(10), pol.predict(11), pol.predict(1)) == (2, 3, 4)


@pytest.mark.parametrize("kind, alive", [("activation", True), ("opt_state", False)])
def test_state_that_is_not_persistent_or_not_alive_keeps_its_operators(kind, alive):
    kinds = {1: "param", 10: "opt_state"}
    if alive:
        kinds[11] = kind
    pol, _ = _replay(_first_step(), kinds)
    assert "aten::zeros_like" in [op.name for op in pol.timeline]


def test_an_allocation_where_the_previous_operator_wrote_in_place_follows_what_it_wrote():
    """Autograd accumulates a gradient in place or out of place as references allow: the storage an
    out-of-place ``add`` allocates is planned as the one the previous step's ``add_`` wrote."""
    prev = Iteration(index=0, ops=[
        _op("aten::mm", "backward", inputs=(1,), outputs=(30,), allocs=(30,)),             # 0: a gradient
        _op("aten::add_", "backward", inputs=(30, 31), outputs=(30,), writes=(30,)),       # 1: accumulated
        _op("aten::t", "backward"),                                                        # 2
        _op("aten::lerp_", "optimizer", inputs=(11, 30), outputs=(11,), writes=(11,)),     # 3
    ])
    pol, view = _replay(prev, {1: "param", 11: "opt_state"})
    pol.on_alloc(40, 0)   # this step's gradient, born where 30 was
    pol.on_alloc(41, 1)   # out of place: a new storage where 30 was written
    view.position = 1
    assert pol.plan(41) == pol.plan(40) == [0, 1, 3] and pol.predict(41) == 3


def test_a_simulator_that_tells_the_storages_alive_at_the_start_later_gets_the_same_timeline():
    """The simulator replays a trace: it knows the iteration ahead and tells the storages alive at its
    start only once it runs, so liveness comes from the trace's frees."""

    class Untold(_View):
        def status(self, sid: int) -> str:
            return "absent"

    view = Untold({1: "param", 10: "opt_state", 11: "opt_state", 20: "activation", 21: "activation"})
    pol = ReplayPolicy()
    pol.small_fraction = 0
    pol.view = view
    pol.begin_iteration(1, IterationContext(history=(_first_step(),), iteration=Iteration(index=1)))
    assert [op.name for op in pol.timeline] == ["aten::mm", "aten::sum", "aten::add_", "aten::lerp_", "aten::add_"]
    pol.begin_iteration(1, IterationContext(history=(_first_step(),)))  # live: absent means freed
    assert len(pol.timeline) == 7
