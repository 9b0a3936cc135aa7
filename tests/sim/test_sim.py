"""Simulator and policies: known answers on hand-built traces, invariants on random ones, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
from builder import TB, UNIT  # noqa: E402

from dynn_runtime.errors import BudgetError, ConfigError, PolicyError, TraceError  # noqa: E402
from dynn_runtime.policies import POLICIES  # noqa: E402
from dynn_runtime.residency import TRANSITIONS, Status  # noqa: E402
from dynn_runtime.sim import Simulator, simulate, unmanaged_peak  # noqa: E402

ALL = sorted(POLICIES)


def chain_trace() -> object:
    """P (param, 100 B, clean on host) then A -> B -> C in forward, backward reads P and C."""
    b = TB()
    b.storage("P", 100, "param", persistent_from=0)
    b.iteration([
        ("op0", "forward", "", [], [("A", 100, "activation", True)], []),
        ("op1", "forward", "", ["A"], [("B", 100, "activation", True)], []),
        ("op2", "forward", "", ["B"], [("C", 100, "temp", False)], []),
        ("op3", "backward", "", ["P", "C"], [], ["A", "B", "C"]),
    ])
    return b.trace()


# ---- known answers (worked out by hand; 1 s per op, 100 B/s copies) ------------------------------

def test_none_fits_and_ooms():
    tr = chain_trace()
    assert unmanaged_peak(tr, 0) == 400
    r = simulate(tr, "none", 400, UNIT, iteration=0)
    assert r.feasible and r.iter_time_s == 4.0 and r.stall_time_s == 0 and r.peak_bytes == 400
    r = simulate(tr, "none", 300, UNIT, iteration=0)
    assert not r.feasible and "out of memory at op 2 (op2" in r.reason and r.iter_time_s == float("inf")


class _Charging(POLICIES["oracle"]):
    """The oracle, charging ``per_op`` host seconds after every operator (the host timeline's input)."""

    def __init__(self, per_op: float) -> None:
        super().__init__()
        self.per_op = per_op
        self.host_seconds = 0.0

    def on_op(self, position, op):
        super().on_op(position, op)
        self.host_seconds += self.per_op


def test_host_timeline_puts_the_policy_host_time_where_the_device_waits():
    # oracle at 300 B: no copies, 4 ops of 1 s. Charged 0.5 s of host time after every op, each of
    # ops 1-3 is issued 0.5 s after the device ran dry: 1.5 s of waiting, 5.5 s in all.
    tr = chain_trace()
    plain = simulate(tr, _Charging(0.5), 300, UNIT, iteration=0)
    assert plain.iter_time_s == 4.0 and plain.host_wait_s == 0.0  # no timeline: host time is free
    r = simulate(tr, _Charging(0.5), 300, UNIT, iteration=0, host_timeline=True)
    assert (r.iter_time_s, r.host_wait_s, r.policy_host_s) == (5.5, 1.5, 2.0)
    assert r.iter_time_s == pytest.approx(r.compute_time_s + r.stall_time_s + r.recompute_time_s + r.host_wait_s)
    # no host time: the host never leads the device, the same run as without the timeline
    z = simulate(tr, _Charging(0.0), 300, UNIT, iteration=0, host_timeline=True)
    assert (z.iter_time_s, z.host_wait_s) == (4.0, 0.0)
    # a faster dispatch does not make the device faster, a slower one shows
    assert simulate(tr, _Charging(0.0), 300, UNIT, iteration=0, host_timeline=0.25).iter_time_s == 4.0
    slow = simulate(tr, _Charging(0.0), 300, UNIT, iteration=0, host_timeline=2.0)  # issued every 2 s
    assert (slow.iter_time_s, slow.host_wait_s) == (7.0, 3.0)
    with pytest.raises(ConfigError, match="host_timeline"):
        simulate(tr, "oracle", 300, UNIT, iteration=0, host_timeline=-1.0)


def test_host_timeline_overlaps_long_operators_until_a_host_synchronisation():
    # op0 runs 4 s on the device (1 s dispatch + 3 s of arithmetic at 1 FLOP/s), then 1 s per op.
    # 2 s of host time charged after every op: op1 is issued at 3 s, hidden behind op0; ops 2 and 3
    # wait 1 s and 2 s (3 s, 10 s in all). If op0 is a `.item()` the host waits for it first and
    # every later op waits 2 s (6 s, 13 s in all).
    import dataclasses

    prof = dataclasses.replace(UNIT, name="slowflops", peak_flops={"float32": 1.0}, compute_efficiency=1.0)
    for name, phase, wait in (("op0", "forward", 3.0), ("aten::_local_scalar_dense", "forward", 6.0),
                              # the optimizer's .item() reads a host-side step counter: no wait
                              ("aten::_local_scalar_dense", "optimizer", 3.0)):
        tr = chain_trace()
        it = tr.iterations[0]
        it.ops[0] = dataclasses.replace(it.ops[0], name=name, phase=phase, flops=3)
        r = simulate(tr, _Charging(2.0), 300, prof, iteration=0, host_timeline=True)
        assert (r.host_wait_s, r.iter_time_s) == (wait, 7.0 + wait), (name, phase)


def test_lru_known_answer():
    # op2: evict P (least recently used; clean copy on host: free). op3 needs P: evict A
    # (offload 1 s, waited for), fetch P (1 s).
    r = simulate(chain_trace(), "lru", 300, UNIT, iteration=0)
    assert (r.iter_time_s, r.stall_time_s, r.bytes_offloaded, r.bytes_fetched) == (6.0, 2.0, 100, 100)
    assert r.prefetch_misses == 1 and r.peak_bytes == 300


def test_oracle_known_answer():
    # op2: A is never read again: the oracle discards it (no copy); P stays for op3.
    r = simulate(chain_trace(), "oracle", 300, UNIT, iteration=0)
    assert (r.iter_time_s, r.stall_time_s, r.bytes_offloaded, r.bytes_fetched) == (4.0, 0.0, 0, 0)
    assert r.evictions == 1


def test_dtr_known_answer_drops_without_copy():
    r = simulate(chain_trace(), "dtr", 300, UNIT, iteration=0)
    assert (r.iter_time_s, r.stall_time_s, r.bytes_offloaded, r.recomputed_ops) == (4.0, 0.0, 0, 0)


def test_save_on_cpu_known_answer():
    # A leaves after its last forward use (op1), B after op2: two synchronous 1 s copies.
    r = simulate(chain_trace(), "save_on_cpu", 300, UNIT, iteration=0)
    assert (r.iter_time_s, r.stall_time_s, r.bytes_offloaded, r.bytes_fetched) == (6.0, 2.0, 200, 0)


def test_save_on_cpu_fetches_synchronously_in_backward():
    b = TB()
    b.iteration([
        ("f0", "forward", "", [], [("X", 100, "activation", True)], []),
        ("f1", "forward", "", ["X"], [("Y", 100, "temp", False)], []),
        ("f2", "forward", "", ["Y"], [("Z", 100, "temp", False)], ["Y"]),
        ("b0", "backward", "", ["X", "Z"], [], ["X", "Z"]),
    ])
    r = simulate(b.trace(), "save_on_cpu", 200, UNIT, iteration=0)
    # X offloaded after f1 (1 s), fetched back at b0 (1 s): 4 ops + 2 s
    assert (r.iter_time_s, r.bytes_offloaded, r.bytes_fetched, r.prefetch_misses) == (6.0, 100, 100, 1)


def test_dtr_recomputes_exactly_the_evicted_ancestors():
    # X -> A1 -> A2 -> A3; a big temporary forces A1 and A2 out; backward reads A2 then A1.
    b = TB()
    b.storage("X", 10, "input", persistent_from=0)
    b.iteration([
        ("f0", "forward", "", ["X"], [("A1", 100, "activation", True)], []),
        ("f1", "forward", "", ["A1"], [("A2", 100, "activation", True)], []),
        ("f2", "forward", "", ["A2"], [("A3", 100, "activation", True)], []),
        ("f3", "forward", "", ["A3"], [("T", 200, "temp", False)], []),
        ("b0", "backward", "", ["T", "A3"], [], ["T", "A3"]),
        ("b1", "backward", "", ["A2"], [], ["A2"]),
        ("b2", "backward", "", ["A1"], [], ["A1"]),
    ])
    tr = b.trace()
    r = simulate(tr, "dtr", 310, UNIT, iteration=0)  # X + A3 + T: A1 and A2 must both go
    assert r.feasible, r.reason
    # both A1 and A2 were dropped at f3; b1 rebuilds A2 from A1 (A1 rebuilt first, from X), and
    # b2 finds A1 already back: exactly the two evicted ancestors are recomputed, each once.
    assert r.recomputed_ops == 2 and r.recompute_time_s == 2.0
    assert r.bytes_offloaded == 0 and r.iter_time_s == 9.0


def test_checkpoint_recomputes_the_whole_block():
    b = TB()
    b.storage("X", 10, "input", persistent_from=0)
    b.iteration([
        ("f0", "forward", "blocks.0.a", ["X"], [("A", 100, "activation", True)], []),
        ("f1", "forward", "blocks.0.b", ["A"], [("B", 100, "activation", True)], []),
        ("f2", "forward", "blocks.0.c", ["B"], [("O", 50, "activation", True)], []),
        ("f3", "forward", "head", ["O"], [("L", 10, "temp", False)], []),
        ("b0", "backward", "head", ["L", "O"], [], ["L", "O"]),
        ("b1", "backward", "blocks.0.b", ["B"], [], ["B"]),
        ("b2", "backward", "blocks.0.a", ["A"], [], ["A"]),
    ])
    r = simulate(b.trace(), "checkpoint", 210, UNIT, iteration=0)  # X + A + B: the in-block peak
    assert r.feasible, r.reason
    assert r.peak_bytes == 210  # the unmanaged peak (270) holds A, B, O and L at once
    # A goes after f1, B after f2 (O is used by the head: kept); b1 re-runs f0..f2 once
    assert r.recomputed_ops == 3 and r.recompute_time_s == 3.0 and r.iter_time_s == 10.0


def test_uvm_pays_faults_per_page_chunk():
    page = 64 << 10
    b = TB()
    b.storage("P", page, "param", persistent_from=0)
    b.iteration([
        ("f0", "forward", "", [], [("A", page, "activation", True)], []),
        ("f1", "forward", "", ["A"], [("B", page, "temp", False)], ["A"]),
        ("b0", "backward", "", ["B", "P"], [], ["B"]),
    ])
    tr = b.trace()
    r = simulate(tr, "uvm", 2 * page, UNIT, iteration=0)
    assert r.feasible, r.reason
    # f1: P (clean) evicted for free; b0 needs P: A is gone, B resident, P faults back in:
    # one 2 MiB batch fault (0.5 s) + 65536 B at 100 B/s
    assert r.stall_time_s == pytest.approx(0.5 + page / 100.0)
    assert r.bytes_fetched == page


def test_replay_equals_oracle_when_iterations_repeat_and_loses_when_they_do_not():
    def it_ops(sizes):
        return [
            ("f0", "forward", "", ["P"], [("A", sizes[0], "activation", True)], []),
            ("f1", "forward", "", ["A"], [("B", sizes[1], "activation", True)], []),
            ("f2", "forward", "", ["B"], [("C", 100, "temp", False)], []),
            ("b0", "backward", "", ["C"], [], ["C"]),
            ("b1", "backward", "", ["B"], [], ["B"]),
            ("b2", "backward", "", ["A", "P"], [], ["A"]),
        ]

    same = TB()
    same.storage("P", 100, "param", persistent_from=0)
    same.iteration(it_ops((100, 100)))
    same.iteration(it_ops((100, 100)))
    tr = same.trace()
    o = simulate(tr, "oracle", 300, UNIT)
    r = simulate(tr, "replay", 300, UNIT)
    # same plan, same storages fetched; only the oracle may discard a dead storage without a copy,
    # so replay's copy of it can delay a prefetch into a demand fetch, never the other way round
    assert r.feasible and r.bytes_fetched == o.bytes_fetched and r.evictions == o.evictions
    assert r.stall_time_s >= o.stall_time_s




def test_replay_pays_for_divergence_on_a_dynamic_network(tmp_path):
    """MoE routing changes between iterations: the replayed plan mispredicts, the oracle does not."""
    from dynn_runtime.trace import read_trace, record

    path = tmp_path / "moe.jsonl.gz"
    record("moe", path, steps=2, preset="tiny")
    tr = read_trace(path)
    # at 1/4 (at 1/2 small storages stay put and the few large ones that move cost replay only
    # 15% more stall than the oracle; here 2x)
    o, r = simulate(tr, "oracle", 0.25, "h100"), simulate(tr, "replay", 0.25, "h100")
    assert o.feasible and r.feasible
    assert r.stall_time_s > 1.2 * o.stall_time_s


def small_big_trace(b_read_at_op1: bool) -> object:
    """Two equal iterations: op0 allocates S (10 B) and B (1000 B), op1 a temporary T (1000 B) (and
    reads B when ``b_read_at_op1``), backward reads B at op2 and S at op3. Footprint 2010 B."""
    b = TB()
    ops = [
        ("op0", "forward", "", [], [("S", 10, "activation", True), ("B", 1000, "activation", True)], []),
        ("op1", "forward", "", ["B"] if b_read_at_op1 else [], [("T", 1000, "temp", False)], ["T"]),
        ("op2", "backward", "", ["B"], [], ["B"]),
        ("op3", "backward", "", ["S"], [], ["S"]),
    ]
    b.iteration(ops)
    b.iteration(ops)
    return b.trace()


@pytest.mark.parametrize("base", ["oracle", "lru", "replay"])
def test_small_storages_leave_only_when_nothing_larger_can(base):
    """At op1, 5 B must go. Belady (and LRU) would take S (needed last; used least recently); with
    S under ``small_fraction`` of the footprint (the previous iteration's, 2010 B) it goes last: B
    leaves. When B cannot leave (op1 reads it), S does and the run stays feasible."""
    cls = POLICIES[base]

    def run(fraction: float, b_read: bool):
        pol = type(f"Tiered{cls.__name__}", (cls,), {"small_fraction": fraction})()
        return simulate(small_big_trace(b_read), pol, 2005, UNIT, iteration=1)

    one_tier = run(0.0, False)
    assert one_tier.feasible and one_tier.bytes_offloaded == 10  # S
    tiered = run(0.01, False)  # small: under 20.1 B
    assert tiered.feasible and tiered.bytes_offloaded == 1000  # B
    forced = run(0.01, True)
    assert forced.feasible and forced.bytes_offloaded == 10  # only S could go


def test_small_storages_classed_by_footprint_and_not_while_away():
    from dynn_runtime.policies.base import IterationContext, SmallStorages

    s = SmallStorages(0.1)
    assert not s.alloc(1, 50)  # footprint 0 when it came: large
    assert s.alloc(2, 1) and s.small(2)  # under 0.1 x 50
    s.alloc(3, 1000)  # footprint 1051
    assert not s.small(1)  # classed at its allocation: not again until it is used
    assert s.access(1) and s.small(1)  # used (so resident): 50 < 105.1
    s.free(3)
    assert s.access(1)  # the footprint is the running maximum: still small
    s.free(1)
    assert not s.small(1)
    fresh = SmallStorages(0.1)  # seeded from the previous iteration (the simulator's context)
    tr = small_big_trace(False)
    fresh.begin_iteration(IterationContext(history=tr.iterations[:1], trace=tr))
    assert fresh.threshold == pytest.approx(201.0) and fresh.alloc(7, 200) and not fresh.alloc(8, 202)
    s.begin_iteration(IterationContext(history=tr.iterations[:1], trace=tr))  # has counted its own: no walk
    assert s.threshold == pytest.approx(105.1)


def test_footprint_peak_walk_equals_the_unmanaged_simulation():
    tr = chain_trace()
    assert tr.iterations[0].footprint_peak(tr) == unmanaged_peak(tr, 0) == 400
    tr = small_big_trace(True)
    assert [it.footprint_peak(tr) for it in tr.iterations] == [unmanaged_peak(tr, i) for i in (0, 1)] == [2010, 2010]


def test_storage_from_an_earlier_iteration_freed_mid_iteration_is_counted():
    """Allocated in iteration 0, read and freed in iteration 1: live (and counted) at its start."""
    b = TB()
    b.iteration([("f0", "forward", "", [], [("K", 100, "temp", False)], [])])
    b.iteration([
        ("g0", "forward", "", [], [("A", 50, "temp", False)], []),
        ("g1", "forward", "", ["K", "A"], [], ["K", "A"]),
    ], fresh=False)
    tr = b.trace()
    assert unmanaged_peak(tr, 1) == 150
    r = simulate(tr, "none", 150, UNIT, iteration=1)
    assert r.feasible and r.peak_bytes == 150 and r.iter_time_s == 2.0
    assert not simulate(tr, "none", 149, UNIT, iteration=1).feasible


def test_budget_one_equals_none_for_every_policy():
    tr = chain_trace()
    base = simulate(tr, "none", 1.0, UNIT, iteration=0)
    for pol in ALL:
        r = simulate(tr, pol, 1.0, UNIT, iteration=0)
        assert (r.iter_time_s, r.stall_time_s, r.bytes_offloaded, r.recompute_time_s, r.managed) == (
            base.iter_time_s, 0.0, 0, 0.0, False), pol


def test_state_machine_rejects_illegal_transitions():
    sim = Simulator(chain_trace(), "lru", 300, UNIT, iteration=0)
    sim.run()
    sid = next(iter(sim.st))
    sim.st[sid].status = Status.HOST
    assert Status.DROPPED not in TRANSITIONS[Status.HOST]
    with pytest.raises(AssertionError, match="illegal transition host -> dropped.*bug"):
        sim.set_status(sim.st[sid], Status.DROPPED)


# ---- bad input -------------------------------------------------------------------------------------

def test_bad_inputs():
    tr = chain_trace()
    with pytest.raises(PolicyError, match="unknown policy 'magic'.*lru"):
        simulate(tr, "magic", 0.5, UNIT, iteration=0)
    with pytest.raises(ConfigError, match="unknown device profile 'tpu'.*h100"):
        simulate(tr, "lru", 0.5, "tpu", iteration=0)
    for bad in (0, -5):
        with pytest.raises(BudgetError, match="positive"):
            simulate(tr, "lru", bad, UNIT, iteration=0)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(BudgetError, match=r"\(0, 1\]"):
            simulate(tr, "lru", bad, UNIT, iteration=0)
    with pytest.raises(ConfigError, match="iteration 3 is out of range"):
        simulate(tr, "lru", 0.5, UNIT, iteration=3)
    tr.header["schema"] = 99
    with pytest.raises(TraceError, match="schema version 99"):
        simulate(tr, "lru", 0.5, UNIT, iteration=0)


def test_infeasible_reported_with_reason_not_raised():
    r = simulate(chain_trace(), "checkpoint", 150, UNIT, iteration=0)
    assert not r.feasible and r.reason.startswith("out of memory at op")


# ---- invariants on random traces (hypothesis) ------------------------------------------------------

@st.composite
def random_trace(draw, uniform: bool = False):
    size = (lambda: 100) if uniform else (lambda: draw(st.integers(1, 8)) * 50)
    n_fwd = draw(st.integers(2, 10))
    b = TB()
    n_params = draw(st.integers(0, 3))
    params = [f"P{i}" for i in range(n_params)]
    for p in params:
        b.storage(p, size(), "param", persistent_from=0)
    ops = []
    live: list[str] = []
    uses: dict[str, int] = {}
    acts: list[str] = []
    for j in range(n_fwd):
        k = draw(st.integers(0, min(2, len(live) + len(params))))
        pool = live + params
        ins = sorted(set(draw(st.lists(st.sampled_from(pool), min_size=k, max_size=k)))) if pool and k else []
        name = f"A{j}"
        saved = draw(st.booleans())
        ops.append([f"f{j}", "forward", f"blocks.{j % 3}", ins, [(name, size(),
                                                                  "activation" if saved else "temp", saved)], []])
        live.append(name)
        if saved:
            acts.append(name)
        for x in ins:
            uses[x] = j
    for j, a in enumerate(reversed(acts)):
        extra = [p for p in params if draw(st.booleans())]
        ops.append([f"b{j}", "backward", "", [a] + extra, [], []])
        uses[a] = len(ops) - 1
    # free every non-param storage after its last use (or right away if never used)
    for name in live:
        last = uses.get(name, next(i for i, o in enumerate(ops) if o[4] and o[4][0][0] == name))
        ops[last][5].append(name)
    b.iteration([tuple(o) for o in ops])
    b.iteration([tuple(o) for o in ops])  # a repeat, so replay has a previous iteration
    return b.trace()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=random_trace(), frac=st.sampled_from([0.25, 0.4, 0.6, 0.8]), pol=st.sampled_from(ALL))
