"""Validate fake (shape-only) recordings against real ones: docs/simulator.md, "GPU-scale traces without a GPU".

For each zoo family and size, records two iterations for real and under
:class:`dynn_runtime.trace.fake.ShapeMode` with ``--small-numel`` elements as the line between real and
fake tensors (small, so that the activations of these CPU-sized presets are fake as they are at
`large`), and prints the fake recording's relative error in operators, storage bytes, unmanaged peak
and FLOPs of the last iteration.

    .venv/bin/python tools/validate_fake_traces.py --sizes tiny:1 tiny:4 small:1 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dynn_runtime import models
from dynn_runtime.bench.harness import scaled_overrides
from dynn_runtime.trace import read_trace, record
from dynn_runtime.trace.fake import iteration_summary, record_fake


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="*", default=list(models.FAMILIES))
    p.add_argument("--sizes", nargs="*", default=["tiny:1", "tiny:4", "small:1"],
                   help="PRESET:SCALE of the family's size knob (default tiny:1 tiny:4 small:1)")
    p.add_argument("--small-numel", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families:
            for size in args.sizes:
                preset, _, scale = size.partition(":")
                ov = scaled_overrides(fam, preset, int(scale or 1))
                real_p, fake_p = Path(tmp) / "real.jsonl.gz", Path(tmp) / "fake.jsonl.gz"
                t0 = time.perf_counter()
                record(fam, real_p, steps=2, preset=preset, seed=args.seed, overrides=ov)
                t1 = time.perf_counter()
                record_fake(fam, fake_p, steps=2, preset=preset, seed=args.seed, overrides=ov,
                            small_numel=args.small_numel)
                t2 = time.perf_counter()
                real, fake = iteration_summary(read_trace(real_p)), iteration_summary(read_trace(fake_p))
                err = fake.relative_error(real)
                row = {"family": fam, "size": size, "overrides": ov, "real": vars(real), "fake": vars(fake),
                       "error": err, "real_s": t1 - t0, "fake_s": t2 - t1}
                rows.append(row)
                print(f"{fam:10s} {size:8s} ops {real.ops:6d} {err['ops']:+7.1%}  storage {real.storage_bytes/1e6:9.2f} MB "
                      f"{err['storage_bytes']:+7.1%}  peak {real.peak_bytes/1e6:9.2f} MB {err['peak_bytes']:+7.1%}  "
                      f"flops {err['flops']:+7.1%}  ({t1 - t0:.1f} s real, {t2 - t1:.1f} s fake)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"small_numel": args.small_numel, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
