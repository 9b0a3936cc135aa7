"""What the manager's per-step methods take, nothing moved, on the CPU: the step's start and end and
the optimizer hooks, and the calls inside them.

Usage: ``python tools/step_edges.py FAMILY POLICY STEPS METHOD[,METHOD...] [foreach]`` (``small``
preset; a family may be ``examples/my_workload.py:build``). Each named method of the manager
(``_begin_step``, ``_end_step``, ``_announce``, ``_native_parse``, ``_native_recency_parse``,
``_opt_pre``, ``_opt_post``, ...) is wrapped on the instance with a ``time.perf_counter`` timer;
prints the median step and each method's median microseconds per step, from the fourth step on.
``foreach``: Adam with ``foreach=True``, the optimizer CUDA users get by default (the CPU's default
is the single-tensor loop). One thread; a budget far above the peak (nothing moves).

Times on a shared machine move by 20-30% between runs: compare within a run, or over several.
``tools/overhead_pair.py`` pairs whole steps against PyTorch alone; ``tools/host_instructions.py``
counts instructions.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time

import torch

import dynn_runtime as dr
from dynn_runtime.workload import load_workload, make_optimizer, train_step


def main() -> None:
    if len(sys.argv) < 5:
        raise SystemExit(__doc__)
    family, policy, steps, names = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    foreach = len(sys.argv) > 5 and sys.argv[5] == "foreach"
    torch.set_num_threads(1)
    wl = load_workload(family, preset="small", seed=0)
    model = copy.deepcopy(wl.model)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True) if foreach
           else make_optimizer(wl, model.parameters()))
    batches = [wl.make_batch(s) for s in range(steps)]
    mm = dr.MemoryManager(1 << 50, policy=policy, device="cpu", events="native")
    cur = dict.fromkeys(names, 0.0)
    acc: dict[str, list[float]] = {k: [] for k in names}

    def timed(k, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                cur[k] += time.perf_counter() - t0
        return wrapper

    for k in names:
        setattr(mm, k, timed(k, getattr(mm, k)))
    mm.attach(model, opt)
    step_s = []
    try:
        for s in range(steps):
            cur.update(dict.fromkeys(names, 0.0))
            t0 = time.perf_counter()
            with mm.step():
                train_step(wl, model, opt, batches[s])
            step_s.append(time.perf_counter() - t0)
            if s >= 3:
                for k in names:
                    acc[k].append(cur[k])
    finally:
        mm.detach()
    print(f"{family} {policy}: step {statistics.median(step_s[3:]) * 1e3:.2f} ms; "
          + ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in acc.items()) + " us")


if __name__ == "__main__":
    main()
