"""What the live memory manager costs on the host, as the simulator charges it (the engine's host timeline).

The live runtime (:class:`~dynn_runtime.runtime.manager.MemoryManager`) runs on the thread that issues
the operators. Two numbers describe what it adds there over PyTorch alone:

* ``per_op_s``: seconds per ATen operator the manager sees (its event path: tracking the storages an
  operator reads and creates, the budget check, the policy's notifications), with nothing moving;
* ``per_decision_s``: seconds per *decision point*, a consultation of the policy that moves memory:
  one ``victims()`` call (memory is short), or one ``after_op()`` that returns actions (proactive
  evictions, prefetches);
* ``per_move_s``: seconds per storage moved (an eviction, a prefetch, a demand fetch): the
  bookkeeping and the issue of its copy. The copy itself is the copy engines' time, not the
  host's: the calibration subtracts it.

The simulator counts decision points and moves the same way (:attr:`SimResult.decision_points`,
:attr:`SimResult.moves`).

A policy whose notifications cost more than ``lru``'s (the pilot's feature state, every operator)
has that added to its ``per_op_s`` (``policy_per_op_s`` in the file, and ``HostCost.policy_per_op_s``):
the live manager runs it whenever the policy is told the step's operators, which is every step
unless the policy sits it out (``Policy.idle_step``: the pilot while no victim search has run in the
previous iteration nor yet in this one). So a simulated iteration that starts idle is charged it
from its first victim search on, with the operators before it charged at that search (the live
runtime tells them all there), and not at all in an iteration whose peak fits (the simulator runs
``none`` there) for a policy that sits such iterations out (``Policy.idles_unbound``). Its
work at its own decision points (the pilot's inference) is the policy's
:attr:`Policy.host_seconds`, charged by its ``host_cost`` model (:func:`policy_options_for`) where
the policy runs.

Both numbers are measured by ``dynn bench --overhead --write-calibration`` per event source (the
Python dispatch path, and the native event path where it is built) and per device the manager ran
on, and kept in ``host_cost.json`` beside this module, with the machine they were measured on: the
CPU's figures under ``sources`` (the file's first layout, read as it was), a GPU's under
``devices.cuda`` (``--device cuda``). The simulator's profiles are GPUs, so ``device="auto"``
charges the GPU's figures where they were measured and the CPU's otherwise; a result says which
(:attr:`HostCost.device`). Policies that stand for something that
does not run in the manager (``none`` is PyTorch alone; ``save_on_cpu``, ``checkpoint``, ``uvm``
and ``dtr`` model other mechanisms) are listed there as uncharged.

>>> from dynn_runtime.sim.hostcost import HostCost, host_cost_for
>>> host_cost_for("none") is None          # PyTorch alone pays no manager
True
>>> c = host_cost_for("lru", source="python")
>>> c.source, c.per_op_s > 0
('python', True)
>>> round(HostCost(per_op_s=2e-6, per_decision_s=5e-6, per_move_s=1e-6, source="model").charge(100, 4, 10), 9)
0.00023
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["HostCost", "CALIBRATION_PATH", "SOURCES", "DEVICES", "load_calibration", "calibration_table", "calibrated_devices", "charged_as",
           "host_cost_for", "policy_options_for", "parse_host_cost"]

#: the calibration data shipped with the package (written by ``dynn bench --overhead --write-calibration``)
CALIBRATION_PATH = Path(__file__).resolve().parent / "host_cost.json"
#: event sources of the live runtime: the Python dispatch mode, the native extension's event path
SOURCES = ("python", "native")
#: devices a calibration is measured on: the manager on the CPU (``sources`` in the file), on a GPU
#: (``devices.cuda``)
DEVICES = ("cpu", "cuda")
CALIBRATION_SCHEMA = 1


@dataclass(frozen=True, kw_only=True)
class HostCost:
    """Host seconds the live manager adds over PyTorch alone, as the simulator charges them."""

    per_op_s: float
    """Seconds per ATen operator, nothing moving (the event path and the policy's notifications)."""
    per_decision_s: float
    """Seconds per decision point (a ``victims()`` call, or an ``after_op()`` that returns actions)."""
    per_move_s: float = 0.0
    """Seconds per storage moved (eviction, prefetch, demand fetch), the copy itself not included."""
    policy_per_op_s: float = 0.0
    """The policy's own share of ``per_op_s`` (its notifications), which an iteration it sits out
    does not pay (``Policy.idle_step``): charged per operator from its first victim search on, and
    for the operators before it at that search."""
    source: str
    """Where the figures come from: an event source of the calibration (``python``, ``native``), or
    ``model`` for figures given by hand."""
    device: str = ""
    """The device the manager ran on when the figures were measured (``cpu``, ``cuda``); "" for
    figures given by hand."""

    def __post_init__(self) -> None:
        for name in ("per_op_s", "per_decision_s", "per_move_s", "policy_per_op_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"sim: HostCost.{name} must be a finite number of seconds >= 0, got {v!r}.")
        if self.policy_per_op_s > self.per_op_s:
            raise ConfigError(f"sim: HostCost.policy_per_op_s ({self.policy_per_op_s!r}) is a share of per_op_s "
                              f"({self.per_op_s!r}) and cannot exceed it.")

    def charge(self, ops: int, decision_points: int, moves: int = 0) -> float:
        """Host seconds for ``ops`` operators, ``decision_points`` decision points and ``moves`` moves."""
        return ops * self.per_op_s + decision_points * self.per_decision_s + moves * self.per_move_s

    def as_dict(self) -> dict[str, Any]:
        return {"per_op_s": self.per_op_s, "per_decision_s": self.per_decision_s, "per_move_s": self.per_move_s,
                "policy_per_op_s": self.policy_per_op_s, "source": self.source, "device": self.device}


def load_calibration(path: str | Path | None = None) -> dict[str, Any]:
    """The calibration file's content (default: the one shipped with the package)."""
    p = Path(path) if path is not None else CALIBRATION_PATH
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"sim: cannot read the host-cost calibration {str(p)!r} ({exc}); re-measure it with "
                          "`dynn bench --overhead --write-calibration`.") from None
    devices = data.get("devices", {})
    if (data.get("schema") != CALIBRATION_SCHEMA or not isinstance(data.get("sources"), dict)
            or not isinstance(devices, dict) or not all(isinstance(v, dict) for v in devices.values())):
        raise ConfigError(f"sim: {str(p)!r} is not a host-cost calibration of schema {CALIBRATION_SCHEMA} "
                          f"(found schema {data.get('schema')!r}); re-measure it with "
                          "`dynn bench --overhead --write-calibration`.")
    unknown = sorted(set(devices) - set(DEVICES[1:]))
    if unknown:
        raise ConfigError(f"sim: {str(p)!r} has figures for unknown device(s) {unknown} under 'devices' (known: "
                          f"{', '.join(DEVICES[1:])}; the CPU's are under 'sources'); re-measure them with "
                          "`dynn bench --overhead --device cuda --write-calibration`.")
    return data


def calibrated_devices(data: dict[str, Any]) -> list[str]:
    """The devices ``data`` has figures for, of :data:`DEVICES`."""
    return [d for d in DEVICES if calibration_table(data, d)]


def calibration_table(data: dict[str, Any], device: str) -> dict[str, Any]:
    """The per-source figures measured on ``device`` (empty where there are none)."""
    return data.get("sources", {}) if device == "cpu" else data.get("devices", {}).get(device, {})


def _device(data: dict[str, Any], device: str, source: str = "auto") -> str:
    """``auto``: the GPU's figures where they were measured for ``source`` (every simulator profile is
    a GPU), else the CPU's."""
    if device == "auto":
        gpu = calibration_table(data, "cuda")
        return "cuda" if gpu and (source == "auto" or source in gpu) else "cpu"
    if device not in DEVICES:
        raise ConfigError(f"sim: a host-cost device is auto, {' or '.join(DEVICES)}; got {device!r}.")
    if not calibration_table(data, device):
        raise ConfigError(f"sim: the host-cost calibration has no figures measured on {device!r} (it has "
                          f"{', '.join(calibrated_devices(data)) or 'none'}); measure them with "
                          f"`dynn bench --overhead --device {device} --write-calibration`.")
    return device


def _source(data: dict[str, Any], source: str, device: str = "cpu") -> str:
    """``auto``: the native event path where it was measured (the runtime uses it where it is built),
    else the Python path."""
    table = calibration_table(data, device)
    if source == "auto":
        return "native" if "native" in table else "python"
    if source not in table:
        raise ConfigError(f"sim: the host-cost calibration has no figures for the {source!r} event source "
                          f"measured on {device!r} (it has {', '.join(table) or 'none'}); measure them with "
                          f"`dynn bench --overhead --device {device} --write-calibration` where that source is "
                          "available.")
    return source


def charged_as(policy: str) -> str:
    """The name whose calibration figures ``policy`` is charged: its class's ``host_cost_as`` (a
    simulator-only policy that would run another's bookkeeping live, as ``hybrid`` the pilot's), else
    its own name (also for a name no policy is registered under)."""
    from ..policies.base import policy_class

    cls = policy_class(policy)
    return (cls.host_cost_as if cls is not None else None) or policy


def host_cost_for(policy: str, source: str = "auto", calibration: dict[str, Any] | None = None,
                  device: str = "auto") -> HostCost | None:
    """The calibrated :class:`HostCost` of running ``policy`` in the live manager, or None for a
    policy that does not run in it (listed as uncharged in the calibration). ``device``: the figures
    measured with the manager on ``cpu`` or ``cuda``; ``auto`` the GPU's where measured."""
    data = calibration if calibration is not None else load_calibration()
    policy = charged_as(policy)
    if policy in data.get("uncharged", {}):
        return None
    dev = _device(data, device, source)
    src = _source(data, source, dev)
    row = calibration_table(data, dev)[src]
    own = float(row.get("policy_per_op_s", {}).get(policy, 0.0))
    return HostCost(per_op_s=float(row["per_op_s"]) + own, per_decision_s=float(row["per_decision_s"]),
                    per_move_s=float(row.get("per_move_s", 0.0)), policy_per_op_s=own, source=src, device=dev)


def policy_options_for(policy: str, source: str = "auto", calibration: dict[str, Any] | None = None,
                       device: str = "auto") -> dict:
    """Options that make ``policy`` charge its own host time from the calibration (deterministic
    simulations): the pilot's ``host_cost`` model. Empty for every other policy."""
    data = calibration if calibration is not None else load_calibration()
    policy = charged_as(policy)
    if policy in data.get("uncharged", {}):
        return {}
    dev = _device(data, device, source)
    row = calibration_table(data, dev)[_source(data, source, dev)]
    return {k: tuple(v) if isinstance(v, list) else v for k, v in row.get("policy_options", {}).get(policy, {}).items()}


def parse_host_cost(text: str) -> str | HostCost | None:
    """``dynn bench --host-cost``: ``calibrated`` (the shipped calibration), ``none`` (no charge), or
    seconds per operator with optional seconds per decision point and per move (``40e-6``,
    ``40e-6,25e-6`` or ``40e-6,25e-6,10e-6``)."""
    t = text.strip().lower()
    if t in ("calibrated", "none"):
        return None if t == "none" else "calibrated"
    try:
        parts = [float(x) for x in t.split(",")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2, 3):
        raise ConfigError(f"bench: --host-cost takes calibrated, none, or seconds per operator[,per decision "
                          f"point[,per move]] like 40e-6,25e-6,10e-6; got {text!r}.")
    parts += [0.0] * (3 - len(parts))
    return HostCost(per_op_s=parts[0], per_decision_s=parts[1], per_move_s=parts[2], source="model")
