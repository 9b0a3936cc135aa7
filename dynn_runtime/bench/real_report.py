"""What ``dynn bench --real`` writes: the markdown tables and the JSON results file of a
:class:`~dynn_runtime.bench.real.RealBenchReport`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .real import RealBenchReport

__all__ = ["render_real_markdown", "write_real_outputs"]


# ---- outputs ---------------------------------------------------------------------------------

def _mib(n: Any) -> str:
    return "" if n is None else f"{n / 2**20:.2f} MiB"


def _ms(t: Any) -> str:
    return "" if t is None or (isinstance(t, float) and math.isnan(t)) else f"{t * 1e3:.1f} ms"


def render_real_markdown(report: RealBenchReport) -> str:
    cfg = report.config
    m = report.meta
    frac = f"1/{round(1 / cfg.fraction)}" if abs(1 / cfg.fraction - round(1 / cfg.fraction)) < 1e-9 else f"{cfg.fraction:g}"
    lines = [
        f"# dynn bench --real: {m['device_name']}, preset {cfg.preset}, cap {frac} of the unlimited peak "
        f"({m['date']})", "",
        f"Measured on {cfg.device} ({'hard cap' if cfg.device == 'cuda' and cfg.hard_cap else 'logical budget'}), "
        f"{cfg.steps} steps per run, median step time without the first. `fits`: trains within the cap. "
        f"Predicted: the simulator ({m['profile']}) on a trace recorded on the same device"
        + ("." if m["profile_like_for_like"] else "; projected from a different device, not comparable."),
    ]
    for family in cfg.families:
        rows = [r for r in report.results if r["family"] == family]
        if not rows:
            continue
        u = rows[0]
        if u.get("beyond_device"):
            lines += ["", f"## {family}: PyTorch alone does not fit the device ({(u.get('reason') or '')[:120]})", "",
                      "Each policy takes the fraction as its budget: the manager measures the peak in a first step "
                      "run under the device's free memory, then keeps to the fraction of it.", "",
                      "| method | trains | step time | measured peak | budget | peak | moved off / on demand | stalls |",
                      "|---|---|---:|---:|---:|---:|---:|---:|"]
            for r in rows[1:]:
                if not r.get("feasible"):
                    lines.append(f"| {r['method']} | no ({(r.get('reason') or '').split(':')[0]}) |  |  |  |  |  |  |")
                    continue
                lines.append(f"| {r['method']} | yes | {_ms(r.get('iter_time_s'))} | {_mib(r.get('measured_peak_bytes'))} "
                             f"| {_mib(r.get('cap_bytes'))} | {_mib(r.get('peak_bytes'))} | "
                             f"{_mib(r.get('bytes_offloaded'))} / {_mib(r.get('bytes_fetched_on_demand'))} | "
                             f"{r.get('stall_seconds') or 0:.3f} s |")
            lines += _failure_lines(rows)
            continue
        if u.get("iter_time_s") is None:
            lines += ["", f"## {family}: the unlimited run failed: {u.get('reason', '')}"]
            continue
        lines += ["", f"## {family}: unlimited peak {_mib(u['peak_bytes'])}, cap {_mib(u['cap_bytes'])}, "
                      f"unlimited step {_ms(u['iter_time_s'])}", "",
                  "| method | fits | step time | vs unlimited | peak | moved off / on demand | stalls | bit-identical "
                  "| predicted vs unlimited |",
                  "|---|---|---:|---:|---:|---:|---:|---|---:|"]
        for r in rows:
            fits = {True: "yes", False: "no", None: "n/a"}[r.get("feasible")]
            if r.get("feasible") is False and r.get("iter_time_s") is None:
                fits = f"no ({(r.get('reason') or '').split(':')[0]})"
            ov = "" if r.get("overhead") is None else f"{r['overhead']:.2f}x"
            moved = "" if r.get("bytes_offloaded") is None else \
                f"{_mib(r['bytes_offloaded'])} / {_mib(r['bytes_fetched_on_demand'])}"
            stalls = "" if r.get("stall_seconds") is None else f"{r['stall_seconds']:.3f} s"
            bit = "" if r.get("bit_identical") is None else ("yes" if r["bit_identical"] else "NO")
            pred = ""
            if "predicted_feasible" in r:
                pred = f"{r['predicted_overhead']:.2f}x" if r["predicted_feasible"] else "OOM"
            lines.append(f"| {r['method']} | {fits} | {_ms(r.get('iter_time_s'))} | {ov} | {_mib(r.get('peak_bytes'))} "
                         f"| {moved} | {stalls} | {bit} | {pred} |")
        lines += _quality_table(rows)
        lines += _failure_lines(rows)
    if report.max_size:
        methods = list(dict.fromkeys(r["method"] for r in report.max_size))
        lines += ["", f"## Max trainable size under a fixed cap (scales up to x{cfg.max_scale})", "",
                  "Capacity: PyTorch alone's footprint at x1 (CUDA: max_memory_reserved). Cells: the largest "
                  "multiple of the size knob that trains within it.", "",
                  "| family | knob | capacity | " + " | ".join(methods) + " |",
                  "|---|---|---:|" + "---:|" * len(methods)]
        ms = {(r["family"], r["method"]): r for r in report.max_size}
        for family in cfg.families:
            first = ms.get((family, "pytorch"))
            if first is None:
                continue
            cells = [f"x{ms[(family, mm)]['scale']}" if (family, mm) in ms else "" for mm in methods]
            lines.append(f"| {family} | {first['knob']} | {_mib(first['capacity_bytes'])} | " + " | ".join(cells) + " |")
    if m.get("skipped_policies"):
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in m["skipped_policies"].items())]
    return "\n".join(lines) + "\n"


def _failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each failed run's error and where it was raised (the row's ``where``: frames, and the errors it
    was raised from or during), so that a report tells which path failed."""
    failed = [r for r in rows if r.get("where")]
    if not failed:
        return []
    return ["", "Failures (the error, then where it was raised):", ""] + [
        f"- {r['method']}: {(r.get('reason') or '')[:240]} -- {r['where'][:900]}" for r in failed]


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:.1f}%"


