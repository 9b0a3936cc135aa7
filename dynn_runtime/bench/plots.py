"""PNG plots of a bench report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .._plot import pyplot, save_png

__all__ = ["plot_overhead", "plot_max_size"]


def _colors(policies: list[str]) -> dict[str, Any]:
    plt = pyplot()
    if len(policies) <= 10:
        cmap = plt.get_cmap("tab10")
        return {p: cmap(i) for i, p in enumerate(policies)}
    cmap = plt.get_cmap("tab20")  # more lines than tab10 has colours: each its own, none repeated
    return {p: cmap(i % 20) for i, p in enumerate(policies)}


def _frac_tick(f: float) -> str:
    inv = 1 / f
    return "1" if f == 1 else (f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-9 else f"{f:g}")


def plot_overhead(report: Any, family: str, out: str | Path) -> Path:
    """Iteration-time overhead vs budget fraction for one family, one line per policy.

    x: budget fraction on a log2 axis, 1 on the left, shrinking to the right. y: iteration time over
    the unlimited-memory time (log scale when it spans more than 10x). Infeasible points are left out
    of the lines and marked with an ``x`` in the policy's colour in the band at the top labelled OOM.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    plt = pyplot()
    cfg = report.config
    policies = list(cfg.policies)
    colors = _colors(policies)
    recs = [r for r in report.results if r["family"] == family]
    feasible = [r["overhead"] for r in recs if r["feasible"] and r["overhead"] is not None]
    ymax = max(feasible, default=1.0)
    log_y = ymax > 10
    top = ymax * (1.6 if log_y else 1.12) if ymax > 1.0 else 1.5
    oom_y = top * (1.25 if log_y else 1.04) if ymax > 1.0 else 1.6

    fig, ax = plt.subplots(figsize=(8.5, 4.8), dpi=120)
    n = len(policies)
    for k, policy in enumerate(policies):
        pts = sorted(((r["budget_fraction"], r) for r in recs if r["policy"] == policy), key=lambda t: -t[0])
        xs = [f for f, r in pts if r["feasible"]]
        ys = [r["overhead"] for f, r in pts if r["feasible"]]
        # a small horizontal offset per policy so identical lines (all 1.0x at budget 1) stay visible
        shift = 2 ** ((k - (n - 1) / 2) * 0.04)
        ax.plot([x * shift for x in xs], ys, marker="o", ms=4, lw=1.6, color=colors[policy], label=policy)
        bad = [f * shift for f, r in pts if not r["feasible"]]
        if bad:
            ax.plot(bad, [oom_y] * len(bad), linestyle="none", marker="x", ms=7, mew=2, color=colors[policy])
    budgets = sorted(cfg.budgets, reverse=True)
    ax.set_xscale("log", base=2)
    ax.set_xlim(max(budgets) * 2**0.3, min(budgets) * 2**-0.3)  # decreasing to the right
    ax.xaxis.set_major_locator(FixedLocator(budgets))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _frac_tick(v)))
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    else:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    lo = min(1.0, min(feasible, default=1.0))
    ax.set_ylim(lo * (0.85 if log_y else 0.95), oom_y * (1.2 if log_y else 1.04))
    ax.axhline(top, color="0.6", lw=0.8, ls="--")
    ax.text(ax.get_xlim()[0], oom_y, " OOM", va="center", ha="left", fontsize=8, color="0.35")
    ax.axhline(1.0, color="0.8", lw=0.8, zorder=0)
    ax.set_xlabel("memory budget (fraction of the peak under none)")
    ax.set_ylabel("iteration time / unlimited-memory time")
    prof = report.meta["profile"]["name"]
    ax.set_title(f"{family} ({cfg.preset} preset), simulated on {prof}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="policy", title_fontsize=8)
    return save_png(fig, out)


def plot_max_size(report: Any, out: str | Path) -> Path:
    """Grouped bars: per family, one bar per policy, height = largest trainable scale over ``none``'s."""
    plt = pyplot()
    cfg = report.config
    policies = list(cfg.policies)
    colors = _colors(policies)
    families = [f for f in cfg.families if any(r["family"] == f for r in report.max_size)]
    ms = {(r["family"], r["policy"]): r for r in report.max_size}
    ratios = [r["ratio_vs_none"] for r in report.max_size if r["ratio_vs_none"]]
    top = max(ratios, default=1.0)

    fig, ax = plt.subplots(figsize=(min(12.0, max(7.5, 2.0 + 0.22 * len(families) * len(policies))), 4.8), dpi=120)
    width = 0.8 / max(1, len(policies))
    for k, policy in enumerate(policies):
        xs, hs = [], []
        for i, fam in enumerate(families):
            r = ms.get((fam, policy))
            xs.append(i - 0.4 + width * (k + 0.5))
            hs.append(r["ratio_vs_none"] if r and r["ratio_vs_none"] else 0.0)
        # log axis: a bar starts at the bottom of the plot; a policy with no passing scale (0) shows none
        bars = ax.bar(xs, hs, width=width * 0.92, color=colors[policy], label=policy)
        for b, h in zip(bars, hs, strict=True):
            if h >= 2 or (h and len(policies) <= 4):
                ax.text(b.get_x() + b.get_width() / 2, h * 1.03, f"{h:g}", ha="center", va="bottom", fontsize=6.5)
    ax.set_yscale("log", base=2)
    ax.set_ylim(0.5, 2 ** (math.ceil(math.log2(max(top, 1.0))) + 1))
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xticks(range(len(families)))
    ax.set_xticklabels([f"{f}\n({ms[(f, policies[0])]['knob']})" if policies else f for f in families], fontsize=8)
    ax.set_ylabel("largest trainable size / none's")
    prof = report.meta["profile"]["name"]
    ax.set_title(f"Max trainable size within the x1 peak, overhead <= {cfg.overhead_limit:g}x "
                 f"({cfg.max_size_preset}, {prof})", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(4, len(policies)), loc="upper left", framealpha=0.9)
    return save_png(fig, out)
