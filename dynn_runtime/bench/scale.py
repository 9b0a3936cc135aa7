"""``dynn bench --scale``: the largest size each policy trains on a fixed device, at GPU scale.

For each family at ``preset`` (``large`` by default), traces are recorded with
:func:`dynn_runtime.trace.fake.record_fake` (shapes without values: no GPU, little memory) and
simulated on the device profile:

* **Max trainable size.** The family's size knob (batch; evoformer's crop, ``residues_min`` and
  ``residues_max`` together) takes the preset's value times each of ``knob_scales``. The device
  capacity is fixed (the profile's memory, 80 GB for ``h100``). At each size, each policy is
  simulated with that capacity as its budget; it trains the size within ``limit`` when the
  iteration fits and takes at most ``limit`` times the iteration time of the same size on an
  unlimited-memory device (``none`` with no budget). Every size is simulated for every policy that
  has not yet failed both limits at two sizes in a row, so one size that a policy misses (a single
  operator that does not fit, a bad plan) does not end its scan; ``largest`` is the largest size
  that passes, ``ratio_vs_none`` that over ``none``'s largest.
* **Budget grid.** At the preset's own size, the iteration time of each policy at ``budgets``
  (fractions of the peak under ``none``) over the unlimited-memory time.

The results file stores the config, per (family, size) the trace's peak and unlimited time, per
(family, size, policy) the simulation, and per (family, policy) the largest sizes; a PNG per family
plots size against iteration time over unlimited, a line per policy.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._log import logger
from ..errors import ConfigError
from ..results import strict_json

__all__ = ["ScaleConfig", "ScaleReport", "run_scale", "SCALE_POLICIES", "render_scale_markdown",
           "write_scale_outputs", "plot_scale"]

#: the policies the issue compares and the recompute-or-copy hybrids, in the order tables list them
SCALE_POLICIES = ("none", "checkpoint", "save_on_cpu", "uvm", "dtr", "lru", "replay", "oracle", "pilot", "hybrid",
                  "hybrid_oracle")


@dataclass(kw_only=True)
class ScaleConfig:
    """What one ``dynn bench --scale`` run measures."""

    families: list[str] = field(default_factory=list)
    """Zoo families; empty means all."""
    policies: list[str] = field(default_factory=list)
    """Policies; empty means those of ``SCALE_POLICIES`` the simulator can run."""
    preset: str = "large"
    """Preset whose size knob is scaled."""
    knob_scales: list[float] = field(default_factory=lambda: [0.25, 0.5, 1, 2, 4, 8, 16, 32])
    """Multiples of the preset's size knob (rounded to integers, at least 1)."""
    budgets: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.125])
    """Budget fractions of the budget grid, at the preset's own size."""
    limits: list[float] = field(default_factory=lambda: [1.5, 2.0])
    """Time limits (over the unlimited-memory time of the same size) of the max-size metric."""
    device_profile: str = "h100"
    """Device profile; its ``capacity_bytes`` is the device capacity unless ``capacity_bytes`` is set."""
    capacity_bytes: int | None = None
    """Device capacity of the max-size scan; default the profile's memory."""
    seed: int = 0
    """Seed of weights, data and the fake recording's seeded values."""
    steps: int = 2
    """Iterations recorded per trace (>= 2: replay and the pilot plan from the previous one)."""
    fake: bool = True
    """Record with shapes only (``record_fake``); False records real values (CPU-sized presets only)."""
    host_cost: str = "calibrated"
    """The live manager's host cost charged, as in ``dynn bench`` (``calibrated``, ``none``, seconds)."""
    cache_dir: str = ".dynn-cache/traces"
    """Trace cache."""
    out_dir: str = "out/bench"
    """Where the JSON, markdown and PNGs go."""
    json_path: str | None = None
    """Results file; default ``<out_dir>/scale-<profile>-<preset>-<stamp>.json``."""

    def resolved(self) -> ScaleConfig:
        """A copy with defaults filled in, validated."""
        from .. import models
        from .harness import available_policies

        ok, _ = available_policies()
        cfg = dataclasses.replace(
            self, families=list(self.families) or list(models.FAMILIES),
            policies=list(self.policies) or [p for p in SCALE_POLICIES if p in ok])
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise a ConfigError (``bench --scale: ...``) naming what is wrong."""
        from .. import models
        from ..sim import PROFILES
        from .harness import BenchConfig

        BenchConfig(families=self.families, policies=self.policies, budgets=self.budgets,
                    device_profile=self.device_profile, steps=self.steps, host_cost=self.host_cost).validate()
        bad = [f for f in self.families if f not in models.FAMILIES]
        if bad:
            raise ConfigError(f"bench --scale: {', '.join(map(repr, bad))} is not a zoo family; the scan records each "
                              f"size from a family's size knob (choices: {', '.join(models.FAMILIES)}). Workloads of "
                              "your own and trace files run in `dynn bench` without --scale.")
        if self.preset not in models.PRESETS:
            raise ConfigError(f"bench --scale: unknown preset {self.preset!r}; choices: {', '.join(models.PRESETS)}.")
        if not self.knob_scales or any(not s > 0 for s in self.knob_scales):
            raise ConfigError(f"bench --scale: knob_scales must be positive numbers, got {self.knob_scales!r}.")
        if not self.limits or any(not lim >= 1 for lim in self.limits):
            raise ConfigError(f"bench --scale: limits are time ratios >= 1, got {self.limits!r}.")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ConfigError(f"bench --scale: capacity_bytes must be positive, got {self.capacity_bytes!r}.")
        if self.device_profile.lower() not in PROFILES:
            raise ConfigError(f"bench --scale: unknown device profile {self.device_profile!r}.")

    def capacity(self) -> int:
        from ..sim import get_profile

        return int(self.capacity_bytes or get_profile(self.device_profile).capacity_bytes)


@dataclass
class ScaleReport:
    config: ScaleConfig
    sizes: list[dict[str, Any]]
    """Per (family, knob value): the trace's unmanaged peak, unlimited time, operators."""
    runs: list[dict[str, Any]]
    """Per (family, knob value, policy): the simulation at the device capacity."""
    max_size: list[dict[str, Any]]
    """Per (family, policy, limit): the largest knob value trained, and its ratio to none's."""
    grid: list[dict[str, Any]]
    """Per (family, policy, budget fraction) at the preset's size: iteration time over unlimited."""
    meta: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return strict_json({"kind": "dynn-bench-scale", "config": dataclasses.asdict(self.config), **self.meta,
                            "sizes": self.sizes, "runs": self.runs, "max_size": self.max_size, "grid": self.grid})


