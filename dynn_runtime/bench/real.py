"""``dynn bench --real``: the live memory manager measured, not simulated.

Per family (``preset``, ``steps`` steps, seed ``seed``):

* **Unlimited.** The steps on PyTorch alone, no cap: median step time (the first step left out)
  and the peak (``torch.cuda.max_memory_allocated`` on CUDA; on the CPU parameters, buffers and
  optimizer state plus the peak allocated during the step). The *cap* is ``fraction`` of that peak.
* **PyTorch's own tools at the cap.** ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around
  each step, and ``torch.utils.checkpoint`` (non-reentrant) around every block of the model's
  outermost ``nn.ModuleList``\\ s (the repeated blocks; a family without one is marked n/a). Each runs
  once without a cap to measure its time and peak; it *fits* when that peak is within the cap (on
  CUDA a fitting one runs again under the hard cap to confirm).
* **Each policy at the cap.** :func:`~dynn_runtime.runtime.train.train_managed` with the cap as the
  budget in bytes, on CUDA with ``hard_cap`` (``torch.cuda.set_per_process_memory_fraction``);
  infeasible when the manager or the allocator raises (reason recorded). Bit identity against the
  unlimited run is checked on the final state's digest.
* **Beyond the device.** Where PyTorch alone runs out of device memory (``large`` presets), each
  policy takes the fraction itself as its budget: the manager measures the peak in a first step run
  under the device's free memory, moving storages as needed, and keeps later steps to the fraction
  of it. There is no unlimited time or state to compare with; the report gives the measured peak.
* **Simulator prediction.** A trace of the same workload recorded on the same device, simulated
  at the same fraction on the profile matching the device (``h100``, ``h200``, ``a100``; a CPU run
  is projected on ``h100`` and is not comparable, which the report says), each policy that runs in
  the manager charged the calibrated host cost (:mod:`dynn_runtime.sim.hostcost`: a GPU's figures
  where they were measured, else the CPU's; ``predicted_host_cost`` says which).
* **Prefetch quality** (:mod:`.quality`). Per policy, live and simulated: prefetch hits, misses,
  stall seconds and bytes moved; beside them the window recall of the policy's predictor (pilot,
  replay, lru) on the same recorded trace, so that a trace metric can be read against what the
  runtime felt.
* **Max trainable size under a fixed cap.** The capacity is PyTorch alone's footprint at x1
  (``max_memory_reserved`` on CUDA: what the caching allocator had to hold; the peak on the CPU).
  The family's size knob is multiplied by 1, 2, 4, ... up to ``max_scale``; PyTorch alone passes a
  scale when its footprint is within the capacity, a policy when it trains under the capacity as
  its budget (hard cap on CUDA). Each scan stops at its first failing scale. A workload given as
  ``path/to/file.py:function`` has no size knob and is left out of the scan.

On the CPU the budget is logical (what the manager accounts), which is enough to exercise the code;
the figures that mean something come from a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._log import logger
from ..errors import ConfigError, DynnError, where_raised
from .quality import live_quality, sim_quality, window_recall

__all__ = ["RealBenchConfig", "RealBenchReport", "run_real_bench", "checkpoint_blocks", "LIVE_POLICIES"]

#: the manager's policies measured by default (PyTorch's own tools run beside them; dtr is simulator-only)
LIVE_POLICIES = ("lru", "save_on_cpu", "replay", "oracle", "pilot")


@dataclass(kw_only=True)
class RealBenchConfig:
    """What one ``dynn bench --real`` run measures; the results file stores it resolved."""

    families: list[str] = field(default_factory=list)
    """Zoo families or ``path/to/file.py:function`` workloads; empty means every zoo family."""
    policies: list[str] = field(default_factory=list)
    """Manager policies; empty means ``LIVE_POLICIES`` (one that cannot be built, e.g. pilot without
    weights, is recorded as skipped)."""
    fraction: float = 0.125
    """The cap, as a fraction of the unlimited run's peak."""
    device: str = "cuda"
    """``cuda`` (hard cap) or ``cpu`` (logical budget; exercises the code)."""
    preset: str | None = None
    """Zoo preset; default ``small``."""
    steps: int | None = None
    """Steps per run (the first is left out of the median); default 5 (quick: 3)."""
    seed: int = 0
    quick: bool = False
    """Fewer steps, max-size scales up to 4 (a GPU family in about a minute)."""
    max_scale: int | None = None
    """Largest size-knob multiple of the max-size scan; default 8 (quick: 4); 0 skips the scan."""
    hard_cap: bool = True
    """CUDA: enforce the cap with ``set_per_process_memory_fraction`` (off: logical budget only)."""
    simulate: bool = True
    """Record a trace on the device and add the simulator's prediction."""
    device_profile: str | None = None
    """Simulator profile; default from the GPU's name (h100, h200, a100), else h100."""
    out_dir: str = "out/bench"
    json_path: str | None = None
    """Results file; default ``<out_dir>/real-<device>-<preset>-<YYYYmmdd-HHMMSS>.json``."""

    def resolved(self) -> RealBenchConfig:
        from .. import models

        cfg = dataclasses.replace(
            self, families=list(self.families) or list(models.FAMILIES),
            policies=list(self.policies) or list(LIVE_POLICIES),
            preset=self.preset or "small",
            steps=self.steps if self.steps is not None else (3 if self.quick else 5),
            max_scale=self.max_scale if self.max_scale is not None else (4 if self.quick else 8),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        from .. import models
        from ..policies import POLICIES

        bad = [f for f in self.families if f not in models.FAMILIES and ".py:" not in f]
        if bad:
            raise ConfigError(f"bench: unknown family {', '.join(map(repr, bad))}; choices: {', '.join(models.FAMILIES)}, "
                              "or a workload of your own as path/to/file.py:function.")
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise ConfigError(f"bench: unknown policy {', '.join(map(repr, bad))}; registered: {', '.join(POLICIES)}.")
        if not (isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1):
            raise ConfigError(f"bench: --cap is a fraction of the unlimited peak in (0, 1], got {self.fraction!r}.")
        if self.device not in ("cuda", "cpu"):
            raise ConfigError(f"bench: --device is cuda or cpu, got {self.device!r}.")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ConfigError("bench: --real runs on CUDA by default but torch.cuda.is_available() is False; "
                                  "add --device cpu (a logical budget) or run on a GPU machine.")
        if self.preset is not None and self.preset not in models.PRESETS:
            raise ConfigError(f"bench: unknown preset {self.preset!r}; choices: {', '.join(models.PRESETS)}.")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 2):
            raise ConfigError(f"bench: --steps must be >= 2 for --real (the first step is warm-up), got {self.steps!r}.")
        if self.max_scale is not None and self.max_scale < 0:
            raise ConfigError(f"bench: --max-scale must be >= 0, got {self.max_scale!r}.")

    def scales(self) -> list[int]:
        out, s = [], 1
        while s <= (self.max_scale or 0):
            out.append(s)
            s *= 2
        return out