def _quality_table(rows: list[dict[str, Any]]) -> list[str]:
    """Prefetch quality of each policy that ran: live hits, misses, hit rate, stalls and bytes moved,
    the simulator's figures for the same run, and its predictor's window recall on the trace."""
    ran = [r for r in rows if r.get("feasible") and "prefetch_hits" in r]
    if not ran:
        return []
    out = ["", "Prefetch quality: live (hits / misses, hit rate, stalls, bytes moved), simulated on the recorded "
           "trace, and the window recall of the policy's predictor on that trace.", "",
           "| method | window recall | hits / misses | hit rate | stalls | moved | simulated hits / misses | "
           "simulated hit rate | simulated stalls |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in ran:
        sim = "" if r.get("predicted_prefetch_hits") is None else \
            f"{r['predicted_prefetch_hits']} / {r['predicted_prefetch_misses']}"
        out.append(f"| {r['method']} | {_pct(r.get('window_recall'))} | {r['prefetch_hits']} / {r['prefetch_misses']} "
                   f"| {_pct(r.get('hit_rate'))} | {_ms(r.get('stall_seconds'))} | {_mib(r.get('bytes_moved'))} "
                   f"| {sim} | {_pct(r.get('predicted_hit_rate'))} | {_ms(r.get('predicted_stall_seconds'))} |")
    return out


def write_real_outputs(report: RealBenchReport) -> dict[str, Path]:
    cfg = report.config
    out = Path(cfg.out_dir)
    path = Path(cfg.json_path) if cfg.json_path else out / f"real-{cfg.device}-{cfg.preset}-{report.meta['stamp']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=1, allow_nan=False, default=str) + "\n")
    md = path.with_suffix(".md")
    md.write_text(render_real_markdown(report))
    return {"json": path, "markdown": md}
