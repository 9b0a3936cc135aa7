"""The managed step against PyTorch alone, paired step by step in one process (native event source).

Usage: ``python tools/overhead_pair.py FAMILY[,FAMILY...] [--steps N] [--configs none,lru,lru@0.5]
[--profile CONFIG] [--rounds R] [--device cuda] [--preset P] [--copies log] [--back-to-back K]`` (``small`` presets by default; a family may be ``examples/my_workload.py:build``;
a configuration is a policy name, ``pilot-every`` for the pilot with every decision point run
(``defer_idle=False``), ``pilot-alt`` for one pilot that defers its idle decision points in steps 4k and
4k+1 and runs every one in steps 4k+2 and 4k+3 (both in both orders against PyTorch alone; the two
halves reported apart), ``pilot-py`` for the pilot with its bulk loop in Python, ``pilot-rec`` for the
pilot with the runtime recording every storage a batch sees born (``records_in_batch``), ``pilot-pyparse`` for the
pilot with the runtime's parse of its batches in Python (``operators_in_c = False``), ``pilot-perop`` for the
pilot with the batches whose ``after_op`` calls may act told one operator at a time by the runtime's Python
loop (``stops_in_c = False``), ``pilot-pywalk`` for the pilot with the module hooks' walk of the autograd nodes in Python
(``tag_nodes_in_c = False``), ``none-lazy-peak`` for none with the native observer's peak an upper bound (no sweep of the
table at each new peak while storages are exposed), ``none-swept`` for none with CUDA deaths swept
for rather than heard from the caching allocator (``hear_frees = False``), ``lru-nofloor`` for lru
with the room ahead of the next operator made of every victim, however small (``reserve_floor =
False``), ``lru-parse`` for lru with every fault and decision
point reading the log first (``defer_parse = False``), ``lru-pycopies`` for lru with
its copies issued by the Python engine (``CudaCopies``; ``--device cuda`` only; every other CUDA
configuration uses the C++ one, ``MemoryManager.copies_in_c``), ``lru-s34`` for lru as session 34 left
it (a walk of the observer's table before every make-room, every late fetch's wait timed, a demand
fetch on the side stream, and on CUDA an event made and destroyed per copy and each copy a ``Tensor.copy_``),
``lru-tensorcopy`` for lru with each CUDA copy a ``Tensor.copy_`` rather than one ``cudaMemcpyAsync``
(``MemoryManager.raw_copies``), ``lru-py`` for lru
with its order kept in Python, ``@F`` a budget).

Two copies of the model start from the same weights and train on the same batches: one under a
manager (policy ``none`` or ``lru`` with a budget far above the peak, or ``lru@F`` at F of the
measured peak), the other alone. Each step runs both, in alternating order, and times each with
the stepping thread's CPU time (``--device cuda``: the wall time, the GPU synchronized around each side); PyTorch alone runs with the observer suspended on the thread (its
key excluded) and without the hooks the manager installs for every module and for the thread (the
module hooks and ``saved_tensors_hooks`` of a policy that reads them: the pilot), so it costs what it
costs without a manager attached. Prints, per configuration,
the median of the per-step ratios (the first two steps left out: the measuring step and the first
managed one) and their range, the median of the per-step differences, the median step times, the
time spent opening and closing the step, the reads of the native log per step and their time, the pilot's decision points run and deferred and its
inference time per step (all steps), and whether the managed side's losses are PyTorch
alone's. ``--back-to-back K`` then times K steps of each side one after another, the device
synchronized only around each block (the pairs synchronize around every step, so they cannot see
what a step's end waits for). ``--profile CONFIG`` writes a cProfile of that configuration's managed steps to
``/tmp/overhead_pair.<family>.<config>.prof`` and prints its top.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import pstats
import statistics
import time

import torch

import dynn_runtime as dr
from dynn_runtime.runtime.copies import cuda_copies, native_copies
from dynn_runtime.runtime.events import QUIET
from dynn_runtime.workload import load_workload, make_optimizer, to_device, train_step, workload_name

_BIG = 1 << 50
_EXPERIMENT = ""
_COPIES = ""
_BACK_TO_BACK = 0  # --back-to-back: steps per block of the unpaired measurement (0: none)


_CLOCK = time.thread_time  # the stepping thread's CPU time; wall time with the GPU synchronized on CUDA
_DEVICE = "cpu"
_PRESET = "small"


def _sync() -> None:
    if _DEVICE != "cpu":
        torch.cuda.synchronize()


def _timed(fn, acc: list[float]):
    def wrapper(*a, **k):
        t0 = _CLOCK()
        try:
            return fn(*a, **k)
        finally:
            acc.append(_CLOCK() - t0)
    return wrapper


class _Phases:
    """``train_step``'s phase factory: thread CPU time per phase, summed per step."""

    def __init__(self) -> None:
        self.step: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = _CLOCK()
        try:
            yield
        finally:
            self.step[name] = self.step.get(name, 0.0) + _CLOCK() - t0

    def close(self) -> None:
        self.steps.append(self.step)
        self.step = {}


