"""Training a workload under the :class:`~dynn_runtime.runtime.manager.MemoryManager`, and the same
run without it: what ``dynn train --budget``, ``dynn demo`` and ``dynn bench --real`` share.

Both loops do per step exactly what the trace recorder does (``trace.recorder.record``): build the
step's batch outside the step, then forward loss, backward, optimizer step,
``zero_grad(set_to_none=True)``, and read the loss value after the step. That is what lets the
``oracle`` policy follow a trace recorded from the same workload, seed and steps (recorded into a
temporary file by :func:`train_managed` when none is given).

Bit identity is judged on a SHA-256 digest of every parameter, buffer and optimizer-state tensor
after the last step (taken after ``detach()``, so offloaded tensors are back), and on the
per-step losses compared exactly.

>>> run = train_managed("moe", budget="1/2", policy="lru", steps=2)       # doctest: +SKIP
>>> cmp = compare_unmanaged(run)                                         # doctest: +SKIP
>>> cmp.params_identical and run.max_managed_peak() <= run.budget_bytes  # doctest: +SKIP
True
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._log import logger
from ..budget import Budget, is_plain_number
from ..errors import ConfigError, WorkloadError
from ..policies.base import policy_class
from ..workload import train_step

__all__ = [
    "RunResult",
    "Comparison",
    "parse_budget",
    "train_managed",
    "train_unmanaged",
    "accounting_run",
    "compare_unmanaged",
    "state_digests",
    "UNLIMITED",
]

#: a budget no run reaches: the manager accounts every byte and moves nothing
UNLIMITED = 1 << 62

#: called after every step with (step, loss, per-step stats dict or None)
StepCallback = Callable[[int, float, "dict[str, Any] | None"], None]


@dataclass
class RunResult:
    """One training run, managed or not."""

    workload: str
    """A short name of the workload (``workload.workload_name``)."""
    spec: str
    """The workload as given (zoo name or ``path/to/file.py:function``; the class name for an object)."""
    preset: str
    seed: int
    steps: int
    device: str
    policy: str
    """The manager's policy, or ``"unmanaged"`` for plain PyTorch (``"unmanaged+<baseline>"`` for a baseline)."""
    budget: Any = None
    """The budget as given (bytes, size string, ``"1/8"``, fraction); ``None`` when unmanaged."""
    overrides: dict = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    peak_bytes: list[int] = field(default_factory=list)
    """Per step, peak device bytes. Managed: the manager's accounting of its device storages.
    Unmanaged: CUDA ``max_memory_allocated``; on the CPU the bytes of parameters, buffers and optimizer
    state at the step's start plus the peak of bytes allocated during the step (``memory.LiveBytes``)."""
    reserved_peak_bytes: list[int] = field(default_factory=list)
    """CUDA, unmanaged: per step, ``torch.cuda.max_memory_reserved`` (what the caching allocator held)."""
    managed_steps: list[bool] = field(default_factory=list)
    """False for a step the manager ran unmanaged (the first step of a fractional budget measures the peak)."""
    budget_bytes: int | None = None
    """The budget in bytes once known (a fractional budget is resolved after the first step)."""
    digest: str = ""
    """SHA-256 over every parameter, buffer and optimizer-state tensor after the last step."""
    tensor_digests: dict[str, str] = field(default_factory=dict)
    stats: dict[str, Any] | None = None
    """``MemoryManager.stats()`` after the run (``None`` unmanaged)."""
    timeline: list[tuple[int, int, int, str]] = field(default_factory=list)
    """``MemoryManager.timeline()``: (step, operator position, managed device bytes after it, phase)."""
    trace_path: str | None = None
    """The trace the oracle read (``None`` for other policies)."""

    def max_managed_peak(self) -> int:
        """The largest per-step peak among the steps the manager managed (0 if none)."""
        return max((p for p, m in zip(self.peak_bytes, self.managed_steps, strict=True) if m), default=0)

    def median_step_seconds(self, skip_first: bool = True) -> float:
        """Median step time, leaving out the first step (warm-up, and the measuring step) when there are others."""
        xs = self.step_seconds[1:] if skip_first and len(self.step_seconds) > 1 else self.step_seconds
        return sorted(xs)[len(xs) // 2] if xs else math.nan

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("timeline", "tensor_digests")}
        out["max_managed_peak"] = self.max_managed_peak()
        return out


