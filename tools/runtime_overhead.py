"""Bookkeeping cost of the live MemoryManager on the CPU: budget far above the peak (nothing moves),
managed vs unmanaged step time, interleaved in one process on the same batches (median of steps 1..N).

    python tools/runtime_overhead.py [PRESET] [STEPS] [FAMILY ...]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import dynn_runtime as dr
from dynn_runtime.workload import load_workload, make_optimizer


def main() -> None:
    preset = sys.argv[1] if len(sys.argv) > 1 else "small"
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    fams = sys.argv[3:] or ["moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen"]
    torch.set_num_threads(1)
    for fam in fams:
        wl = load_workload(fam, preset=preset, seed=0)
        model = wl.model
        opt = make_optimizer(wl, model.parameters())
        mm = dr.MemoryManager(1 << 50, policy="lru", device="cpu")
        plain, managed = [], []
        for step in range(steps + 1):
            batch = wl.make_batch(step)
            t0 = time.perf_counter()
            loss = wl.loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            mm.attach(model, opt)
            with mm.step():
                loss = wl.loss(model, batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            ops = mm.steps[-1].ops
            mm.detach()
            t2 = time.perf_counter()
            if step:
                plain.append(t1 - t0)
                managed.append(t2 - t1)
        p, m = statistics.median(plain), statistics.median(managed)
        print(f"{fam:<11} {preset}: unmanaged {p * 1e3:8.1f} ms  managed {m * 1e3:8.1f} ms  ratio {m / p:5.2f}x  "
              f"ops/step {ops}  ~{(m - p) / max(ops, 1) * 1e6:.0f} us/op", flush=True)


if __name__ == "__main__":
    main()