def knob_values(family: str, preset: str, scales: list[float]) -> list[tuple[float, dict[str, int]]]:
    """``(scale, overrides)`` per distinct knob value, smallest first: the size knob times each scale,
    rounded, at least 1 (evoformer's ``residues_min`` moves with ``residues_max``, at least 2)."""
    from .. import models
    from .harness import scan_knob

    fam = models.family(family)
    base = fam.config(preset)
    knob = scan_knob(family, "size")
    assert knob is not None, f"bench --scale: {family} has no size knob (please report this bug)"
    low = knob[: -len("_max")] + "_min" if knob.endswith("_max") else None
    out: dict[int, tuple[float, dict[str, int]]] = {}
    for s in sorted(scales):
        value = max(1, round(getattr(base, knob) * s))
        ov = {knob: value}
        if low is not None and hasattr(base, low):
            ov[low] = max(2, min(value, round(getattr(base, low) * s)))
            ov[knob] = max(ov[knob], ov[low])
        if ov[knob] not in out:
            out[ov[knob]] = (s, ov)
    return list(out.values())


def run_scale(cfg: ScaleConfig, progress: Any = None, partial: Any = None) -> ScaleReport:
    """Record (cached) and simulate the max-size scan and the budget grid of ``cfg``.

    ``partial(report)``, if given, receives the report so far after each size and each grid, so a
    long run that is stopped keeps what it measured."""
    import torch

    from .. import __version__
    from ..sim import get_profile, simulate, unmanaged_peak
    from ..trace.cache import TraceCache
    from .harness import _Charges, scan_knob

    t0 = time.perf_counter()
    cfg = cfg.resolved()
    say = progress or (lambda text: None)
    profile = get_profile(cfg.device_profile)
    capacity = cfg.capacity()
    charge = _Charges(dataclasses.replace(_bench_cfg(cfg)))
    cache = TraceCache(cfg.cache_dir, fake=cfg.fake)
    sizes: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    grid: list[dict[str, Any]] = []

    def report() -> ScaleReport:
        now = time.localtime()
        meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S", now), "stamp": time.strftime("%Y%m%d-%H%M%S", now),
                "torch": torch.__version__, "dynn_runtime": __version__, "profile": dataclasses.asdict(profile),
                "capacity_bytes": capacity, "traces_recorded": cache.recorded, "traces_reused": cache.reused,
                "wall_s": time.perf_counter() - t0, "host_cost": charge.describe(cfg.policies)}
        return ScaleReport(config=cfg, sizes=sizes, runs=runs, max_size=max_size_records(cfg, runs, capacity),
                           grid=grid, meta=meta)

    for family in cfg.families:
        knob = scan_knob(family, "size")
        misses = {p: {lim: 0 for lim in cfg.limits} for p in cfg.policies}
        for scale, ov in knob_values(family, cfg.preset, cfg.knob_scales):
            alive = [p for p in cfg.policies if any(m < 2 for m in misses[p].values())]
            if not alive:
                break
            say(f"{family} {knob}={ov[knob]}: trace")
            t_rec = time.perf_counter()
            trace = cache.get(family, cfg.preset, cfg.seed, cfg.steps, ov)
            rec_s = time.perf_counter() - t_rec
            ref = simulate(trace, "none", 1.0, profile)
            peak = unmanaged_peak(trace)
            sizes.append({"family": family, "knob": knob, "knob_value": ov[knob], "scale": scale, "overrides": ov,
                          "unmanaged_peak_bytes": peak, "unlimited_iter_time_s": ref.iter_time_s, "ops": ref.ops,
                          "fits_capacity": peak <= capacity, "trace_s": rec_s})
            for policy in alive:
                say(f"{family} {knob}={ov[knob]}: {policy}")
                t_sim = time.perf_counter()
                res = simulate(trace, policy, int(capacity), profile, **charge(policy))
                overhead = res.iter_time_s / ref.iter_time_s if res.feasible else None
                runs.append({"family": family, "knob": knob, "knob_value": ov[knob], "scale": scale,
                             "policy": policy, "feasible": res.feasible, "reason": res.reason,
                             "iter_time_s": res.iter_time_s if res.feasible else None, "overhead": overhead,
                             "unlimited_iter_time_s": ref.iter_time_s, "stall_time_s": res.stall_time_s,
                             "recompute_time_s": res.recompute_time_s, "host_cost_s": res.host_cost_s,
                             "bytes_offloaded": res.bytes_offloaded, "peak_bytes": res.peak_bytes,
                             "sim_s": time.perf_counter() - t_sim})
                for lim in cfg.limits:
                    misses[policy][lim] = 0 if overhead is not None and overhead <= lim else misses[policy][lim] + 1
            if partial is not None:
                partial(report())
            if scale == 1 or (scale > 1 and not any(g["family"] == family for g in grid)):
                for policy in cfg.policies:
                    grid.extend(_budget_grid(cfg, family, ov, trace, ref.iter_time_s, profile, charge, say, policy))
                    if partial is not None:
                        partial(report())
    return report()


