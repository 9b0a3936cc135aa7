"""Workloads: what dynn-runtime trains, records and simulates.

A workload is any object with

* ``model``: a ``torch.nn.Module``;
* ``make_batch(step) -> batch``: a seeded, dynamic batch for that step (the same
  step gives the same batch every time; tensors may be on the CPU, the trainer
  moves them);
* ``loss(model, batch) -> Tensor``: a scalar loss;
* optionally ``optimizer(params) -> torch.optim.Optimizer`` (default: Adam, lr 1e-3);
* optionally ``step_facts() -> dict``: what the last step did that varies from
  step to step (experts used, blocks run, samples exited...), for reports.

Workloads are named either by a zoo name (``moe``, ``skipnet``, ...; see
``dynn models``) or by ``path/to/file.py:function``, where ``function(preset)``
returns such an object. Example of a user's own workload file::

    import torch
    from torch import nn

    class MyWorkload:
        def __init__(self, preset):
            width = {"tiny": 16, "small": 256}[preset]
            torch.manual_seed(0)
            self.model = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))

        def make_batch(self, step):
            g = torch.Generator().manual_seed(step)
            n = int(torch.randint(4, 64, (1,), generator=g))   # dynamic batch size
            x = torch.randn(n, 8, generator=g)
            return x, x.sum(dim=1, keepdim=True)

        def loss(self, model, batch):
            x, y = batch
            return nn.functional.mse_loss(model(x), y)

    def build(preset):
        return MyWorkload(preset)

and then ``dynn train my_workload.py:build --preset tiny``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .errors import DynnError, WorkloadError

__all__ = [
    "Workload",
    "SeededBatches",
    "SEED_STRIDE",
    "load_workload",
    "to_device",
    "make_optimizer",
    "TrainResult",
    "train",
    "train_step",
    "resolve_device",
    "add_workload_args",
    "parse_overrides",
    "workload_name",
]


@runtime_checkable
class Workload(Protocol):
    """What a workload provides (see the module docstring)."""

    model: nn.Module

    def make_batch(self, step: int) -> Any: ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor: ...


#: under seed s, a user workload whose function takes no ``seed`` yields for step k the batch it
#: would give for step ``k + s * SEED_STRIDE`` (a prime far beyond any run's step count, so the
#: streams of two seeds do not overlap in practice)
SEED_STRIDE = 1_000_003


class SeededBatches:
    """A user workload whose ``function(preset)`` takes no ``seed``, under seed ``seed``: batch
    ``step`` is the workload's batch ``step + seed * SEED_STRIDE``; every other member is the
    workload's own. Seed 0 is not wrapped (the workload as written)."""

    def __init__(self, inner: Any, seed: int) -> None:
        self.inner = inner
        self.seed = seed
        self.offset = seed * SEED_STRIDE

    def make_batch(self, step: int) -> Any:
        return self.inner.make_batch(step + self.offset)

    def __getattr__(self, name: str) -> Any:
        # only called for names the wrapper lacks: model, loss, optimizer, step_facts, ...
        inner = self.__dict__.get("inner")
        if inner is None:  # (being copied or unpickled: no inner yet)
            raise AttributeError(name)
        return getattr(inner, name)