@dataclass
class RealBenchReport:
    config: RealBenchConfig
    results: list[dict[str, Any]]
    """One record per (family, method): method is ``unlimited``, ``save_on_cpu (torch)``,
    ``checkpoint (torch)`` or a policy name."""
    max_size: list[dict[str, Any]]
    """One record per (family, method) of the max-size scan; method ``pytorch`` is PyTorch alone."""
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        from .harness import strict_json

        return strict_json({"kind": "dynn-bench-real", "config": dataclasses.asdict(self.config), **self.meta,
                        "results": self.results, "max_size": self.max_size})


# ---- PyTorch's own tools ---------------------------------------------------------------------

def checkpoint_blocks(model: Any) -> list[str]:
    """Wrap every block of ``model``'s outermost ``nn.ModuleList`` objects in non-reentrant
    ``torch.utils.checkpoint``; returns the lists' names (empty: the model has no repeated block)."""
    from ..runtime.blocks import checkpoint_modules, repeated_blocks

    lists, blocks = repeated_blocks(model)
    checkpoint_modules(blocks)
    return lists


# ---- the run ---------------------------------------------------------------------------------

def _failures() -> tuple[type[BaseException], ...]:
    """What ends one measurement without ending the bench: the manager's and PyTorch's errors, and any
    other exception (a bug in a policy must not cost the rest of a GPU session; it is recorded with
    its type and logged)."""
    return (Exception,)


def _reason(exc: BaseException) -> str:
    import torch

    if not isinstance(exc, (DynnError, torch.OutOfMemoryError)):
        logger.warning("bench: unexpected %s (a bug; recorded as infeasible): %s", type(exc).__name__, exc)
    return f"{type(exc).__name__}: {exc}"[:300]


def _failed(exc: BaseException) -> dict[str, str]:
    """A failed measurement's row fields: ``reason`` (the error) and ``where`` (the frames it was raised
    in and the errors it was raised from or during, :func:`~dynn_runtime.errors.where_raised`), so
    that a report says which path of the manager or which operator failed."""
    return {"reason": _reason(exc), "where": where_raised(exc)[:1500]}


