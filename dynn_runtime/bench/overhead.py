"""``dynn bench --overhead``: what the live memory manager costs on the host, measured against PyTorch alone.

Three measurements, each pairing managed and unmanaged runs in one process on the same inputs
(the machine's noise hits both alike; ratios are taken within a pair, then the median), with the
manager on ``device`` (``cpu``, or ``cuda``: tensors, models and the manager on the GPU, and every
timed run or step ends with ``torch.cuda.synchronize()`` on both sides, so a time includes the
kernels it launched):

1. **Operators.** A loop of small ATen operators (``mul``, ``add``, ``mm``, ``relu`` on 8x8 tensors)
   and a small ``Linear`` forward and backward, one intra-op thread, alone and inside a
   :meth:`MemoryManager.step` whose budget is far above the peak (nothing moves; every event the
   manager listens to is on), per policy and per event source, a managed run paired with one
   alone (the manager paused on the thread) in alternating order. Reported: host microseconds per
   operator over PyTorch alone (median over repetitions).
2. **Workloads.** Every zoo family at ``preset`` and the README's example
   (``examples/my_workload.py:build``): step time managed (budget above the peak) over unmanaged,
   per policy, the manager attached once per run of steps (as a user attaches it), PyTorch alone on
   a copy of the same initial model step by step beside it (with the manager paused on the thread),
   step ``i`` paired with step ``i``; and ``lru`` at half the peak: the ratio and where the time goes (the manager's
   ``stall_seconds``, ``copy_seconds``, ``policy_seconds``; the rest is its event path), with the
   decision points (``victims()`` calls and ``after_op()`` calls that returned actions, counted by
   a wrapper around the policy: the definition of :mod:`dynn_runtime.sim.hostcost`).
3. **The pilot.** Per family: its decision points per step, seconds per decision point (its own
   inference, and the manager's ``policy_seconds`` over them) and its share of the step, from a
   run with every decision point taken (``defer_idle=False``: as shipped, above the peak it sits
   every step out, since nothing would read what it computes there, ``Policy.idle_step``; its
   column in 2. is that run, and the share of steps it sat out is reported).
4. **Python's cyclic collector**, timed in every workload step on both sides (``gc.callbacks``): its
   seconds per step managed and alone, and the full (oldest-generation) collections among them. A
   full collection visits every tracked object of the process (the framework's included), and
   whatever a step keeps alive brings the next one closer, so the objects the manager keeps per
   operator cost it here rather than where they are made.

From these, the calibration of the simulator's host cost per event source and device
(``--write-calibration`` writes it into :data:`~dynn_runtime.sim.hostcost.CALIBRATION_PATH`, under
the device measured): ``per_op_s`` is the median
over the zoo families of (managed - unmanaged, the median over the step pairs) / operators with ``lru`` above the peak;
``per_move_s`` the sum over the families of (step at half the peak - step above the peak on the
same batch - stalls, which on the CPU include the synchronous copies and on a GPU are the compute
stream's timed waits) over the storages moved (evictions and fetches alike: one per-move term)
(``per_decision_s`` is 0 on the Python path: the policy is consulted after every operator, which
``per_op_s`` holds, and a joint fit of a per-consultation and a per-move term is not stable on
noisy machines; the file keeps the per-consultation figure that would explain the same seconds); the pilot's ``host_cost``
model (seconds per decision point, per row scored, per operator) is fitted to its own counters
(inference per decision point and row) and to the step time it adds over ``lru`` (per operator,
added to the pilot's ``per_op_s`` as ``policy_per_op_s``).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import os
import platform
import statistics
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._log import logger
from ..errors import ConfigError
from .calibration import ZOO_AND_EXAMPLE, calibration_from, write_calibration

__all__ = ["OverheadConfig", "OverheadReport", "run_overhead", "render_overhead_markdown", "write_overhead",
           "calibration_from", "write_calibration", "ZOO_AND_EXAMPLE"]

_BIG = 1 << 50  # a budget far above any peak here: nothing moves
#: the budget label of the pilot above the peak with every decision point run (``defer_idle=False``):
#: the cost per decision point that the simulator charges where they run
EVERY_POINT = "above peak, every decision point"
_ROUNDS = 2  # the workloads' runs per manager, with fresh models, PyTorch alone first in the first pair of one


@dataclass(kw_only=True)
class OverheadConfig:
    """What one ``dynn bench --overhead`` run measures; ``None`` fields take the mode's default."""

    workloads: list[str] = field(default_factory=list)
    """Zoo families or ``path.py:function`` specs; empty: the zoo and ``examples/my_workload.py:build``
    (left out with a warning when that file is not under the current directory)."""
    policies: list[str] = field(default_factory=lambda: ["none", "lru", "pilot"])
    """Policies measured above the peak (the budget-1/2 run is always ``lru``)."""
    sources: list[str] = field(default_factory=list)
    """Event sources (``python``, ``native``); empty: every source this build offers."""
    preset: str | None = None
    """Workload preset; default ``small`` (quick: ``tiny``)."""
    steps: int | None = None
    """Measured steps per workload after one warm-up step (default 6; quick 2)."""
    reps: int | None = None
    """Repetitions of the operator microbenchmark (default 41; quick 9)."""
    seed: int = 0
    quick: bool = False
    half: float = 0.5
    """The constrained budget, a fraction of the peak (lru)."""
    threads: int = 1
    """``torch.set_num_threads`` for the run."""
    device: str = "cpu"
    """Where the models, the operators' tensors and the manager run: ``cpu`` or ``cuda``."""
    json_path: str = "out/bench/overhead.json"

    def resolved(self) -> OverheadConfig:
        self.validate()  # the device first: the event sources are probed on it
        cfg = dataclasses.replace(
            self,
            workloads=list(self.workloads) or _default_workloads(),
            sources=list(self.sources) or available_sources(self.device),
            preset=self.preset or ("tiny" if self.quick else "small"),
            steps=self.steps if self.steps is not None else (2 if self.quick else 6),
            reps=self.reps if self.reps is not None else (9 if self.quick else 41),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        from .. import models
        from ..policies import POLICIES

        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ConfigError(f"bench: unknown policies {bad}; registered: {', '.join(POLICIES)}.")
        bad = [w for w in self.workloads if ".py:" not in w and w not in models.FAMILIES]
        if bad:
            raise ConfigError(f"bench: unknown workload(s) {', '.join(map(repr, bad))}; give zoo families "
                              f"({', '.join(models.FAMILIES)}) or path/to/file.py:function.")
        for s in self.sources:
            if s not in ("python", "native"):
                raise ConfigError(f"bench: an event source is 'python' or 'native', got {s!r}.")
        if self.preset is not None and self.preset not in models.PRESETS:
            raise ConfigError(f"bench: unknown preset {self.preset!r}; choices: {', '.join(models.PRESETS)}.")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"bench: --steps must be >= 1 for --overhead, got {self.steps}.")
        if self.reps is not None and self.reps < 1:
            raise ConfigError(f"bench: --reps must be >= 1, got {self.reps}.")
        if not 0 < self.half < 1:
            raise ConfigError(f"bench: the constrained budget is a fraction in (0, 1), got {self.half}.")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"bench: --overhead runs on --device cpu or cuda, got {self.device!r}.")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("bench: --overhead --device cuda needs a GPU, and CUDA is not available here; "
                                  "measure on the CPU (--device cpu) or run it where a GPU is.")