def max_size_records(cfg: ScaleConfig, runs: list[dict[str, Any]], capacity: int) -> list[dict[str, Any]]:
    """Per (family, limit, policy): the largest knob value whose run fits and is within the limit."""
    out = []
    for family in dict.fromkeys(r["family"] for r in runs):
        fam_runs = [r for r in runs if r["family"] == family]
        knob = fam_runs[0]["knob"]
        for lim in cfg.limits:
            none_best = _largest(fam_runs, "none", lim)
            for policy in cfg.policies:
                b = _largest(fam_runs, policy, lim)
                out.append({
                    "family": family, "knob": knob, "policy": policy, "limit": lim, "capacity_bytes": capacity,
                    "largest": b["knob_value"] if b else None, "overhead": b["overhead"] if b else None,
                    "none_largest": none_best["knob_value"] if none_best else None,
                    "ratio_vs_none": (b["knob_value"] / none_best["knob_value"]) if b and none_best else None,
                })
    return out


def _largest(runs: list[dict[str, Any]], policy: str, limit: float) -> dict[str, Any] | None:
    ok = [r for r in runs if r["policy"] == policy and r["overhead"] is not None and r["overhead"] <= limit]
    return max(ok, key=lambda r: r["knob_value"]) if ok else None


def _bench_cfg(cfg: ScaleConfig) -> Any:
    from .harness import BenchConfig

    return BenchConfig(host_cost=cfg.host_cost)


