"""Host instructions per step, managed against PyTorch alone, counted by valgrind (CPU; no GPU needed).

Usage: ``python tools/host_instructions.py FAMILY[,FAMILY...] [--preset tiny] [--steps 4,12]
[--policy none] [--budget F] [--copies sync|log] [--jobs 2] [--keep DIR]``

Timings on a shared machine move by 10-30% from step to step; instruction counts do not. Each
workload runs four times under ``valgrind --tool=callgrind`` (managed and alone, each for two
numbers of steps after the same warm-up), and the difference between the two step counts, divided
by their difference, is what one step executes: start-up, imports and the warm-up cancel out.
Managed runs ``MemoryManager(policy, budget far above the peak, events="native")``: nothing moves,
so what it adds is the manager's bookkeeping, the host work that decides the nothing-moved ratio
of a host-bound GPU step. ``tiny`` presets keep the kernels small, as a GPU's are to its host.
``--budget F`` (F of the measured peak) makes it move: the extra per move is then the host work of
a move, and ``--copies log`` runs the C++ copy engine on its log device, so a move makes the calls
it makes on CUDA (the copies themselves run at once, as memcpy).

``--keep DIR`` keeps the callgrind files, for ``callgrind_annotate`` by function. (Not by shared
object: it merges functions of one name in different libraries, the stripped ones' inlined
``std::string`` members among them, under the first library it met, which changes from run to run.)

The runs set ``PYTHONHASHSEED=0`` and one BLAS thread, so that two runs of one build execute nearly
the same instructions (docs/benchmarks.md says how nearly). A count is not a time (a cache miss
costs more than an add), so a change is judged by both: this for what the host executes,
``tools/overhead_pair.py`` for what it costs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import sys, torch
import dynn_runtime as dr
from dynn_runtime.workload import load_workload, make_optimizer, train_step
torch.set_num_threads(1)
family, preset, mode, policy, warm, steps, budget, engine = sys.argv[1:9]
torch.manual_seed(0)
wl = load_workload(family, preset=preset, seed=0)
model = wl.model
opt = make_optimizer(wl, model.parameters())
batches = [wl.make_batch(s) for s in range(8)]
if mode == "managed":
    copies = None
    if engine == "log":  # the C++ engine on its log device: the CUDA path's calls, the copies run at once
        from dynn_runtime.runtime.copies import native_copies
        copies = native_copies("log", 0, True)
    mm = dr.MemoryManager(float(budget) if budget else 1 << 50, policy=policy, device="cpu", events="native",
                          copies=copies)
    mm.attach(model, opt)
    step = mm.step
else:
    import contextlib
    step = contextlib.nullcontext
for i in range(int(warm) + int(steps)):
    with step():
        train_step(wl, model, opt, batches[i % len(batches)])
if mode == "managed":
    last = mm.steps[-1]
    print("ops", last.ops, "moves", last.evictions + last.prefetch_misses + last.prefetch_hits)
"""

_TOTAL = re.compile(r"Collected : (\d+)")


def _run(family: str, preset: str, mode: str, policy: str, budget: str, engine: str, warm: int, steps: int,
         out: str) -> tuple[int, int, int]:
    # run outside the checkout, so that the child imports the installed package (the checkout's own
    # directory would shadow a package installed elsewhere, as when a build is compared with another)
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    path, sep, fn = family.rpartition(":")
    if sep and path.endswith(".py"):  # a workload file: the child runs in another directory
        family = f"{os.path.abspath(path)}:{fn}"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", _CHILD,
           family, preset, mode, policy, str(warm), str(steps), budget, engine]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=os.path.dirname(out))
    m = _TOTAL.search(p.stderr)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"host_instructions: {family} {mode} {steps} steps failed:\n{p.stderr[-2000:]}")
    ops = re.search(r"ops (\d+) moves (\d+)", p.stdout)
    return int(m.group(1)), int(ops.group(1)) if ops else 0, int(ops.group(2)) if ops else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", default="4,12", help="the two step counts, after one warm-up step")
    ap.add_argument("--policy", default="none")
    ap.add_argument("--budget", default="", help="the managed budget (a fraction < 1 of the measured peak); "
                                                  "default far above the peak: nothing moves")
    ap.add_argument("--copies", choices=("sync", "log"), default="sync",
                    help="the copy engine: the CPU's synchronous one, or the C++ engine on its log device "
                         "(the calls a CUDA move makes; the copies run at once)")
    ap.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    ap.add_argument("--keep", default="", help="a folder to keep the callgrind files in")
    args = ap.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("host_instructions: valgrind is not installed (apt install valgrind)")
    lo, hi = (int(x) for x in args.steps.split(","))
    if hi <= lo:
        raise SystemExit("host_instructions: --steps LO,HI needs HI > LO")
    work = args.keep or tempfile.mkdtemp(prefix="dynn-cg-")
    os.makedirs(work, exist_ok=True)
    for family in args.families.split(","):
        runs = [(mode, n) for mode in ("alone", "managed") for n in (lo, hi)]
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
            futs = {r: ex.submit(_run, family, args.preset, r[0], args.policy, args.budget, args.copies, 1, r[1],
                                 os.path.join(work, f"cg.{re.sub(r'[^A-Za-z0-9_.-]', '_', family)}.{r[0]}.{r[1]}")) for r in runs}
            got = {r: f.result() for r, f in futs.items()}
        per = {mode: (got[(mode, hi)][0] - got[(mode, lo)][0]) / (hi - lo) for mode in ("alone", "managed")}
        ops, moves = got[("managed", hi)][1:]
        extra = per["managed"] - per["alone"]
        moved = f"at {args.budget}, {moves} moves in the last step" if args.budget else "nothing moved"
        per_move = f", +{extra / moves:.0f} a move" if moves else ""
        print(f"{family} ({args.preset}, {args.policy}, {moved}): alone {per['alone'] / 1e6:.2f} M "
              f"instructions/step, managed {per['managed'] / 1e6:.2f} M: x{per['managed'] / per['alone']:.4f}, "
              f"+{extra / 1e6:.2f} M a step, +{extra / max(ops, 1):.0f} a operator ({ops} operators){per_move}", flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