def test_resident_bytes_never_exceed_budget(tr, frac, pol):
    r = simulate(tr, pol, frac, UNIT)
    assert r.peak_bytes <= r.budget_bytes
    assert r.feasible or r.reason
    if r.feasible:
        assert r.iter_time_s >= r.compute_time_s - 1e-9
        assert r.iter_time_s == pytest.approx(r.compute_time_s + r.stall_time_s + r.recompute_time_s)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=random_trace(uniform=True), frac=st.sampled_from([0.3, 0.5, 0.7]))
def test_oracle_never_fetches_more_than_online_swappers(tr, frac):
    """Belady's rule is optimal for equal-sized storages in what it fetches (MIN): with prefetch off,
    the oracle never brings back more bytes than another policy, which prefetching cannot lower.

    Stall time is not the quantity it optimises: with asynchronous prefetch and serial copy
    engines hypothesis finds traces where LRU stalls one copy less than the oracle, and with mixed
    sizes the optimal offline eviction is NP-hard (the oracle ignores sizes). docs/simulator.md
    reports that gap; the recorded-trace comparison is in ``dynn bench``.
    """
    demand = POLICIES["oracle"]()
    demand.lookahead = 0  # no prefetch: fetches on demand only
    o = simulate(tr, demand, frac, UNIT)
    assert o.prefetch_hits == 0
    for pol in ("lru", "save_on_cpu", "replay", "oracle"):
        r = simulate(tr, pol, frac, UNIT)
        if r.feasible:
            assert o.feasible, (pol, o.reason)
            assert o.bytes_fetched <= r.bytes_fetched, pol


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tr=random_trace(), pol=st.sampled_from(ALL))
def test_budget_one_is_none(tr, pol):
    base = simulate(tr, "none", 1.0, UNIT)
    r = simulate(tr, pol, 1.0, UNIT)
    assert r.feasible and r.iter_time_s == base.iter_time_s and r.bytes_offloaded == 0 and r.recomputed_ops == 0