@contextlib.contextmanager
def _hard_cap(dev: str, nbytes: int | None) -> Any:
    """CUDA: cap the caching allocator at ``nbytes`` for the block (an empty cache first, so the cap
    applies to this run's blocks only)."""
    import torch

    if dev != "cuda" or nbytes is None:
        yield
        return
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def _fresh(dev: str) -> None:
    import gc

    import torch

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def profile_for(device: str) -> tuple[str, bool]:
    """The simulator profile matching ``device`` and whether the projection is like for like."""
    import torch

    if device == "cuda":
        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100", "v100"):
            if key in name:
                return key, True
    return "h100", False


def run_real_bench(cfg: RealBenchConfig, progress: Callable[[str], None] | None = None) -> RealBenchReport:
    """Measure every family of ``cfg`` (see the module docstring); writes nothing. ``progress(text)``
    hears what runs next."""
    import torch

    from .. import __version__, models

    t_start = time.perf_counter()
    cfg = cfg.resolved()
    results: list[dict[str, Any]] = []
    max_size: list[dict[str, Any]] = []
    skipped = _unbuildable(cfg)
    policies = [p for p in cfg.policies if p not in skipped]
    for name, why in skipped.items():
        logger.warning("bench: skipping policy %s: %s", name, why)
    from ..runtime.train import deterministic

    with deterministic():
        for family in cfg.families:
            if progress is not None:
                progress(f"{family} ({cfg.preset}) on {cfg.device}: unlimited, torch baselines, {len(policies)} policies")
            results += _family_grid(cfg, family, policies)
            if cfg.scales() and family in models.FAMILIES:
                if progress is not None:
                    progress(f"{family}: max-size scan up to x{cfg.max_scale}")
                max_size += _family_scan(cfg, family, policies)
    now = time.localtime()
    meta = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S", now), "stamp": time.strftime("%Y%m%d-%H%M%S", now),
        "torch": torch.__version__, "dynn_runtime": __version__,
        "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu",
        "skipped_policies": skipped, "wall_s": time.perf_counter() - t_start,
        "profile": profile_for(cfg.device)[0] if cfg.device_profile is None else cfg.device_profile,
        "profile_like_for_like": profile_for(cfg.device)[1] and cfg.device_profile is None,
    }
    return RealBenchReport(config=cfg, results=results, max_size=max_size, meta=meta)


def _unbuildable(cfg: RealBenchConfig) -> dict[str, str]:
    from ..errors import PolicyError
    from ..policies import make_policy

    provides = {"history", "pilot", "future"} | ({"gpu"} if cfg.device == "cuda" else set())
    out = {}
    for p in cfg.policies:
        try:
            make_policy(p, provides=provides)
        except (PolicyError, DynnError) as exc:
            out[p] = str(exc)
    return out


def _row(family: str, cfg: RealBenchConfig, method: str, **kw: Any) -> dict[str, Any]:
    return {"family": family, "preset": cfg.preset, "device": cfg.device, "method": method,
            "budget_fraction": cfg.fraction, **kw}


