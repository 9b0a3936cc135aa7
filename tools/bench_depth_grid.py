"""Budget grid on depth-scaled zoo traces, where an eighth of the peak is above the single-operator floor.

    python tools/bench_depth_grid.py PRESET SCALE FAMILIES OUT.json POLICIES
    python tools/bench_depth_grid.py tiny 8 moe,varlen,evoformer,skipnet,early_exit \
        out/bench/depth/grid.json oracle,pilot,replay,lru,dtr,save_on_cpu

Each family's depth knob (layers, blocks) is multiplied by SCALE (``bench.scaled_overrides(...,
"depth")``; the Tree-LSTM has none), the trace recorded through the bench's cache, and every policy
simulated on the h100 profile at budgets 1/2, 1/4, 1/8 of the unmanaged peak; printed as the
iteration time over the unlimited-memory time and written to OUT.json (docs/pilot.md, "In the simulator").
"""

from __future__ import annotations

import json
import sys

from dynn_runtime.bench.harness import TraceCache, scaled_overrides
from dynn_runtime.sim import simulate


def main() -> None:
    preset, scale, fams, out_path, pols = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4], \
        sys.argv[5].split(",")
    cache = TraceCache(".dynn-cache/traces")
    out = []
    for fam in fams:
        ov = scaled_overrides(fam, preset, scale, "depth")
        tr = cache.get(fam, preset, 0, 2, ov)
        ref = simulate(tr, "none", 1.0, "h100").iter_time_s
        row = {"family": fam, "overrides": ov, "ref_s": ref}
        for b in (0.5, 0.25, 0.125):
            for p in pols:
                r = simulate(tr, p, b, "h100")
                row[f"{p}@{b}"] = r.iter_time_s / ref if r.feasible else None
        out.append(row)
        print(fam, ov, " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}=OOM"
                                for k, v in row.items() if "@" in k), flush=True)
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
