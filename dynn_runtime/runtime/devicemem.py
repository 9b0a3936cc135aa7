"""Device memory outside the manager's storages: what the process already holds, and the budget
when none is given."""

from __future__ import annotations

import gc

import torch

from ..errors import BudgetError
from ..memory import format_bytes

__all__ = ["DEFAULT_HEADROOM", "default_budget", "device_baseline", "device_room"]

#: what ``default_budget`` leaves free on a CUDA device: (bytes, fraction of its total), the larger
#: applies (the CUDA context's own allocations, other processes' growth, the allocator's slack)
DEFAULT_HEADROOM = (512 << 20, 0.05)


def default_budget(dev: torch.device) -> int:
    """The budget when none is given: on CUDA the device's free memory now (``torch.cuda.mem_get_info``)
    plus what this process's allocator already holds, less ``DEFAULT_HEADROOM``; on the CPU, where
    the budget is logical, no limit."""
    if dev.type != "cuda":
        return 1 << 62
    free, total = torch.cuda.mem_get_info(dev)
    fixed, frac = DEFAULT_HEADROOM
    usable = free + torch.cuda.memory_reserved(dev) - max(fixed, int(total * frac))
    if usable <= 0:
        raise BudgetError(f"runtime: the device has {format_bytes(free)} free, less than the headroom the default "
                          f"budget keeps ({format_bytes(max(fixed, int(total * frac)))}); pass a budget in bytes.")
    return usable


def device_baseline(dev: torch.device) -> int:
    """CUDA: the bytes the process holds now, once garbage cycles are collected and the current
    stream's cuBLAS workspace exists (made here rather than mid-step, so every run in a process starts
    from the same point). A hard cap is set on top of it, and ``train_unmanaged`` counts a run's peak
    above it. 0 on the CPU."""
    if dev.type != "cuda":
        return 0
    gc.collect()
    a = torch.ones(16, 16, device=dev)
    torch.mm(a, a)
    del a
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev)


def device_room(dev: torch.device) -> int:
    """Bytes more this process can allocate on ``dev`` now: the device's free memory plus what the
    caching allocator holds unused. On the CPU, where the budget is logical, no limit."""
    if dev.type != "cuda":
        return 1 << 62
    free, _ = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
