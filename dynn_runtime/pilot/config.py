"""The ``pilot`` policy's options (:class:`PilotPolicyConfig`) and its weights: where the shipped ones
are, and a cache so that policies built from the same file share one loaded model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import PolicyError
from .scheduling import seconds

__all__ = ["PilotPolicyConfig", "default_weights_path", "cached_model"]

_WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


def default_weights_path() -> Path:
    """The weights shipped in the package (trained on the zoo; provenance in ``zoo.json`` beside it)."""
    return _WEIGHTS_DIR / "zoo.npz"


_MODEL_CACHE: dict[str, Any] = {}


def cached_model(path: Path) -> Any:
    """The model at ``path``, loaded once per file version (its mtime) and shared by every policy."""
    from .model import load_model

    key = str(path)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        stamp = None
    hit = _MODEL_CACHE.get(key)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    model = load_model(path)
    _MODEL_CACHE[key] = (stamp, model)
    return model


@dataclass(kw_only=True)
class PilotPolicyConfig:
    """The ``pilot`` policy's options: ``make_policy("pilot", **options)`` and
    ``PilotPolicy(**options)`` take these fields; ``PilotPolicy(config)`` takes the object."""

    weights: str | Path | None = None
    """Trained weights (``.npz``); None: the weights shipped in the package (:func:`default_weights_path`)."""
    model: Any = None
    """A loaded :class:`~dynn_runtime.pilot.model.PilotModel` to use instead of ``weights``."""
    group: int | None = None
    """Operators between the feature state's decision points; None: the policy's ``decision_every``."""
    recheck: float = 0.25
    """Incremental rescoring: a storage not touched is rescored once the time since it was scored
    reaches this fraction of the low quantile (``quantile``) of its predicted next-use distance."""
    quantile: float = 0.1
    """The quantile of the bucket probabilities that ``recheck`` scales."""
    online: bool = False
    """Fine-tune the model on the run's own finished iterations (:mod:`.policy`'s online refit)."""
    refit_every: int = 4
    """With ``online``: iterations between refits."""
    refit_background: bool = True
    """With ``online``: refit on a background thread (the refit model is taken at the first iteration
    start after it is done); False: at the iteration start, synchronously (reproducible decisions)."""
    fallback: bool = False
    """Follow ``replay``'s or ``lru``'s predictions, per decision point, while their window recall on
    the run's recent decision points beats the model's (:mod:`.adapt`)."""
    max_share: float | None = None
    """Cost governor: decision points are put off while inference has used more than this share of
    the elapsed device time (in (0, 1]); None: no governor."""
    backend: str | None = None
    """Inference backend: ``"native"`` (the C kernel, :mod:`dynn_runtime.pilot.kernel`), ``"numpy"``,
    or None: native when it is available."""
    host_cost: tuple[float, float, float] | None = None
    """Seconds charged per decision point, per row scored and per operator instead of the measured
    time, for the governor and ``host_seconds`` (the simulator passes its calibration); None: measured."""
    defer_idle: bool = True
    """Defer a decision point while nothing would read it (no victim search in this iteration or the
    previous one: :mod:`.scheduling`, "Idle decision points"), rescoring every live storage at the
    first victim search after it; False: every decision point runs (the reference)."""
    worker: bool | str = "auto"
    """``"auto"``: hand a decision point to a worker thread when the device is short of queued work
    (native backend, :mod:`.scheduling`); False: always decide on the issuing thread."""

    #: the values ``worker`` takes; an experiment's config (tools/pilot_lab.py) adds True (always hand off)
    workers: ClassVar[tuple[Any, ...]] = ("auto", False)

    def __post_init__(self) -> None:
        if self.max_share is not None and not 0 < float(self.max_share) <= 1:
            raise PolicyError(f"policies: pilot max_share must be in (0, 1], got {self.max_share!r}.")
        if self.backend not in (None, "auto", "native", "numpy"):
            raise PolicyError(f"policies: pilot backend must be 'native', 'numpy' or None (auto), got {self.backend!r}.")
        self.host_cost = seconds(self.host_cost, "host_cost", ("per decision point", "per row scored", "per operator"))
        if not any(self.worker is w if isinstance(w, bool) else self.worker == w for w in self.workers):
            raise PolicyError(f"policies: pilot worker must be one of {', '.join(map(repr, self.workers))}, "
                              f"got {self.worker!r}. Experiment-only switches are in tools/pilot_lab.py.")

    @classmethod
    def build(cls, config: PilotPolicyConfig | None, options: dict[str, Any]) -> PilotPolicyConfig:
        """``config`` (default: the defaults) with ``options`` replacing its fields, validated."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise PolicyError(f"policies: pilot has no option {', '.join(map(repr, unknown))}; it takes "
                              f"{', '.join(sorted(names))}. Experiment-only switches are in tools/pilot_lab.py.")
        if config is None:
            return cls(**options)
        if not isinstance(config, cls):
            raise PolicyError(f"policies: pilot takes a {cls.__name__}, got {type(config).__name__}.")
        return dataclasses.replace(config, **options)
