"""Merge `dynn bench --scale` results files (one per family, say; partial files too) into one
markdown table set and redraw the PNG per family; the max-size records are derived from the runs.

    .venv/bin/python tools/scale_report.py out/bench/scale/*.json --md out.md --png-dir docs/img

Files of one family may hold different policies (a run of a new policy beside an older run): the
tables and plots take the union; a point simulated in both counts once (the later file's).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynn_runtime.bench.scale import (
    SCALE_POLICIES,
    ScaleConfig,
    ScaleReport,
    max_size_records,
    plot_scale,
    render_scale_markdown,
)


def load(paths: list[str]) -> ScaleReport:
    """One report holding every family of ``paths`` (their configs must agree but for the families)."""
    datas = [json.loads(Path(p).read_text()) for p in paths]
    cfg = dict(datas[0]["config"])
    cfg["families"] = list(dict.fromkeys(f for d in datas for f in d["config"]["families"]))
    # files of one family may hold different policies (a later run of a new policy): the union, in
    # the order of the list, then the others in the order first seen
    seen = list(dict.fromkeys(p for d in datas for p in d["config"]["policies"]))
    cfg["policies"] = [p for p in SCALE_POLICIES if p in seen] + [p for p in seen if p not in SCALE_POLICIES]
    report = ScaleReport(config=ScaleConfig(**cfg), sizes=[], runs=[], max_size=[], grid=[],
                         meta={k: datas[0][k] for k in ("profile", "capacity_bytes")})
    runs: dict[tuple, dict] = {}
    grid: dict[tuple, dict] = {}
    sizes: dict[tuple, dict] = {}
    for d in datas:  # a point simulated in two files (none, rerun beside a new policy) counts once: the later
        sizes.update(((s["family"], s["knob_value"]), s) for s in d["sizes"])
        runs.update(((r["family"], r["knob_value"], r["policy"]), r) for r in d["runs"])
        grid.update(((g["family"], g["policy"], g["budget_fraction"]), g) for g in d["grid"])
    report.sizes, report.runs, report.grid = list(sizes.values()), list(runs.values()), list(grid.values())
    report.max_size = max_size_records(report.config, report.runs, report.meta["capacity_bytes"])
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--md", default="")
    p.add_argument("--png-dir", default="")
    p.add_argument("--png-prefix", default="scale_", help="PNG file names: PREFIX<family>.png")
    args = p.parse_args()
    report = load(args.json)
    text = render_scale_markdown(report)
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    if args.png_dir:
        for fam in report.config.families:
            print(plot_scale(report, fam, Path(args.png_dir) / f"{args.png_prefix}{fam}.png"))


if __name__ == "__main__":
    main()
