"""``dynn train WORKLOAD --budget B --policy P``: training under the memory manager, from the command line.

``dynn_runtime.cli`` owns ``dynn train``; this module adds its memory-manager options and runs it
when ``--budget`` is given (without it, ``dynn train`` trains as plain PyTorch, as before).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from ..memory import format_bytes
from ..policies.base import policy_class

__all__ = ["add_budget_args", "run_train"]


def add_budget_args(p: argparse.ArgumentParser) -> None:
    """The options of ``dynn train`` that put the run under the memory manager."""
    g = p.add_argument_group("memory manager (with --budget)")
    g.add_argument("--budget", default=None, metavar="B",
                   help="train under the memory manager within B: a fraction of the unmanaged peak (1/8, 0.125; "
                        "the first step runs unmanaged to measure it), bytes, or a size (6GiB, 512MB)")
    g.add_argument("--measure-steps", type=int, default=1, metavar="K",
                   help="a fractional budget's peak is measured over the first K steps (default 1); a dynamic "
                        "network's first step need not reach its peak")
    g.add_argument("--policy", default="lru",
                   help="what to move and when: none, lru, save_on_cpu, replay, oracle (records a trace of the "
                        "same run first), pilot (default lru)")
    g.add_argument("--host-budget", default=None, metavar="SIZE",
                   help="most host memory offloaded tensors may use, e.g. 8GiB (default unlimited)")
    g.add_argument("--sync-copies", action="store_true", help="CUDA: copies on the compute stream, synchronous")
    g.add_argument("--no-compare", dest="compare", action="store_false",
                   help="skip the unmanaged run that checks losses and final parameters are bit-identical")
    g.add_argument("--json", default=None, metavar="OUT.json", help="write the run's results as JSON")
    g.add_argument("--timeline", default=None, metavar="OUT.png",
                   help="write the memory timeline (managed bytes per operator, budget, unmanaged curve; the "
                        "unmanaged curve costs one more run with the manager accounting only)")


def _step_line(step: int, loss: float, st: dict[str, Any], budget_text: str) -> str:
    if not st.get("managed", True):
        return (f"step {step:4d}  loss {loss:.6f}  peak {format_bytes(st['peak_device_bytes'])}  "
                f"(measuring the peak for budget {budget_text})")
    return (f"step {step:4d}  loss {loss:.6f}  peak {format_bytes(st['peak_device_bytes'])} / budget "
            f"{budget_text}  offloaded {format_bytes(st['bytes_offloaded'])}  prefetched "
            f"{format_bytes(st['bytes_prefetched'])}  on demand {format_bytes(st['bytes_fetched_on_demand'])}  "
            f"evictions {st['evictions']}  stall {st['stall_seconds']:.3f} s")


def run_train(args: argparse.Namespace, overrides: dict) -> int:
    """``dynn train ... --budget B``: per-step lines, then a summary; exit 1 if the run is not bit-identical."""
    from .train import accounting_run, compare_unmanaged, deterministic, parse_budget, train_managed

    budget = parse_budget(args.budget)
    cls = policy_class(args.policy)
    if cls is not None and "future" in cls.requires:
        print(f"recording a trace of the same {args.steps} step(s) for the oracle ...", flush=True)
    common = dict(steps=args.steps, preset=args.preset, seed=args.seed, device=args.device, overrides=overrides)
    t0 = time.perf_counter()

    # both sides of the comparison run deterministic kernels (on CUDA some reproduce themselves only so)
    with deterministic() if args.compare else contextlib.nullcontext():
        res = train_managed(args.workload, budget, args.policy, host_budget=args.host_budget,
                            async_copies=not args.sync_copies, on_step=_printer(budget, args.budget),
                            measure_steps=args.measure_steps, **common)
        managed_s = time.perf_counter() - t0
        cmp = compare_unmanaged(res) if args.compare else None
    st = res.stats or {}
    b = res.budget_bytes or 0
    peak = res.max_managed_peak()
    print()
    measured = st.get("measured_peak_bytes")
    how = str(args.budget) if measured is None else f"{args.budget} of the measured peak {format_bytes(measured)}"
    print(f"done: {res.steps} step(s) of {res.workload} ({res.preset}) on {res.device}, policy {res.policy}, "
          f"budget {format_bytes(b)} ({how})")
    n_managed = sum(res.managed_steps)
    if n_managed:
        verdict = "within the budget" if peak <= b else f"OVER the budget by {format_bytes(peak - b)}"
        if peak > b and st.get("budget_overshoot_at"):
            verdict += f" (the largest overshoot: {st['budget_overshoot_at']})"
        print(f"  peak managed bytes   {format_bytes(peak)} over {n_managed} managed step(s): {verdict}")
    else:
        print("  no managed step: the first steps of a fractional budget only measure the peak (--measure-steps); "
              "add --steps")
    print(f"  moved                offloaded {format_bytes(st.get('bytes_offloaded', 0))}, prefetched "
          f"{format_bytes(st.get('bytes_prefetched', 0))} (hits {st.get('prefetch_hits', 0)}), fetched on demand "
          f"{format_bytes(st.get('bytes_fetched_on_demand', 0))} (misses {st.get('prefetch_misses', 0)}), "
          f"{st.get('evictions', 0)} evictions; host peak {format_bytes(st.get('host_bytes_peak', 0))}")
    print(f"  time                 stalls {st.get('stall_seconds', 0):.3f} s, copies {st.get('copy_seconds', 0):.3f} s, "
          f"policy {st.get('policy_seconds', 0):.3f} s; median step {res.median_step_seconds():.4f} s; "
          f"all steps {managed_s:.2f} s")
    code = 0
    if cmp is not None:
        ref = cmp.unmanaged
        print(f"  unmanaged            peak {format_bytes(max(ref.peak_bytes))}, median step "
              f"{ref.median_step_seconds():.4f} s")
        if cmp.losses_identical and cmp.params_identical:
            print("  bit-identical        yes: every loss, and every parameter, buffer and optimizer state after "
                  "the last step")
        else:
            what = [] if cmp.losses_identical else [f"losses (max diff {cmp.max_loss_diff:.3g})"]
            if not cmp.params_identical:
                shown = ", ".join(cmp.differing[:5]) + (" ..." if len(cmp.differing) > 5 else "")
                what.append(f"{len(cmp.differing)} tensor(s): {shown}")
            if cmp.reproducible:
                print(f"  bit-identical        NO: {'; '.join(what)} differ from the unmanaged run")
                code = 1
            else:
                print(f"  bit-identical        cannot tell: {'; '.join(what)} differ, but two unmanaged runs also "
                      "differ from each other (non-deterministic kernels or threads); on CUDA the comparison "
                      "runs with deterministic algorithms, on the CPU use one thread (OMP_NUM_THREADS=1)")
    if args.timeline:
        ref_run = accounting_run(args.workload, **common)
        from .plots import plot_memory_timeline

        path = plot_memory_timeline(res, args.timeline, reference=ref_run)
        print(f"wrote {path}")
    if args.json:
        out = {"kind": "dynn-train", "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "config": {"workload": args.workload, "budget": args.budget, "policy": args.policy,
                          "steps": args.steps, "preset": args.preset, "seed": args.seed, "device": args.device,
                          "overrides": overrides, "host_budget": args.host_budget,
                          "async_copies": not args.sync_copies},
               "result": res.to_json(), "comparison": cmp.to_json() if cmp is not None else None}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_strict(out), indent=1, default=str) + "\n")
        print(f"wrote {path}")
    return code


def _printer(budget: Any, text: str) -> Any:
    """Per-step printer; a fractional budget is shown in bytes once its measuring steps are done."""
    shown = {"text": str(text)}

    def on_step(step: int, loss: float, st: dict[str, Any] | None) -> None:
        st = st or {}
        if not st.get("managed", True) and isinstance(budget, (float, str)):
            print(_step_line(step, loss, st, shown["text"]), flush=True)
            return
        if st.get("budget_bytes") is not None:  # the manager's own figure (it counts late state too)
            shown["text"] = format_bytes(st["budget_bytes"])
        elif isinstance(budget, int):
            shown["text"] = format_bytes(budget)
        print(_step_line(step, loss, st, shown["text"]), flush=True)

    return on_step


def _strict(x: Any) -> Any:
    from ..results import strict_json as strict

    return strict(x)
