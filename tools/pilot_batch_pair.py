"""`python tools/pilot_batch_pair.py [FAMILY] [PAIRS] [--nogc] [--switch ATTR] [--budget B]`: `small`, the pilot above the
peak (or at budget B, e.g. ``1/2``) on the native source: thread CPU time of managed steps with the policy's boolean ATTR on and off, alternating step by step in one
manager, each after a PyTorch alone step (outside mm.step). ATTR: ``batch_kernel`` (default: the bulk call's runs in
one kernel call, or one kernel call per operator) or ``native_pack`` (the runs' records packed by the C module, or
by the Python loop); or an attribute of the manager (``records_in_batch``: every storage a batch sees born
recorded, or only those that outlive it; ``operators_in_c``: the runtime's parse of a batch in C, or by its
Python loop; ``stops_in_c``: a batch whose ``after_op`` calls may act parsed in C and told in one call that stops
for them, or one operator at a time by the runtime's Python loop, whose time counts as its parse here)."""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

import dynn_runtime as dr
from dynn_runtime.pilot.policy import PilotPolicy
from dynn_runtime.workload import load_workload, make_optimizer, train_step

family = sys.argv[1] if len(sys.argv) > 1 else "tree_lstm"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
nogc = "--nogc" in sys.argv
switch = sys.argv[sys.argv.index("--switch") + 1] if "--switch" in sys.argv else "batch_kernel"
budget = sys.argv[sys.argv.index("--budget") + 1] if "--budget" in sys.argv else 1 << 50
torch.set_num_threads(1)
wl = load_workload(family, preset="small", seed=0)
torch.manual_seed(0)
model = wl.model
opt = make_optimizer(wl, model.parameters())
pol = PilotPolicy(backend="native")
mm = dr.MemoryManager(budget, policy=pol, device="cpu", events="native").attach(model, opt)
res = {True: [], False: []}
inside = {True: [], False: []}
_acc = [0.0]
_orig = pol.on_operators
def _timed(events, phase, *after):
    t0 = time.thread_time()
    try:
        _orig(events, phase, *after)
    finally:
        _acc[0] += time.thread_time() - t0
pol.on_operators = _timed
# the runtime's side of the bulk path: its parse of a batch (records, Op records, access fields), the policy's call
# taken out
_parse = [0.0]
_orig_parse = mm._native_operators
def _timed_parse(log, **stops):
    t0 = time.thread_time()
    before = _acc[0]
    try:
        _orig_parse(log, **stops)
    finally:
        _parse[0] += time.thread_time() - t0 - (_acc[0] - before)
mm._native_operators = _timed_parse
parse = {True: [], False: []}
alone = {True: [], False: []}
ops = 0
young = {True: 0, False: 0}
full = {True: 0, False: 0}
cur = [None]
def cb(phase, info):
    if phase == "start" and cur[0] is not None:
        if info["generation"] == 0:
            young[cur[0]] += 1
        elif info["generation"] == 2:
            full[cur[0]] += 1
gc.callbacks.append(cb)
try:
    for s in range(2):
        with mm.step():
            train_step(wl, model, opt, wl.make_batch(s))
    for r in range(steps):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            b = wl.make_batch(2 + 2 * r + on)
            t0 = time.thread_time()
            train_step(wl, model, opt, b)
            p = time.thread_time() - t0
            setattr(pol if hasattr(pol, switch) else mm, switch, on)
            cur[0] = on
            gc.collect()
            if nogc:
                gc.disable()
            _acc[0] = 0.0
            _parse[0] = 0.0
            with mm.step():
                t0 = time.thread_time()
                train_step(wl, model, opt, b)
                m = time.thread_time() - t0
            cur[0] = None
            gc.enable()
            ops = mm.steps[-1].ops
            res[on].append(m)
            inside[on].append(_acc[0] / ops)
            parse[on].append(_parse[0] / ops)
            alone[on].append(p)
    assert mm.stats()["event_source"] == "native"
finally:
    mm.detach()
for on in (True, False):
    m, p = statistics.median(res[on]), statistics.median(alone[on])
    print(f"  min managed {min(res[on]):.3f}, min alone {min(alone[on]):.3f}")
    print(f"{switch}={on}: managed {m:.3f} s/step, PyTorch alone {p:.3f} s/step, ratio {m / p:.2f}x, "
          f"+{(m - p) / ops * 1e6:.1f} us/op over alone ({ops} ops/step), young collections {young[on]}, full {full[on]}")
    print(f"  on_operators: median {statistics.median(inside[on]) * 1e6:.1f} us/op, min {min(inside[on]) * 1e6:.1f}")
    print(f"  the runtime's parse: median {statistics.median(parse[on]) * 1e6:.1f} us/op, min {min(parse[on]) * 1e6:.1f}")
d = [a - b for a, b in zip(res[True], res[False])]
e = [a - b for a, b in zip(inside[True], inside[False])]
print(f"on_operators per pair (on - off): median {statistics.median(e) * 1e6:+.1f} us/op, lower in {sum(x < 0 for x in e)}/{len(e)}")
f = [a - b for a, b in zip(parse[True], parse[False])]
print(f"the runtime's parse per pair (on - off): median {statistics.median(f) * 1e6:+.1f} us/op, "
      f"lower in {sum(x < 0 for x in f)}/{len(f)}")
print("pairs (on, off) s:", [(round(a, 3), round(b, 3)) for a, b in zip(res[True], res[False])])
print(f"per-pair difference (on - off): median {statistics.median(d) / ops * 1e6:+.1f} us/op; "
      f"on lower in {sum(x < 0 for x in d)}/{len(d)} pairs")
