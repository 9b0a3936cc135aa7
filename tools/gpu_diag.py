"""GPU diagnostics for a short lease: where managed training stops being bit-identical, and the
manager's step time against PyTorch alone measured both before and after it (A-B-A).

    python tools/gpu_diag.py identity [--families varlen evoformer] [--fraction 0.25]
    python tools/gpu_diag.py overhead [--families moe varlen evoformer] [--steps 8]
    python tools/gpu_diag.py profile [--families moe] [--fraction 0.5] [--steps 4]
    python tools/gpu_diag.py hardcap [--families moe varlen evoformer] [--fraction 0.25]
    python tools/gpu_diag.py lru-order [--families moe tree_lstm evoformer] [--fraction 0.5] [--steps 5]
    python tools/gpu_diag.py one FAMILY FRACTION VARIANT      (a child: one managed run, one JSON line)

``identity`` runs each family at ``--fraction`` of its peak with lru (a logical budget) in one child
process per variant: native events; python events; native with synchronous copies (every copy on
the compute stream); native under ``CUDA_LAUNCH_BLOCKING=1``. A variant that is identical where the
default is not names the missing order (asynchronous copies, or launches overlapping the host).
For each it prints the first step whose loss differs and how many state tensors differ.

``profile`` runs lru at ``--fraction`` (a logical budget, native events) under cProfile and prints the
host functions by own time and by cumulative time: where the host goes when storages move.
``hardcap`` trains lru under a hard cap at ``--fraction`` and, where it fails, prints the whole
traceback, the manager's view and the caching allocator's own summary.
``lru-order`` times lru with its order kept by the native observer against lru keeping it in Python
(``native_order=False``), each after a run of PyTorch alone, at ``--fraction`` and with nothing moved.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEVICE = os.environ.get("DYNN_DIAG_DEVICE", "cuda")  # cpu: a smoke run of this script

VARIANTS = {
    "native": ({"DYNN_EVENTS": "native"}, {}),
    "python": ({"DYNN_EVENTS": "python"}, {}),
    "native-sync-copies": ({"DYNN_EVENTS": "native"}, {"async_copies": False}),
    "native-launch-blocking": ({"DYNN_EVENTS": "native", "CUDA_LAUNCH_BLOCKING": "1"}, {}),
}


def one(family: str, fraction: float, variant: str, steps: int) -> dict:
    from dynn_runtime.runtime.train import deterministic, train_managed, train_unmanaged

    kw = VARIANTS[variant][1]
    with deterministic():
        base = train_unmanaged(family, steps=steps, preset="small", device=DEVICE)
        r = train_managed(family, int(max(base.peak_bytes) * fraction), "lru", steps=steps, preset="small",
                          device=DEVICE, **kw)
    differ = sorted(k for k, v in r.tensor_digests.items() if base.tensor_digests.get(k) != v)
    first = next((i for i, (a, b) in enumerate(zip(base.losses, r.losses, strict=True)) if a != b), None)
    st = r.stats
    return dict(family=family, variant=variant, fraction=fraction, identical=not differ and first is None,
                first_loss_step=first, differ=len(differ), examples=differ[:6], moved=st["bytes_offloaded"],
                on_demand=st.get("bytes_fetched_on_demand"), event_source=st.get("event_source"))


def identity(families: list[str], fraction: float, steps: int, timeout: float) -> list[dict]:
    rows = []
    for fam in families:
        for variant, (env, _) in VARIANTS.items():
            t0 = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, __file__, "one", fam, str(fraction), variant, "--steps", str(steps)],
                                   capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
                line = [x for x in p.stdout.splitlines() if x.startswith("{")]
                row = json.loads(line[-1]) if line else dict(family=fam, variant=variant, error=p.stderr[-1500:])
            except subprocess.TimeoutExpired:
                row = dict(family=fam, variant=variant, error=f"timeout after {timeout} s")
            row["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def lru_order(families: list[str], fraction: float, steps: int) -> list[dict]:
    """lru with its order kept by the observer against lru keeping it in Python (``native_order``),
    each between runs of PyTorch alone (A-B-A-B-A), at ``fraction`` of the peak and with nothing moved."""
    import torch

    from dynn_runtime.runtime.train import deterministic, train_managed, train_unmanaged

    os.environ["DYNN_EVENTS"] = "native"
    rows = []
    with deterministic():
        for fam in families:
            train_unmanaged(fam, steps=2, preset="small", device=DEVICE)  # warm-up: handles, kernels, the allocator
            for budget in (fraction, 64 << 30):
                times: dict[str, list[float]] = {}
                moves = {}
                for label in ("alone", "native", "alone", "python", "alone"):
                    if label == "alone":
                        r = train_unmanaged(fam, steps=steps, preset="small", device=DEVICE)
                    else:
                        r = train_managed(fam, budget, "lru", steps=steps, preset="small", device=DEVICE,
                                          policy_options={"native_order": label == "native"})
                        moves[label] = sum(s.get("evictions", 0) for s in (r.stats or {}).get("per_step", [])[1:])
                    if DEVICE == "cuda":
                        torch.cuda.synchronize()
                    times.setdefault(label, []).append(r.median_step_seconds())
                alone = sorted(times["alone"])[1]
                row = dict(family=fam, budget=budget if budget != 64 << 30 else "above the peak", steps=steps,
                           alone_ms=[round(x * 1e3, 2) for x in times["alone"]],
                           native_ms=round(times["native"][0] * 1e3, 2), python_ms=round(times["python"][0] * 1e3, 2),
                           native_ratio=round(times["native"][0] / alone, 3),
                           python_ratio=round(times["python"][0] / alone, 3), evictions=moves)
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def overhead(families: list[str], steps: int) -> list[dict]:
    """PyTorch alone, none (native), PyTorch alone, lru (native), PyTorch alone: a budget above the peak."""
    import torch

    from dynn_runtime.runtime.train import deterministic, train_managed, train_unmanaged

    os.environ["DYNN_EVENTS"] = "native"
    rows = []
    with deterministic():
        for fam in families:
            train_unmanaged(fam, steps=2, preset="small", device=DEVICE)  # warm-up: handles, kernels, the allocator
            times: dict[str, list[float]] = {}
            for label in ("alone", "none", "alone", "lru", "alone"):
                if label == "alone":
                    r = train_unmanaged(fam, steps=steps, preset="small", device=DEVICE)
                else:
                    r = train_managed(fam, 64 << 30, label, steps=steps, preset="small", device=DEVICE)
                if DEVICE == "cuda":
                    torch.cuda.synchronize()
                times.setdefault(label, []).append(r.median_step_seconds())
            alone = sorted(times["alone"])[1]
            row = dict(family=fam, steps=steps, alone_ms=[round(x * 1e3, 2) for x in times["alone"]],
                       none_ms=round(times["none"][0] * 1e3, 2), lru_ms=round(times["lru"][0] * 1e3, 2),
                       none_ratio=round(times["none"][0] / alone, 3), lru_ratio=round(times["lru"][0] / alone, 3))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def profile(families: list[str], fraction: float, steps: int) -> None:
    import cProfile
    import pstats

    import torch

    from dynn_runtime.runtime.train import train_managed, train_unmanaged

    os.environ["DYNN_EVENTS"] = "native"
    for fam in families:
        base = train_unmanaged(fam, steps=2, preset="small", device=DEVICE)
        budget = int(max(base.peak_bytes) * fraction)
        train_managed(fam, budget, "lru", steps=2, preset="small", device=DEVICE)  # warm: kernels, pinned chunks
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        r = train_managed(fam, budget, "lru", steps=steps, preset="small", device=DEVICE)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        prof.disable()
        st = r.stats
        print(f"== {fam} lru at {fraction} ({budget} B): {time.perf_counter() - t0:.2f} s for {steps} steps, "
              f"median step {r.median_step_seconds() * 1e3:.1f} ms, evictions {st.get('evictions')}, "
              f"prefetch misses {st.get('prefetch_misses')}, copy_seconds {st.get('copy_seconds')}", flush=True)
        ps = pstats.Stats(prof)
        ps.sort_stats("tottime").print_stats(28)
        ps.sort_stats("cumulative").print_stats(40)
        timed(fam, budget, steps)


def timed(fam: str, budget: int, steps: int) -> None:
    """The same run without the profiler, the manager's move path timed per call (wall clock, us)."""
    import functools

    import torch

    from dynn_runtime.runtime import copies, hostpool, moves
    from dynn_runtime.runtime.train import train_managed

    spent: dict[str, list[float]] = {}
    saved = []

    def wrap(owner: type, name: str) -> None:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))
        key = f"{owner.__name__}.{name}"
        acc = spent.setdefault(key, [0.0, 0])

        @functools.wraps(fn)
        def inner(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[0] += time.perf_counter() - t0
                acc[1] += 1
        setattr(owner, name, inner)

    for owner, name in [(copies.CudaCopies, "to_host"), (copies.CudaCopies, "to_device"), (copies.CudaCopies, "release"),
                        (copies.CudaCopies, "allocate"), (copies.CudaCopies, "timed_wait"),
                        (copies.CudaCopies, "compute_waits"), (moves.Moves, "_evict"), (moves.Moves, "_release_device"),
                        (moves.Moves, "_fetch_now"), (moves.Moves, "_prefetch"), (moves.Moves, "_reap"),
                        (hostpool.HostPool, "alloc"), (hostpool.HostPool, "release")]:
        if hasattr(owner, name):
            wrap(owner, name)
    t0 = time.perf_counter()
    try:
        r = train_managed(fam, budget, "lru", steps=steps, preset="small", device=DEVICE)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    print(f"== {fam} timed: {time.perf_counter() - t0:.2f} s for {steps} steps, median step "
          f"{r.median_step_seconds() * 1e3:.1f} ms (all steps, nested times overlap)", flush=True)
    for key, (sec, n) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        if n:
            print(f"  {key:28s} {n:7d} calls {sec * 1e3:9.1f} ms {sec / n * 1e6:8.1f} us/call", flush=True)


def hardcap(families: list[str], fraction: float, steps: int) -> None:
    import traceback

    import torch

    from dynn_runtime.runtime.train import train_managed, train_unmanaged

    os.environ["DYNN_EVENTS"] = "native"
    for fam in families:
        base = train_unmanaged(fam, steps=steps, preset="small", device=DEVICE)
        cap = int(max(base.peak_bytes) * fraction)
        print(f"== {fam} hard cap {fraction}: {cap} B of peak {max(base.peak_bytes)} B "
              f"(reserved peak {max(base.reserved_peak_bytes or [0])} B)", flush=True)
        try:
            r = train_managed(fam, cap, "lru", steps=steps, preset="small", device=DEVICE, hard_cap=True)
            st = r.stats
            print(f"ok: median {r.median_step_seconds() * 1e3:.1f} ms, evictions {st.get('evictions')}, "
                  f"oom_retries {st.get('oom_retries')}, peak {max(r.peak_bytes)} B", flush=True)
        except Exception:
            traceback.print_exc()
            if DEVICE == "cuda":
                print(torch.cuda.memory_summary(abbreviated=True), flush=True)
                torch.cuda.set_per_process_memory_fraction(1.0)
                torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["identity", "overhead", "profile", "hardcap", "lru-order", "one"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--families", nargs="+", default=None)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args()
    if a.mode == "one":
        fam, frac, variant = a.rest
        print(json.dumps(one(fam, float(frac), variant, a.steps or 3)), flush=True)
    elif a.mode == "identity":
        identity(a.families or ["varlen", "evoformer"], a.fraction, a.steps or 3, a.timeout)
    elif a.mode == "profile":
        profile(a.families or ["moe"], a.fraction, a.steps or 4)
    elif a.mode == "lru-order":
        lru_order(a.families or ["moe", "tree_lstm", "evoformer"], a.fraction, a.steps or 5)
    elif a.mode == "hardcap":
        hardcap(a.families or ["moe", "varlen", "evoformer"], a.fraction, a.steps or 3)
    else:
        overhead(a.families or ["moe", "varlen", "evoformer"], a.steps or 8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