def _default_workloads() -> list[str]:
    out = list(ZOO_AND_EXAMPLE[:-1])
    example = ZOO_AND_EXAMPLE[-1]
    if Path(example.rpartition(":")[0]).is_file():
        out.append(example)
    else:
        logger.warning("bench: %s is not under the current directory; measuring the zoo only", example)
    return out


def _events_kwarg() -> bool:
    from ..runtime.manager import MemoryManager

    return "events" in inspect.signature(MemoryManager).parameters


def _manager(budget: Any, policy: Any, source: str, device: str = "cpu") -> Any:
    from ..runtime.manager import MemoryManager

    kw = {"events": source} if _events_kwarg() else {}
    return MemoryManager(budget, policy=policy, device=device, **kw)


def _synchronizer(device: str) -> Any:
    """What ends every timed run or step on ``device``: the host waits for the kernels (CUDA), or nothing."""
    import torch

    if device == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def _source_used(mm: Any) -> str:
    return str(mm.stats().get("event_source", "python"))


def available_sources(device: str = "cpu") -> list[str]:
    """The event sources this build runs on ``device``: ``python`` always; ``native`` where the manager
    takes ``events=`` and a step with ``events="native"`` reports that it used it."""
    import torch

    out = ["python"]
    if not _events_kwarg():
        return out
    try:
        model = torch.nn.Linear(4, 4).to(device)
        mm = _manager(_BIG, "none", "native", device)
        mm.attach(model)
        try:
            with mm.step():
                model(torch.randn(2, 4, device=device)).sum().backward()
            if _source_used(mm) == "native":
                out.append("native")
        finally:
            mm.detach()
    except Exception as exc:  # noqa: BLE001 - any failure means the source is not usable here
        logger.warning("bench: the native event source is not usable here (%s); measuring python only", exc)
    return out


