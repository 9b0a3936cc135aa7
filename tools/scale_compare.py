"""Two `dynn bench --scale` results files of the same families side by side: the budget grid's
iteration time over unlimited per policy, as grouped bars, one panel per family (e.g. the host cost
charged against not charged, to show what the charge costs each policy).

    .venv/bin/python tools/scale_compare.py "calibrated=out/a.json" "none=out/b.json" \\
        --families evoformer skipnet moe --policies oracle pilot hybrid_oracle hybrid --png docs/img/x.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def grid(paths: str) -> dict[tuple[str, str, float], float | None]:
    """The budget grid of comma-separated results files (a later file's point replaces an earlier's)."""
    out = {}
    for path in paths.split(","):
        d = json.loads(Path(path).read_text())
        out.update({(g["family"], g["policy"], g["budget_fraction"]): g["overhead"] for g in d["grid"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs=2, metavar="LABEL=FILE[,FILE...]", help="two sets of results files, each labelled")
    p.add_argument("--families", nargs="+", required=True)
    p.add_argument("--policies", nargs="+", required=True)
    p.add_argument("--png", required=True)
    args = p.parse_args()

    from dynn_runtime._plot import pyplot, save_png

    plt = pyplot()
    runs = [(lab, grid(f)) for lab, _, f in (r.partition("=") for r in args.runs)]
    budgets = sorted({k[2] for _, g in runs for k in g}, reverse=True)
    fig, axes = plt.subplots(1, len(args.families), figsize=(4.2 * len(args.families), 3.8), dpi=120,
                             squeeze=False)
    width = 0.8 / (len(args.policies) * 2)
    for ax, fam in zip(axes[0], args.families, strict=True):
        for i, pol in enumerate(args.policies):
            for k, (lab, g) in enumerate(runs):
                xs, ys = [], []
                for b_i, b in enumerate(budgets):
                    v = g.get((fam, pol, b))
                    if v is not None:
                        xs.append(b_i + (2 * i + k) * width - 0.4 + width / 2)
                        ys.append(v)
                ax.bar(xs, ys, width, color=f"C{i}", alpha=1.0 if k == 0 else 0.45,
                       hatch="" if k == 0 else "//", label=f"{pol} ({lab})")
        ax.axhline(1.5, color="0.5", lw=0.8, ls="--")
        ax.set_xticks(range(len(budgets)), [f"1/{round(1 / b)}" for b in budgets])
        ax.set_xlabel("budget (fraction of the peak)")
        ax.set_title(fam, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("iteration time / unlimited")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    print(save_png(fig, args.png))


if __name__ == "__main__":
    main()
