"""The memory timeline of a managed run as a PNG (``dynn train --timeline``, ``dynn demo``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .._plot import pyplot, save_png

__all__ = ["plot_memory_timeline"]


def _series(timeline: list[tuple[int, int, int, str]]) -> tuple[list[int], list[int], list[int]]:
    """x (operator index counted across steps), y (device bytes), and the x where each step starts."""
    xs: list[int] = []
    ys: list[int] = []
    starts: list[int] = []
    offset = 0
    step = None
    last = -1
    for s, pos, nbytes, _phase in timeline:
        if s != step:
            offset = last + 1
            starts.append(offset)
            step = s
        last = offset + pos
        xs.append(last)
        ys.append(nbytes)
    return xs, ys, starts


def _unit(top: float) -> tuple[float, str]:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= div:
            return float(div), name
    return 1.0, "B"


def plot_memory_timeline(managed: Any, out: str | Path, reference: Any | None = None, title: str | None = None) -> Path:
    """Managed device bytes after every operator of ``managed`` (a :class:`~.train.RunResult`), the budget
    line over the steps the manager managed, and, if given, ``reference``'s curve (an
    :func:`~.train.accounting_run`: the same steps with nothing moved) for comparison.

    A fractional budget's first step runs unmanaged to measure the peak; it is shaded.
    """
    plt = pyplot()
    xs, ys, starts = _series(managed.timeline)
    rx, ry = ([], [])
    if reference is not None and reference.timeline:
        rx, ry, _ = _series(reference.timeline)
    top = max([*ys, *ry, managed.budget_bytes or 0, 1])
    div, unit = _unit(top)

    fig, ax = plt.subplots(figsize=(10, 4.6), dpi=120)
    if ry:
        ax.plot(rx, [y / div for y in ry], color="0.55", lw=1.0, label="unmanaged (same steps, nothing moved)")
    ax.plot(xs, [y / div for y in ys], color="tab:blue", lw=1.2, label=f"managed ({managed.policy})")
    ends = [*starts[1:], (xs[-1] + 1) if xs else 0]
    budget = managed.budget_bytes
    first = True
    for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
        is_managed = k < len(managed.managed_steps) and managed.managed_steps[k]
        if not is_managed:
            ax.axvspan(a, b, color="0.92", zorder=0)
            ax.text((a + b) / 2, top / div * 1.02, "measuring\n(unmanaged)", ha="center", va="bottom", fontsize=7,
                    color="0.35")
        elif budget:
            ax.hlines(budget / div, a, b, colors="tab:red", linestyles="--", lw=1.2,
                      label=f"budget {budget / div:.3g} {unit}" if first else None)
            first = False
        if k:
            ax.axvline(a, color="0.75", lw=0.6)
    ax.set_xlim(0, max(ends[-1] if ends else 1, rx[-1] + 1 if rx else 1))
    ax.set_ylim(0, top / div * 1.15)
    ax.set_xlabel("operator (steps one after another; thin lines mark step starts)")
    ax.set_ylabel(f"device bytes held ({unit})")
    ax.set_title(title or f"{managed.workload} ({managed.preset}) on {managed.device}: policy {managed.policy}, "
                          f"budget {managed.budget}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    return save_png(fig, out)
