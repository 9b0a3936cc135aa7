"""Peak memory of the zoo on the CPU: params, saved activations, step peak.

Usage: python tools/measure_zoo_memory.py PRESET STEPS [JSON overrides per family]
"""

import contextlib
import json
import sys

import torch

from dynn_runtime import models
from dynn_runtime.memory import LiveBytes, format_bytes
from dynn_runtime.workload import make_optimizer, train_step


def saved_bytes_hook():
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


res = {}
preset = sys.argv[1]
steps = int(sys.argv[2])
over = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
for name in models.FAMILIES:
    kw = over.get(name, {})
    wl = models.build(name, preset, seed=0, **kw)
    pptrs = {p.untyped_storage().data_ptr() for p in wl.model.parameters()}
    opt = make_optimizer(wl, wl.model.parameters())
    act, peak = [], []
    for s in range(steps):
        b = wl.make_batch(s)
        seen, hooks = saved_bytes_hook()
        with LiveBytes() as m:
            # the saved-tensor hooks are on for the forward pass only: what autograd saves there
            loss = train_step(wl, wl.model, opt, b,
                              phase=lambda name, h=hooks: h if name == "forward" else contextlib.nullcontext())
        a = sum(v for k, v in seen.items() if k not in pptrs)
        act.append(a)
        peak.append(m.peak_bytes)
        del loss, seen
    pbytes = sum(p.numel() * p.element_size() for p in wl.model.parameters())
    print(
        f"{name:11s} {preset:6s} {kw} params={format_bytes(pbytes):>10s} saved-activations max={format_bytes(max(act)):>10s} min={format_bytes(min(act)):>10s} step-peak max={format_bytes(max(peak)):>10s}",
        flush=True,
    )