def _counting(policy: str) -> Any:
    """``policy`` with its decision points counted (as the simulator's host cost counts them): ``victims()`` calls, and
    ``after_op()`` calls that return actions."""
    from ..policies import POLICIES, Policy

    base = POLICIES[policy]

    class Counting(base):  # type: ignore[misc, valid-type]
        decision_points = 0
        prefetches = 0

        def victims(self, need_bytes: int, exclude: set[int]) -> Any:
            self.decision_points += 1
            return super().victims(need_bytes, exclude)

    def after_op(self: Any, position: int) -> Any:
        actions = base.after_op(self, position)
        if actions:
            self.decision_points += 1
            self.prefetches += sum(a.kind == "prefetch" for a in actions)
        return actions

    Counting.__name__ = Counting.__qualname__ = f"Counting{base.__name__}"
    pol = Counting()
    # Only a policy that acts ahead of need overrides after_op, and the native event source calls Python
    # every ``decide_every`` operators for such a policy alone (runtime/steps.py): wrapping it on the
    # others would measure a manager the user does not run. The wrapper goes on the instance, which the
    # runtime calls: the class keeps the policy's own after_op, which a policy checks of itself before
    # it takes its fast paths (the pilot's batches told in bulk, operators_in_bulk and stops_in_bulk).
    if base.after_op is not Policy.after_op:
        pol.after_op = types.MethodType(after_op, pol)
    return pol


def _runtime_decision_points(mm: Any) -> float:
    """``stats()["decision_points"]`` (cumulative), 0 where the runtime does not report it."""
    return float(mm.stats().get("decision_points", 0) or 0)


def _pilot_counters(pol: Any) -> dict[str, float]:
    """The pilot's own cumulative counters (zeros for any other policy)."""
    keys = ("decisions", "deferred_idle", "catch_ups", "candidates", "ops", "inference_s", "bookkeeping_s")
    return {k: float(getattr(pol, k, 0) or 0) for k in keys} | {"host_seconds": float(pol.host_seconds)}


def _machine(device: str = "cpu") -> dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    out = {"host_cpu": cpu, "cores": os.cpu_count(), "device": device, "torch": torch.__version__,
           "python": platform.python_version(), "platform": platform.platform()}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda"] = torch.version.cuda
    return out


# ---- 1: the operator microbenchmark ---------------------------------------------------------------