def _takes_seed(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        return False
    return any((p.name == "seed" and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in params)


def _load_from_file(spec: str, preset: str, seed: int = 0, **kwargs: Any) -> Any:
    path_str, _, func_name = spec.rpartition(":")
    path = Path(path_str)
    if not path.is_file():
        raise WorkloadError(
            f"workload: file {str(path)!r} (from {spec!r}) does not exist. "
            "Give an existing Python file as path/to/file.py:function."
        )
    mod_name = f"_dynn_user_workload_{abs(hash(str(path.resolve())))}"
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    if mspec is None or mspec.loader is None:
        raise WorkloadError(f"workload: cannot import {str(path)!r} as a Python module.")
    module = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = module
    try:
        mspec.loader.exec_module(module)
    except Exception as exc:  # the user's module failed at import: say where
        raise WorkloadError(f"workload: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise WorkloadError(
            f"workload: {str(path)!r} has no function {func_name!r}. Callables defined there: {public}."
        )
    takes_seed = _takes_seed(fn)
    if takes_seed:
        kwargs = {**kwargs, "seed": seed}
    torch.manual_seed(seed)  # weights a function draws from the global generator follow the seed too
    try:
        wl = fn(preset, **kwargs) if kwargs else fn(preset)
    except Exception as exc:
        raise WorkloadError(
            f"workload: {spec}({preset!r}) raised {type(exc).__name__}: {exc}"
        ) from exc
    _check_workload(wl, spec)
    return SeededBatches(wl, seed) if seed and not takes_seed else wl


def _check_workload(wl: Any, spec: str) -> None:
    missing = []
    if not isinstance(getattr(wl, "model", None), nn.Module):
        missing.append("`.model` (an nn.Module)")
    for name in ("make_batch", "loss"):
        if not callable(getattr(wl, name, None)):
            missing.append(f"`.{name}(...)`")
    if missing:
        raise WorkloadError(
            f"workload: {spec} returned a {type(wl).__name__}, which lacks {', '.join(missing)}. "
            "A workload needs .model, .make_batch(step) and .loss(model, batch); see `dynn train --help`."
        )


def load_workload(spec: str, preset: str = "tiny", seed: int = 0, **overrides: Any) -> Any:
    """Build a workload from a zoo name or ``path/to/file.py:function``.

    ``overrides`` set fields of a zoo family's config (for example ``batch=8``);
    they are not passed to user functions unless given. ``seed`` reaches a user function as its
    ``seed`` keyword where it takes one (``def build(preset, seed=0)``); otherwise a nonzero seed
    shifts the steps its ``make_batch`` is asked for (:class:`SeededBatches`), so two seeds give
    different batches and one seed the same ones. The global torch generator is seeded with it
    before the function runs.
    """
    if ".py:" in spec:
        return _load_from_file(spec, preset, seed, **overrides)
    from . import models

    return models.build(spec, preset=preset, seed=seed, **overrides)


def workload_name(spec: str) -> str:
    """A short, file-name-safe name for a workload spec (or a recorded trace file's path: its name
    without ``.jsonl.gz``)."""
    if ".py:" in spec:
        path, _, fn = spec.rpartition(":")
        return f"{Path(path).stem}.{fn}"
    for ext in (".jsonl.gz", ".jsonl"):
        if spec.endswith(ext):
            return Path(spec).name[: -len(ext)]
    return spec


def to_device(obj: Any, device: torch.device | str) -> Any:
    """Move every tensor inside a batch (dicts, lists, tuples, dataclasses) to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return obj


def make_optimizer(wl: Any, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The workload's optimizer if it names one, else Adam with lr 1e-3."""
    factory: Callable[..., torch.optim.Optimizer] | None = getattr(wl, "optimizer", None)
    if callable(factory):
        return factory(params)
    return torch.optim.Adam(params, lr=1e-3)


@dataclasses.dataclass
class TrainResult:
    """Per-step record of a training run."""

    losses: list[float]
    peak_bytes: list[int]
    step_seconds: list[float]
    facts: list[dict]
    device: str


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a :class:`torch.device`; a :class:`WorkloadError` if it is CUDA and CUDA is not available."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise WorkloadError(
            "train: --device cuda was asked for but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Use --device cpu, or install a CUDA build of torch."
        )
    return dev




def train(
    wl: Any,
    steps: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
    on_step: Callable[[int, float, int], None] | None = None,
    step_context: Callable[[], Any] | None = None,
) -> TrainResult:
    """Train ``wl`` for ``steps`` steps; the reference loop every other tool is compared against.

    Peak memory per step is ``torch.cuda.max_memory_allocated`` on CUDA and, on the CPU, the
    peak of live tensor storage bytes tracked by :class:`dynn_runtime.memory.LiveBytes`.
    ``step_context`` (a context-manager factory) wraps each step, e.g. a memory manager's ``step()``.
    """
    from .memory import LiveBytes

    dev = resolve_device(device)
    if steps < 1:
        raise WorkloadError(f"train: steps must be at least 1, got {steps}.")
    torch.manual_seed(seed)
    model = wl.model.to(dev)
    opt = make_optimizer(wl, model.parameters())
    res = TrainResult([], [], [], [], str(dev))
    for step in range(steps):
        batch = to_device(wl.make_batch(step), dev)
        t0 = time.perf_counter()
        with LiveBytes(dev) as mem:
            if step_context is not None:
                with step_context():
                    loss = float(train_step(wl, model, opt, batch).detach())
            else:
                loss = float(train_step(wl, model, opt, batch).detach())
        res.step_seconds.append(time.perf_counter() - t0)
        if not math.isfinite(loss):
            raise WorkloadError(
                f"train: loss became {loss} at step {step}. Lower the learning rate or check the workload's loss."
            )
        res.losses.append(loss)
        res.peak_bytes.append(mem.peak_bytes)
        facts_fn = getattr(wl, "step_facts", None)
        res.facts.append(facts_fn() if callable(facts_fn) else {})
        if on_step is not None:
            on_step(step, loss, mem.peak_bytes)
    return res


def train_step(wl: Any, model: nn.Module, opt: torch.optim.Optimizer, batch: Any,
               phase: Callable[[str], AbstractContextManager[Any]] | None = None,
               after_backward: Callable[[], None] | None = None,
               after_optimizer: Callable[[], None] | None = None) -> torch.Tensor:
    """One training step, the only one in dynn-runtime: ``wl.loss``, ``backward()``, ``opt.step()``,
    ``opt.zero_grad(set_to_none=True)``; returns the loss tensor (its graph already freed by
    backward). Detaching it (``aten::detach``) and reading its value are the caller's, each where its
    loop always did, so each tool's operator stream stays what it was.

    The recorder, the live manager, the reference loop and the benchmarks all train through it, so
    they issue the same ATen operators in the same order: the live oracle replays a recorded trace
    position by position and depends on that. ``phase(name)`` (a context-manager factory) wraps
    ``"forward"``, ``"backward"`` and ``"optimizer"``; ``after_backward`` runs between backward and the
    optimizer step, outside any phase; ``after_optimizer`` inside the optimizer phase, after
    ``opt.step()`` and before ``zero_grad`` (the recorder marks gradients and optimizer state there).
    """
    ctx = phase or _no_phase
    with ctx("forward"):
        loss = wl.loss(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise WorkloadError(
            f"train: the workload's loss() must return a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + "."
        )
    with ctx("backward"):
        loss.backward()
    if after_backward is not None:
        after_backward()
    with ctx("optimizer"):
        opt.step()
        if after_optimizer is not None:
            after_optimizer()
        opt.zero_grad(set_to_none=True)
    return loss


def _no_phase(name: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in {"1", "true", "yes"}


# -- how a command line names a workload (every `dynn` command that takes one) --------------------


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The arguments every command that names a workload takes."""
    p.add_argument("workload", help="zoo family name, or path/to/file.py:function")
    p.add_argument("--preset", default="tiny", help="preset: tiny, small or large (default tiny)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field of a zoo family, e.g. --set batch=4 (repeatable)")


def parse_overrides(items: Sequence[str]) -> dict:
    """``--set FIELD=VALUE`` items as a dict: a VALUE that reads as a Python literal is that literal,
    anything else the string."""
    import ast

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise DynnError(f"cli: --set expects FIELD=VALUE, got {item!r}.")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out
