"""Wall time of simulating one small iteration per family and policy (needs out/traces/*-small.jsonl.gz from `dynn trace`)."""

import time

from dynn_runtime.policies import POLICIES
from dynn_runtime.sim import simulate
from dynn_runtime.trace import read_trace

for fam in ["moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen"]:
    tr = read_trace(f"out/traces/{fam}-small.jsonl.gz")
    worst = 0
    worst_p = ""
    for pol in POLICIES:
        for b in (0.5, 0.125):
            t0 = time.perf_counter()
            simulate(tr, pol, b, "h100")
            dt = time.perf_counter() - t0
            if dt > worst:
                worst, worst_p = dt, f"{pol}@{b}"
    print(
        f"{fam:11s} ops/iter={len(tr.iterations[-1].ops):6d} slowest policy run {worst * 1000:6.0f} ms ({worst_p})",
        flush=True,
    )