def _budget_grid(cfg: ScaleConfig, family: str, ov: dict, trace: Any, ref_s: float, profile: Any, charge: Any,
                 say: Any, policy: str) -> list[dict[str, Any]]:
    """One policy at each of ``cfg.budgets`` on ``trace``, over the unlimited-memory time ``ref_s``."""
    from ..sim import simulate

    out = []
    for frac in cfg.budgets:
        say(f"{family} budget {frac:g}: {policy}")
        res = simulate(trace, policy, float(frac), profile, **charge(policy))
        out.append({"family": family, "overrides": ov, "policy": policy, "budget_fraction": frac,
                    "budget_bytes": res.budget_bytes, "feasible": res.feasible, "reason": res.reason,
                    "iter_time_s": res.iter_time_s if res.feasible else None,
                    "overhead": res.iter_time_s / ref_s if res.feasible else None,
                    "stall_time_s": res.stall_time_s, "recompute_time_s": res.recompute_time_s,
                    "host_cost_s": res.host_cost_s})
    return out


def _fmt(x: float | None, suffix: str = "x") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}{suffix}"


def render_scale_markdown(report: ScaleReport) -> str:
    """The tables of a scale report: max size per limit, and the budget grid."""
    cfg = report.config
    cap = report.meta["capacity_bytes"] / 1e9
    lines = [f"## Max trainable size at `{cfg.preset}` on {report.meta['profile']['name']} ({cap:g} GB), "
             "ratio to `none`'s largest", ""]
    for lim in cfg.limits:
        lines += [f"Within {lim:g}x of the unlimited-memory time (knob value, ratio to none):", "",
                  "| family | knob | " + " | ".join(cfg.policies) + " |",
                  "|---|---|" + "---:|" * len(cfg.policies)]
        for fam in cfg.families:
            recs = {r["policy"]: r for r in report.max_size if r["family"] == fam and r["limit"] == lim}
            if not recs:
                continue
            knob = next(iter(recs.values()))["knob"]
            cells = []
            for p in cfg.policies:
                r = recs.get(p)
                if r is None or r["largest"] is None:
                    cells.append("no size")
                else:
                    ratio = r["ratio_vs_none"]
                    cells.append(f"{r['largest']} ({ratio:.3g}x)" if ratio else f"{r['largest']} (-)")
            lines.append(f"| {fam} | {knob} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [f"## Iteration time over unlimited at `{cfg.preset}`, budgets as fractions of the peak "
              "(OOM: does not fit; -: not simulated)", ""]
    lines += ["| family | budget | " + " | ".join(cfg.policies) + " |", "|---|---|" + "---:|" * len(cfg.policies)]
    for fam in cfg.families:
        for frac in cfg.budgets:
            recs = {r["policy"]: r for r in report.grid if r["family"] == fam and r["budget_fraction"] == frac}
            if recs:
                lines.append(f"| {fam} | {_frac(frac)} | " + " | ".join(
                    "-" if p not in recs else _fmt(recs[p]["overhead"]) if recs[p]["feasible"] else "OOM"
                    for p in cfg.policies) + " |")
    return "\n".join(lines) + "\n"


