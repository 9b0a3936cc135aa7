"""Whether the native event log and the pilot's moves are the same from run to run (issue #28).

    python tools/log_determinism.py log moe [--warm]    # two runs in this process: nodes and deaths per step
    python tools/log_determinism.py pilot moe 1/2 [--order plain-first|managed-first|twice]

`log` trains FAMILY (tiny, 3 steps, native source, no budget pressure) twice in this process and prints,
per run and step, the first operators' node words and digests of the node words (relative to the
step's first node) and of the deaths by position; `--warm` makes an autograd graph first. `pilot`
trains FAMILY under PilotPolicy at BUDGET (4 steps) and prints a digest of its moves and whether the
losses are PyTorch alone's. Run either in two processes and compare the lines.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json

import torch

import dynn_runtime as dr
from dynn_runtime.policies.base import Policy
from dynn_runtime.workload import load_workload, make_optimizer, train_step


def _digest(x: object) -> str:
    return hashlib.md5(json.dumps(x).encode()).hexdigest()[:10]


def _log_run(family: str) -> tuple[list[float], list[dict]]:
    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    mm = dr.MemoryManager(1 << 40, policy=Policy(), device="cpu", events="native", record_every_op=True,
                          history=10).attach(model, opt)
    gc.collect()
    gc.disable()  # the collector's deaths fall where its thresholds do: the program's, not the log's
    losses = []
    try:
        for step in range(3):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(step)).item())
    finally:
        gc.enable()
        mm.detach()
    out = []
    for it in mm.history:
        nodes = [o.node for o in it.ops]
        base = min((n for n in nodes if n >= 0), default=0)
        out.append({"first": nodes[:3], "nodes": [n if n < 0 else n - base for n in nodes],
                    "frees": sorted(it.frees.items())})
    return losses, out


def _pilot_run(family: str, budget: str) -> tuple[list[float], list[tuple], list[int]]:
    from dynn_runtime.pilot.policy import PilotPolicy

    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    pol = PilotPolicy(backend="native")
    moves: list[tuple] = []
    victims, after_op = pol.victims, pol.after_op

    def record_victims(need, exclude):
        for sid in victims(need, exclude):
            moves.append((pol.view.position, "evict", sid))
            yield sid

    def record_after_op(position):
        actions = after_op(position)
        moves.extend((position, a.kind, a.sid) for a in actions)
        return actions

    pol.victims, pol.after_op = record_victims, record_after_op
    mm = dr.MemoryManager(budget, policy=pol, device="cpu", events="native").attach(model, opt)
    losses = []
    try:
        for step in range(4):
            with mm.step():
                losses.append(train_step(wl, model, opt, wl.make_batch(step)).item())
    finally:
        mm.detach()
    return losses, moves, [s.prefetch_hits for s in mm.steps]


def _plain(family: str, steps: int) -> list[float]:
    wl = load_workload(family, preset="tiny", seed=0)
    torch.manual_seed(0)
    model = wl.model
    opt = make_optimizer(wl, model.parameters())
    return [train_step(wl, model, opt, wl.make_batch(s)).item() for s in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["log", "pilot"])
    ap.add_argument("family")
    ap.add_argument("budget", nargs="?", default="1/2")
    ap.add_argument("--warm", action="store_true")
    ap.add_argument("--order", default="plain-first", choices=["plain-first", "managed-first", "twice"])
    a = ap.parse_args()
    if a.mode == "log":
        if a.warm:
            (torch.ones(1, requires_grad=True) * 2).sum().backward()
        for k in range(2):
            losses, steps = _log_run(a.family)
            print(f"run {k + 1}: losses {losses} first nodes {[s['first'] for s in steps]} "
                  f"nodes {[_digest(s['nodes']) for s in steps]} deaths {[_digest(s['frees']) for s in steps]}")
        return
    if a.order == "plain-first":
        ref = _plain(a.family, 4)
        losses, moves, hits = _pilot_run(a.family, a.budget)
    else:
        if a.order == "twice":
            _pilot_run(a.family, a.budget)
        losses, moves, hits = _pilot_run(a.family, a.budget)
        ref = _plain(a.family, 4)
    print(json.dumps({"order": a.order, "bit_identical": losses == ref, "moves": len(moves),
                      "moves_md5": _digest(moves), "prefetch_hits": hits}))


if __name__ == "__main__":
    main()
