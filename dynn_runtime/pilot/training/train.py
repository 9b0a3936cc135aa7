"""Training the pilot model from recorded traces (Python API behind ``dynn pilot train``).

>>> from dynn_runtime.pilot import train, PilotConfig          # doctest: +SKIP
>>> model, info = train(["moe.jsonl.gz", "skipnet.jsonl.gz"], PilotConfig(epochs=4))   # doctest: +SKIP
>>> save_model(model, "pilot.npz")                             # doctest: +SKIP
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..._version import __version__
from ...errors import PilotError
from ...trace.format import Trace
from ..features import CAND_FEATURES, CTX_FEATURES, N_FINE
from ..model import PilotConfig, PilotModel, fit
from .data import Rows, build_rows, load_traces, trace_family

__all__ = ["train", "fit_prior", "git_commit"]


def fit_prior(rows: Rows) -> np.ndarray:
    """The provisional-prediction table (phase x storage class): median log next-use distance of
    storages right after an access, from training rows whose age is 0 (see :mod:`.policy`); rows of
    the synthetic networks are left out when rows of real workloads are there."""
    from ..features import BUCKET_EDGES
    from ..model import bucket_reps
    from .synth import SYNTH_FAMILY

    c = {n: i for i, n in enumerate(CAND_FEATURES)}
    x = {n: i for i, n in enumerate(CTX_FEATURES)}
    X, C, y = rows.X, rows.C, rows.y
    # The table is a deployment-time default, so the synthetic networks (training data for the
    # network only, many small storages) do not vote in it unless nothing else is there: their
    # storages would teach forward temporaries "not again" (docs/pilot-lab-notes.md).
    real = np.fromiter((f != SYNTH_FAMILY for f in rows.family), dtype=bool, count=len(rows.family))
    if len(real) == len(y) and real.any() and not real.all():
        X, C, y = X[real], C[real], y[real]
    prior = np.full((3, 5), np.log(BUCKET_EDGES[3]), dtype=np.float32)
    if not len(y):
        return prior
    reps = np.log(bucket_reps(4 * BUCKET_EDGES[-1]))
    phase = np.argmax(C[:, x["phase_forward"]: x["phase_optimizer"] + 1], axis=1)
    age0 = X[:, c["age0"]] > 0
    fresh = age0 & (X[:, c["born_this_iter"]] > 0) & (X[:, c["log_since_birth"]] == 0)
    kind = np.argmax(X[:, :7], axis=1)  # KINDS order: param buffer opt_state grad activation input temp
    saved = X[:, c["saved"]] > 0
    cls = np.select([fresh, saved & (kind >= 4), kind <= 2, kind == 3], [0, 2, 1, 3], default=4)
    for ph in range(3):
        for k in range(5):
            sel = age0 & (phase == ph) & (cls == k)
            if sel.sum() >= 8:
                prior[ph, k] = float(np.median(reps[y[sel]]))
    return prior


def git_commit() -> str:
    """The repository's current commit (``unknown`` outside a git checkout)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def train(
    traces: Iterable[str | Path | Trace],
    config: PilotConfig | None = None,
    exclude_families: Sequence[str] = (),
    log: Any = None,
    max_decisions: int | None = None,
) -> tuple[PilotModel, dict[str, Any]]:
    """Train a pilot model on every iteration of ``traces`` (paths, directories or loaded traces).

    ``exclude_families``: leave these workloads out (leave-one-family-out experiments).
    ``max_decisions``: decision points sampled per iteration at most (long iterations are thinned
    evenly; see :func:`~dynn_runtime.pilot.data.build_rows`). Returns the
    model and a provenance record (data, config, loss per epoch, time, version, commit), also stored
    in the model's ``meta`` so that it is saved with the weights.
    """
    cfg = config or PilotConfig()
    loaded: list[Trace] = []
    for t in traces:
        loaded.extend([t] if isinstance(t, Trace) else load_traces([t]))
    loaded = [t for t in loaded if trace_family(t) not in set(exclude_families)]
    if not loaded:
        raise PilotError("pilot: no traces to train on (after leaving out "
                         f"{list(exclude_families) or 'nothing'}). Record some with `dynn trace WORKLOAD -o FILE`.")
    t0 = time.perf_counter()
    rows = build_rows(loaded, group=cfg.group, per_decision=cfg.candidates_per_decision, seed=cfg.seed,
                      max_decisions=max_decisions)
    if not len(rows):
        raise PilotError("pilot: the traces hold no decision points (no operators?); nothing to train on.")
    t_rows = time.perf_counter() - t0
    if log:
        log(f"pilot: {len(rows)} training rows from {len(loaded)} trace(s) in {t_rows:.1f} s")
    model, losses = fit(rows.X, rows.C, rows.y, cfg)
    model.arrays["prior"] = fit_prior(rows)
    data = [{"path": t.path, "workload": trace_family(t), "preset": t.header.get("preset"),
             "seed": t.header.get("seed"), "iterations": len(t.iterations)} for t in loaded]
    info = {
        "data": data,
        "families": sorted({d["workload"] for d in data}),
        "excluded_families": list(exclude_families),
        "max_decisions": max_decisions,
        "rows": len(rows),
        "label_counts": np.bincount(rows.y, minlength=N_FINE).tolist(),
        "losses": [round(x, 5) for x in losses],
        "train_s": round(time.perf_counter() - t0, 2),
        "n_params": model.n_params,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "dynn_runtime": __version__,
        "git_commit": git_commit(),
    }
    model.meta.update({"training": info})
    return model, info