def _frac(f: float) -> str:
    inv = 1 / f
    return f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 else f"{f:g}"


def plot_scale(report: ScaleReport, family: str, out: str | Path) -> Path:
    """Size against iteration time over unlimited for one family on the fixed device, a line per policy.

    x: the size knob (log2). y: iteration time over the unlimited-memory time of the same size (log);
    dashed lines at the limits; sizes a policy does not fit are ``x`` marks in the band at the top;
    the grey band is where ``none`` (PyTorch alone) runs out of memory.
    """
    from matplotlib.ticker import FuncFormatter

    from .._plot import pyplot, save_png
    from .plots import _colors

    plt = pyplot()
    cfg = report.config
    recs = [r for r in report.runs if r["family"] == family]
    sizes = [s for s in report.sizes if s["family"] == family]
    colors = _colors(list(cfg.policies))
    over = [r["overhead"] for r in recs if r["overhead"]]
    top = max(max(over, default=2.0), max(cfg.limits)) * 1.4
    fig, ax = plt.subplots(figsize=(8.5, 4.8), dpi=120)
    n = len(cfg.policies)
    for k, p in enumerate(cfg.policies):
        pts = sorted((r["knob_value"], r) for r in recs if r["policy"] == p)
        shift = 2 ** ((k - (n - 1) / 2) * 0.008)  # identical lines stay visible
        ok = [(x * shift, r["overhead"]) for x, r in pts if r["feasible"]]
        if ok:
            ax.plot(*zip(*ok, strict=True), marker="o", ms=4, lw=1.6, color=colors[p], label=p)
        bad = [x * shift for x, r in pts if not r["feasible"]]
        if bad:
            ax.plot(bad, [top] * len(bad), ls="none", marker="x", ms=7, mew=2, color=colors[p],
                    label=None if ok else p)
    oom = [s["knob_value"] for s in sizes if not s["fits_capacity"]]
    if oom:
        ax.axvspan(min(oom) / 2**0.25, max(s["knob_value"] for s in sizes) * 2**0.25, color="0.92", zorder=0)
        ax.text(min(oom), 1.0, " none out of memory", fontsize=8, color="0.4", va="bottom")
    for lim in cfg.limits:
        ax.axhline(lim, color="0.5", lw=0.8, ls="--")
    if sizes:
        ax.text(min(s["knob_value"] for s in sizes), top, "does not fit ", fontsize=8, color="0.35",
                va="center", ha="right")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if v in (1.5, 2, 3, 5) else ""))
    ax.set_ylim(0.9, top * 1.3)
    knob = sizes[0]["knob"] if sizes else "size"
    ax.set_xlabel(f"{knob} (every other field: the {cfg.preset} preset)")
    ax.set_ylabel("iteration time / same size, unlimited memory")
    ax.set_title(f"{family}: sizes on one {report.meta['profile']['name']} "
                 f"({report.meta['capacity_bytes'] / 1e9:g} GB), simulated", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="policy", title_fontsize=8)
    return save_png(fig, out)


def write_scale_outputs(report: ScaleReport) -> dict[str, Any]:
    """Write the JSON, the markdown beside it and a PNG per family; return their paths."""
    import json

    cfg = report.config
    out_dir = Path(cfg.out_dir)
    jpath = Path(cfg.json_path) if cfg.json_path else (
        out_dir / f"scale-{report.meta['profile']['name']}-{cfg.preset}-{report.meta['stamp']}.json")
    jpath.parent.mkdir(parents=True, exist_ok=True)
    jpath.write_text(json.dumps(report.to_json(), indent=1, allow_nan=False))
    mpath = jpath.with_suffix(".md")
    mpath.write_text(render_scale_markdown(report))
    plots = []
    for fam in cfg.families:
        if any(r["family"] == fam for r in report.runs):
            try:
                plots.append(plot_scale(report, fam, out_dir / f"scale_{fam}.png"))
            except ImportError as exc:  # matplotlib missing: the tables still stand
                logger.warning("bench --scale: no plot for %s (%s)", fam, exc)
    return {"json": jpath, "markdown": mpath, "plots": plots}
