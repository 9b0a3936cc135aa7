"""The benchmark harness: record (cached), simulate every policy under every budget, scan model size.

Two experiments, one report:

* **Budget grid.** For each family, one trace of ``steps`` iterations at ``preset``; for each policy
  and each budget fraction (of the last iteration's unmanaged peak, i.e. the peak under ``none``),
  the simulated iteration time of the last iteration. ``overhead`` is that time over the
  unlimited-memory time (``none`` at budget 1.0 on the same trace).
* **Max trainable size.** For each family, the size knob of ``max_size_preset``'s config
  (``batch``, ``residues_max``, ...) is multiplied by 1, 2, 4, ... up to ``max_scale``, one trace per
  scale. The device capacity is fixed at the unmanaged peak of scale 1. A policy passes a scale when
  the simulated iteration is feasible within that capacity and at most ``overhead_limit`` times the
  unlimited-memory time *of that scale*. Each policy's scan stops at its first failing scale: we
  assume that what does not fit at scale s does not fit at 2s either (memory grows with the knob),
  which also keeps the number of recorded traces down. ``ratio_vs_none`` is a policy's largest
  passing scale over ``none``'s (which is 1 by construction, unless memory does not grow with the
  knob).

Every policy that runs in the live manager is charged the manager's own host cost (the simulator's
host cost, :mod:`dynn_runtime.sim.hostcost`): by default the shipped calibration, ``host_cost="none"``
for none, or seconds per operator (and per decision point). ``none`` (PyTorch alone, the reference
of every overhead) and the policies that stand for other mechanisms are never charged.

Traces are cached under ``cache_dir`` by family, preset, seed, steps and a short hash of the config
overrides; a cached file that does not read back (:class:`~dynn_runtime.errors.TraceError`) is
recorded again, with a warning logged.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._log import logger
from ..budget import Budget
from ..errors import BudgetError, ConfigError, PolicyError
from ..results import strict_json
from ..trace.cache import TraceCache  # re-exported: it moved to trace/
from ..trace.format import read_trace
from .quality import window_recall

__all__ = [
    "BenchConfig",
    "BenchReport",
    "TraceCache",
    "run_bench",
    "scaled_overrides",
    "scan_knob",
    "strict_json",
    "DEFAULT_BUDGETS",
    "QUICK_BUDGETS",
]

DEFAULT_BUDGETS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125, 0.0625)
QUICK_BUDGETS: tuple[float, ...] = (1.0, 0.5, 0.25, 0.125)


@dataclass(kw_only=True)
class BenchConfig:
    """What one ``dynn bench`` run measures. ``None`` fields take the default of the mode (quick or full);
    :meth:`resolved` fills them in, and that resolved config is what the results file stores."""

    families: list[str] = field(default_factory=list)
    """Zoo families, ``path/to/file.py:function`` workloads or recorded trace files (``*.jsonl.gz``,
    simulated as recorded) to run; the last two have no size or depth knob and are left out of the
    max-size scan and of a deeper grid. Empty means all of ``models.FAMILIES``."""
    policies: list[str] = field(default_factory=list)
    """Policies to simulate; empty means every policy registered in ``POLICIES`` at run time that the
    simulator can serve (one that needs e.g. trained pilot weights that are missing is skipped, logged)."""
    budgets: list[float] | None = None
    """Budget fractions of the unmanaged peak, each in (0, 1]; default 1, 1/2, 1/4, 1/8, 1/16
    (quick: down to 1/8)."""
    preset: str | None = None
    """Zoo preset of the budget grid; default ``small`` (quick: ``tiny``)."""
    seed: int = 0
    """Seed of weights and data for every recorded trace."""
    steps: int = 2
    """Iterations recorded per trace (at least 2, so ``replay`` has a previous iteration); the last one
    is simulated."""
    device_profile: str = "h100"
    """Device profile the traces are projected onto (``sim.PROFILES``)."""
    quick: bool = False
    """The quick mode: tiny preset, budgets down to 1/8, max-size scales up to 8 (minutes on a laptop)."""
    max_scale: int | None = None
    """Largest size-knob multiplier of the max-size scan (powers of two from 1); default 64 (quick: 8);
    0 skips the scan."""
    max_size_preset: str = "tiny"
    grid_depth: int = 1
    """Multiplier of each family's depth knob (layers, blocks) for the budget grid's traces: on deeper
    models a small budget fraction stays above the largest single operator. Families without a depth
    knob (the Tree-LSTM) are left out of a grid with ``grid_depth > 1``."""
    max_size_knob: str = "size"
    """What the max-size scan multiplies: ``size``, the family's memory knob (batch, residues: larger
    activations), or ``depth``, its depth knob (layers, blocks: a larger model, the paper's "larger
    DyNN"); families without a depth knob are left out of a depth scan."""
    """Preset whose size knob the max-size scan multiplies. Tiny by default: the ratio between policies
    is what the scan measures, and recording scaled-up small presets on a CPU takes long."""
    overhead_limit: float = 1.5
    """A scale counts as trainable when the iteration is at most this many times the unlimited-memory time."""
    out_dir: str = "out/bench"
    """Directory of the plots, and of the JSON and markdown files unless ``json_path`` is given."""
    json_path: str | None = None
    """Results file; default ``<out_dir>/bench-<profile>-<preset>-<YYYYmmdd-HHMMSS>.json``."""
    cache_dir: str = ".dynn-cache/traces"
    """Where recorded traces are cached (relative to the current directory)."""
    host_cost: str = "calibrated"
    """The live manager's host cost charged (the simulator's host cost): ``calibrated`` (the shipped calibration),
    ``none``, or seconds per operator with optional seconds per decision point (``"40e-6,25e-6"``)."""
    host_source: str = "auto"
    """Which event source's calibration: ``python``, ``native``, or ``auto`` (native where measured)."""
    window_recall: bool = True
    """Score the window recall of the pilot, replay and lru predictors on each grid trace (reported
    beside the prefetch hits, misses, stalls and bytes moved; :mod:`.quality`)."""

    def resolved(self) -> BenchConfig:
        """A copy with every default filled in (families, policies, budgets, preset, max_scale), validated."""
        from .. import models

        cfg = dataclasses.replace(
            self,
            families=list(self.families) or list(models.FAMILIES),
            policies=list(self.policies) or available_policies()[0],
            budgets=[float(b) for b in (self.budgets if self.budgets is not None
                                        else (QUICK_BUDGETS if self.quick else DEFAULT_BUDGETS))],
            preset=self.preset or ("tiny" if self.quick else "small"),
            max_scale=self.max_scale if self.max_scale is not None else (8 if self.quick else 64),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise a ConfigError (``bench: ...``) naming what is wrong and the valid choices."""
        from .. import models
        from ..policies import POLICIES
        from ..sim import PROFILES

        bad = [f for f in self.families if f not in models.FAMILIES and ".py:" not in f and not is_trace_file(f)]
        if bad:
            raise ConfigError(f"bench: unknown famil{'y' if len(bad) == 1 else 'ies'} {', '.join(map(repr, bad))}; "
                              f"choices: {', '.join(models.FAMILIES)}, a workload of your own as "
                              "path/to/file.py:function, or a recorded trace file (.jsonl.gz).")
        missing = [f for f in self.families if is_trace_file(f) and not Path(f).is_file()]
        if missing:
            raise ConfigError(f"bench: trace file {', '.join(map(repr, missing))} does not exist; record one with "
                              "`dynn trace WORKLOAD -o FILE.jsonl.gz`.")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ConfigError(f"bench: unknown polic{'y' if len(bad) == 1 else 'ies'} {', '.join(map(repr, bad))}; "
                              f"registered: {', '.join(POLICIES)}.")
        for p in self.policies:
            try:
                from ..policies import make_policy
                from ..sim.engine import SIM_PROVIDES

                make_policy(p, provides=SIM_PROVIDES)
            except PolicyError as exc:
                raise ConfigError(f"bench: policy {p!r} cannot run in the simulator ({exc}). "
                                  "Leave it out of --policies.") from None
        if self.device_profile.lower() not in PROFILES:
            raise ConfigError(f"bench: unknown device profile {self.device_profile!r}; "
                              f"choices: {', '.join(PROFILES)}.")
        for b in self.budgets or ():
            if isinstance(b, str):
                raise ConfigError(f"bench: BenchConfig.budgets holds fractions as numbers, got {b!r}; "
                                  "e.g. budgets=[1, 0.5, 0.25].")
            try:
                Budget.parse_fraction(b, "bench")
            except BudgetError as exc:  # a configuration error here: the grid is checked before it runs
                raise ConfigError(str(exc)) from None
        if self.budgets is not None and not self.budgets:
            raise ConfigError("bench: expected at least one budget fraction, got none; e.g. --budgets 1,0.5.")
        for name in ("preset", "max_size_preset"):
            value = getattr(self, name)
            if value is not None and value not in models.PRESETS:
                raise ConfigError(f"bench: unknown {name.replace('_', ' ')} {value!r}; "
                                  f"choices: {', '.join(models.PRESETS)}.")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise ConfigError(f"bench: steps must be an integer >= 2 (replay plans from the previous "
                              f"iteration), got {self.steps!r}.")
        if self.max_scale is not None and (not isinstance(self.max_scale, int) or self.max_scale < 0):
            raise ConfigError(f"bench: max_scale must be an integer >= 0 (0 skips the max-size scan), "
                              f"got {self.max_scale!r}.")
        if not isinstance(self.grid_depth, int) or self.grid_depth < 1:
            raise ConfigError(f"bench: grid_depth must be an integer >= 1, got {self.grid_depth!r}.")
        if self.max_size_knob not in ("size", "depth"):
            raise ConfigError(f"bench: max_size_knob is 'size' (batch, residues) or 'depth' (layers, blocks), "
                              f"got {self.max_size_knob!r}.")
        from ..sim.hostcost import host_cost_for, parse_host_cost

        spec = parse_host_cost(str(self.host_cost))
        if self.host_source not in ("auto", "python", "native"):
            raise ConfigError(f"bench: host_source is auto, python or native, got {self.host_source!r}.")
        if spec == "calibrated":
            host_cost_for("lru", self.host_source)  # the calibration reads and has the source
        if not self.overhead_limit >= 1:
            raise ConfigError(f"bench: overhead_limit must be >= 1 (a time ratio), got {self.overhead_limit!r}.")

    def scales(self) -> list[int]:
        """The max-size scan's multipliers: 1, 2, 4, ... up to ``max_scale``."""
        top = self.max_scale if self.max_scale is not None else (8 if self.quick else 64)
        out, s = [], 1
        while s <= top:
            out.append(s)
            s *= 2
        return out


def available_policies() -> tuple[list[str], dict[str, str]]:
    """Registered policies the simulator can run, and the others with the reason they cannot."""
    from ..policies import POLICIES, make_policy
    from ..sim.engine import SIM_PROVIDES

    ok: list[str] = []
    skipped: dict[str, str] = {}
    for name in POLICIES:
        try:
            make_policy(name, provides=SIM_PROVIDES)
        except PolicyError as exc:
            skipped[name] = str(exc)
        else:
            ok.append(name)
    return ok, skipped


def is_trace_file(family: str) -> bool:
    """``family`` names a recorded trace file (``.jsonl.gz`` or ``.jsonl``: simulated as recorded; no
    size or depth knob) rather than a zoo family or a ``file.py:function`` workload."""
    return family.endswith((".jsonl.gz", ".jsonl"))


def scan_knob(family: str, which: str = "size") -> str | None:
    """The config field a max-size scan multiplies: the family's ``size`` or ``depth`` knob (None if it has
    none, as a ``file.py:function`` workload has none)."""
    from .. import models

    if family not in models.FAMILIES:
        return None
    fam = models.family(family)
    return fam.size_knob if which == "size" else fam.depth_knob


def scaled_overrides(family: str, preset: str, scale: int, which: str = "size") -> dict[str, int]:
    """Config overrides that multiply ``family``'s size (or depth) knob by ``scale`` (``{}`` at scale 1).

    A knob named ``X_max`` whose config also has ``X_min`` (evoformer's ``residues_max``) scales
    ``X_min`` too, so the sampled range moves up as a whole and ``X_min <= X_max`` holds.
    """
    from .. import models

    if scale == 1:
        return {}
    fam = models.family(family)
    base = fam.config(preset)
    knob = scan_knob(family, which)
    if knob is None:
        raise ConfigError(f"bench: {family} has no {which} knob to scale; choices: size"
                          f"{', depth' if fam.depth_knob else ''}.")
    out = {knob: getattr(base, knob) * scale}
    if knob.endswith("_max"):
        low = knob[: -len("_max")] + "_min"
        if hasattr(base, low):
            out[low] = getattr(base, low) * scale
    return out


@dataclass
class BenchReport:
    """What :func:`run_bench` found: the resolved config, the budget grid, the max-size scan, metadata."""

    config: BenchConfig
    """The resolved config that produced this report."""
    results: list[dict[str, Any]]
    """One record per (family, policy, budget fraction)."""
    max_size: list[dict[str, Any]]
    """One record per (family, policy): the largest trainable scale and its ratio to ``none``'s."""
    meta: dict[str, Any]
    """torch and dynn-runtime versions, date, device profile, wall time, cache counts, skipped policies."""

    def to_json(self) -> dict[str, Any]:
        """The results file's content: strict JSON (infinities and NaN become null)."""
        return strict_json({
            "kind": "dynn-bench",
            "config": dataclasses.asdict(self.config),
            **self.meta,
            "results": self.results,
            "max_size": self.max_size,
        })


class _Charges:
    """Per policy, the host cost (the simulator's host cost) and policy options a simulation of ``cfg`` charges."""

    def __init__(self, cfg: BenchConfig) -> None:
        from ..sim.hostcost import load_calibration, parse_host_cost

        self.spec = parse_host_cost(str(cfg.host_cost))
        self.source = cfg.host_source
        self.data = load_calibration() if self.spec is not None else None

    def __call__(self, policy: str) -> dict[str, Any]:
        from ..sim.hostcost import HostCost, host_cost_for, policy_options_for

        if self.spec is None or self.data is None or policy in self.data.get("uncharged", {}):
            return {}
        if isinstance(self.spec, HostCost):
            return {"host_cost": self.spec}
        return {"host_cost": host_cost_for(policy, self.source, self.data),
                "policy_options": policy_options_for(policy, self.source, self.data) or None}

    def describe(self, policies: list[str]) -> dict[str, Any]:
        """What the results file says about the charge."""
        per = {}
        for p in policies:
            c = self(p)
            per[p] = ({**c["host_cost"].as_dict(), **{k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in (c.get("policy_options") or {}).items()}}
                      if c else None)
        mode = "none" if self.spec is None else ("calibrated" if self.spec == "calibrated" else "model")
        out: dict[str, Any] = {"mode": mode, "policies": per}
        if mode == "calibrated" and self.data is not None:
            from ..sim.hostcost import calibration_table

            used = {(c["source"], c["device"]) for c in per.values() if c}
            out["measured"] = {src: calibration_table(self.data, dev)[src].get("measured") for src, dev in used}
        return out


def _sim_record(family: str, preset: str, policy: str, fraction: float, res: Any, ref_s: float,
                trace_path: Path) -> dict[str, Any]:
    ok = res.feasible
    return {
        "family": family, "preset": preset, "policy": policy, "budget_fraction": fraction,
        "budget_bytes": res.budget_bytes, "unmanaged_peak_bytes": res.unmanaged_peak_bytes,
        "feasible": ok, "reason": res.reason,
        "iter_time_s": res.iter_time_s if ok else None,
        "overhead": res.iter_time_s / ref_s if ok else None,
        "unlimited_iter_time_s": ref_s,
        "compute_time_s": res.compute_time_s, "stall_time_s": res.stall_time_s,
        "recompute_time_s": res.recompute_time_s, "bytes_offloaded": res.bytes_offloaded,
        "bytes_fetched": res.bytes_fetched, "peak_bytes": res.peak_bytes, "managed": res.managed,
        "evictions": res.evictions, "recomputed_ops": res.recomputed_ops, "prefetch_hits": res.prefetch_hits,
        "prefetch_misses": res.prefetch_misses, "ops": res.ops, "trace": trace_path.name,
        "decision_points": res.decision_points, "moves": res.moves, "host_cost_s": res.host_cost_s,
        "host_wait_s": res.host_wait_s,
        "policy_host_s": res.policy_host_s, "host_cost_source": res.host_cost_source,
    }


def run_bench(cfg: BenchConfig, progress: bool = True) -> BenchReport:
    """Run the budget grid and the max-size scan of ``cfg``; nothing is written but the trace cache."""
    import torch
    from tqdm import tqdm

    from .. import __version__
    from ..sim import get_profile, simulate

    t_start = time.perf_counter()
    _, skipped = available_policies()
    explicit_policies = bool(cfg.policies)
    cfg = cfg.resolved()
    if explicit_policies:
        skipped = {}
    for name, why in skipped.items():
        logger.warning("bench: skipping policy %s: %s", name, why)
    profile = get_profile(cfg.device_profile)
    charge = _Charges(cfg)
    cache = TraceCache(cfg.cache_dir)
    scales = cfg.scales()
    n_grid = len(cfg.families) * len(cfg.policies) * len(cfg.budgets)
    n_scan = len(cfg.families) * len(cfg.policies) * len(scales)
    bar = tqdm(total=n_grid + n_scan, desc="bench", unit="sim", disable=not progress, leave=False,
               dynamic_ncols=True)

    def trace_for(family: str, preset: str, overrides: dict) -> Any:
        bar.set_postfix_str(f"trace {family} {preset} {overrides or ''}".strip())
        if is_trace_file(family):  # recorded already: simulated as it is (its own preset, seed and steps)
            return read_trace(family), Path(family)
        trace = cache.get(family, preset, cfg.seed, cfg.steps, overrides)
        return trace, cache.path(family, preset, cfg.seed, cfg.steps, overrides)

    results: list[dict[str, Any]] = []
    recall: dict[str, dict[str, float | None]] = {}
    try:
        for family in cfg.families:
            if cfg.grid_depth > 1 and scan_knob(family, "depth") is None:
                logger.warning("bench: %s has no depth knob; left out of the grid at depth x%d", family, cfg.grid_depth)
                bar.update(len(cfg.policies) * len(cfg.budgets))
                continue
            trace, tpath = trace_for(family, cfg.preset, scaled_overrides(family, cfg.preset, cfg.grid_depth, "depth"))
            ref = simulate(trace, "none", 1.0, profile)
            if cfg.window_recall:
                bar.set_postfix_str(f"{family} window recall")
                recall[family] = window_recall(trace)
            for policy in cfg.policies:
                for frac in cfg.budgets:
                    bar.set_postfix_str(f"{family} {policy} @{_frac_label(frac)}")
                    res = simulate(trace, policy, float(frac), profile, **charge(policy))
                    results.append(_sim_record(family, cfg.preset, policy, frac, res, ref.iter_time_s, tpath))
                    bar.update(1)
        max_size = [rec for family in cfg.families
                    for rec in _scan_family(cfg, family, scales, trace_for, bar, charge)]
    finally:
        bar.close()

    now = time.localtime()
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S", now),
        "stamp": time.strftime("%Y%m%d-%H%M%S", now),
        "torch": torch.__version__,
        "dynn_runtime": __version__,
        "profile": dataclasses.asdict(profile),
        "skipped_policies": skipped,
        "traces_recorded": cache.recorded,
        "traces_reused": cache.reused,
        "wall_s": time.perf_counter() - t_start,
        "simulated_iteration": -1,
        "host_cost": charge.describe(cfg.policies),
        "window_recall": recall,
    }
    return BenchReport(config=cfg, results=results, max_size=max_size, meta=meta)


def _scan_family(cfg: BenchConfig, family: str, scales: list[int], trace_for: Any, bar: Any,
                 charge: Any = None) -> list[dict]:
    """The max-size scan of one family (see the module docstring for the rules)."""
    from .. import models
    from ..sim import simulate, unmanaged_peak

    if not scales:
        return []
    preset = cfg.max_size_preset
    which = cfg.max_size_knob
    knob = scan_knob(family, which)
    if knob is None:
        logger.warning("bench: %s has no %s knob; left out of the max-size scan", family, which)
        return []
    base_value = getattr(models.family(family).config(preset), knob)
    alive = list(cfg.policies)
    best: dict[str, dict[str, Any]] = {p: {"scale": 0, "iter_time_s": None, "overhead": None} for p in alive}
    stopped: dict[str, str] = {}
    capacity = 0
    for i, scale in enumerate(scales):
        if not alive:
            break
        trace, _ = trace_for(family, preset, scaled_overrides(family, preset, scale, which))
        if i == 0:
            capacity = unmanaged_peak(trace)
        ref_s = simulate(trace, "none", 1.0, cfg.device_profile).iter_time_s
        for policy in list(alive):
            bar.set_postfix_str(f"max-size {family} x{scale} {policy}")
            res = simulate(trace, policy, int(capacity), cfg.device_profile, **(charge(policy) if charge else {}))
            overhead = res.iter_time_s / ref_s if res.feasible else math.inf
            if res.feasible and overhead <= cfg.overhead_limit:
                best[policy] = {"scale": scale, "iter_time_s": res.iter_time_s, "overhead": overhead}
                bar.update(1)
            else:
                alive.remove(policy)
                stopped[policy] = (f"x{scale}: {res.reason}" if not res.feasible else
                                   f"x{scale}: overhead {overhead:.2f}x > {cfg.overhead_limit:g}x")
                bar.update(len(scales) - i)  # the scales this policy will not try
    none_scale = best.get("none", {}).get("scale") or None
    if none_scale is None:  # `none` not among the policies: scan it alone as the reference
        none_scale = 0
        for scale in scales:
            trace, _ = trace_for(family, preset, scaled_overrides(family, preset, scale, which))
            if not simulate(trace, "none", int(capacity), cfg.device_profile).feasible:
                break
            none_scale = scale
    out = []
    for policy in cfg.policies:
        b = best[policy]
        out.append({
            "family": family, "preset": preset, "policy": policy, "knob": knob,
            "scale": b["scale"], "knob_value": base_value * b["scale"],
            "ratio_vs_none": b["scale"] / none_scale if none_scale else None,
            "none_scale": none_scale, "capacity_bytes": capacity,
            "iter_time_s": b["iter_time_s"], "overhead": b["overhead"],
            "limited_by": stopped.get(policy, f"scan cap x{scales[-1]}"),
        })
    return out


def _frac_label(f: float) -> str:
    if f == 1:
        return "1"
    inv = 1 / f
    if abs(inv - round(inv)) < 1e-9:
        return f"1/{round(inv)}"
    return f"{f:g}"