def test_recorded_trace_all_policies_fast(tmp_path):
    """A real recorded trace: every policy runs, within budget, in well under a second."""
    import time

    from dynn_runtime.trace import read_trace, record

    path = tmp_path / "evo.jsonl.gz"
    record("evoformer", path, steps=2, preset="tiny")
    tr = read_trace(path)
    for pol in ALL:
        t0 = time.perf_counter()
        r = simulate(tr, pol, 0.5, "h100")
        assert r.peak_bytes <= r.budget_bytes
        assert time.perf_counter() - t0 < 5.0  # generous: the bench measures the real figure


def test_prefetch_entry_of_a_storage_still_offloading_is_kept_until_it_lands():
    # a storage evicted while its device-to-host copy is in flight cannot be fetched yet; once the copy
    # lands it must still be prefetched ahead of its next use (its heap entry used to be dropped as
    # stale, so only a demand fetch brought it back)
    from dynn_runtime.policies.nextuse import NextUsePolicy

    class View:
        position = 0
        victim_floor = 0
        state = {1: "resident", 2: "resident"}

        def status(self, sid):
            return self.state[sid]

        def movable(self, sid):
            return True

        def nbytes(self, sid):
            return 10

        def free_bytes(self):
            return 100

    class Fixed(NextUsePolicy):
        small_fraction = 0.0

        def predict(self, sid):
            return {1: 5, 2: 40}[sid]

    pol = Fixed()
    pol.attach(view := View())
    pol.on_alloc(1, 0)
    pol.on_alloc(2, 0)
    assert next(pol.victims(10, set())) == 2  # furthest next use leaves first
    view.state[2] = "offloading"
    assert pol.after_op(10) == []  # in flight: nothing to fetch yet
    view.state[2] = "host"
    assert [(a.kind, a.sid) for a in pol.after_op(11)] == [("prefetch", 2)]  # 29 operators ahead: fetched