def _back_to_back(managed_block, alone_block, batches, own) -> tuple[float, float, float]:
    """``--back-to-back``: each side runs its steps one after another with the device synchronized
    only around the block, as a training loop that reads nothing back runs; four blocks alternating
    which side goes first. Returns (managed, alone) wall milliseconds a step and their ratio."""
    picks = [i % len(batches) for i in range(_BACK_TO_BACK)]
    blocks = {True: [batches[i] for i in picks], False: [own[i] for i in picks]}
    t = {True: 0.0, False: 0.0}
    for r in range(4):
        for managed in ((True, False) if r % 2 == 0 else (False, True)):
            _sync()
            t0 = time.perf_counter()
            (managed_block if managed else alone_block)(blocks[managed])
            _sync()
            t[managed] += time.perf_counter() - t0
    n = 4 * len(picks)
    return 1e3 * t[True] / n, 1e3 * t[False] / n, t[True] / t[False]


def run(family: str, config: str, steps: int, profile: bool) -> dict:
    torch.manual_seed(0)
    wl = load_workload(family, preset=_PRESET, seed=0)
    initial = copy.deepcopy(wl.model).to(_DEVICE)
    batches = [to_device(wl.make_batch(s), torch.device(_DEVICE)) for s in range(steps)]
    own = copy.deepcopy(batches)  # PyTorch alone's: the manager may hold the managed side's (an input it moved)
    policy, _, frac = config.partition("@")
    budget = float(frac) if frac else _BIG
    if policy == "pilot-py":  # the pilot with its bulk loop and packing in Python (no C walk)
        from dynn_runtime.pilot.policy import PilotPolicy

        policy = PilotPolicy()
        policy.native_pack = False
    elif policy == "pilot-alt":  # one manager: idle decision points deferred and run on alternate step pairs
        from dynn_runtime.pilot.policy import PilotPolicy

        policy = PilotPolicy()
    elif policy == "pilot-every":  # the pilot with every decision point run (defer_idle=False: the reference)
        from dynn_runtime.pilot.policy import PilotPolicy

        policy = PilotPolicy(defer_idle=False)
    elif policy in ("pilot-rec", "pilot-pyparse", "pilot-perop", "pilot-pywalk"):  # the runtime's reference bulk paths
        from dynn_runtime.pilot.policy import PilotPolicy

        policy = PilotPolicy()
    elif policy in ("none-lazy-peak", "none-swept"):  # the observer's books, below
        policy = "none"
    elif policy == "lru-nofloor":  # lru with the reserve made of every victim (reserve_floor = False)
        policy = "lru"
    elif policy == "lru-parse":  # lru reading the log at every fault and decision (defer_parse = False), below
        policy = "lru"
    elif policy == "lru-pycopies":  # lru with the Python copy engine (CudaCopies), below
        if _DEVICE == "cpu":
            raise SystemExit("overhead_pair: lru-pycopies needs --device cuda (the CPU's copies are synchronous)")
        policy = "lru"
    elif policy in ("lru-s34", "lru-tensorcopy"):  # lru as session 34 left it; lru copying with copy_: below
        policy = "lru"
    elif policy == "lru-py":  # lru with its order kept in Python, told every touch (no observer-kept order)
        from dynn_runtime.policies.basic import LRUPolicy

        policy = LRUPolicy()
        policy.native_order = False
    m_model, a_model = copy.deepcopy(initial), copy.deepcopy(initial)
    m_opt, a_opt = make_optimizer(wl, m_model.parameters()), make_optimizer(wl, a_model.parameters())
    copies = None
    if config.startswith("lru-pycopies"):
        copies = cuda_copies(torch.device(_DEVICE), True, native=False)
    s34 = config.startswith("lru-s34")
    if s34 and _DEVICE != "cpu":  # the C++ engine making and destroying an event per copy, copying with copy_
        copies = native_copies("cuda", torch.device(_DEVICE).index or 0, True, reuse_events=False, raw_copies=False)
    elif config.startswith("lru-tensorcopy") and _DEVICE != "cpu":  # lru with each copy a Tensor.copy_
        copies = native_copies("cuda", torch.device(_DEVICE).index or 0, True, raw_copies=False)
    elif _COPIES == "log":  # the C++ engine on its log device: a CUDA move's calls, on the CPU
        copies = native_copies("log", 0, True, reuse_events=not s34)
    mm = dr.MemoryManager(budget, policy=policy, device=_DEVICE, events="native", copies=copies)
    mm.records_in_batch = config.startswith("pilot-rec")
    mm.operators_in_c = not config.startswith("pilot-pyparse")
    mm.stops_in_c = not config.startswith("pilot-perop")
    begin, end, hooks = [], [], []
    mm._opt_pre = _timed(mm._opt_pre, hooks)
    mm._opt_post = _timed(mm._opt_post, hooks)
    mm.reserve_floor = not config.startswith("lru-nofloor")  # room ahead of the next operator: every victim
    mm.tag_nodes_in_c = not config.startswith("pilot-pywalk")  # modules' autograd nodes tagged by Python's walk
    mm.defer_parse = not config.startswith("lru-parse")  # every fault and decision reads the log first
    mm.hear_frees = config != "none-swept"  # CUDA deaths swept for, not heard from the allocator
    mm.walk_every_room = s34  # a walk of the observer's table before every make-room
    mm.time_late_every = 1 if s34 else mm.time_late_every  # every late fetch's wait timed
    mm.inline_demand_fetches = not s34  # a demand fetch on the side stream, as a prefetch
    mm.attach(m_model, m_opt)
    obs = QUIET[-1]
    obs.exact_peak = config != "none-lazy-peak"
    mm._begin_step = _timed(mm._begin_step, begin)
    mm._end_step = _timed(mm._end_step, end)
    reads: list[float] = []  # the managed side's reads of the native log (NativeSource._native_parse_log)
    mm._native_parse_log = _timed(mm._native_parse_log, reads)
    prof = cProfile.Profile() if profile else None
    ratios, mt, at, ml, al = [], [], [], [], []
    alt = config == "pilot-alt"
    halves: dict[bool, list[float]] = {True: [], False: []}  # pilot-alt: managed - alone (s) by defer_idle
    mph, aph = _Phases(), _Phases()

    def managed(batch) -> float:
        _sync()
        t0 = _CLOCK()
        if prof is not None:
            prof.enable()
        with mm.step():
            loss = train_step(wl, m_model, m_opt, batch, phase=mph)
        _sync()
        mph.close()
        if prof is not None:
            prof.disable()
        t = _CLOCK() - t0
        ml.append(loss.item())
        return t

    def alone(batch) -> float:
        with mm._paused():
            _sync()
            t0 = _CLOCK()
            loss = train_step(wl, a_model, a_opt, batch, phase=aph)
            _sync()
            t = _CLOCK() - t0
            aph.close()
        al.append(loss.item())
        return t

    def managed_block(block) -> None:
        for batch in block:
            with mm.step():
                train_step(wl, m_model, m_opt, batch)

    def alone_block(block) -> None:
        with mm._paused():
            for batch in block:
                train_step(wl, a_model, a_opt, batch)

    try:
        for s, (batch, mine) in enumerate(zip(batches, own)):
            gc.collect()
            if s == 2:
                reads.clear()  # counted from the third step, as the ratios (the first two measure and warm up)
            if alt:
                mm.policy.defer_idle = s % 4 < 2
            if s % 2:
                ta, tm = alone(mine), managed(batch)
            else:
                tm, ta = managed(batch), alone(mine)
            if s >= 2:
                if alt:
                    halves[mm.policy.defer_idle].append(tm - ta)
                ratios.append(tm / ta)
                mt.append(tm)
                at.append(ta)
        st = mm.stats()
        per = st["per_step"][2:]
        pol = mm.policy
        pilot = {k: getattr(pol, k, 0) / steps for k in ("decisions", "deferred_idle", "inference_s")}
        # the measuring step walks the table after every operator: walks of the steps the medians keep
        sweeps = sum(p["table_sweeps"] for p in per) / max(len(per), 1)
        deaths = st["deaths"]
        paired_reads = list(reads)  # (the blocks below read the log too)
        b2b = _back_to_back(managed_block, alone_block, batches, own) if _BACK_TO_BACK else None
    finally:
        mm.detach()
    out = {
        "ratio": statistics.median(ratios), "ratio_range": (min(ratios), max(ratios)),
        "extra_ms": 1e3 * statistics.median(m - a for m, a in zip(mt, at)),
        "managed_ms": 1e3 * statistics.median(mt),
        "alone_ms": 1e3 * statistics.median(at), "begin_ms": 1e3 * statistics.median(begin[2:]),
        "end_ms": 1e3 * statistics.median(end[2:]),
        "hooks_ms": 1e3 * statistics.median(a + b for a, b in zip(hooks[4::2], hooks[5::2])), "same": ml == al,
        "evictions": sum(p["evictions"] for p in per) / max(len(per), 1),
        "decisions": sum(p["decision_points"] for p in per) / max(len(per), 1),
        "ops": statistics.median(p["ops"] for p in per),
        "pilot": pilot, "sweeps": sweeps, "deaths": deaths,
        "reads": len(paired_reads) / max(steps - 2, 1), "reads_ms": 1e3 * sum(paired_reads) / max(steps - 2, 1),
        "halves": {k: 1e3 * statistics.median(v) for k, v in halves.items() if v}, "b2b": b2b,
        "phases": {k: 1e3 * statistics.median(m[k] - a[k] for m, a in zip(mph.steps[2:], aph.steps[2:]))
                   for k in ("forward", "backward", "optimizer")},
    }
    if prof is not None:
        path = f"/tmp/overhead_pair.{workload_name(family)}.{config}.prof"
        prof.dump_stats(path)
        pstats.Stats(path).sort_stats("tottime").print_stats(25)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("families")
    ap.add_argument("--steps", type=int, default=22)
    ap.add_argument("--configs", default="none,lru,lru@0.5")
    ap.add_argument("--profile", default="")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--experiment", default="")
    ap.add_argument("--preset", default="small", help="the zoo preset (tiny: CPU steps whose host work dominates, as on a GPU)")
    ap.add_argument("--copies", default="", choices=("", "log"),
                    help="log (CPU): every configuration's copies through the C++ engine on its log device, so "
                         "that a move makes the calls a CUDA move makes (the copies run at once)")
    ap.add_argument("--back-to-back", type=int, default=0, metavar="K",
                    help="also time K steps of each side one after another, the device synchronized only "
                         "around each block (what a training loop that reads nothing back sees), after the pairs")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: wall time with the GPU synchronized around each side's step, default threads")
    args = ap.parse_args()
    global _EXPERIMENT, _CLOCK, _DEVICE, _PRESET, _COPIES, _BACK_TO_BACK
    _EXPERIMENT = args.experiment
    _BACK_TO_BACK = args.back_to_back
    _COPIES = args.copies
    if _COPIES and args.device != "cpu":
        raise SystemExit("overhead_pair: --copies log is for --device cpu")
    _PRESET = args.preset
    _DEVICE = args.device
    if _DEVICE == "cuda":
        _CLOCK = time.perf_counter
    else:
        torch.set_num_threads(1)
    for family in args.families.split(","):
        for r in range(args.rounds):
            for config in args.configs.split(","):
                o = run(family, config, args.steps, config == args.profile and r == 0)
                print(f"{workload_name(family)} {config} round {r}: ratio {o['ratio']:.3f} (range "
                      f"{o['ratio_range'][0]:.3f}-{o['ratio_range'][1]:.3f}; managed - alone {o['extra_ms']:.2f} ms; managed "
                      f"{o['managed_ms']:.2f} ms, alone {o['alone_ms']:.2f} ms; begin {o['begin_ms']:.3f}, end "
                      f"{o['end_ms']:.3f} ms, optimizer hooks {o['hooks_ms']:.3f} ms; ops {o['ops']}, decisions/step {o['decisions']:.1f}, evictions/step "
                      f"{o['evictions']:.1f}, sweeps/step {o['sweeps']:.1f}, log reads/step {o['reads']:.1f} "
                      f"({o['reads_ms']:.2f} ms), deaths {o['deaths']}; managed - alone ms: "
                      + ", ".join(f"{k} {v:+.3f}" for k, v in o["phases"].items())
                      + f"); pilot per step: {o['pilot']['decisions']:.1f} decision points run, "
                      f"{o['pilot']['deferred_idle']:.1f} deferred, inference {o['pilot']['inference_s'] * 1e3:.2f} ms"
                      + "".join(f"; managed - alone with defer_idle={k}: {v:.2f} ms" for k, v in o["halves"].items())
                      + ("" if o["b2b"] is None else "; back to back: managed {:.2f} ms, alone {:.2f} ms a step, "
                         "ratio {:.3f}".format(*o["b2b"]))
                      + f"; losses PyTorch alone's: {o['same']}"
                      + ("" if o["same"] or _DEVICE == "cpu" or torch.are_deterministic_algorithms_enabled()
                         else " (deterministic algorithms are off here: two runs of PyTorch alone may differ"
                              " too; tools/soc_match.py and the gpu tests compare under them)"), flush=True)


if __name__ == "__main__":
    main()
