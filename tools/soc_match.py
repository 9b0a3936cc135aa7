"""The manager at the memory torch's ``save_on_cpu`` reaches, against it (issue #28's GPU target).

Usage: ``python tools/soc_match.py [FAMILY ...] [--steps N] [--policies lru,pilot] [--device cuda]
[--rounds R] [--json PATH]`` (``small`` presets; default families moe, skipnet, early_exit, tree_lstm,
evoformer, varlen; a policy ``P-pycopies`` is P with its copies issued by the Python engine,
``CudaCopies``, rather than the C++ one, ``MemoryManager.copies_in_c``).

Per family and round: PyTorch alone, then ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
(pinned on CUDA only), each for ``--steps`` steps, their peaks measured as ``train_unmanaged``
measures them (CUDA: ``max_memory_allocated`` over what the process held before the model). Then
each policy trains under a logical budget of save_on_cpu's peak in bytes; while the managed run's
own peak, measured the same way, lands above save_on_cpu's, the budget becomes what the manager
counted at its peak less that excess (and 3%), and the run is repeated, up to three times, so the row compares runs at the same memory (a row
whose peak stays above says so: its peak is printed beside save_on_cpu's). Rounds alternate the order
of the methods. Step times are medians without the first step, under deterministic algorithms;
"identical" compares every parameter and optimizer-state tensor with PyTorch alone's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dynn_runtime.runtime.devicemem import device_baseline
from dynn_runtime.runtime.manager import MemoryManager
from dynn_runtime.runtime.train import deterministic, train_managed, train_unmanaged

FAMILIES = ("moe", "skipnet", "early_exit", "tree_lstm", "evoformer", "varlen")
SHRINKS = 3


def _managed(family: str, policy: str, budget: int, steps: int, dev: torch.device):
    held = device_baseline(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    was = MemoryManager.copies_in_c
    MemoryManager.copies_in_c = was and not policy.endswith("-pycopies")
    try:
        r = train_managed(family, budget, policy.removesuffix("-pycopies"), steps=steps, preset="small", device=dev)
    finally:
        MemoryManager.copies_in_c = was
    peak = torch.cuda.max_memory_allocated(dev) - held if dev.type == "cuda" else r.max_managed_peak()
    return r, int(peak)


def _shrunk(budget: int, r, excess: int) -> int:
    """The next budget of a run whose peak was ``excess`` bytes above save_on_cpu's: the bytes the
    manager counted at its peak (below the budget where the allocator also holds what no tensor
    shows: workspaces, rounding), less the excess and 3%."""
    counted = max((s["peak_device_bytes"] for s in (r.stats or {}).get("per_step", []) if s["managed"]), default=budget)
    out = int((min(budget, counted) - excess) * 0.97)
    if out <= 0:
        raise ValueError(f"no budget reaches save_on_cpu's peak: {excess} bytes over it at {budget}")
    return out


def one_round(family: str, policies: list[str], steps: int, dev: torch.device, reverse: bool) -> list[dict]:
    rows: list[dict] = []
    pin = dev.type == "cuda"

    def soc():
        return torch.autograd.graph.save_on_cpu(pin_memory=pin)

    alone = train_unmanaged(family, steps=steps, preset="small", device=dev)
    s = train_unmanaged(family, steps=steps, preset="small", device=dev, step_context=soc, label="save_on_cpu")
    t_alone, t_soc, p_soc = alone.median_step_seconds(), s.median_step_seconds(), max(s.peak_bytes)
    rows.append(dict(family=family, method="PyTorch alone", ms=1e3 * t_alone, x_alone=1.0, peak=max(alone.peak_bytes),
                     identical=True))
    rows.append(dict(family=family, method="save_on_cpu", ms=1e3 * t_soc, x_alone=t_soc / t_alone, peak=p_soc,
                     identical=s.digest == alone.digest))
    for pol in (policies[::-1] if reverse else policies):
        budget = p_soc
        try:
            r, peak = _managed(family, pol, budget, steps, dev)
            for _ in range(SHRINKS):  # the allocator holds more than the manager counts: shrink until it fits
                if peak <= p_soc:
                    break
                budget = _shrunk(budget, r, peak - p_soc)
                r, peak = _managed(family, pol, budget, steps, dev)
        except Exception as exc:  # a budget the policy cannot meet is a row, not the end of the run
            rows.append(dict(family=family, method=pol, error=f"{type(exc).__name__}: {str(exc)[:300]}",
                             budget=budget))
            continue
        t = r.median_step_seconds()
        st = r.stats or {}
        rows.append(dict(family=family, method=pol, ms=1e3 * t, x_alone=t / t_alone, x_soc=t / t_soc, peak=peak,
                         budget=budget, identical=r.digest == alone.digest,
                         moves=st.get("evictions", 0), bytes_offloaded=st.get("bytes_offloaded", 0)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--policies", default="lru,pilot")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = torch.device(a.device)
    rows: list[dict] = []
    with deterministic():
        for fam in a.families:
            for rnd in range(a.rounds):
                for row in one_round(fam, a.policies.split(","), a.steps, dev, reverse=bool(rnd % 2)):
                    rows.append({**row, "round": rnd})
                    err = row.get("error")
                    print(f"{fam} r{rnd} {row['method']}: " + (err if err else
                          f"{row['ms']:.1f} ms, {row['x_alone']:.2f}x alone"
                          + (f", {row['x_soc']:.2f}x save_on_cpu" if "x_soc" in row else "")
                          + f", peak {row['peak'] / 2**20:.1f} MiB"
                          + (f" (budget {row['budget'] / 2**20:.1f} MiB, {row['moves']} evictions)" if "budget" in row else "")
                          + f", identical {row['identical']}"), flush=True)
    print("\nfamily | method | x PyTorch alone (median of rounds) | x save_on_cpu | peak MiB")
    for fam in a.families:
        for m in dict.fromkeys(r["method"] for r in rows if r["family"] == fam):
            rs = [r for r in rows if r["family"] == fam and r["method"] == m and "error" not in r]
            if not rs:
                print(f"{fam} | {m} | failed | | ")
                continue
            xs = statistics.median(r.get("x_soc", float("nan")) for r in rs)
            print(f"{fam} | {m} | {statistics.median(r['x_alone'] for r in rs):.2f}x | "
                  f"{xs:.2f}x | {max(r['peak'] for r in rs) / 2**20:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