@dataclass
class Comparison:
    """A managed run next to the same steps without the manager."""

    managed: RunResult
    unmanaged: RunResult
    losses_identical: bool
    params_identical: bool
    """Every parameter, buffer and optimizer-state tensor bit-identical after the last step."""
    differing: list[str]
    """Names of the tensors whose final bytes differ (empty when identical)."""
    max_loss_diff: float
    reproducible: bool = True
    """False when, after a mismatch, a second unmanaged run differed from the first: the unmanaged
    run does not reproduce itself (non-deterministic kernels or thread counts), so the mismatch says
    nothing about the manager."""

    def to_json(self) -> dict[str, Any]:
        return {"losses_identical": self.losses_identical, "params_identical": self.params_identical,
                "differing": self.differing, "max_loss_diff": self.max_loss_diff, "reproducible": self.reproducible,
                "unmanaged": self.unmanaged.to_json()}


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Deterministic algorithms for the duration: a bit-identity check compares two runs, and some CUDA
    kernels (atomics in index_add and scatter backward, cuBLAS split-K) differ from themselves run to run,
    which would otherwise read as the manager changing the numbers."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read by cuBLAS at each call
    torch.use_deterministic_algorithms(True, warn_only=True)  # an operator without one warns, never fails
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def parse_budget(text: str | int | float) -> int | str | float:
    """A command-line budget as the manager takes it, checked by :meth:`~dynn_runtime.budget.Budget.parse`.

    A bare number is what it means there (at most 1: a fraction of the unmanaged peak, ``"0.125"``,
    ``"1"``; above 1: bytes); a fraction ``"1/8"`` or a size ``"6GiB"`` stays as written (the run's
    result records the budget as it was given).

    >>> parse_budget("1/8"), parse_budget("0.25"), parse_budget("1"), parse_budget("4096"), parse_budget("6GiB")
    ('1/8', 0.25, 1.0, 4096, '6GiB')
    """
    budget = Budget.parse(text, "runtime")
    if isinstance(text, str) and not is_plain_number(text.strip()):
        return text.strip()
    if isinstance(text, (int, float)):
        return text
    return budget.fraction if budget.fraction is not None else budget.bytes


# ---- the step, as the recorder runs it ---------------------------------------------------------

