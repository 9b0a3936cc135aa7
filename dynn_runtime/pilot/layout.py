"""The pilot's feature layout and its prediction buckets: the one table every other copy comes from.

:data:`CAND_TABLE` lists the columns of a candidate's feature row and :data:`CTX_TABLE` those of the
context row shared by one decision point's candidates, in column order. The numpy feature code
(:mod:`.features`) indexes columns by these names, the model's input width is their length, and
the native kernel's C header (``kernel/pilot_kernel.h``, written by
:func:`dynn_runtime.pilot.kernel.abi.header`) numbers them as ``F_<GROUP>`` / ``X_<GROUP>``. Adding a
feature is one entry here, its computation in :meth:`.features.FeatureState.features_numpy` and in
``kernel/kernel.c``'s ``pilot_feature_row``, and regenerating the header
(``python -m dynn_runtime.pilot.kernel.abi``); the shipped weights must then be retrained.

Each entry is ``(group, columns)``: a group of one column is named after it; a group of several
(one per storage kind, phase, idiom component or threshold) is contiguous, so that the kernel
writes column ``F_<GROUP> + i``.
"""

from __future__ import annotations

import numpy as np

from ..trace.format import KINDS, PHASES

__all__ = [
    "CAND_TABLE", "CTX_TABLE", "CAND_FEATURES", "CTX_FEATURES", "THRESH", "HINT_MAX", "IV_WIDTH", "KEY_BASE",
    "BUCKET_EDGES", "N_FINE", "COARSE_NAMES", "COARSE_OF_FINE", "N_COARSE", "fine_bucket",
]

#: cumulative "estimated distance <= t operators" indicators: sharp edges at the bucket and window
#: boundaries, where an exact replay is right and the network would otherwise blur it
THRESH: tuple[int, ...] = (8, 16, 32, 48, 64, 96, 128, 256)
#: hinted step counts and distances are capped here, so that the kernel's log tables cover them
HINT_MAX = 4095
#: the previous iteration's positions are keyed ``index * KEY_BASE + position`` (one sort orders
#: them by storage, then position)
KEY_BASE = 1 << 32
#: components of an operator's idiom vector (producer, consumer and history features)
IV_WIDTH = 6

Table = tuple[tuple[str, tuple[str, ...]], ...]


def _one(*names: str) -> Table:
    return tuple((n, (n,)) for n in names)


def _group(name: str, columns: object) -> Table:
    return ((name, tuple(columns)),)  # type: ignore[arg-type]


CAND_TABLE: Table = (
    *_group("kind", (f"kind_{k}" for k in KINDS)),
    *_one("saved", "persistent", "log_bytes", "accessed_this_iter", "log_age", "log_count", "log_count_phase"),
    *_group("acc", (f"acc_{p}" for p in PHASES)),
    *_one("born_this_iter", "log_since_birth"),
    *_group("born", (f"born_{p}" for p in PHASES)),
    *_group("last", (f"last_{p}" for p in PHASES)),
    *_group("producer_iv", (f"producer_iv{i}" for i in range(IV_WIDTH))),
    *_one("has_producer"),
    *_group("consumer_iv", (f"consumer_iv{i}" for i in range(IV_WIDTH))),
    *_one("on_stack", "log_stack_depth", "stack_top", "matched", "prev_used_again", "log_prev_dist",
          "log_prev_count", "occ_has_next", "log_occ_remaining", "log_occ_gap", "age0", "ext_by_order",
          "log_stack_span", "log_stack_est", "stack_overdue"),
    *_group("prev_le", (f"prev_le{t}" for t in THRESH)),
    *_group("occ_le", (f"occ_le{t}" for t in THRESH)),
    *_group("stack_le", (f"stack_le{t}" for t in THRESH)),
    *_one("mirror", "mirror_linked", "mirror_final", "log_mirror_span", "log_mirror_est"),
    *_group("mirror_le", (f"mirror_le{t}" for t in THRESH)),
    *_one("hinted", "hint_done", "log_hint_steps", "log_hint_est"),
    *_group("hint_le", (f"hint_le{t}" for t in THRESH)),
    *_one("hint_read"),
)
CTX_TABLE: Table = (
    *_group("phase", (f"phase_{p}" for p in PHASES)),
    *_one("log_in_phase", "has_history", "anchored_progress", "progress", "log_since_anchor"),
    *_group("hist_fast_iv", (f"hist_fast_iv{i}" for i in range(IV_WIDTH))),
    *_group("hist_slow_iv", (f"hist_slow_iv{i}" for i in range(IV_WIDTH))),
    *_one("hist_slow_allocs", "log_candidates", "log_bwd_fwd_ratio", "hints"),
)
CAND_FEATURES: tuple[str, ...] = tuple(c for _, cols in CAND_TABLE for c in cols)
CTX_FEATURES: tuple[str, ...] = tuple(c for _, cols in CTX_TABLE for c in cols)

#: upper edges (in operators after the decision point, inclusive) of the fine buckets the model
#: predicts; after them come "later this iteration" (past the last edge) and "not again this
#: iteration". Octaves up to 16384 operators: a far next use is predicted to an octave too, so the
#: policy rescores a storage about when its use could come near instead of at a fixed interval.
BUCKET_EDGES: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_FINE = len(BUCKET_EDGES) + 2
#: coarse buckets (reported): with the default group of 16 operators they are next group,
#: within 4 groups, within 16 groups, later this iteration, not again this iteration
COARSE_NAMES = ("next group", "within 4 groups", "within 16 groups", "later", "not again")
COARSE_OF_FINE = np.asarray([0 if e <= 16 else 1 if e <= 64 else 2 if e <= 256 else 3 for e in BUCKET_EDGES]
                            + [3, 4], dtype=np.int64)
N_COARSE = len(COARSE_NAMES)


def fine_bucket(dist: np.ndarray) -> np.ndarray:
    """Fine bucket of next-use distances (operators; ``<= 0`` or ``inf``: not again this iteration)."""
    d = np.asarray(dist, dtype=np.float64)
    b = np.searchsorted(np.asarray(BUCKET_EDGES, dtype=np.float64), d, side="left")
    b = np.where(np.isfinite(d) & (d > 0), b, N_FINE - 1)
    return b.astype(np.int64)
