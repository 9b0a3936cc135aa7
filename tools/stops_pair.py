"""`python tools/stops_pair.py FAMILY PAIRS [BUDGET]`: `small`, the pilot at BUDGET (default ``1/2``) on the native
source: the thread CPU time per managed step of the runtime's log reads (``NativeSource._native_parse_log``, the
policy's calls in it included) and of the whole step, with ``stops_in_c`` on (a batch whose ``after_op`` calls may
act parsed in C and told in one call that stops for them) and off (one operator at a time by the runtime's Python
loop), alternating step by step in one manager (the decisions are the same either way)."""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

import dynn_runtime as dr
from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.workload import load_workload, make_optimizer, train_step

family, pairs = sys.argv[1], int(sys.argv[2])
budget = sys.argv[3] if len(sys.argv) > 3 else "1/2"
torch.set_num_threads(1)
wl = load_workload(family, preset="small", seed=0)
torch.manual_seed(0)
opt = make_optimizer(wl, wl.model.parameters())
mm = dr.MemoryManager(budget, policy=PilotPolicy(), device="cpu", events="native").attach(wl.model, opt)
acc, depth = [0.0], [0]
_orig = mm._native_parse_log


def _timed(*args):
    if depth[0]:  # a handler's read inside a read is the outer one's
        return _orig(*args)
    depth[0] += 1
    t0 = time.thread_time()
    try:
        return _orig(*args)
    finally:
        acc[0] += time.thread_time() - t0
        depth[0] -= 1


mm._native_parse_log = _timed
reads: dict[bool, list[float]] = {True: [], False: []}
steps: dict[bool, list[float]] = {True: [], False: []}
try:
    for s in range(2):
        with mm.step():
            train_step(wl, wl.model, opt, wl.make_batch(s))
    k = 2
    for r in range(pairs):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            mm.stops_in_c = on
            acc[0] = 0.0
            gc.collect()
            t0 = time.thread_time()
            with mm.step():
                train_step(wl, wl.model, opt, wl.make_batch(k))
            steps[on].append(time.thread_time() - t0)
            reads[on].append(acc[0])
            k += 1
finally:
    mm.detach()
for on in (True, False):
    print(f"{family} stops_in_c={on}: step {statistics.median(steps[on]) * 1e3:.1f} ms (min "
          f"{min(steps[on]) * 1e3:.1f}), log reads {statistics.median(reads[on]) * 1e3:.1f} ms/step "
          f"(min {min(reads[on]) * 1e3:.1f})")
d = [a - b for a, b in zip(reads[True], reads[False])]
e = [a - b for a, b in zip(steps[True], steps[False])]
print(f"{family} on - off per pair: log reads median {statistics.median(d) * 1e3:+.1f} ms/step (lower in "
      f"{sum(x < 0 for x in d)}/{len(d)}), step median {statistics.median(e) * 1e3:+.1f} ms (lower in "
      f"{sum(x < 0 for x in e)}/{len(e)})")
