"""Merge `dynn bench --scale` results files (one per family, say; partial files too) into one
markdown table set and redraw the PNG per family; the max-size records are derived from the runs.

    .venv/bin/python tools/scale_report.py out/bench/scale/*.json --md out.md --png-dir docs/img
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dynn_runtime.bench.scale import (
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
    cfg["families"] = [f for d in datas for f in d["config"]["families"]]
    report = ScaleReport(config=ScaleConfig(**cfg), sizes=[], runs=[], max_size=[], grid=[],
                         meta={k: datas[0][k] for k in ("profile", "capacity_bytes")})
    for d in datas:
        report.sizes += d["sizes"]
        report.runs += d["runs"]
        report.grid += d["grid"]
    report.max_size = max_size_records(report.config, report.runs, report.meta["capacity_bytes"])
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--md", default="")
    p.add_argument("--png-dir", default="")
    args = p.parse_args()
    report = load(args.json)
    text = render_scale_markdown(report)
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    if args.png_dir:
        for fam in report.config.families:
            print(plot_scale(report, fam, Path(args.png_dir) / f"scale_{fam}.png"))


if __name__ == "__main__":
    main()