def _family_grid(cfg: RealBenchConfig, family: str, policies: list[str]) -> list[dict[str, Any]]:
    import torch

    from ..runtime.train import train_managed, train_unmanaged

    common = dict(steps=cfg.steps, preset=cfg.preset, seed=cfg.seed, device=cfg.device)
    _fresh(cfg.device)
    try:
        unl = train_unmanaged(family, **common)
    except torch.OutOfMemoryError as exc:
        return _beyond_the_device(cfg, family, policies, _reason(exc))
    except _failures() as exc:
        return [_row(family, cfg, "unlimited", feasible=False, **_failed(exc))]
    peak = max(unl.peak_bytes)
    cap = max(1, int(peak * cfg.fraction))
    t_unl = unl.median_step_seconds()
    rows = [_row(family, cfg, "unlimited", feasible=True, iter_time_s=t_unl, overhead=1.0, peak_bytes=peak,
                 cap_bytes=cap, reserved_bytes=max(unl.reserved_peak_bytes, default=None), reason="")]

    def baseline(method: str, **kw: Any) -> dict[str, Any]:
        _fresh(cfg.device)
        try:
            r = train_unmanaged(family, label=method, **common, **kw)
        except _failures() as exc:
            return _row(family, cfg, method, feasible=False, cap_bytes=cap, **_failed(exc))
        p = max(r.peak_bytes)
        fits, reason = p <= cap, ("" if p <= cap else f"peak {p} B > cap {cap} B")
        kw_where: dict[str, str] = {}
        if fits and cfg.device == "cuda" and cfg.hard_cap:
            try:
                with _hard_cap(cfg.device, cap):
                    train_unmanaged(family, label=method, **common, **kw)
            except torch.OutOfMemoryError as exc:
                fits, reason = False, f"OutOfMemoryError under the hard cap: {str(exc)[:200]}"
                kw_where = {"where": where_raised(exc)[:1500]}
        return _row(family, cfg, method, feasible=fits, reason=reason, **kw_where, iter_time_s=r.median_step_seconds(),
                    overhead=r.median_step_seconds() / t_unl, peak_bytes=p, cap_bytes=cap,
                    note="time and peak measured without a cap")

    pin = cfg.device == "cuda"
    rows.append(baseline("save_on_cpu (torch)",
                         step_context=lambda: torch.autograd.graph.save_on_cpu(pin_memory=pin)))
    from .. import models
    from ..workload import load_workload

    probe = load_workload(family, preset="tiny" if family in models.FAMILIES else cfg.preset, seed=cfg.seed)
    if checkpoint_blocks(probe.model):
        rows.append(baseline("checkpoint (torch)", prepare=checkpoint_blocks))
    else:
        rows.append(_row(family, cfg, "checkpoint (torch)", feasible=None, cap_bytes=cap,
                         reason="n/a: the model has no nn.ModuleList of repeated blocks"))

    for policy in policies:
        _fresh(cfg.device)
        try:
            r = train_managed(family, cap, policy, hard_cap=cfg.hard_cap and cfg.device == "cuda", **common)
        except _failures() as exc:
            rows.append(_row(family, cfg, policy, feasible=False, cap_bytes=cap, **_failed(exc)))
            continue
        st = r.stats or {}
        t = r.median_step_seconds()
        rows.append(_row(
            family, cfg, policy, feasible=True, reason="", iter_time_s=t, overhead=t / t_unl,
            peak_bytes=r.max_managed_peak(), cap_bytes=cap, bit_identical=r.digest == unl.digest,
            max_memory_allocated=st.get("max_memory_allocated"),
            **{k: st.get(k) for k in ("bytes_offloaded", "bytes_prefetched", "bytes_fetched_on_demand", "evictions",
                                      "stall_seconds", "copy_seconds", "policy_seconds", "prefetch_hits",
                                      "prefetch_misses", "budget_overshoot_bytes", "host_bytes_peak",
                                      "host_syncs", "event_source")},
            hit_rate=live_quality(st)["hit_rate"], bytes_moved=live_quality(st)["bytes_moved"]))
    if cfg.simulate:
        _add_predictions(cfg, family, rows, policies)
    return rows


def _beyond_the_device(cfg: RealBenchConfig, family: str, policies: list[str], why: str) -> list[dict[str, Any]]:
    """PyTorch alone ran out of device memory: each policy trains with the fraction itself as its
    budget. The manager measures the peak in its first step, run under the device's free memory and
    moving storages as needed, and keeps later steps to the fraction of it (hard-capped on CUDA).
    There is no unlimited run to compare times or bits with, so those cells stay empty."""
    from ..runtime.train import train_managed

    common = dict(steps=cfg.steps, preset=cfg.preset, seed=cfg.seed, device=cfg.device)
    rows = [_row(family, cfg, "unlimited", feasible=False, beyond_device=True, reason=why)]
    for policy in policies:
        _fresh(cfg.device)
        try:
            r = train_managed(family, float(cfg.fraction), policy, hard_cap=cfg.hard_cap and cfg.device == "cuda",
                              **common)
        except _failures() as exc:
            rows.append(_row(family, cfg, policy, feasible=False, **_failed(exc)))
            continue
        st = r.stats or {}
        rows.append(_row(
            family, cfg, policy, feasible=True, reason="", iter_time_s=r.median_step_seconds(),
            peak_bytes=r.max_managed_peak(), cap_bytes=st.get("budget_bytes"),
            measured_peak_bytes=st.get("measured_peak_bytes"), max_memory_allocated=st.get("max_memory_allocated"),
            **{k: st.get(k) for k in ("bytes_offloaded", "bytes_fetched_on_demand", "evictions", "stall_seconds",
                                      "budget_overshoot_bytes", "host_bytes_peak", "host_syncs", "event_source")}))
    return rows


