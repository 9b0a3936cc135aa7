"""The pilot network: a small MLP scoring every candidate of a decision point in one batch.

Architecture (``hidden`` = 64 by default: 10.5k parameters)::

    h1 = relu(((x - mu) / sd) @ W1c + ((ctx - mu_ctx) / sd_ctx) @ W1x + b1)   # candidate + shared context
    h2 = relu(h1 @ W2 + b2)
    logits = h2 @ W3 + b3                                                    # N_FINE next-use buckets

The context term is computed once per decision point and broadcast, so a decision costs two
``(n, hidden)`` matrix products. Training (Adam, manual backprop) and the reference inference
(:meth:`PilotModel.logits`, :meth:`PilotModel.probs`) are numpy; :meth:`PilotModel.score` runs on
the native C kernel (:mod:`.native`) when it is available, equal to numpy up to float32 summation
order. That keeps inference free of torch operators (the live runtime runs policies while its own
``TorchDispatchMode`` is active), makes a refit between iterations safe in the same place, and
makes inference bit-for-bit deterministic for a given machine and backend.

Weights files (``.npz``): the arrays above plus ``meta``, a JSON record with ``format``
(``"dynn-pilot"``), ``version`` (:data:`WEIGHTS_VERSION`), the feature names the file was trained
with, the config, the provisional-prediction prior and (version 2) the range of every input in the
training rows (``lo``/``hi``, ``lo_ctx``/``hi_ctx``), to which inference clamps its inputs.
:func:`load_model` checks all of it and
raises :class:`~dynn_runtime.errors.PilotError` naming the file and the fix.
"""

from __future__ import annotations

import functools
import json
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PilotError
from .features import BUCKET_EDGES, CAND_FEATURES, COARSE_OF_FINE, CTX_FEATURES, N_COARSE, N_FINE

__all__ = ["PilotConfig", "PilotModel", "load_model", "save_model", "WEIGHTS_VERSION", "WEIGHTS_FORMAT",
           "fit", "bucket_reps"]

WEIGHTS_FORMAT = "dynn-pilot"
WEIGHTS_VERSION = 2
_ARRAYS = ("W1c", "W1x", "b1", "W2", "b2", "W3", "b3", "mu", "sd", "mu_ctx", "sd_ctx", "lo", "hi", "lo_ctx",
           "hi_ctx", "prior")
_RANGE = ("lo", "hi", "lo_ctx", "hi_ctx")
#: the input range of a model that was never fitted (no clamping in effect)
_BOUND = np.float32(1e30)


@dataclass(kw_only=True)
class PilotConfig:
    """How a pilot model is shaped and trained."""

    group: int = 16
    """Operators per decision point (also split at every phase change)."""
    hidden: int = 64
    """Width of the two hidden layers."""
    epochs: int = 12
    """Passes over the training rows."""
    batch: int = 512
    """Rows per Adam step."""
    lr: float = 3e-3
    """Adam learning rate (halved for the last third of the epochs)."""
    weight_decay: float = 1e-5
    """L2 penalty on the weight matrices."""
    seed: int = 0
    """Initialisation and shuffling seed (training is deterministic for a given seed)."""
    candidates_per_decision: int = 64
    """Training rows sampled per decision point (evaluation uses every candidate)."""


def bucket_reps(expected_len: int) -> np.ndarray:
    """Representative next-use distance of each fine bucket (log-midpoint), used to order storages.

    ``later`` and ``not again`` scale with the expected iteration length (previous iteration's).
    """
    edges = (0.5,) + BUCKET_EDGES
    reps = [float(np.sqrt(max(edges[i], 1.0) * edges[i + 1])) for i in range(len(BUCKET_EDGES))]
    length = max(float(expected_len), 4.0 * BUCKET_EDGES[-1])
    reps.append(max(length / 2.0, 2.0 * BUCKET_EDGES[-1]))
    reps.append(4.0 * length)
    return np.asarray(reps, dtype=np.float64)


