"""What covering saves: the native observer with storages covered (the CPU default: deaths heard of)
against every storage exposed (as on CUDA: deaths swept for), paired run by run in one process.

    python tools/cover_pair.py [--families moe varlen evoformer] [--fraction 0.25] [--reps 3] [--preset small]

Per family: PyTorch alone's peak sets the budget; then ``reps`` rounds of (covered, exposed) lru
runs, 3 steps each, with the stepping thread's CPU time of the steps after the first. Prints the
median per-step seconds of each and the ratio exposed / covered per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dynn_runtime.runtime.events import native_module
from dynn_runtime.runtime.train import train_managed, train_unmanaged


def _run(family: str, budget: int, preset: str, cover: bool) -> tuple[float, dict]:
    C = native_module()
    base = C.Observer
    if not cover:
        class Exposed(base):  # type: ignore[misc, valid-type]
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.cover = False
        C.Observer = Exposed
    times: list[float] = []
    last = [time.thread_time()]

    def on_step(step: int, loss: float, stats: object) -> None:
        now = time.thread_time()
        if step > 0:
            times.append(now - last[0])
        last[0] = now

    try:
        r = train_managed(family, budget, "lru", steps=3, preset=preset, device="cpu", on_step=on_step)
    finally:
        C.Observer = base
    return statistics.median(times), r.stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=["moe", "varlen", "evoformer"])
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--preset", default="small")
    a = ap.parse_args()
    torch.set_num_threads(1)
    for fam in a.families:
        peak = max(train_unmanaged(fam, steps=2, preset=a.preset, device="cpu").peak_bytes)
        budget = int(peak * a.fraction)
        rounds = []
        for _ in range(a.reps):
            cov, st_c = _run(fam, budget, a.preset, True)
            exp, st_e = _run(fam, budget, a.preset, False)
            rounds.append(dict(covered_s=round(cov, 4), exposed_s=round(exp, 4), ratio=round(exp / cov, 3),
                               evictions=(st_c["evictions"], st_e["evictions"])))
        print(json.dumps(dict(family=fam, fraction=a.fraction, preset=a.preset, rounds=rounds,
                              median_ratio=statistics.median(r["ratio"] for r in rounds))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