def _add_predictions(cfg: RealBenchConfig, family: str, rows: list[dict[str, Any]], policies: list[str]) -> None:
    """The simulator's iteration time for the same run: a trace recorded on the same device."""
    from ..sim import simulate
    from ..sim.hostcost import host_cost_for, policy_options_for
    from ..trace import read_trace, record
    from ..workload import workload_name

    prof = cfg.device_profile or profile_for(cfg.device)[0]
    with tempfile.TemporaryDirectory(prefix="dynn-real-") as tmp:
        path = Path(tmp) / f"{workload_name(family)}.jsonl.gz"
        _fresh(cfg.device)
        try:
            record(family, path, steps=2, preset=cfg.preset, seed=cfg.seed, device=cfg.device)
            trace = read_trace(path)
        except _failures() as exc:
            logger.warning("bench: could not record %s for the prediction: %s", family, exc)
            return
    ref = simulate(trace, "none", 1.0, prof)
    recall = window_recall(trace)
    sim_for = {"unlimited": "none", "save_on_cpu (torch)": "save_on_cpu", "checkpoint (torch)": "checkpoint",
               **{p: p for p in policies}}
    for row in rows:
        pol = sim_for.get(row["method"])
        if pol is None or row.get("feasible", True) is None:
            continue
        try:
            hc = host_cost_for(pol)
            res = ref if row["method"] == "unlimited" else simulate(
                trace, pol, float(cfg.fraction), prof, host_cost=hc, policy_options=policy_options_for(pol) or None)
        except DynnError as exc:
            row["predicted_reason"] = str(exc)[:200]
            continue
        row.update(predicted_feasible=res.feasible, predicted_iter_time_s=res.iter_time_s if res.feasible else None,
                   predicted_overhead=res.iter_time_s / ref.iter_time_s if res.feasible else None,
                   predicted_unmanaged_peak_bytes=res.unmanaged_peak_bytes, predicted_profile=prof,
                   predicted_policy=pol,
                   predicted_host_cost=None if hc is None or row["method"] == "unlimited" else hc.as_dict())
        if pol in recall:
            row["window_recall"] = recall[pol]
        if res.feasible and row["method"] != "unlimited":
            row.update({f"predicted_{k}": v for k, v in sim_quality(res.as_dict()).items()})


def _family_scan(cfg: RealBenchConfig, family: str, policies: list[str]) -> list[dict[str, Any]]:
    from .. import models
    from ..runtime.train import train_managed, train_unmanaged
    from .harness import scaled_overrides

    knob = models.family(family).size_knob
    base_value = getattr(models.family(family).config(cfg.preset), knob)
    steps = 2
    methods = ["pytorch", *policies]
    best: dict[str, int] = {m: 0 for m in methods}
    times: dict[str, float | None] = {m: None for m in methods}
    stopped: dict[str, str] = {}
    capacity = 0
    for scale in cfg.scales():
        alive = [m for m in methods if m not in stopped]
        if not alive:
            break
        ov = scaled_overrides(family, cfg.preset, scale)
        common = dict(steps=steps, preset=cfg.preset, seed=cfg.seed, device=cfg.device, overrides=ov)
        _fresh(cfg.device)
        try:
            ref = train_unmanaged(family, **common)
        except _failures() as exc:
            for m in alive:
                stopped[m] = f"x{scale}: the unlimited run failed ({_reason(exc)})"
            break
        foot = max(ref.reserved_peak_bytes) if cfg.device == "cuda" else max(ref.peak_bytes)
        if scale == 1:
            capacity = foot
        if "pytorch" in alive:
            if foot <= capacity:
                best["pytorch"], times["pytorch"] = scale, ref.median_step_seconds()
            else:
                stopped["pytorch"] = f"x{scale}: footprint {foot} B > capacity {capacity} B"
        for policy in [m for m in alive if m != "pytorch"]:
            _fresh(cfg.device)
            try:
                r = train_managed(family, capacity, policy, hard_cap=cfg.hard_cap and cfg.device == "cuda", **common)
            except _failures() as exc:
                stopped[policy] = f"x{scale}: {_reason(exc)} [{where_raised(exc)[:600]}]"
                continue
            best[policy], times[policy] = scale, r.median_step_seconds()
    out = []
    for m in methods:
        out.append({"family": family, "preset": cfg.preset, "device": cfg.device, "method": m, "knob": knob,
                    "scale": best[m], "knob_value": base_value * best[m], "capacity_bytes": capacity,
                    "ratio_vs_pytorch": best[m] / best["pytorch"] if best["pytorch"] else None,
                    "iter_time_s": times[m], "limited_by": stopped.get(m, f"scan cap x{cfg.scales()[-1]}")})
    return out