class _Collector:
    """Wall seconds inside Python's cyclic collector (every thread), all generations and the oldest
    alone, and the number of oldest-generation collections, while :meth:`watching`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full_seconds = 0.0
        self.full = 0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        dt = time.perf_counter() - self._t0
        self.seconds += dt
        if info.get("generation") == 2:
            self.full_seconds += dt
            self.full += 1

    def snapshot(self) -> tuple[float, float, int]:
        return self.seconds, self.full_seconds, self.full

    def since(self, snap: tuple[float, float, int]) -> dict[str, float]:
        return {"gc_s": self.seconds - snap[0], "gc_full_s": self.full_seconds - snap[1],
                "gc_full": float(self.full - snap[2])}

    def __enter__(self) -> _Collector:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        import gc

        gc.callbacks.remove(self._callback)


def _micro(cfg: OverheadConfig, source: str, policy: str, bar: Any,
           probe: Any = None) -> dict[str, Any]:
    """``probe``, if given, is called at the start of every run of the loop (tests: who observes it)."""
    import torch

    dev = cfg.device
    sync = _synchronizer(dev)
    g = torch.Generator().manual_seed(cfg.seed)
    x, w = torch.randn(8, 8, generator=g).to(dev), torch.randn(8, 8, generator=g).to(dev)
    lin = torch.nn.Linear(16, 16).to(dev)
    inp = torch.randn(4, 16, generator=g).to(dev)
    # PyTorch alone's own copies: it runs with the manager paused, and so touches nothing the manager holds
    alone_args = copy.deepcopy((x, w, lin, inp))

    def work(x: Any, w: Any, lin: Any, inp: Any) -> None:
        if probe is not None:
            probe()
        y = x
        for _ in range(25):
            y = torch.relu(torch.mm(y * 0.5 + x, w))
        lin(inp).sum().backward()
        lin.zero_grad(set_to_none=True)
        sync()

    mm = _manager(_BIG, policy, source, dev)
    per_op: list[float] = []
    ratio: list[float] = []
    plain_op: list[float] = []
    mm.attach(lin)
    try:
        with mm._paused():
            work(*alone_args)  # warm-up: the allocator
        with mm.step():
            work(x, w, lin, inp)  # unmeasured: the manager's caches, as a user's first step fills them
        for i in range(cfg.reps):
            # a pair: PyTorch alone (the manager paused on this thread) and a managed step, in
            # alternating order, so that what one leaves the other (the caches) favours neither
            for managed in (False, True) if i % 2 == 0 else (True, False):
                if managed:
                    with mm.step():
                        t0 = time.perf_counter()
                        work(x, w, lin, inp)
                        m = time.perf_counter() - t0
                else:
                    with mm._paused():
                        t0 = time.perf_counter()
                        work(*alone_args)
                        a = time.perf_counter() - t0
            ops = max(mm.steps[-1].ops, 1)
            per_op.append((m - a) / ops)
            ratio.append(m / a)
            plain_op.append(a / ops)
            bar.update(1)
    finally:
        mm.detach()
    used = _source_used(mm)
    return {"source": source, "source_used": used, "policy": policy, "ops": mm.steps[-1].ops, "reps": cfg.reps,
            "plain_us_per_op": statistics.median(plain_op) * 1e6,
            "overhead_us_per_op": statistics.median(per_op) * 1e6, "ratio": statistics.median(ratio)}


# ---- 2 and 3: the workloads ------------------------------------------------------------------------

def _one_step(wl: Any, model: Any, opt: Any, batch: Any) -> None:
    from ..workload import train_step

    train_step(wl, model, opt, batch)


def _workload(cfg: OverheadConfig, spec: str, source: str, bar: Any,
              collector: _Collector | None = None) -> list[dict[str, Any]]:
    """One workload on one event source, per manager (each policy above the peak, then lru at ``half``),
    in ``_ROUNDS`` rounds: two fresh copies of the model train ``steps + 1`` steps on the same batches,
    one under the manager, attached once for the round as a user attaches it, the other alone, step
    by step: step ``i`` of one is paired with step ``i`` of the other, PyTorch alone first in every
    other pair (and in the first pair of even rounds only), so that what one side leaves the other
    (the allocator's pools, the caches) favours neither. PyTorch alone runs with the manager paused on
    the thread (:meth:`MemoryManager._paused`), on its own copy of the batches. Step 0 is a warm-up
    and the half run's measuring step, left out."""
    import torch

    from ..workload import load_workload, make_optimizer, to_device, workload_name

    dev = cfg.device
    sync = _synchronizer(dev)
    torch.manual_seed(cfg.seed)
    wl = load_workload(spec, preset=cfg.preset, seed=cfg.seed)
    initial = copy.deepcopy(wl.model).to(dev)
    batches = [to_device(wl.make_batch(step), dev) for step in range(cfg.steps + 1)]
    alone_batches = copy.deepcopy(batches)  # the manager may hold the managed side's (an input it moved)
    variants = [*((p, "above", _BIG) for p in cfg.policies), ("lru", "half", cfg.half)]
    if "pilot" in cfg.policies:  # as shipped it defers its idle decision points: their cost measured too
        variants.append(("pilot", "every", _BIG))
    rows: dict[tuple[str, str], list[dict[str, float]]] = {(p, b): [] for p, b, _ in variants}
    plain: list[float] = []
    used: dict[str, str] = {}
    clock = collector if collector is not None else _Collector()

    def round_(policy: str, where: str, budget: Any, alone_first: bool) -> list[dict[str, float]]:
        a_model, m_model = copy.deepcopy(initial), copy.deepcopy(initial)
        a_opt, m_opt = make_optimizer(wl, a_model.parameters()), make_optimizer(wl, m_model.parameters())
        mm = _manager(budget, _counting(policy), source, dev)
        pol = mm.policy
        if where == "every":
            pol.defer_idle = False

        def alone(batch: Any) -> dict[str, float]:
            with mm._paused():
                g0 = clock.snapshot()
                c0, t0 = time.process_time(), time.perf_counter()
                _one_step(wl, a_model, a_opt, batch)
                sync()
                dt, dt_cpu = time.perf_counter() - t0, time.process_time() - c0
                gc = clock.since(g0)
            return {"plain_s": dt, "plain_cpu_s": dt_cpu, "plain_gc_s": gc["gc_s"], "plain_gc_full": gc["gc_full"]}

        def managed(batch: Any) -> dict[str, float]:
            before_dp, before_pf, before = pol.decision_points, pol.prefetches, _pilot_counters(pol)
            before_rt = _runtime_decision_points(mm)
            g0 = clock.snapshot()
            c0, t0 = time.process_time(), time.perf_counter()  # the step's start and end are the user's too
            with mm.step():
                _one_step(wl, m_model, m_opt, batch)
            sync()  # the step's end waits for its copies; this waits for its compute stream too
            dt = time.perf_counter() - t0
            dt_cpu = time.process_time() - c0
            collected = clock.since(g0)
            bar.update(1)
            s = mm.steps[-1]
            after = _pilot_counters(pol)
            return {
                "managed_s": dt, "managed_cpu_s": dt_cpu, "ops": s.ops, "stall_s": s.stall_seconds,
                "copy_s": s.copy_seconds, "policy_s": s.policy_seconds, "evictions": s.evictions,
                "idle": float(s.idle),  # the policy sat the step out (Policy.idle_step)
                "decision_points": pol.decision_points - before_dp,
                # storages moved: evictions, demand fetches, prefetches asked for (an upper bound)
                "moves": s.evictions + s.prefetch_misses + pol.prefetches - before_pf,
                # the runtime's own count where it reports one (the native event path's Python entries)
                "runtime_decision_points": _runtime_decision_points(mm) - before_rt,
                **{f"pilot_{k}": after[k] - before[k] for k in after},
                **collected,
            }

        out: list[dict[str, float]] = []
        mm.attach(m_model, m_opt)
        try:
            for step, (batch, own) in enumerate(zip(batches, alone_batches)):
                if (step % 2 == 0) == alone_first:
                    a = alone(own)
                    m = managed(batch)
                else:
                    m = managed(batch)
                    a = alone(own)
                out.append({**a, **m})
        finally:
            mm.detach()
        used[where] = _source_used(mm)
        return out

    for policy, where, budget in variants:
        for r in range(_ROUNDS):
            pairs = round_(policy, where, budget, r % 2 == 0)
            plain.extend(p["plain_s"] for p in pairs[1:])
            rows[(policy, where)].extend(pairs[1:])
    out = []
    name = workload_name(spec)
    for (policy, where), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        ratio = statistics.median(r["managed_s"] / r["plain_s"] for r in rs)
        # the process's CPU time (every thread of it): what the manager costs the host, less exposed than the wall
        # clock to other processes sharing the cores
        cpu_ratio = statistics.median(r["managed_cpu_s"] / max(r["plain_cpu_s"], 1e-9) for r in rs)
        rec = {"workload": name, "spec": spec, "source": source, "source_used": used[where], "policy": policy,
               "budget": {"above": "above peak", "every": EVERY_POINT}.get(where, cfg.half), "steps": len(rs), "ratio": ratio,
               "cpu_ratio": cpu_ratio,
               "plain_s": statistics.median(plain), **med,
               # means, not medians: a full collection lands in one step of several
               **{k: statistics.fmean(r[k] for r in rs) for k in ("gc_s", "gc_full_s", "gc_full", "plain_gc_s",
                                                                    "plain_gc_full", "idle")}}
        # on the CPU copies are synchronous: stall_seconds includes them (copy_seconds is that part)
        # what the manager adds to a step: the median of the pairs' differences (steps seconds apart)
        rec["extra_s"] = statistics.median(r["managed_s"] - r["plain_s"] for r in rs)
        rec["other_s"] = rec["extra_s"] - med["stall_s"] - med["policy_s"]
        rec["overhead_us_per_op"] = rec["extra_s"] / max(med["ops"], 1) * 1e6
        base = rows.get(("lru", "above"))
        if where == "half" and base:  # paired by step (the same batch): what the decision points added
            rec["extra_over_above_s"] = statistics.median(h["managed_s"] - a["managed_s"] - h["stall_s"]
                                                          for h, a in zip(rs, base))
        if med["pilot_decisions"]:
            d = med["pilot_decisions"]
            rec["pilot"] = {"decisions_per_step": d, "inference_us_per_decision": med["pilot_inference_s"] / d * 1e6,
                            "policy_us_per_decision": med["policy_s"] / d * 1e6,
                            "share_of_step": med["policy_s"] / med["managed_s"],
                            "inference_share_of_step": med["pilot_inference_s"] / med["managed_s"]}
        out.append(rec)
    return out


@dataclass
class OverheadReport:
    config: OverheadConfig
    micro: list[dict[str, Any]]
    workloads: list[dict[str, Any]]
    calibration: dict[str, Any]
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        from .harness import strict_json as _strict

        return _strict({"kind": "dynn-bench-overhead", "config": dataclasses.asdict(self.config), **self.meta,
                        "micro": self.micro, "workloads": self.workloads, "calibration": self.calibration})


def run_overhead(cfg: OverheadConfig, progress: bool = True) -> OverheadReport:
    """Run the three measurements of ``cfg`` (see the module docstring); nothing is written."""
    import torch
    from tqdm import tqdm

    from .. import __version__

    cfg = cfg.resolved()
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    total = len(cfg.sources) * (len(cfg.policies) * cfg.reps
                                 + len(cfg.workloads) * (len(cfg.policies) + 1) * (cfg.steps + 1) * _ROUNDS)
    bar = tqdm(total=total, desc="bench --overhead", unit="rep", disable=not progress, leave=False,
               dynamic_ncols=True)
    micro: list[dict[str, Any]] = []
    workloads: list[dict[str, Any]] = []
    failed: list[dict[str, str]] = []
    try:
        with _Collector() as collector:
            for source in cfg.sources:
                for policy in cfg.policies:
                    bar.set_postfix_str(f"{source} ops {policy}")
                    micro.append(_micro(cfg, source, policy, bar))
                for spec in cfg.workloads:
                    bar.set_postfix_str(f"{source} {spec}")
                    try:
                        workloads += _workload(cfg, spec, source, bar, collector)
                    except Exception as exc:  # noqa: BLE001 - recorded and reported; the other workloads still calibrate
                        logger.warning("bench: --overhead: %s on %s failed: %s", spec, source, exc)
                        failed.append({"workload": spec, "source": source, "error": f"{type(exc).__name__}: {exc}"[:500]})
    finally:
        bar.close()
        torch.set_num_threads(threads)
    now = time.localtime()
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S", now), "dynn_runtime": __version__,
            "machine": _machine(cfg.device), "threads": cfg.threads, "wall_s": time.perf_counter() - t_start,
            "failed": failed}
    report = OverheadReport(config=cfg, micro=micro, workloads=workloads, calibration={}, meta=meta)
    report.calibration = calibration_from(report)
    return report