def _step(wl: Any, model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    """One iteration (:func:`~dynn_runtime.workload.train_step`); returns the detached loss, detached
    inside the step as the recorder does (its value is read outside the step)."""
    return train_step(wl, model, opt, batch).detach()


def _setup(workload: str | Any, preset: str, seed: int, device: torch.device,
           overrides: dict | None) -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    from ..workload import load_workload, make_optimizer

    wl = load_workload(workload, preset=preset, seed=seed, **(overrides or {})) if isinstance(workload, str) \
        else workload
    torch.manual_seed(seed)  # as train() and record() do: workloads that draw at run time draw the same
    model = wl.model.to(device)
    return wl, model, make_optimizer(wl, model.parameters())


def _device(device: str | torch.device) -> torch.device:
    from ..workload import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _check_loss(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise WorkloadError(f"train: loss became {loss} at step {step}. Lower the learning rate or check the "
                            "workload's loss.")


def state_digests(model: nn.Module, opt: torch.optim.Optimizer | None) -> tuple[str, dict[str, str]]:
    """SHA-256 of every parameter, buffer and optimizer-state tensor (name -> hex), and of all of them."""
    per: dict[str, str] = {}
    tensors: list[tuple[str, torch.Tensor]] = [(f"param:{n}", p) for n, p in model.named_parameters()]
    tensors += [(f"buffer:{n}", b) for n, b in model.named_buffers()]
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, state in opt.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    tensors.append((f"opt:{names.get(id(p), '?')}:{k}", v))
    total = hashlib.sha256()
    with torch.no_grad():
        for name, t in tensors:
            h = hashlib.sha256()
            cpu = t.detach().to("cpu").contiguous().reshape(-1)
            h.update(str((tuple(t.shape), t.dtype)).encode())
            h.update(cpu.view(torch.uint8).numpy().tobytes() if cpu.numel() else b"")
            per[name] = h.hexdigest()
            total.update(name.encode())
            total.update(per[name].encode())
    return total.hexdigest(), per


def _spec(workload: str | Any) -> str:
    return workload if isinstance(workload, str) else type(workload).__name__


def _name(workload: str | Any) -> str:
    from ..workload import workload_name

    return workload_name(workload) if isinstance(workload, str) else type(workload).__name__


# ---- managed -----------------------------------------------------------------------------------

def train_managed(
    workload: str | Any,
    budget: int | str | float,
    policy: str = "lru",
    *,
    steps: int = 5,
    preset: str = "tiny",
    seed: int = 0,
    device: str | torch.device = "cpu",
    overrides: dict | None = None,
    host_budget: int | str | None = None,
    async_copies: bool = True,
    hard_cap: bool = False,
    trace: str | Path | None = None,
    on_step: StepCallback | None = None,
    record_every_op: bool = False,
    policy_options: dict | None = None,
    measure_steps: int = 1,
) -> RunResult:
    """Train ``workload`` for ``steps`` steps under a :class:`MemoryManager` with ``budget`` and ``policy``
    (built with ``policy_options``, e.g. ``{"online": True}`` for the pilot; a fractional budget
    measured over the first ``measure_steps`` steps).

    ``workload`` is a zoo name or ``path/to/file.py:function`` (a workload object works too, except
    with ``oracle`` and no ``trace``). ``budget`` is what the manager takes (bytes, ``"6GiB"``,
    ``"1/8"``, a float in (0, 1]); strings from a command line go through :func:`parse_budget` first.
    For ``policy="oracle"`` without ``trace``, a trace of the same workload, preset, seed, steps and
    overrides is recorded into a temporary file first (and removed afterwards).
    ``on_step(step, loss, step_stats)`` is called after every step.
    """
    from .manager import MemoryManager

    if steps < 1:
        raise WorkloadError(f"train: steps must be at least 1, got {steps}.")
    dev = _device(device)
    budget = parse_budget(budget) if isinstance(budget, str) else budget
    cls = policy_class(policy)
    reads_future = cls is not None and "future" in cls.requires  # the oracle: it replays a recorded trace
    with contextlib.ExitStack() as stack:
        trace_path = str(trace) if trace is not None else None
        if reads_future and trace is None:
            trace_path = stack.enter_context(_recorded_trace(workload, steps, preset, seed, dev, overrides))
        mm = MemoryManager(budget, policy=policy, device=dev, host_budget=host_budget, async_copies=async_copies,
                           hard_cap=hard_cap, trace=trace_path, record_every_op=record_every_op,
                           policy_options=policy_options, measure_steps=measure_steps)
        wl, model, opt = _setup(workload, preset, seed, dev, overrides)
        res = RunResult(workload=_name(workload), spec=_spec(workload), preset=preset, seed=seed, steps=steps,
                        device=str(dev), policy=mm.policy.name, budget=budget, overrides=dict(overrides or {}),
                        trace_path=trace_path if reads_future and trace is not None else None)
        from ..workload import to_device

        mm.attach(model, opt)
        try:
            for step in range(steps):
                batch = to_device(wl.make_batch(step), dev)
                t0 = time.perf_counter()
                with mm.step():
                    loss_t = _step(wl, model, opt, batch)
                    del batch
                res.step_seconds.append(time.perf_counter() - t0)  # step() synchronizes its streams at the end
                loss = float(loss_t)
                del loss_t
                _check_loss(loss, step)
                st = mm.steps[-1]
                res.losses.append(loss)
                res.peak_bytes.append(int(st.peak_device_bytes))
                res.managed_steps.append(bool(st.managed))
                res.budget_bytes = mm.budget
                if on_step is not None:
                    on_step(step, loss, {**st.__dict__, "budget_bytes": mm.budget})
        finally:
            failing = sys.exc_info()[1] is not None
            try:
                res.stats = mm.stats()
                res.timeline = mm.timeline()
                try:
                    mm.detach()
                except Exception as exc:
                    if not failing:
                        raise
                    # the run's own error is what the caller must see; the manager stays attached
                    logger.warning("train: detach() after a failed run failed too: %s", exc)
            finally:
                if hard_cap and dev.type == "cuda":
                    torch.cuda.set_per_process_memory_fraction(1.0, dev)  # the cap belongs to this run only
        res.budget_bytes = mm.budget
        res.digest, res.tensor_digests = state_digests(model, opt)
    return res


@contextlib.contextmanager
def _recorded_trace(workload: str | Any, steps: int, preset: str, seed: int, dev: torch.device,
                    overrides: dict | None) -> Iterator[str]:
    from ..trace.recorder import record

    if not isinstance(workload, str):
        raise ConfigError("runtime: the oracle policy needs a trace of the same inputs; give the workload by name "
                          "(a zoo family or path/to/file.py:function) so it can be recorded, or pass trace=PATH.")
    fd, path = tempfile.mkstemp(prefix=f"dynn-oracle-{_name(workload)}-", suffix=".jsonl.gz")
    os.close(fd)
    try:
        record(workload, path, steps=steps, preset=preset, seed=seed, device=str(dev), overrides=dict(overrides or {}))
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def accounting_run(workload: str | Any, **kwargs: Any) -> RunResult:
    """:func:`train_managed` with policy ``none`` and an unreachable budget: the manager accounts every
    operator's device bytes and moves nothing. Its timeline is the unmanaged memory curve in the
    manager's units, and its step times over the plain run's are the manager's bookkeeping cost."""
    kwargs.pop("policy", None)
    kwargs.pop("budget", None)
    kwargs.pop("trace", None)
    return train_managed(workload, UNLIMITED, "none", record_every_op=True, **kwargs)


# ---- unmanaged ---------------------------------------------------------------------------------

def train_unmanaged(
    workload: str | Any,
    *,
    steps: int = 5,
    preset: str = "tiny",
    seed: int = 0,
    device: str | torch.device = "cpu",
    overrides: dict | None = None,
    prepare: Callable[[nn.Module], Any] | None = None,
    step_context: Callable[[], Any] | None = None,
    label: str = "unmanaged",
    on_step: StepCallback | None = None,
) -> RunResult:
    """The same steps as :func:`train_managed`, on plain PyTorch: the reference for bit identity and time.

    ``prepare(model)`` may change the model before training (the bench wraps blocks in
    ``torch.utils.checkpoint`` there); ``step_context()`` wraps each step (``save_on_cpu``).
    """
    from ..memory import LiveBytes, state_bytes
    from ..workload import to_device

    if steps < 1:
        raise WorkloadError(f"train: steps must be at least 1, got {steps}.")
    dev = _device(device)
    from .devicemem import device_baseline

    held = device_baseline(dev)
    wl, model, opt = _setup(workload, preset, seed, dev, overrides)
    if prepare is not None:
        prepare(model)
    res = RunResult(workload=_name(workload), spec=_spec(workload), preset=preset, seed=seed, steps=steps,
                    device=str(dev), policy=label, overrides=dict(overrides or {}))
    for step in range(steps):
        batch = to_device(wl.make_batch(step), dev)
        _sync(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = -held  # max_memory_allocated counts everything resident, the process's own bytes too
        else:
            opt_state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            base = state_bytes([*model.parameters(), *model.buffers(), *opt_state])
        t0 = time.perf_counter()
        with LiveBytes(dev) if dev.type == "cpu" else contextlib.nullcontext() as mem:
            with step_context() if step_context is not None else contextlib.nullcontext():
                loss_t = _step(wl, model, opt, batch)
                del batch
            _sync(dev)
        res.step_seconds.append(time.perf_counter() - t0)
        peak = base + (torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else mem.peak_bytes)
        if dev.type == "cuda":
            res.reserved_peak_bytes.append(int(torch.cuda.max_memory_reserved(dev)))
        loss = float(loss_t)
        del loss_t
        _check_loss(loss, step)
        res.losses.append(loss)
        res.peak_bytes.append(int(peak))
        res.managed_steps.append(False)
        if on_step is not None:
            on_step(step, loss, None)
    res.digest, res.tensor_digests = state_digests(model, opt)
    return res


def compare_unmanaged(managed: RunResult, **kwargs: Any) -> Comparison:
    """Run ``managed``'s workload, preset, seed, steps and device without the manager and compare:
    losses exactly, and every parameter, buffer and optimizer-state tensor bit for bit.
    ``kwargs`` go to :func:`train_unmanaged` (e.g. ``on_step``); a workload object cannot be rebuilt,
    so pass ``workload=`` a fresh one in that case."""
    workload = kwargs.pop("workload", None) or managed.spec
    ref = train_unmanaged(workload, steps=managed.steps, preset=managed.preset, seed=managed.seed,
                          device=managed.device, overrides=managed.overrides, **kwargs)
    differing = sorted(k for k in set(ref.tensor_digests) | set(managed.tensor_digests)
                       if ref.tensor_digests.get(k) != managed.tensor_digests.get(k))
    diffs = [abs(a - b) for a, b in zip(managed.losses, ref.losses, strict=True)]
    same = managed.losses == ref.losses and not differing and managed.digest == ref.digest
    reproducible = True
    if not same:  # is it the manager, or does the unmanaged run not reproduce itself?
        again = train_unmanaged(workload, steps=managed.steps, preset=managed.preset, seed=managed.seed,
                                device=managed.device, overrides=managed.overrides)
        reproducible = again.losses == ref.losses and again.digest == ref.digest
    return Comparison(managed=managed, unmanaged=ref, losses_identical=managed.losses == ref.losses,
                      params_identical=not differing and managed.digest == ref.digest, differing=differing,
                      max_loss_diff=max(diffs, default=0.0), reproducible=reproducible)