@functools.lru_cache(maxsize=64)
def _log_bucket_reps(expected_len: int) -> np.ndarray:
    """``log(bucket_reps(n))``, computed once per length (every decision point of an iteration asks
    for the same one). Read-only: the cached array is shared."""
    out = np.log(bucket_reps(expected_len))
    out.flags.writeable = False
    return out


@dataclass
class PilotModel:
    """Trained weights and what they were trained with; :meth:`probs` is the whole inference."""

    arrays: dict[str, np.ndarray]
    config: PilotConfig = field(default_factory=PilotConfig)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_params(self) -> int:
        return int(sum(self.arrays[k].size for k in ("W1c", "W1x", "b1", "W2", "b2", "W3", "b3")))

    @classmethod
    def init(cls, config: PilotConfig | None = None, rng: np.random.Generator | None = None) -> PilotModel:
        cfg = config or PilotConfig()
        rng = rng or np.random.default_rng(cfg.seed)
        fc, fx, h = len(CAND_FEATURES), len(CTX_FEATURES), cfg.hidden

        def he(i: int, o: int) -> np.ndarray:
            return (rng.standard_normal((i, o)) * np.sqrt(2.0 / i)).astype(np.float32)

        w1 = he(fc + fx, h)
        arrays = {
            "W1c": w1[:fc], "W1x": w1[fc:], "b1": np.zeros(h, np.float32),
            "W2": he(h, h), "b2": np.zeros(h, np.float32),
            "W3": (rng.standard_normal((h, N_FINE)) * np.sqrt(1.0 / h)).astype(np.float32),
            "b3": np.zeros(N_FINE, np.float32),
            "mu": np.zeros(fc, np.float32), "sd": np.ones(fc, np.float32),
            "mu_ctx": np.zeros(fx, np.float32), "sd_ctx": np.ones(fx, np.float32),
            "lo": np.full(fc, -_BOUND), "hi": np.full(fc, _BOUND),
            "lo_ctx": np.full(fx, -_BOUND), "hi_ctx": np.full(fx, _BOUND),
            "prior": np.full((3, 5), 8.0, np.float32),
        }
        return cls(arrays=arrays, config=cfg)

    def copy(self) -> PilotModel:
        return PilotModel({k: v.copy() for k, v in self.arrays.items()}, PilotConfig(**asdict(self.config)),
                          json.loads(json.dumps(self.meta)))

    # ---- inference ----------------------------------------------------------------------------
    def _folded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        # the input normalisations folded into the first layer: one pass over X instead of three,
        # and the context row's product is one vector-matrix product per decision point
        f = self.__dict__.get("_fold")
        if f is None:
            a = self.arrays
            w = (a["W1c"] / a["sd"][:, None]).astype(np.float32)
            b = (a["b1"] - (a["mu"] / a["sd"]) @ a["W1c"]).astype(np.float32)
            wx = (a["W1x"] / a["sd_ctx"][:, None]).astype(np.float32)
            bx = (b - (a["mu_ctx"] / a["sd_ctx"]) @ a["W1x"]).astype(np.float32)
            f = self.__dict__["_fold"] = (w, b, wx, bx)
        return f

    def bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(lo, hi, lo_ctx, hi_ctx)``: the input range inference clamps to (the training rows' range;
        unbounded for arrays built by hand without it)."""
        a = self.arrays
        fc, fx = a["W1c"].shape[0], a["W1x"].shape[0]
        return (a.get("lo", np.full(fc, -_BOUND)), a.get("hi", np.full(fc, _BOUND)),
                a.get("lo_ctx", np.full(fx, -_BOUND)), a.get("hi_ctx", np.full(fx, _BOUND)))

    #: rows per matrix product at inference. OpenBLAS runs a product of fewer than 2^18
    #: multiply-adds on the calling thread; larger ones wake its thread pool, which on a busy CPU
    #: (the training process's own threads, other jobs) was measured to stall for milliseconds
    #: (p99 16 ms vs 0.4 ms for 1000 candidates). 63 x 64 x 64 stays under that threshold.
    chunk_rows: int = 63

    def logits(self, X: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Bucket logits for candidate rows ``X`` (n, F) under one context row ``ctx`` (C,)."""
        a = self.arrays
        w1, _, wx, bx = self._folded()
        # inputs are clamped to the range seen in training: a ReLU network extrapolates linearly, so
        # distance features of iterations longer than any training one would push every prediction
        # to "later" (measured in docs/pilot-lab-notes.md)
        lo, hi, lo_ctx, hi_ctx = self.bounds()
        c = np.clip(np.asarray(ctx, dtype=np.float32), lo_ctx, hi_ctx) @ wx
        c += bx
        X = np.clip(X, lo, hi, dtype=np.float32)
        w2, b2, w3, b3 = a["W2"], a["b2"], a["W3"], a["b3"]
        out = np.empty((len(X), w3.shape[1]), dtype=np.float32)
        step = self.chunk_rows
        for s in range(0, len(X), step):
            h = X[s: s + step] @ w1
            h += c
            np.maximum(h, 0, out=h)
            h = h @ w2
            h += b2
            np.maximum(h, 0, out=h)
            o = out[s: s + step]
            np.matmul(h, w3, out=o)
            o += b3
        return out

    def probs(self, X: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        z = self.logits(X, ctx)
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        return z

    def expected_log_distance(self, P: np.ndarray, expected_len: int) -> np.ndarray:
        """Order key: the expected log next-use distance under the bucket probabilities ``P``."""
        return P.astype(np.float64) @ _log_bucket_reps(expected_len)

    def score(self, X: np.ndarray, ctx: np.ndarray, expected_len: int, quantile: float = 0.1,
              backend: str | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(P, eld, k)``: :meth:`probs`, :meth:`expected_log_distance`, and per row the first bucket
        whose cumulative probability reaches ``quantile`` (what the policy needs of a decision point).

        ``backend``: ``"native"`` (the C kernel, :mod:`.native`: equal to numpy up to float32
        summation order), ``"numpy"`` (the methods above), or None: native when available and it
        takes this model's shape.
        """
        from . import kernel as native

        use = native.resolve(backend) == "native"
        if use and not native.kernel().supports(self):
            if backend == "native":
                raise PilotError(f"pilot: the native kernel does not take this model's shape "
                                 f"(hidden {self.arrays['W2'].shape[0]}); use backend='numpy'.")
            use = False
        if use:
            P, eld, k, _ = native.kernel().score(self, X, ctx, _log_bucket_reps(expected_len), quantile)
            return P, eld, k
        P = self.probs(X, ctx)
        return P, self.expected_log_distance(P, expected_len), (np.cumsum(P, axis=1) >= quantile).argmax(axis=1)

    @staticmethod
    def coarse(P: np.ndarray) -> np.ndarray:
        """Probabilities of the coarse (reported) buckets."""
        out = np.zeros((P.shape[0], N_COARSE), dtype=P.dtype)
        np.add.at(out.T, COARSE_OF_FINE, P.T)
        return out


def save_model(model: PilotModel, path: str | Path) -> Path:
    """Write ``model`` as a versioned ``.npz`` (arrays + a JSON ``meta`` record)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": WEIGHTS_FORMAT, "version": WEIGHTS_VERSION,
        "cand_features": list(CAND_FEATURES), "ctx_features": list(CTX_FEATURES),
        "bucket_edges": list(BUCKET_EDGES), "config": asdict(model.config), **{
            k: v for k, v in model.meta.items() if k not in ("format", "version", "cand_features", "ctx_features",
                                                            "bucket_edges", "config")},
    }
    with open(p, "wb") as f:
        np.savez_compressed(f, meta=np.array(json.dumps(meta, sort_keys=True)),
                            **{k: model.arrays[k] for k in _ARRAYS if k not in _RANGE},
                            **dict(zip(_RANGE, model.bounds())))
    return p


def load_model(path: str | Path) -> PilotModel:
    """Read a weights file written by :func:`save_model`; a clear :class:`PilotError` otherwise."""
    p = Path(path)
    fix = "Retrain it with `dynn pilot train --traces ... -o FILE`, or use the shipped weights (no weights= option)."
    if not p.is_file():
        raise PilotError(f"pilot: weights file {str(p)!r} does not exist. {fix}")
    try:
        with np.load(p, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError) as exc:
        raise PilotError(f"pilot: {p} is not a readable pilot weights file ({type(exc).__name__}: {exc}); "
                         f"it is corrupt or truncated. {fix}") from None
    if "meta" not in data:
        raise PilotError(f"pilot: {p} has no 'meta' record: not a dynn pilot weights file. {fix}")
    try:
        meta = json.loads(str(data["meta"]))
    except json.JSONDecodeError as exc:
        raise PilotError(f"pilot: {p}: the meta record is not JSON ({exc.msg}); the file is corrupt. {fix}") from None
    if meta.get("format") != WEIGHTS_FORMAT:
        raise PilotError(f"pilot: {p}: format {meta.get('format')!r}, expected {WEIGHTS_FORMAT!r}. {fix}")
    v = meta.get("version")
    if v != WEIGHTS_VERSION:
        newer = isinstance(v, int) and v > WEIGHTS_VERSION
        raise PilotError(
            f"pilot: {p}: weights format version {v!r}, this dynn-runtime reads version {WEIGHTS_VERSION}. "
            + ("Upgrade dynn-runtime, or " if newer else "") + fix[0].lower() + fix[1:])
    for key, names in (("cand_features", CAND_FEATURES), ("ctx_features", CTX_FEATURES)):
        got = meta.get(key)
        if got != list(names):
            n = len(got) if isinstance(got, list) else "?"
            raise PilotError(
                f"pilot: {p}: trained on {n} {key.replace('_', ' ')} ({key}), this dynn-runtime computes "
                f"{len(names)} different ones: the feature width or meaning changed since it was trained. {fix}")
    if meta.get("bucket_edges") != list(BUCKET_EDGES):
        raise PilotError(f"pilot: {p}: bucket edges {meta.get('bucket_edges')} differ from this dynn-runtime's "
                         f"{list(BUCKET_EDGES)}. {fix}")
    missing = [k for k in _ARRAYS if k not in data]
    if missing:
        raise PilotError(f"pilot: {p} lacks arrays {missing}; the file is corrupt. {fix}")
    arrays = {k: np.ascontiguousarray(data[k], dtype=np.float32) for k in _ARRAYS}
    cfg_d = meta.get("config", {})
    try:
        cfg = PilotConfig(**cfg_d)
    except TypeError as exc:
        raise PilotError(f"pilot: {p}: config record does not match this version ({exc}). {fix}") from None
    fc, fx, h = len(CAND_FEATURES), len(CTX_FEATURES), cfg.hidden
    shapes = {"W1c": (fc, h), "W1x": (fx, h), "b1": (h,), "W2": (h, h), "b2": (h,), "W3": (h, N_FINE),
              "b3": (N_FINE,), "mu": (fc,), "sd": (fc,), "mu_ctx": (fx,), "sd_ctx": (fx,), "lo": (fc,), "hi": (fc,),
              "lo_ctx": (fx,), "hi_ctx": (fx,), "prior": (3, 5)}
    for k, shape in shapes.items():
        if arrays[k].shape != shape:
            raise PilotError(f"pilot: {p}: array {k} has shape {arrays[k].shape}, expected {shape} "
                             f"(feature width {fc}+{fx}, hidden {h}). {fix}")
        if not np.all(np.isfinite(arrays[k])):
            raise PilotError(f"pilot: {p}: array {k} holds NaN or infinite values; the file is corrupt. {fix}")
    extra = {k: v for k, v in meta.items()
             if k not in ("format", "version", "cand_features", "ctx_features", "bucket_edges", "config")}
    return PilotModel(arrays=arrays, config=cfg, meta=extra)


# ---- training (numpy: Adam, manual backprop) ----------------------------------------------------

def fit(
    X: np.ndarray,
    C: np.ndarray,
    y: np.ndarray,
    config: PilotConfig | None = None,
    init: PilotModel | None = None,
    epochs: int | None = None,
    normalize: bool = True,
) -> tuple[PilotModel, list[float]]:
    """Train on rows ``X`` (n, F) with context rows ``C`` (n, Cx) and fine-bucket labels ``y``.

    ``init``: start from these weights (online refit; normalisation is then kept). Returns the
    model and the mean training loss per epoch. Deterministic for a given ``config.seed``.
    """
    cfg = config or (init.config if init is not None else PilotConfig())
    rng = np.random.default_rng(cfg.seed)
    model = init.copy() if init is not None else PilotModel.init(cfg, rng)
    a = model.arrays
    if init is None and normalize and len(X):
        a["mu"] = X.mean(axis=0).astype(np.float32)
        a["sd"] = np.maximum(X.std(axis=0), 1e-3).astype(np.float32)
        a["mu_ctx"] = C.mean(axis=0).astype(np.float32)
        a["sd_ctx"] = np.maximum(C.std(axis=0), 1e-3).astype(np.float32)
        a["lo"], a["hi"] = X.min(axis=0).astype(np.float32), X.max(axis=0).astype(np.float32)
        a["lo_ctx"], a["hi_ctx"] = C.min(axis=0).astype(np.float32), C.max(axis=0).astype(np.float32)
    # inference clamps its inputs to the training range (a refit's rows too)
    lo, hi, lo_ctx, hi_ctx = model.bounds()
    X = np.clip(X, lo, hi)
    C = np.clip(C, lo_ctx, hi_ctx)
    Xn = ((X - a["mu"]) / a["sd"]).astype(np.float32)
    Cn = ((C - a["mu_ctx"]) / a["sd_ctx"]).astype(np.float32)
    params = ["W1c", "W1x", "b1", "W2", "b2", "W3", "b3"]
    m = {k: np.zeros_like(a[k]) for k in params}
    v = {k: np.zeros_like(a[k]) for k in params}
    b1, b2, eps = 0.9, 0.999, 1e-8
    n = len(y)
    n_epochs = cfg.epochs if epochs is None else epochs
    losses: list[float] = []
    t = 0
    for ep in range(n_epochs):
        lr = cfg.lr * (0.5 if ep >= (2 * n_epochs) // 3 else 1.0)
        order = rng.permutation(n)
        tot = 0.0
        for s in range(0, n, cfg.batch):
            bi = order[s: s + cfg.batch]
            xb, cb, yb = Xn[bi], Cn[bi], y[bi]
            nb = len(bi)
            z1 = xb @ a["W1c"] + cb @ a["W1x"] + a["b1"]
            h1 = np.maximum(z1, 0)
            z2 = h1 @ a["W2"] + a["b2"]
            h2 = np.maximum(z2, 0)
            z3 = h2 @ a["W3"] + a["b3"]
            z3 -= z3.max(axis=1, keepdims=True)
            p = np.exp(z3)
            p /= p.sum(axis=1, keepdims=True)
            tot += float(-np.log(p[np.arange(nb), yb] + 1e-12).sum())
            g3 = p
            g3[np.arange(nb), yb] -= 1.0
            g3 /= nb
            grads = {"W3": h2.T @ g3, "b3": g3.sum(0)}
            g2 = (g3 @ a["W3"].T) * (z2 > 0)
            grads["W2"] = h1.T @ g2
            grads["b2"] = g2.sum(0)
            g1 = (g2 @ a["W2"].T) * (z1 > 0)
            grads["W1c"] = xb.T @ g1
            grads["W1x"] = cb.T @ g1
            grads["b1"] = g1.sum(0)
            t += 1
            for k in params:
                g = grads[k]
                if k[0] == "W":
                    g = g + cfg.weight_decay * a[k]
                m[k] = b1 * m[k] + (1 - b1) * g
                v[k] = b2 * v[k] + (1 - b2) * g * g
                mh = m[k] / (1 - b1 ** t)
                vh = v[k] / (1 - b2 ** t)
                a[k] = (a[k] - lr * mh / (np.sqrt(vh) + eps)).astype(np.float32)
        losses.append(tot / max(n, 1))
    model.__dict__.pop("_fold", None)  # the arrays changed: the folded first layer is stale
    model.__dict__.pop("_native", None)  # and the native kernel's weight table
    return model, losses