# ---- outputs ---------------------------------------------------------------------------------------

def _x(v: float | None) -> str:
    return "" if v is None or not math.isfinite(v) else f"{v:.2f}x"


def _pair(r: dict[str, Any]) -> str:
    """A workload record's wall-clock and CPU-time ratios, ``1.05x / 1.02x``."""
    return f"{_x(r['ratio'])} / {_x(r['cpu_ratio'])}" if "cpu_ratio" in r else _x(r["ratio"])


def render_overhead_markdown(report: OverheadReport) -> str:
    cfg, m = report.config, report.meta["machine"]
    on = f"{m['gpu']} (CUDA {m.get('cuda')}), host " if cfg.device == "cuda" else ""
    lines = [f"# dynn bench --overhead ({report.meta['date']}): {on}{m['host_cpu']}, {m['cores']} cores, torch "
             f"{m['torch']}, {cfg.threads} thread(s), preset {cfg.preset}, manager on {cfg.device}", "",
             "## Operators: host us per ATen operator over PyTorch alone (budget far above the peak)", "",
             "| source | policy | ops/rep | PyTorch us/op | manager +us/op | ratio |", "|---|---|---:|---:|---:|---:|"]
    for r in report.micro:
        src = r["source"] if r["source_used"] == r["source"] else f"{r['source']} (ran {r['source_used']})"
        lines.append(f"| {src} | {r['policy']} | {r['ops']} | {r['plain_us_per_op']:.1f} | "
                     f"{r['overhead_us_per_op']:.1f} | {_x(r['ratio'])} |")
    by = {(r["source"], r["workload"], r["policy"], r["budget"]): r for r in report.workloads}
    names = list(dict.fromkeys(r["workload"] for r in report.workloads))
    for source in cfg.sources:
        lines += ["", f"## Workloads ({source}): step time managed / PyTorch alone, budget above the peak", "",
                  "Each cell: wall-clock ratio / process CPU-time ratio (the second is less exposed to other "
                  "processes on the machine).", "",
                  "| workload | ops/step | PyTorch ms | " + " | ".join(cfg.policies) + " | lru +us/op |",
                  "|---|---:|---:|" + "---:|" * (len(cfg.policies) + 1)]
        for w in names:
            first = by.get((source, w, cfg.policies[0], "above peak"))
            if first is None:
                continue
            lru = by.get((source, w, "lru", "above peak"))
            cells = [_pair(by[(source, w, p, "above peak")]) if (source, w, p, "above peak") in by else ""
                     for p in cfg.policies]
            tail = f" | {lru['overhead_us_per_op']:.1f} |" if lru else " | |"
            lines.append(f"| {w} | {first['ops']:.0f} | {first['plain_s'] * 1e3:.1f} | " + " | ".join(cells) + tail)
        lines += ["", f"## Workloads ({source}): lru at {cfg.half:g} of the peak, where the time goes (ms per step)",
                  ("On the CPU copies are synchronous: `stall` includes them (`copy` is that part)." if cfg.device == "cpu"
                   else "On the GPU copies run on side streams: `stall` is the compute stream's timed waits, `copy` "
                        "the host's time issuing them."), "",
                  "| workload | ratio | PyTorch | managed | stall | copy | policy | event path, rest | "
                  "decision points | moves |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for w in names:
            r = by.get((source, w, "lru", cfg.half))
            if r is None:
                continue
            lines.append(f"| {w} | {_pair(r)} | {r['plain_s'] * 1e3:.1f} | {r['managed_s'] * 1e3:.1f} | "
                         f"{r['stall_s'] * 1e3:.1f} | {r['copy_s'] * 1e3:.1f} | {r['policy_s'] * 1e3:.1f} | "
                         f"{r['other_s'] * 1e3:.1f} | {r['decision_points']:.0f} | {r['moves']:.0f} |")
        gc_rows = [(w, [by.get((source, w, p, "above peak")) for p in cfg.policies]) for w in names]
        gc_rows = [(w, rs) for w, rs in gc_rows if any(r is not None and "gc_s" in r for r in rs)]
        if gc_rows:
            lines += ["", f"## Python's cyclic collector ({source}, budget above the peak): ms per step", "",
                      "Each cell: the collector's wall ms per step (mean) / full collections per step; PyTorch "
                      "alone's beside the first policy's run.", "",
                      "| workload | PyTorch alone | " + " | ".join(cfg.policies) + " |",
                      "|---|---:|" + "---:|" * len(cfg.policies)]
            for w, rs in gc_rows:
                first = next(r for r in rs if r is not None)
                cells = ["" if r is None or "gc_s" not in r else f"{r['gc_s'] * 1e3:.1f} / {r['gc_full']:.2f}"
                         for r in rs]
                lines.append(f"| {w} | {first['plain_gc_s'] * 1e3:.1f} / {first['plain_gc_full']:.2f} | "
                             + " | ".join(cells) + " |")
        pil = [by[(source, w, "pilot", EVERY_POINT)] for w in names if (source, w, "pilot", EVERY_POINT) in by]
        pil = [r for r in pil if "pilot" in r]
        if pil:
            lines += ["", f"## The pilot ({source}, budget above the peak): per decision point and share of the step",
                      "", "Every decision point run (`defer_idle=False`); as shipped the pilot sits out the steps "
                      "in which nothing would read them (`Policy.idle_step`: told no operator) and defers the "
                      "decision points of a step it is told before its first victim search (the last three "
                      "columns).", "",
                      "| workload | decision points/step | inference us/decision | policy_seconds us/decision | "
                      "policy share of step | inference share | ratio | as shipped: steps sat out | "
                      "as shipped: run/deferred per step | as shipped: ratio |",
                      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            for r in pil:
                p = r["pilot"]
                shipped = by.get((source, r["workload"], "pilot", "above peak"))
                tail = (f"{shipped.get('idle', 0.0) * 100:.0f}% | "
                        f"{shipped['pilot_decisions']:.0f}/{shipped['pilot_deferred_idle']:.0f} | {_pair(shipped)} |"
                        if shipped else " | | |")
                lines.append(f"| {r['workload']} | {p['decisions_per_step']:.0f} | "
                             f"{p['inference_us_per_decision']:.1f} | {p['policy_us_per_decision']:.1f} | "
                             f"{p['share_of_step'] * 100:.1f}% | {p['inference_share_of_step'] * 100:.1f}% | "
                             f"{_pair(r)} | " + tail)
    for f in report.meta.get("failed", []):
        lines += ["", f"**{f['workload']} ({f['source']}) failed**, left out of the tables and the calibration: "
                      f"{f['error']}"]
    if report.calibration:
        where = "sources" if cfg.device == "cpu" else f"devices.{cfg.device}"
        lines += ["", f"## Calibration of the simulator's host cost (dynn_runtime/sim/host_cost.json, {where})", "",
                  "| source | per operator us | per decision point us | per move us | "
                  "pilot host_cost (us/decision, us/row, us/op) |", "|---|---:|---:|---:|---|"]
        for source, c in report.calibration.items():
            hc = c.get("policy_options", {}).get("pilot", {}).get("host_cost")
            if hc:
                hc = [hc[0], hc[1], c.get("policy_per_op_s", {}).get("pilot", 0.0)]
            lines.append(f"| {source} | {c['per_op_s'] * 1e6:.1f} | {c['per_decision_s'] * 1e6:.1f} | "
                         f"{c['per_move_s'] * 1e6:.1f} | "
                         + (", ".join(f"{v * 1e6:.2f}" for v in hc) if hc else "") + " |")
    return "\n".join(lines) + "\n"


def write_overhead(report: OverheadReport, path: str | Path | None = None) -> dict[str, Path]:
    p = Path(path if path is not None else report.config.json_path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n")
    md = p.with_suffix(".md")
    md.write_text(render_overhead_markdown(report))
    return {"json": p, "markdown": md}

