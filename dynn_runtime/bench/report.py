"""What ``dynn bench`` writes: the markdown tables, the JSON results file and the plots of a
:class:`~dynn_runtime.bench.harness.BenchReport`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .harness import BenchReport, _frac_label
from .quality import sim_quality

__all__ = ["render_markdown", "write_outputs"]


# ---- outputs --------------------------------------------------------------------------------------

def render_markdown(report: BenchReport) -> str:
    """One overhead table per family (policy x budget; ``OOM`` where infeasible), then the max-size table."""
    cfg = report.config
    prof = report.meta["profile"]["name"]
    lines = [
        f"# dynn bench: {prof}, preset {cfg.preset}{f', depth x{cfg.grid_depth}' if cfg.grid_depth > 1 else ''}, "
        f"seed {cfg.seed} ({report.meta['date']})",
        "",
        "Iteration time over the unlimited-memory time (`none` at budget 1), simulated; budgets are fractions "
        "of the peak under `none`. `OOM`: the policy cannot run the iteration within the budget.",
        "",
        f"Manager host cost charged: {_host_cost_line(report.meta.get('host_cost'))}.",
    ]
    by_key = {(r["family"], r["policy"], r["budget_fraction"]): r for r in report.results}
    for family in cfg.families:
        any_rec = next((r for r in report.results if r["family"] == family), None)
        if any_rec is None:
            continue
        lines += ["", f"## {family} ({cfg.preset}): peak {_mib(any_rec['unmanaged_peak_bytes'])}, "
                      f"unlimited iteration {any_rec['unlimited_iter_time_s'] * 1e3:.3f} ms", ""]
        lines.append("| policy | " + " | ".join(_frac_label(b) for b in cfg.budgets) + " |")
        lines.append("|---|" + "---:|" * len(cfg.budgets))
        for policy in cfg.policies:
            cells = []
            for b in cfg.budgets:
                r = by_key.get((family, policy, b))
                cells.append("" if r is None else (f"{r['overhead']:.2f}x" if r["feasible"] else "OOM"))
            lines.append(f"| {policy} | " + " | ".join(cells) + " |")
        lines += _quality_table(report, family, by_key)
    if report.max_size:
        lines += [
            "", f"## Max trainable size ({cfg.max_size_preset} preset, {cfg.max_size_knob} knob, scales up to "
            f"x{cfg.max_scale})", "",
            f"Largest multiple of the family's {cfg.max_size_knob} knob that runs within a device capacity of the unmanaged "
            f"peak at x1, at most {cfg.overhead_limit:g}x the unlimited-memory time; shown as the ratio to "
            "`none`'s largest.", "",
            "| family | knob | capacity | " + " | ".join(cfg.policies) + " |",
            "|---|---|---:|" + "---:|" * len(cfg.policies),
        ]
        ms = {(r["family"], r["policy"]): r for r in report.max_size}
        for family in cfg.families:
            recs = [ms.get((family, p)) for p in cfg.policies]
            first = next((r for r in recs if r), None)
            if first is None:
                continue
            cells = ["" if r is None or r["ratio_vs_none"] is None else f"{r['ratio_vs_none']:g}x" for r in recs]
            lines.append(f"| {family} | {first['knob']} | {_mib(first['capacity_bytes'])} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _quality_table(report: BenchReport, family: str, by_key: dict[Any, dict[str, Any]]) -> list[str]:
    """Per policy and budget below 1: prefetch hits / misses, hit rate, stall time and bytes moved (the
    figures ``dynn bench --real`` measures live), beside the predictor's window recall on the trace."""
    cfg = report.config
    recall = (report.meta.get("window_recall") or {}).get(family, {})
    budgets = [b for b in cfg.budgets if b < 1]
    rows = []
    for policy in cfg.policies:
        for b in budgets:
            r = by_key.get((family, policy, b))
            if r is None or not r["feasible"] or not r["managed"]:
                continue
            q = sim_quality(r)
            rate = "" if q["hit_rate"] is None else f"{100 * q['hit_rate']:.1f}%"
            wr = recall.get(policy)
            rows.append(f"| {policy} | {_frac_label(b)} | {'' if wr is None else f'{100 * wr:.1f}%'} "
                        f"| {q['prefetch_hits']} / {q['prefetch_misses']} | {rate} | {q['stall_seconds'] * 1e3:.3f} ms "
                        f"| {_mib(q['bytes_moved'])} |")
    if not rows:
        return []
    return ["", "Prefetch quality (simulated): hits / misses, hit rate, stall time, bytes moved; window recall of the "
            "policy's predictor on the trace.", "",
            "| policy | budget | window recall | hits / misses | hit rate | stalls | moved |",
            "|---|---|---:|---:|---:|---:|---:|", *rows]


def _host_cost_line(hc: dict[str, Any] | None) -> str:
    if not hc or hc.get("mode") == "none":
        return "none"
    charged = {p: c for p, c in hc["policies"].items() if c}
    if not charged:
        return f"{hc['mode']}, no policy here runs in the manager"
    c = min(charged.values(), key=lambda x: x["per_op_s"])
    more = [f"{p} {x['per_op_s'] * 1e6:.1f}" for p, x in charged.items() if x["per_op_s"] != c["per_op_s"]]
    on = f", measured on {c['device']}" if c.get("device") else ""
    return (f"{hc['mode']} ({c['source']}{on}): {c['per_op_s'] * 1e6:.1f} us per operator"
            + (f" ({', '.join(more)})" if more else "")
            + f", {c['per_decision_s'] * 1e6:.1f} us per decision point, {c.get('per_move_s', 0.0) * 1e6:.1f} us "
            f"per storage moved, on {', '.join(charged)}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def write_outputs(report: BenchReport, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Write the JSON results, the markdown beside it, and the PNG plots into ``out_dir``.

    Returns ``{"json": Path, "markdown": Path, "plots": [Path, ...]}``.
    """
    from .plots import plot_max_size, plot_overhead

    cfg = report.config
    out = Path(out_dir if out_dir is not None else cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.json_path:
        json_path = Path(cfg.json_path)
    else:
        json_path = out / f"bench-{report.meta['profile']['name']}-{cfg.preset}-{report.meta['stamp']}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report.to_json(), indent=1, allow_nan=False) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(render_markdown(report))
    from ..workload import workload_name

    plots = [plot_overhead(report, family, out / f"overhead_{workload_name(family)}.png") for family in cfg.families]
    if report.max_size:
        plots.append(plot_max_size(report, out / "max_size.png"))
    return {"json": json_path, "markdown": md_path, "plots": plots}
