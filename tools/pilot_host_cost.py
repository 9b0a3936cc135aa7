"""The pilot's host cost per operator on the native event source, and where it goes.

    python tools/pilot_host_cost.py [--reps 60] [--device cuda] [--clock process] [VARIANT ...]

Runs the operator loop of ``dynn bench --overhead`` (small ATen operators and a small ``Linear``
forward and backward, one thread, budget far above the peak) under one manager per variant, and
PyTorch alone before every managed step; prints the manager's host microseconds per operator
over PyTorch alone (thread CPU time: the median of per-repetition differences, and the minimum
managed minus the minimum PyTorch alone, which other processes on a shared machine disturb
less). ``--device cuda`` runs the loop on the GPU, synchronized after each side outside the timed
part: the thread's CPU time is then the host's alone, whatever the GPU waits for (``dynn bench
--overhead --device cuda`` times the wall clock); there backward runs on autograd's device thread,
which only ``--clock process`` (every thread's CPU time) counts. Variants (default: all):

- ``pilot``: the pilot as shipped (with nothing moved it sits every step out: ``Policy.idle_step``,
  no operator told);
- ``pilot-every``: the pilot told every step, every decision point run (``defer_idle=False``): a
  batch told in one ``on_operators`` call where no ``after_op`` of it would act, the fused
  ``on_operator`` per operator inside;
- ``per-operator``: the pilot told per operator (``on_operator`` and ``after_op`` calls: the path
  the runtime takes while something this policy evicted is away);
- ``python-fused``: the fused ``on_operator`` with its per-storage writes in Python (the native
  kernel's per-operator call off: the path without ``dynn_pilot_operator``);
- ``per-notification``: the pilot told through the interface's default ``on_operator`` (separate
  ``on_alloc``, ``on_access``, ``on_op`` calls);
- ``no-op-update``: the pilot without its ``on_op`` (what allocations, accesses and deaths cost);
- ``parse-only``: a pilot that ignores every notification (what the runtime's log parse costs);
- ``lru``, ``none``: the policies that never read the log in a step without a decision (``lru-py``: lru
  keeping its order in Python, ``native_order=False``).

Results are timing only: the stubbed variants make no sensible decisions.

``--paired-defer``: the pilot as shipped (sitting the idle steps out) and told every step with
every decision point run (``defer_idle``) on alternate steps of one manager. ``--paired-kernel``: the pilot's batches told in bulk on every step, their runs of operators in one
kernel call (``dynn_pilot_operators``) and one kernel call per operator (``batch_kernel = False``)
on alternate steps of one manager. ``--paired-pack``: the same, the runs' records packed by the C
module (``pilot/kernel/pack.c``) and by the Python loop (``native_pack = False``). ``--paired-records``:
the same, the runtime making no record for a storage born and dead in a batch, and one for every birth
(``MemoryManager.records_in_batch``, the reference). ``--paired-parse``: the same, the runtime's parse of
each batch in C (``_C.parse_operators``) and by the Python loop (``MemoryManager.operators_in_c = False``, the
reference).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.policies.base import Policy
from dynn_runtime.policies.basic import LRUPolicy
from dynn_runtime.runtime.manager import MemoryManager


class _PerNotification(PilotPolicy):
    name = "pilot-per-notification"
    on_operator = Policy.on_operator


class _PerOperator(PilotPolicy):
    name = "pilot-per-operator"

    def operators_in_bulk(self) -> bool:
        return False


class _PythonFused(PilotPolicy):
    name = "pilot-python-fused"

    def attach(self, view: Any) -> None:
        super().attach(view)
        self._fused_native = None


class _NoOpUpdate(PilotPolicy):
    name = "pilot-no-op-update"

    def on_op(self, position: int, op: Any) -> None:
        pass


class _ParseOnly(PilotPolicy):
    name = "pilot-parse-only"

    def on_operator(self, position: int, op: Any, accessed: Any) -> None:
        pass

    def on_alloc(self, sid: int, position: int) -> None:
        pass

    def on_free(self, sid: int) -> None:
        pass

    def after_op(self, position: int) -> list:
        return []  # still overridden: the runtime reads the log every 32 operators, as for the pilot


# the pilot's stubbed variants are told every step (``defer_idle=False``): with nothing moved the
# shipped pilot sits every step out and would measure none of what they change
VARIANTS = {"pilot": PilotPolicy, "pilot-every": lambda: PilotPolicy(defer_idle=False),
            **{name: (lambda cls=cls: cls(defer_idle=False)) for name, cls in (
                ("per-operator", _PerOperator), ("python-fused", _PythonFused),
                ("per-notification", _PerNotification), ("no-op-update", _NoOpUpdate), ("parse-only", _ParseOnly))},
            "lru": lambda: "lru", "lru-py": lambda: LRUPolicy(native_order=False), "none": lambda: "none"}


class _Switchable(PilotPolicy):
    """The pilot whose batches go in bulk or per operator, as set before each step (same state either way)."""

    name = "pilot-switchable"
    bulk = True

    def operators_in_bulk(self) -> bool:
        return self.bulk and super().operators_in_bulk()


def _work(device: str = "cpu") -> tuple[Any, torch.nn.Module]:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 8, generator=g).to(device), torch.randn(8, 8, generator=g).to(device)
    lin = torch.nn.Linear(16, 16).to(device)
    inp = torch.randn(4, 16, generator=g).to(device)

    def work() -> None:
        y = x
        for _ in range(25):
            y = torch.relu(torch.mm(y * 0.5 + x, w))
        lin(inp).sum().backward()
        lin.zero_grad(set_to_none=True)

    return work, lin


def measure_paired(reps: int, kernel: bool = False, pack: bool = False,
                   records: bool = False, defer: bool = False, parse: bool = False) -> tuple[int, float, float]:
    """One manager, one pilot: every repetition runs PyTorch alone, a step told in bulk, PyTorch alone
    and a step told per operator (the order alternating), so both sides meet the same load.
    (operators per step, median us per operator over PyTorch alone in bulk, and per operator).
    ``kernel``: both sides in bulk, the runs in one kernel call against one call per operator;
    ``pack``: both sides in bulk, the runs packed in C against in Python; ``records``: both sides in
    bulk, no record for the storages born and dead in a batch against a record for every birth;
    ``defer``: the shipped pilot (it sits the idle steps out) against one told every step with every
    decision point run; ``parse``: both sides in bulk, the
    batch parsed in C against by the Python loop."""
    work, lin = _work()
    # told every step (defer_idle=False), but for ``defer``, whose switch it is
    pol = _Switchable(defer_idle=False) if not (kernel or pack or records or defer or parse) else PilotPolicy(
        defer_idle=False)
    mm = MemoryManager(1 << 50, policy=pol, device="cpu", events="native")
    # the switch set before each step: (its owner, attribute, the value for the first side)
    owner, attr, first = ((pol, "batch_kernel", True) if kernel else (pol, "native_pack", True) if pack
                          else (mm, "records_in_batch", False) if records else (pol, "defer_idle", True) if defer
                          else (mm, "operators_in_c", True) if parse else (pol, "bulk", True))
    mm.attach(lin)
    diff: dict[bool, list[float]] = {True: [], False: []}
    try:
        for _ in range(3):
            with mm.step():
                work()
        for r in range(reps):
            for bulk in ((True, False) if r % 2 == 0 else (False, True)):
                t0 = time.thread_time()
                work()
                p = time.thread_time() - t0
                setattr(owner, attr, bulk == first)
                with mm.step():
                    t0 = time.thread_time()
                    work()
                    m = time.thread_time() - t0
                ops = mm.steps[-1].ops
                diff[bulk].append((m - p) / ops)
    finally:
        mm.detach()
    return ops, statistics.median(diff[True]) * 1e6, statistics.median(diff[False]) * 1e6


def measure(variant: str, reps: int, device: str = "cpu", clock=time.thread_time) -> tuple[int, float, float]:
    """(operators per step, median us per operator over PyTorch alone, min-min us per operator).
    On ``cuda`` the thread's CPU time is the host's alone (the kernels run on the GPU; it is
    synchronized after each side, outside the timed part). ``clock``: ``time.thread_time`` (the
    stepping thread) or ``time.process_time`` (every thread: on CUDA, backward runs on autograd's
    device thread, which the stepping thread's time does not see)."""
    work, lin = _work(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    mm = MemoryManager(1 << 50, policy=VARIANTS[variant](), device=device, events="native")
    mm.attach(lin)
    try:
        for _ in range(3):  # warm-up: the pilot's history, the allocator
            with mm.step():
                work()
        diff, plain, managed = [], [], []
        for _ in range(reps):
            sync()
            t0 = clock()
            work()
            p = clock() - t0
            sync()
            with mm.step():
                t0 = clock()
                work()
                m = clock() - t0
                sync()
            ops = mm.steps[-1].ops
            diff.append((m - p) / ops)
            plain.append(p / ops)
            managed.append(m / ops)
        if mm.stats().get("event_source") != "native":
            raise SystemExit("the native event source is not available in this build")
    finally:
        mm.detach()
    return ops, statistics.median(diff) * 1e6, (min(managed) - min(plain)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", metavar="VARIANT", help=f"any of {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--clock", default="thread", choices=["thread", "process"],
                    help="the stepping thread's CPU time, or the process's (every thread: on CUDA, backward runs "
                         "on autograd's device thread)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the loop runs (the variants only; the --paired modes run on the CPU)")
    ap.add_argument("--paired", action="store_true",
                    help="only the pilot, its batches told in bulk and per operator on alternate steps of one manager")
    ap.add_argument("--paired-kernel", action="store_true",
                    help="only the pilot told in bulk, its runs in one kernel call and one per operator on alternate "
                         "steps of one manager")
    ap.add_argument("--paired-pack", action="store_true",
                    help="only the pilot told in bulk, its runs packed by the C module and by Python on alternate "
                         "steps of one manager")
    ap.add_argument("--paired-records", action="store_true",
                    help="only the pilot told in bulk, the runtime without and with records for the storages born "
                         "and dead in a batch on alternate steps of one manager")
    ap.add_argument("--paired-defer", action="store_true",
                    help="only the pilot, as shipped (sitting idle steps out) and told every step with every "
                         "decision point run, on alternate steps of one manager")
    ap.add_argument("--paired-parse", action="store_true",
                    help="only the pilot told in bulk, the runtime's parse of its batches in C and by the Python loop "
                         "on alternate steps of one manager")
    args = ap.parse_args()
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    torch.set_num_threads(1)
    if args.paired_defer:
        ops, deferred, every = measure_paired(args.reps, defer=True)
        print(f"pilot, {ops} operators per step: +{deferred:.1f} us/op as shipped (idle steps sat out), "
              f"+{every:.1f} us/op told every step with every decision point run (median over PyTorch alone, "
              "paired step by step)")
        return
    if args.paired_parse:
        ops, c, py = measure_paired(args.reps, parse=True)
        print(f"pilot told in bulk, {ops} operators per step: +{c:.1f} us/op with the batches parsed in C, "
              f"+{py:.1f} us/op parsed by the Python loop (median over PyTorch alone, paired step by step)")
        return
    if args.paired_records:
        ops, light, full = measure_paired(args.reps, records=True)
        print(f"pilot told in bulk, {ops} operators per step: +{light:.1f} us/op without records for storages born "
              f"and dead in a batch, +{full:.1f} us/op with them (median over PyTorch alone, paired step by step)")
        return
    if args.paired_pack:
        ops, c, py = measure_paired(args.reps, pack=True)
        print(f"pilot told in bulk, {ops} operators per step: +{c:.1f} us/op packed in C, "
              f"+{py:.1f} us/op packed in Python (median over PyTorch alone, paired step by step)")
        return
    if args.paired_kernel:
        ops, run, per_op = measure_paired(args.reps, kernel=True)
        print(f"pilot told in bulk, {ops} operators per step: +{run:.1f} us/op with a kernel call per run, "
              f"+{per_op:.1f} us/op with one per operator (median over PyTorch alone, paired step by step)")
        return
    if args.paired:
        ops, bulk, per_op = measure_paired(args.reps)
        print(f"pilot, {ops} operators per step: +{bulk:.1f} us/op told in bulk, +{per_op:.1f} us/op per operator "
              "(median over PyTorch alone, paired step by step)")
        return
    print("| variant | ops/step | +us/op (median) | +us/op (min-min) |\n|---|---:|---:|---:|")
    for v in args.variants or list(VARIANTS):
        ops, med, low = measure(v, args.reps, args.device, time.process_time if args.clock == "process" else time.thread_time)
        print(f"| {v} | {ops} | {med:.1f} | {low:.1f} |")


if __name__ == "__main__":
    main()
