"""The pilot's feature rows in numpy: what each column of :data:`~dynn_runtime.pilot.layout.CAND_FEATURES`
and :data:`~dynn_runtime.pilot.layout.CTX_FEATURES` holds, computed from a
:class:`~dynn_runtime.pilot.features.FeatureState`.

The native kernel (``kernel/kernel.c``, ``pilot_feature_row`` and ``pilot_context_row``) computes the same rows
bit for bit and is tested against :func:`feature_rows`. The columns, by group (see
:mod:`.features` for the state behind them):

* kind, saved, persistent, size, recency and counts (this iteration and this phase), the phases it
  was accessed, born and last used in, and the idiom vectors of its producer and consumers;
* the saved-activation stack: depth, span in forward operators and its estimate in backward
  operators (times the previous iteration's backward/forward ratio), overdue;
* anchored replay: whether the storage has a counterpart in the previous iteration, when the
  counterpart was next used after the anchor, its access count, and the occurrence gap (after its
  k-th access the counterpart was next used that many operators later); ``ext_by_order`` marks a
  counterpart assigned ahead of the first access by announcement order;
* the backward mirror: whether a forward access below the mirror is pending, its span and estimate;
* workload hints: hinted, steps to the hinted step and their estimate in operators, read already;
* for every estimated distance, cumulative indicators "<= t operators" (:data:`~.layout.THRESH`),
  so that the network can draw sharp boundaries where an exact replay is right;
* the context row: phase, progress against the previous iteration (anchored and positional), the
  fast and slow idiom histories, the number of candidates, the backward/forward ratio, and whether
  the iteration has hints, so that the network can tell "no hint" from "hints, but none here".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .layout import CAND_FEATURES, CTX_FEATURES, HINT_MAX, KEY_BASE, THRESH

__all__ = ["feature_rows"]

_C = {n: i for i, n in enumerate(CAND_FEATURES)}
_X = {n: i for i, n in enumerate(CTX_FEATURES)}
_THRESH_ARR = np.asarray(THRESH, dtype=np.float64)


def feature_rows(state: Any, idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``state``'s feature rows for slots ``idx`` (None: every live storage): the storage ids, the
    (m, len(CAND_FEATURES)) rows and the context row, as :meth:`FeatureState.features
    <dynn_runtime.pilot.features.FeatureState.features>` returns them. The reference the native
    kernel is tested against (bit for bit)."""
    n_live = int(state.active[: state._cap].sum()) if idx is not None else None
    if idx is None:
        idx = state.active_slots()
    pos = state.position
    m = len(idx)
    X = np.zeros((m, len(CAND_FEATURES)), dtype=np.float32)
    kind = state.kind[idx]
    X[np.arange(m), kind] = 1.0
    X[:, _C["saved"]] = state.saved[idx]
    X[:, _C["persistent"]] = state.persistent[idx]
    X[:, _C["log_bytes"]] = state.log_bytes[idx]
    last = state.last[idx]
    accessed = last >= 0
    X[:, _C["accessed_this_iter"]] = accessed
    age = np.where(accessed, pos - last, pos + 1)
    X[:, _C["log_age"]] = np.log1p(np.maximum(age, 0)) / 8.0
    X[:, _C["age0"]] = accessed & (age == 0)
    X[:, _C["log_count"]] = np.log1p(state.count[idx]) / 4.0
    cp = np.where(state.count_phase_of[idx] == state.phase, state.count_phase[idx], 0.0)
    X[:, _C["log_count_phase"]] = np.log1p(cp) / 4.0
    X[:, _C["acc_forward"]: _C["acc_optimizer"] + 1] = state.acc_phase[idx]
    born = state.born[idx]
    b = born >= 0
    X[:, _C["born_this_iter"]] = b
    X[:, _C["log_since_birth"]] = np.where(b, np.log1p(np.maximum(pos - born, 0)) / 8.0, 0.0)
    bp = state.born_phase[idx]
    rows = np.flatnonzero(bp >= 0)
    X[rows, _C["born_forward"] + bp[rows]] = 1.0
    lp = state.last_phase[idx]
    rows = np.flatnonzero(lp >= 0)
    X[rows, _C["last_forward"] + lp[rows]] = 1.0
    X[:, _C["producer_iv0"]: _C["producer_iv5"] + 1] = state.producer_iv[idx]
    X[:, _C["has_producer"]] = state.has_producer[idx]
    X[:, _C["consumer_iv0"]: _C["consumer_iv5"] + 1] = state.consumer_iv[idx]
    # stack depth among saved activations not yet read in backward (the saved-activation stack)
    st = state.stack_idx[idx]
    on = (st >= 0) & (state.acc_phase[idx, 1] == 0)
    if on.any():
        rows = np.flatnonzero(on)
        # depth among every live storage on the stack, not only among the rows asked for (idx may
        # be a subset: the policy's incremental rescoring); stack indices are unique
        cap = state._cap
        st_all = state.stack_idx[:cap]
        st_all = np.sort(st_all[state.active[:cap] & (st_all >= 0) & (state.acc_phase[:cap, 1] == 0)])
        depth = (len(st_all) - np.searchsorted(st_all, st[rows], side="right")).astype(np.float32)
        X[rows, _C["on_stack"]] = 1.0
        X[rows, _C["log_stack_depth"]] = np.log1p(depth) / 6.0
        X[rows, _C["stack_top"]] = depth < 1
        # forward operators between its push and the forward position backward has reached (the
        # push position of the storage it read last from the stack; in forward: now), scaled by
        # the previous iteration's backward/forward operator ratio: backward replays forward in
        # reverse. Pushed after that position and still unread: overdue.
        if state.phase == 0:
            front = pos
        else:
            front = state._frontier if state._frontier >= 0 else state.phase_start
        span = (front - state.stack_pos[idx[rows]]).astype(np.float64)
        X[rows, _C["stack_overdue"]] = span < 0
        span = np.maximum(span, 0.0)
        est = span * state._ratio
        X[rows, _C["log_stack_span"]] = np.log1p(span) / 8.0
        X[rows, _C["log_stack_est"]] = np.log1p(est) / 8.0
        X[rows, _C["stack_le8"]: _C["stack_le256"] + 1] = est[:, None] <= _THRESH_ARR
    # backward mirrors forward
    if state.phase == 1 and state._mirror >= 0:
        tgt = state.mirror_tgt[idx]
        rows = np.flatnonzero(tgt >= 0)
        if len(rows):
            t = tgt[rows]
            keys = state._mir_keys
            mir = state._mirror
            k = np.searchsorted(keys, t * KEY_BASE + mir, side="left")
            first = state._mir_off[t]
            ok = k > first
            rows, k, first, t = rows[ok], k[ok], first[ok], t[ok]
            span = (mir - keys[k - 1] % KEY_BASE).astype(np.float64)
            est = span * state._ratio
            X[rows, _C["mirror"]] = 1.0
            X[rows, _C["mirror_linked"]] = state._mir_sid[t] != state.sid[idx[rows]]
            X[rows, _C["mirror_final"]] = k - 1 == first
            X[rows, _C["log_mirror_span"]] = np.log1p(span) / 8.0
            X[rows, _C["log_mirror_est"]] = np.log1p(est) / 8.0
            X[rows, _C["mirror_le8"]: _C["mirror_le256"] + 1] = est[:, None] <= _THRESH_ARR
    # anchored replay
    prev = state.prev[idx]
    p_here, q = state._anchor
    has_prev = prev >= 0
    X[:, _C["matched"]] = has_prev
    # external storages ahead of their first access: an external storage not accessed yet gets the counterpart it will be
    # matched to if externals are first accessed in the order they were announced
    pend = ~has_prev & (state.born[idx] < 0) & (state.count[idx] == 0)
    if state._prev_len and pend.any():
        act = np.flatnonzero(state.active[: state._cap])
        pa = act[(state.prev[act] < 0) & (state.born[act] < 0) & (state.count[act] == 0)]
        rank_of = np.empty(state._cap, dtype=np.int64)
        rank_of[pa[np.argsort(state.announce[pa], kind="stable")]] = np.arange(len(pa))
        ext = state._prev_external
        rem = [state._prev_idx[c] for c in ext[state._ext_next: state._ext_next + len(pa) + len(state._slot)]
               if c not in state._slot][: len(pa)]
        rows = np.flatnonzero(pend)
        rk = rank_of[idx[rows]]
        ok = rk < len(rem)
        if ok.any():
            prev = prev.copy()
            prev[rows[ok]] = np.asarray(rem, dtype=np.int64)[rk[ok]]
            X[rows[ok], _C["ext_by_order"]] = 1.0
            has_prev = prev >= 0
    if state._prev_len and has_prev.any():
        rows = np.flatnonzero(has_prev)
        pi = prev[rows]
        qm = q + (pos - p_here) if q >= 0 else pos
        keys = state._prev_keys
        k = np.searchsorted(keys, pi * KEY_BASE + qm, side="right")
        ok = k < len(keys)
        kk = np.minimum(k, len(keys) - 1)
        ok &= (keys[kk] // KEY_BASE) == pi
        dist = np.where(ok, keys[kk] % KEY_BASE - qm, 0)
        X[rows, _C["prev_used_again"]] = ok
        X[rows, _C["log_prev_dist"]] = np.where(ok, np.log1p(np.maximum(dist, 0)) / 8.0, 0.0)
        X[rows, _C["prev_le8"]: _C["prev_le256"] + 1] = ok[:, None] & (dist[:, None] <= _THRESH_ARR)
        X[rows, _C["log_prev_count"]] = np.log1p(state._prev_count[pi]) / 4.0
        # occurrence-anchored: after its k-th access the counterpart was next used g operators later
        cnt = state.count[idx[rows]].astype(np.int64)
        acc_r = cnt > 0
        first = np.searchsorted(keys, pi * KEY_BASE, side="left")
        jn = first + cnt
        okn = acc_r & (jn < len(keys))
        jn_c = np.minimum(jn, len(keys) - 1)
        okn &= (keys[jn_c] // KEY_BASE) == pi
        gap = (keys[jn_c] % KEY_BASE) - (keys[np.maximum(jn_c - 1, 0)] % KEY_BASE)
        age_r = pos - state.last[idx[rows]]
        X[rows, _C["occ_has_next"]] = okn
        X[rows, _C["log_occ_gap"]] = np.where(okn, np.log1p(np.maximum(gap, 0)) / 8.0, 0.0)
        X[rows, _C["log_occ_remaining"]] = np.where(okn, np.log1p(np.maximum(gap - age_r, 0)) / 8.0, 0.0)
        X[rows, _C["occ_le8"]: _C["occ_le256"] + 1] = okn[:, None] & ((gap - age_r)[:, None] <= _THRESH_ARR)
    # workload hints
    if state._h_active:
        at = state.hint_at[idx]
        rows = np.flatnonzero(at >= 0)
        if len(rows):
            steps = np.minimum(np.maximum(at[rows] - state._h_step, 0), HINT_MAX)
            est = np.minimum(np.maximum(steps * state._hint_len() - (pos + 1 - state._h_start), 0), HINT_MAX)
            X[rows, _C["hinted"]] = 1.0
            X[rows, _C["log_hint_steps"]] = np.log1p(steps.astype(np.float32)) / 4.0
            X[rows, _C["log_hint_est"]] = np.log1p(est) / 8.0
            X[rows, _C["hint_le8"]: _C["hint_le256"] + 1] = est[:, None] <= _THRESH_ARR
            # hinted for this step and already read in it: the read the hint announced may be over
            X[rows, _C["hint_read"]] = (steps == 0) & (state.last[idx[rows]] >= state._h_start)
        X[at == -2, _C["hint_done"]] = 1.0
    ctx = np.zeros(len(CTX_FEATURES), dtype=np.float32)
    ctx[state.phase] = 1.0
    ctx[_X["log_in_phase"]] = np.log1p(pos - state.phase_start) / 8.0
    if state._prev_len:
        ctx[_X["has_history"]] = 1.0
        qm = q + (pos - p_here) if q >= 0 else pos
        ctx[_X["anchored_progress"]] = min(qm / state._prev_len, 3.0)
        ctx[_X["progress"]] = min(pos / state._prev_len, 3.0)
        ctx[_X["log_since_anchor"]] = np.log1p(pos - p_here if q >= 0 else pos + 1) / 8.0
    ctx[_X["hist_fast_iv0"]: _X["hist_fast_iv5"] + 1] = state._hist_fast
    ctx[_X["hist_slow_iv0"]: _X["hist_slow_iv5"] + 1] = state._hist_slow
    ctx[_X["hist_slow_allocs"]] = min(state._hist_allocs, 8.0) / 4.0
    ctx[_X["log_candidates"]] = np.log1p(m if n_live is None else n_live) / 8.0
    ctx[_X["log_bwd_fwd_ratio"]] = np.log1p(state._ratio)
    ctx[_X["hints"]] = state._h_active
    return state.sid[idx].copy(), X, ctx
