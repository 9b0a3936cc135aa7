"""Host cost per operator on the native event source: operators with an unboxed kernel at the
observer's key (``add_``, ``mul``) against their twins of the same schema on the boxed fallback
(``sub_``, ``div``).

Usage: ``python tools/unboxed_micro.py [ROUNDS]``. In one managed step (policy lru, a budget far
above the peak), each operator runs in chunks of 2,000 calls, alternating with the same chunk while
the observer is suspended on the thread (PyTorch alone); prints the fastest chunk of each side (thread
CPU time) and the difference, in microseconds per operator.
"""

from __future__ import annotations

import sys
import time

import torch

import dynn_runtime as dr
from dynn_runtime.runtime.events import QUIET

N = 2000


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 4)
    mm = dr.MemoryManager(1 << 40, policy="lru", device="cpu", events="native").attach(model)
    obs = QUIET[-1]
    x, y = torch.randn(64), torch.randn(64)
    cases = {"add_ (unboxed)": lambda: x.add_(y), "sub_ (boxed)": lambda: x.sub_(y),
             "mul (unboxed)": lambda: torch.mul(x, y), "div (boxed)": lambda: torch.div(x, y)}

    def chunk(f, alone: bool) -> float:
        if alone:
            obs.suspend()
        t0 = time.thread_time()
        for _ in range(N):
            f()
        t = time.thread_time() - t0
        if alone:
            obs.resume()
        return t / N * 1e6

    best = {(k, alone): float("inf") for k in cases for alone in (False, True)}
    try:
        with mm.step():
            for r in range(rounds):
                for k, f in cases.items():
                    for alone in ((False, True) if r % 2 else (True, False)):
                        best[(k, alone)] = min(best[(k, alone)], chunk(f, alone))
    finally:
        mm.detach()
    for k in cases:
        a, m = best[(k, True)], best[(k, False)]
        print(f"{k}: alone {a:.2f} us, managed {m:.2f} us, +{m - a:.2f} us per operator")


if __name__ == "__main__":
    main()
