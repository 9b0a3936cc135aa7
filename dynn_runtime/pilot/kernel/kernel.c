/* Native kernel of the pilot model's inference (dynn_runtime/pilot): feature rows and the MLP.
 *
 * Plain C99, no Python or numpy headers: CMake builds it at install, or dynn_runtime/pilot/kernel
 * compiles it with the system C compiler on first use; it is loaded with ctypes. The numpy code it replaces stays the
 * reference (FeatureState.features_numpy, PilotModel.logits/probs):
 *
 *   dynn_pilot_features  FeatureState.features: the (m, NF) float32 rows and the context row, equal
 *                        bit for bit to the numpy code (every transcendental goes through tables that
 *                        kernel/tables.py fills with numpy itself, so both round the same way);
 *   dynn_pilot_score     the MLP with the input normalisation folded in (PilotModel._folded), softmax,
 *                        the expected log distance and the low-quantile bucket of every row;
 *   dynn_pilot_decide    both for the policy's rows in one pass (no (m, NF) matrix is materialised),
 *                        and what PilotPolicy._score does with the result: predicted positions, when
 *                        each storage is due again, the "touched" flags;
 *   dynn_pilot_select    the policy's choice of rows at a decision point (live slots that moved or are
 *                        due);
 *   dynn_pilot_alloc     FeatureState.alloc's writes for one storage;
 *   dynn_pilot_op        FeatureState.op's per-operator update of the arrays (the idiom histories, the
 *                        producer and consumer idioms, counts, the saved-activation stack, the replayed
 *                        next uses), equal to the Python code it stands in for;
 *   dynn_pilot_finish    the network and the policy's arithmetic for gathered rows, on a worker thread;
 *   dynn_heap_*          the policy's eviction heap (heapq's pop order over the same entries, stale
 *                        entries skipped here), and dynn_pilot_merge: a decision point's rows into it.
 *
 * The MLP sums in a different order than BLAS does, so probabilities agree with numpy to float32
 * rounding (not bit for bit); it is deterministic for a given build. Inner loops run over the hidden
 * dimension on contiguous weight rows so that the compiler vectorises them; zero inputs (one-hots,
 * indicators, ReLU zeros) are skipped. Multiply-adds are fused (fmaf) where the target has FMA.
 *
 * The feature columns (F_*, X_*) and the structures Python fills (dynn_state, dynn_point, dynn_policy,
 * dynn_model, dynn_op: arrays of 8-byte words in field order) are in pilot_kernel.h, generated from
 * the Python feature table (dynn_runtime/pilot/layout.py, kernel/abi.py); dynn_pilot_layout reports
 * them so that the loader refuses a library built from another header.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pilot_kernel.h"

#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define MADD(a, b, c) fmaf((a), (b), (c))
#else
#define MADD(a, b, c) ((a) * (b) + (c))
#endif

/* numpy's clip: min(max(v, lo), hi) */
static inline float clampf(float v, float lo, float hi)
{
    v = v < lo ? lo : v;
    return v > hi ? hi : v;
}

/* ---- decision-point preparation shared by every row ------------------------------------------- */
typedef struct {
    const dynn_state *S;
    const dynn_point *D;
    int64_t n_live, front, qm;
    int stack_any;
    int32_t *gt;                  /* gt[v]: live on-stack storages with a stack index > v */
    int64_t n_gt;
    int64_t *pa;                  /* pending externals: (announce, slot) pairs, sorted */
    int64_t n_pa;
    const int64_t *rem;
    int64_t nrem;
    int pend_any;
} prep_t;

static int cmp_pair(const void *a, const void *b)
{
    const int64_t *x = (const int64_t *)a, *y = (const int64_t *)b;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    if (x[1] != y[1]) return x[1] < y[1] ? -1 : 1;
    return 0;
}

static void prep_free(prep_t *P)
{
    free(P->gt);
    free(P->pa);
    P->gt = NULL;
    P->pa = NULL;
}

static inline int pending_slot(const dynn_state *S, int64_t s)
{
    return S->prev[s] < 0 && S->born[s] < 0 && S->count[s] == 0.0f;
}

/* 0: ready; -1: tables too small; -2: out of memory; -4: a row is no slot; 1 + n: the caller must
 * pass the first n counterparts of the previous iteration's unmatched external storages (rem) */
static int64_t prepare(prep_t *P, const dynn_state *S, const dynn_point *D)
{
    const int64_t *idx = D->rows, m = D->m, *rem = D->rem, nrem = D->nrem;
    memset(P, 0, sizeof(*P));
    P->S = S;
    P->D = D;
    int64_t need = D->pos + 2;
    if (S->prev_len + 1 > need) need = S->prev_len + 1;
    if (S->cap + 1 > need) need = S->cap + 1;
    if (m + 1 > need) need = m + 1;
    if (D->phase < 0 || D->phase > 2 || D->pos < 0 || need > S->ntab) return -1;
    const int64_t cap = S->cap;
    for (int64_t i = 0; i < m; i++)
        if (idx[i] < 0 || idx[i] >= cap) return -4;
    if (D->n_live < 0) {
        int64_t n = 0;
        for (int64_t s = 0; s < cap; s++) n += S->active[s] != 0;
        P->n_live = n;
    } else {
        P->n_live = D->n_live;
    }
    P->front = D->phase == 0 ? D->pos : (D->frontier >= 0 ? D->frontier : D->phase_start);
    P->qm = D->q >= 0 ? D->q + (D->pos - D->p_here) : D->pos;
    /* external storages not accessed yet, ranked by announcement */
    if (S->prev_len) {
        for (int64_t i = 0; i < m; i++) {
            if (pending_slot(S, idx[i])) {
                P->pend_any = 1;
                break;
            }
        }
    }
    if (P->pend_any) {
        int64_t npa = 0;
        for (int64_t s = 0; s < cap; s++) npa += S->active[s] && pending_slot(S, s);
        if (nrem < 0) return 1 + npa;
        P->pa = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)(npa ? npa : 1));
        if (!P->pa) return -2;
        int64_t j = 0;
        for (int64_t s = 0; s < cap; s++) {
            if (S->active[s] && pending_slot(S, s)) {
                P->pa[2 * j] = S->announce[s];
                P->pa[2 * j + 1] = s;
                j++;
            }
        }
        qsort(P->pa, (size_t)npa, 2 * sizeof(int64_t), cmp_pair);
        P->n_pa = npa;
        P->rem = rem;
        P->nrem = nrem;
    }
    /* the saved-activation stack: depth among every live storage on the stack, not only the rows asked for */
    for (int64_t i = 0; i < m; i++) {
        int64_t s = idx[i];
        if (S->stack_idx[s] >= 0 && S->acc_phase[3 * s + 1] == 0.0f) {
            P->stack_any = 1;
            break;
        }
    }
    if (P->stack_any) {
        int64_t top = -1;
        for (int64_t s = 0; s < cap; s++) {
            int64_t st = S->stack_idx[s];
            if (S->active[s] && st > top && S->acc_phase[3 * s + 1] == 0.0f) top = st;
        }
        int64_t n = top + 1;
        P->gt = (int32_t *)calloc((size_t)(n ? n : 1), sizeof(int32_t));
        if (!P->gt) {
            prep_free(P);
            return -2;
        }
        for (int64_t s = 0; s < cap; s++) {
            int64_t st = S->stack_idx[s];
            if (S->active[s] && st >= 0 && S->acc_phase[3 * s + 1] == 0.0f) P->gt[st] = 1;
        }
        int32_t above = 0;
        for (int64_t v = n - 1; v >= 0; v--) {
            int32_t here = P->gt[v];
            P->gt[v] = above;
            above += here;
        }
        P->n_gt = n;
    }
    return 0;
}

/* numpy.searchsorted(a, v, side="right") */
static inline int64_t upper_bound(const int64_t *a, int64_t n, int64_t v)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (a[mid] <= v) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* numpy.searchsorted(a, v, side="left") */
static inline int64_t lower_bound(const int64_t *a, int64_t n, int64_t v)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + ((hi - lo) >> 1);
        if (a[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* table entry n, n clamped to [0, ntab - 1]: prepare() checked that every argument of a decision
 * point is below ntab (a count, an age or a distance is at most the position, the previous
 * iteration's length, or the number of slots); the upper clamp only keeps a broken state in bounds */
static inline float tab(const float *t, int64_t n, int64_t ntab)
{
    return t[n < 0 ? 0 : (n < ntab ? n : ntab - 1)];
}

/* float32 that holds a small non-negative integer (counts) */
static inline int64_t ival(float v)
{
    return (int64_t)v;
}

/* one feature row: FeatureState.features for slot s */
static void feature_row(const prep_t *P, int64_t s, float *restrict x)
{
    const dynn_state *S = P->S;
    const dynn_point *D = P->D;
    const int64_t pos = D->pos;
    for (int f = 0; f < NF; f++) x[f] = 0.0f;
    int64_t kind = S->kind[s];
    if (kind >= 0 && kind < N_KINDS) x[F_KIND + kind] = 1.0f;
    x[F_SAVED] = S->saved[s];
    x[F_PERSISTENT] = S->persistent[s];
    x[F_LOG_BYTES] = S->log_bytes[s];
    const int64_t last = S->last[s];
    const int accessed = last >= 0;
    x[F_ACCESSED_THIS_ITER] = (float)accessed;
    const int64_t age = accessed ? pos - last : pos + 1;
    x[F_LOG_AGE] = tab(S->l8, age, S->ntab);
    x[F_AGE0] = (float)(accessed && age == 0);
    x[F_LOG_COUNT] = tab(S->l4, ival(S->count[s]), S->ntab);
    x[F_LOG_COUNT_PHASE] = S->count_phase_of[s] == D->phase ? tab(S->l4, ival(S->count_phase[s]), S->ntab) : 0.0f;
    const float *acc = S->acc_phase + 3 * s;
    x[F_ACC] = acc[0];
    x[F_ACC + 1] = acc[1];
    x[F_ACC + 2] = acc[2];
    const int64_t born = S->born[s];
    if (born >= 0) {
        x[F_BORN_THIS_ITER] = 1.0f;
        x[F_LOG_SINCE_BIRTH] = tab(S->l8, pos - born, S->ntab);
    }
    const int64_t bp = S->born_phase[s];
    if (bp >= 0 && bp < 3) x[F_BORN + bp] = 1.0f;
    const int64_t lp = S->last_phase[s];
    if (lp >= 0 && lp < 3) x[F_LAST + lp] = 1.0f;
    const float *piv = S->producer_iv + 6 * s, *civ = S->consumer_iv + 6 * s;
    for (int i = 0; i < 6; i++) {
        x[F_PRODUCER_IV + i] = piv[i];
        x[F_CONSUMER_IV + i] = civ[i];
    }
    x[F_HAS_PRODUCER] = S->has_producer[s];
    /* the saved-activation stack */
    const int64_t st = S->stack_idx[s];
    if (st >= 0 && acc[1] == 0.0f) {
        const int64_t depth = st < P->n_gt ? P->gt[st] : 0;
        x[F_ON_STACK] = 1.0f;
        x[F_LOG_STACK_DEPTH] = tab(S->l6, depth, S->ntab);
        x[F_STACK_TOP] = (float)(depth < 1);
        int64_t span = P->front - S->stack_pos[s];
        x[F_STACK_OVERDUE] = (float)(span < 0);
        if (span < 0) span = 0;
        const double est = (double)span * S->ratio;
        x[F_LOG_STACK_SPAN] = tab(S->l8, span, S->ntab);
        x[F_LOG_STACK_EST] = tab(S->lest, span, S->ntab);
        for (int t = 0; t < N_THRESH; t++) x[F_STACK_LE + t] = (float)(est <= (double)THRESH[t]);
    }
    /* backward mirrors forward: the latest forward access below the mirror */
    if (D->phase == 1 && D->mirror >= 0) {
        const int64_t t = S->mirror_tgt[s];
        if (t >= 0 && t < S->n_mir) {
            const int64_t *seg = S->mir_pos + S->mir_off[t];
            const int64_t k = lower_bound(seg, S->mir_off[t + 1] - S->mir_off[t], D->mirror);
            if (k > 0) {
                const int64_t span = D->mirror - seg[k - 1];
                const double est = (double)span * S->ratio;
                x[F_MIRROR] = 1.0f;
                x[F_MIRROR_LINKED] = (float)(S->mir_sid[t] != S->sid[s]);
                x[F_MIRROR_FINAL] = (float)(k == 1);
                x[F_LOG_MIRROR_SPAN] = tab(S->l8, span, S->ntab);
                x[F_LOG_MIRROR_EST] = tab(S->lest, span, S->ntab);
                for (int i = 0; i < N_THRESH; i++) x[F_MIRROR_LE + i] = (float)(est <= (double)THRESH[i]);
            }
        }
    }
    /* workload hints */
    if (D->h_active) {
        const int64_t at = S->hint_at[s];
        if (at >= 0) {
            int64_t steps = at - D->h_step;
            steps = steps < 0 ? 0 : (steps > HINT_MAX ? HINT_MAX : steps);
            int64_t est = steps * D->h_len - (pos + 1 - D->h_start);
            est = est < 0 ? 0 : (est > HINT_MAX ? HINT_MAX : est);
            x[F_HINTED] = 1.0f;
            x[F_LOG_HINT_STEPS] = tab(S->l4, steps, S->ntab);
            x[F_LOG_HINT_EST] = tab(S->l8, est, S->ntab);
            for (int t = 0; t < N_THRESH; t++) x[F_HINT_LE + t] = (float)(est <= THRESH[t]);
            x[F_HINT_READ] = (float)(steps == 0 && last >= D->h_start);
        } else if (at == -2) {
            x[F_HINT_DONE] = 1.0f;
        }
    }
    /* anchored replay */
    int64_t pi = S->prev[s];
    x[F_MATCHED] = (float)(pi >= 0);
    if (pi < 0 && P->pend_any && born < 0 && S->count[s] == 0.0f) {
        /* an external storage before its first access: the counterpart it gets if externals are accessed in announcement order */
        int64_t key[2] = {S->announce[s], s};
        int64_t lo = 0, hi = P->n_pa;
        while (lo < hi) {
            int64_t mid = lo + ((hi - lo) >> 1);
            if (cmp_pair(P->pa + 2 * mid, key) < 0) lo = mid + 1; else hi = mid;
        }
        if (lo < P->nrem) {
            pi = P->rem[lo];
            x[F_EXT_BY_ORDER] = 1.0f;
        }
    }
    if (S->prev_len && pi >= 0 && pi < S->n_prev) {
        /* features_numpy searches the sorted keys (index * 2^32 + position) of every counterpart;
         * the keys of counterpart pi are its own segment, so the same answers come from searching
         * that segment's positions only */
        const int64_t *seg = S->prev_pos + S->prev_off[pi];
        const int64_t n_seg = S->prev_off[pi + 1] - S->prev_off[pi];
        const int64_t qm = P->qm;
        const int64_t k = upper_bound(seg, n_seg, qm);
        if (k < n_seg) {
            const int64_t dist = seg[k] - qm;
            x[F_PREV_USED_AGAIN] = 1.0f;
            x[F_LOG_PREV_DIST] = tab(S->l8, dist, S->ntab);
            for (int t = 0; t < N_THRESH; t++) x[F_PREV_LE + t] = (float)(dist <= THRESH[t]);
        }
        x[F_LOG_PREV_COUNT] = tab(S->l4, ival(S->prev_count[pi]), S->ntab);
        /* occurrence-anchored: after its k-th access the counterpart was next used gap operators later */
        const int64_t cnt = ival(S->count[s]);
        if (cnt > 0 && cnt < n_seg) {
            const int64_t gap = seg[cnt] - seg[cnt - 1];
            const int64_t rest = gap - (pos - last);
            x[F_OCC_HAS_NEXT] = 1.0f;
            x[F_LOG_OCC_GAP] = tab(S->l8, gap, S->ntab);
            x[F_LOG_OCC_REMAINING] = tab(S->l8, rest, S->ntab);
            for (int t = 0; t < N_THRESH; t++) x[F_OCC_LE + t] = (float)(rest <= THRESH[t]);
        }
    }
}

static void context_row(const prep_t *P, float *restrict c)
{
    const dynn_state *S = P->S;
    const dynn_point *D = P->D;
    const int64_t pos = D->pos;
    for (int i = 0; i < NC; i++) c[i] = 0.0f;
    c[X_PHASE + D->phase] = 1.0f;
    c[X_LOG_IN_PHASE] = tab(S->l8, pos - D->phase_start, S->ntab);
    if (S->prev_len) {
        const double n = (double)S->prev_len;
        double a = (double)P->qm / n, p = (double)pos / n;
        c[X_HAS_HISTORY] = 1.0f;
        c[X_ANCHORED_PROGRESS] = (float)(3.0 < a ? 3.0 : a);
        c[X_PROGRESS] = (float)(3.0 < p ? 3.0 : p);
        c[X_LOG_SINCE_ANCHOR] = tab(S->l8, D->q >= 0 ? pos - D->p_here : pos + 1, S->ntab);
    }
    for (int i = 0; i < 6; i++) {
        c[X_HIST_FAST_IV + i] = S->hist[i];
        c[X_HIST_SLOW_IV + i] = S->hist[6 + i];
    }
    const double ha = D->hist_allocs;
    c[X_HIST_SLOW_ALLOCS] = (float)((8.0 < ha ? 8.0 : ha) / 4.0);
    c[X_LOG_CANDIDATES] = tab(S->l8, P->n_live, S->ntab);
    c[X_LOG_BWD_FWD_RATIO] = (float)S->log1p_ratio;
    c[X_HINTS] = (float)(D->h_active != 0);
}

/* FeatureState.features for the slots D->rows: X (m, NF), ctx (NC,), sids (m,). Returns prepare()'s
 * code. */
int64_t dynn_pilot_features(const dynn_state *S, const dynn_point *D, float *X, float *ctx, int64_t *sids)
{
    prep_t P;
    const int64_t *idx = D->rows, m = D->m;
    int64_t rc = prepare(&P, S, D);
    if (rc) return rc;
    for (int64_t i = 0; i < m; i++) {
        feature_row(&P, idx[i], X + i * NF);
        sids[i] = S->sid[idx[i]];
    }
    context_row(&P, ctx);
    prep_free(&P);
    return 0;
}

/* The worker hand-off on the issuing thread: dynn_pilot_features for the slots D->rows, those slots
 * copied to slots (the worker's results are merged by them), and their touched flags cleared (a
 * storage touched again before the results come back keeps its newer provisional prediction). */
int64_t dynn_pilot_gather(const dynn_state *S, const dynn_point *D, float *X, float *ctx, int64_t *sids,
                          int64_t *slots)
{
    int64_t rc = dynn_pilot_features(S, D, X, ctx, sids);
    if (rc) return rc;
    for (int64_t i = 0; i < D->m; i++) {
        slots[i] = D->rows[i];
        S->touched[D->rows[i]] = 0;
    }
    return 0;
}

/* ---- the network ------------------------------------------------------------------------------ */
/* Every layer runs over the output dimension in blocks of 16 floats (one 512-bit or two 256-bit
 * vectors) whose accumulators stay in registers across the loop over inputs: each inner loop has a
 * constant trip count of 16 on contiguous weights, which the compiler unrolls and vectorises. */

/* c = ctx @ wx + bx: the context's share of the first layer, once per decision point */
static void context_term(const dynn_model *M, const float *ctx, float *restrict c)
{
    const int64_t H = M->h;
    for (int64_t j = 0; j < H; j++) c[j] = 0.0f;
    for (int64_t i = 0; i < M->nc; i++) {
        const float a = clampf(ctx[i], M->lo_ctx[i], M->hi_ctx[i]);
        if (a == 0.0f) continue;
        const float *restrict w = M->wx + i * H;
        for (int64_t j = 0; j < H; j++) c[j] = MADD(a, w[j], c[j]);
    }
    for (int64_t j = 0; j < H; j++) c[j] += M->bx[j];
}

/* index of the lowest set bit of v != 0 */
static inline int lowest_bit(uint64_t v)
{
#if defined(__GNUC__)
    return __builtin_ctzll(v);
#else
    static const int debruijn[64] = {
        0, 1, 48, 2, 57, 49, 28, 3, 61, 58, 50, 42, 38, 29, 17, 4, 62, 55, 59, 36, 53, 51, 43, 22,
        45, 39, 33, 30, 24, 18, 12, 5, 63, 47, 56, 27, 60, 41, 37, 16, 54, 35, 52, 21, 44, 32, 23, 11,
        46, 26, 40, 15, 34, 20, 31, 10, 25, 14, 19, 9, 13, 8, 7, 6};
    return debruijn[((v & (0 - v)) * 0x03f79d71b4cb0a89ULL) >> 58];
#endif
}

/* indices of the nonzero entries of in[0:n] (ascending; NaN counts as nonzero, -0 does not): a
 * bit mask per 64 inputs (a vectorised comparison), then its set bits */
static inline int64_t nonzeros(const float *restrict in, int64_t n, int32_t *restrict nz)
{
    int64_t k = 0;
    for (int64_t b = 0; b < n; b += 64) {
        const int64_t e = n - b < 64 ? n - b : 64;
        uint64_t mask = 0;
        for (int64_t i = 0; i < e; i++) {
            uint32_t bits;
            memcpy(&bits, in + b + i, sizeof(bits));
            mask |= (uint64_t)((bits << 1) != 0u) << i;
        }
        while (mask) {
            nz[k++] = (int32_t)(b + lowest_bit(mask));
            mask &= mask - 1;
        }
    }
    return k;
}

/* out[0:H] = relu(init + sum over the nonzero in[k] of in[k] * W[k, :]) */
static void dense_relu(const float *restrict in, int64_t nin, const float *restrict W,
                       const float *restrict init, float *restrict out, int64_t H)
{
    int32_t nz[MAX_H > NF ? MAX_H : NF];
    const int64_t n = nonzeros(in, nin, nz);
    int64_t jb = 0;
    for (; jb + 4 * LANES <= H; jb += 4 * LANES) {
        float a0[LANES], a1[LANES], a2[LANES], a3[LANES];
        for (int j = 0; j < LANES; j++) {
            a0[j] = init[jb + j];
            a1[j] = init[jb + LANES + j];
            a2[j] = init[jb + 2 * LANES + j];
            a3[j] = init[jb + 3 * LANES + j];
        }
        for (int64_t t = 0; t < n; t++) {
            const float a = in[nz[t]];
            const float *restrict w = W + (int64_t)nz[t] * H + jb;
            for (int j = 0; j < LANES; j++) a0[j] = MADD(a, w[j], a0[j]);
            for (int j = 0; j < LANES; j++) a1[j] = MADD(a, w[LANES + j], a1[j]);
            for (int j = 0; j < LANES; j++) a2[j] = MADD(a, w[2 * LANES + j], a2[j]);
            for (int j = 0; j < LANES; j++) a3[j] = MADD(a, w[3 * LANES + j], a3[j]);
        }
        for (int j = 0; j < LANES; j++) {
            out[jb + j] = a0[j] > 0.0f ? a0[j] : 0.0f;
            out[jb + LANES + j] = a1[j] > 0.0f ? a1[j] : 0.0f;
            out[jb + 2 * LANES + j] = a2[j] > 0.0f ? a2[j] : 0.0f;
            out[jb + 3 * LANES + j] = a3[j] > 0.0f ? a3[j] : 0.0f;
        }
    }
    for (; jb + LANES <= H; jb += LANES) {
        float a0[LANES];
        for (int j = 0; j < LANES; j++) a0[j] = init[jb + j];
        for (int64_t t = 0; t < n; t++) {
            const float a = in[nz[t]];
            const float *restrict w = W + (int64_t)nz[t] * H + jb;
            for (int j = 0; j < LANES; j++) a0[j] = MADD(a, w[j], a0[j]);
        }
        for (int j = 0; j < LANES; j++) out[jb + j] = a0[j] > 0.0f ? a0[j] : 0.0f;
    }
    for (; jb < H; jb++) {
        float a0 = init[jb];
        for (int64_t t = 0; t < n; t++) a0 = MADD(in[nz[t]], W[(int64_t)nz[t] * H + jb], a0);
        out[jb] = a0 > 0.0f ? a0 : 0.0f;
    }
}

/* z[0:KP] = b + in @ W for the last layer (W (H, KP), KP a multiple of LANES: zero-padded
 * columns), every input (no skipping), four interleaved accumulators per block */
static void dense_out(const float *restrict in, int64_t H, const float *restrict W, const float *restrict b,
                      float *restrict z, int64_t KP)
{
    for (int64_t jb = 0; jb < KP; jb += LANES) {
        float a0[LANES], a1[LANES], a2[LANES], a3[LANES];
        for (int j = 0; j < LANES; j++) {
            a0[j] = b[jb + j];
            a1[j] = 0.0f;
            a2[j] = 0.0f;
            a3[j] = 0.0f;
        }
        int64_t k = 0;
        for (; k + 4 <= H; k += 4) {
            const float x0 = in[k], x1 = in[k + 1], x2 = in[k + 2], x3 = in[k + 3];
            const float *restrict w = W + k * KP + jb;
            for (int j = 0; j < LANES; j++) a0[j] = MADD(x0, w[j], a0[j]);
            for (int j = 0; j < LANES; j++) a1[j] = MADD(x1, w[KP + j], a1[j]);
            for (int j = 0; j < LANES; j++) a2[j] = MADD(x2, w[2 * KP + j], a2[j]);
            for (int j = 0; j < LANES; j++) a3[j] = MADD(x3, w[3 * KP + j], a3[j]);
        }
        for (; k < H; k++) {
            const float x0 = in[k];
            const float *restrict w = W + k * KP + jb;
            for (int j = 0; j < LANES; j++) a0[j] = MADD(x0, w[j], a0[j]);
        }
        for (int j = 0; j < LANES; j++) z[jb + j] = (a0[j] + a1[j]) + (a2[j] + a3[j]);
    }
}

/* y = exp(x) on LANES floats, x <= 0 (softmax logits less their maximum): Cody-Waite reduction to
 * [-ln2/2, ln2/2] and the Cephes expf polynomial, within 1 ulp of libm's expf; 0 below -87 (where
 * expf is below 1.7e-38). Vectorised, unlike calls to expf. */
static inline void exp_lanes(const float *restrict x, float *restrict y)
{
    for (int j = 0; j < LANES; j++) {
        const float v = x[j] < -87.0f ? -87.0f : x[j];
        /* n = round(v / ln2): adding and subtracting 1.5 * 2^23 rounds to an integer */
        const float n = (v * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
        float r = v - n * 0.693359375f;
        r = r - n * -2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = MADD(p, r, 1.3981999507e-3f);
        p = MADD(p, r, 8.3334519073e-3f);
        p = MADD(p, r, 4.1665795894e-2f);
        p = MADD(p, r, 1.6666665459e-1f);
        p = MADD(p, r, 5.0000001201e-1f);
        p = MADD(p, r * r, r) + 1.0f;
        const int32_t e = (int32_t)(((uint32_t)((int32_t)n + 127)) << 23); /* 2^n, n in [-126, 0] */
        float scale;
        memcpy(&scale, &e, sizeof(scale));
        y[j] = x[j] < -87.0f ? 0.0f : p * scale;
    }
}

/* logits (KP, the first K real) -> probabilities (softmax), the expected log distance, the first
 * bucket whose cumulative probability reaches the quantile, the most probable bucket (numpy's
 * argmax: the first maximum) */
static inline void head(const float *restrict z, int64_t K, int64_t KP, const double *restrict logreps,
                        float quantile, float *restrict p, double *eld, int64_t *kq, int64_t *amax)
{
    float mx = z[0];
    for (int64_t k = 1; k < K; k++) mx = z[k] > mx ? z[k] : mx;
    float t[MAX_K], e[MAX_K];
    for (int64_t k = 0; k < KP; k++) t[k] = k < K ? z[k] - mx : -INFINITY;
    for (int64_t k = 0; k < K; k += LANES) exp_lanes(t + k, e + k); /* K <= KP, KP % LANES == 0 */
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) sum += e[k];
    double acc = 0.0;
    float cs = 0.0f, pm = -1.0f;
    int64_t q = -1, am = 0;
    for (int64_t k = 0; k < K; k++) {
        const float v = e[k] / sum;
        p[k] = v;
        acc += (double)v * logreps[k];
        cs += v;
        if (q < 0 && cs >= quantile) q = k;
        if (v > pm) {
            pm = v;
            am = k;
        }
    }
    *eld = acc;
    *kq = q < 0 ? 0 : q;
    *amax = am;
}

/* logits z (padded to KP) of one row: relu(relu(x @ w1 + c) @ W2 + b2) @ W3 + b3 */
static void mlp_row(const dynn_model *M, const float *restrict x, const float *restrict c, float *restrict z)
{
    float h1[MAX_H], h2[MAX_H], xc[NF];
    const int64_t H = M->h;
    for (int64_t i = 0; i < NF; i++) xc[i] = clampf(x[i], M->lo[i], M->hi[i]);
    dense_relu(xc, M->nf, M->w1, c, h1, H);
    dense_relu(h1, H, M->w2, M->b2, h2, H);
    dense_out(h2, H, M->w3, M->b3, z, M->kp);
}

static int model_ok(const dynn_model *M)
{
    return M->nf == NF && M->nc == NC && M->h > 0 && M->h <= MAX_H && M->k > 0 && M->k <= M->kp &&
           M->kp <= MAX_K && M->kp % LANES == 0;
}

/* PilotModel: P (m, K), expected log distance, quantile bucket, argmax for rows X (m, NF) under ctx.
 * Returns 0, or -3 when the model's shape is not one this kernel handles. */
int64_t dynn_pilot_score(const dynn_model *M, const float *X, int64_t m, const float *ctx,
                         const double *logreps, double quantile, float *P, double *eld, int64_t *kq,
                         int64_t *amax)
{
    if (!model_ok(M)) return -3;
    float c[MAX_H], z[MAX_K];
    context_term(M, ctx, c);
    const float qf = (float)quantile;
    for (int64_t i = 0; i < m; i++) {
        mlp_row(M, X + i * NF, c, z);
        head(z, M->k, M->kp, logreps, qf, P + i * M->k, eld + i, kq + i, amax + i);
    }
    return 0;
}

/* a row's predicted next-use position (exp(expected log distance) after the decision point; +inf for
 * "not again" unless a parameter, buffer or optimizer state: the next iteration needs those) and when
 * it is due again (min(prediction, position + recheck * lower[quantile bucket]): incremental rescoring) */
static inline double settle(const float *x, double eld, int64_t kq, int64_t am, int64_t K, double position,
                            double recheck, const double *lower, double *due)
{
    double score = exp(eld) + position;
    if (am == K - 1 && x[F_KIND] == 0.0f && x[F_KIND + 1] == 0.0f && x[F_KIND + 2] == 0.0f)
        score = INFINITY;
    const double d = position + recheck * lower[kq];
    *due = score < d ? score : d;
    return score;
}

/* The worker's half of a decision point (pilot/scheduling.py): the network and settle() for m
 * feature rows X gathered on the issuing thread, to score and due (per row). Reads only its
 * arguments and writes only its outputs, so it runs while the issuing thread goes on (ctypes
 * releases the GIL for it). Returns 0, or -3 (model shape). */
int64_t dynn_pilot_finish(const dynn_model *M, const float *X, int64_t m, const float *ctx,
                          const double *logreps, const double *lower, double quantile, double recheck,
                          int64_t position, double *score, double *due)
{
    if (!model_ok(M)) return -3;
    float c[MAX_H], z[MAX_K], p[MAX_K];
    context_term(M, ctx, c);
    const float qf = (float)quantile;
    const int64_t K = M->k;
    for (int64_t i = 0; i < m; i++) {
        const float *x = X + i * NF;
        mlp_row(M, x, c, z);
        double eld;
        int64_t kq, am;
        head(z, K, M->kp, logreps, qf, p, &eld, &kq, &am);
        score[i] = settle(x, eld, kq, am, K, (double)position, recheck, lower, &due[i]);
    }
    return 0;
}

/* PilotPolicy._score for the slots D->rows: features, the network, and per row the predicted
 * next-use position (exp(expected log distance) after the decision point; +inf for "not again" unless
 * a parameter, buffer or optimizer state), when it is due again (min(prediction, position + recheck *
 * lower[quantile bucket])), touched cleared; storage ids and predictions to Q's outputs (for
 * dynn_pilot_merge). Returns prepare()'s code, or -3 (model shape). */
int64_t dynn_pilot_decide(const dynn_state *S, const dynn_point *D, const dynn_model *M, const dynn_policy *Q)
{
    if (!model_ok(M)) return -3;
    prep_t P;
    int64_t rc = prepare(&P, S, D);
    if (rc) return rc;
    float ctx[NC], c[MAX_H], x[NF], z[MAX_K], p[MAX_K];
    context_row(&P, ctx);
    context_term(M, ctx, c);
    const float qf = (float)Q->quantile;
    const double recheck = Q->recheck;
    const int64_t K = M->k, m = D->m;
    const int64_t *idx = D->rows;
    const double position = (double)D->pos;
    for (int64_t i = 0; i < m; i++) {
        const int64_t s = idx[i];
        feature_row(&P, s, x);
        mlp_row(M, x, c, z);
        double eld;
        int64_t kq, am;
        head(z, K, M->kp, Q->logreps, qf, p, &eld, &kq, &am);
        const double score = settle(x, eld, kq, am, K, position, recheck, Q->lower, &Q->due[s]);
        S->pred[s] = score;
        S->touched[s] = 0;
        Q->sids_out[i] = S->sid[s];
        Q->score_out[i] = score;
    }
    prep_free(&P);
    return 0;
}

/* PilotPolicy.on_op's rows: every live slot (full) or those touched since they were scored or due
 * (due[s] <= position), except the slots marked in skip (the policy's small storages; NULL: none),
 * in slot order, to rows (room for cap). Returns the number of live slots; the number of rows goes
 * to *n_rows. */
int64_t dynn_pilot_select(const dynn_state *S, const double *due, int64_t position, int64_t full,
                          const uint8_t *skip, int64_t *rows, int64_t *n_rows)
{
    const int64_t cap = S->cap;
    const double pd = (double)position;
    int64_t n_live = 0, n = 0;
    for (int64_t s = 0; s < cap; s++) {
        if (!S->active[s]) continue;
        n_live++;
        if ((full || S->touched[s] || due[s] <= pd) && !(skip && skip[s])) rows[n++] = s;
    }
    *n_rows = n;
    return n_live;
}

/* FeatureState.op after the alignment lookups: the same writes in the same order. The state's
 * arrays are written through its table (the table points at writable numpy arrays). */
int64_t dynn_pilot_op(const dynn_state *S, dynn_op *O)
{
    const int64_t pos = O->position, ph = O->phase;
    const float *iv = O->iv;
    float *hist = O->hist;
    for (int i = 0; i < 12; i++) {
        hist[i] = hist[i] * O->decay[i];  /* h *= decay; h += ivk: two float32 roundings, as numpy */
        hist[i] = hist[i] + O->ivk[i];
    }
    float *producer_iv = (float *)S->producer_iv, *has_producer = (float *)S->has_producer;
    float *consumer_iv = (float *)S->consumer_iv, *count = (float *)S->count;
    float *count_phase = (float *)S->count_phase, *acc_phase = (float *)S->acc_phase;
    int64_t *prev = (int64_t *)S->prev, *last = (int64_t *)S->last, *last_phase = (int64_t *)S->last_phase;
    int64_t *count_phase_of = (int64_t *)S->count_phase_of, *stack_idx = (int64_t *)S->stack_idx;
    int64_t *stack_pos = (int64_t *)S->stack_pos;
    for (int64_t i = 0; i < O->n_alloc; i++) {
        const int64_t s = O->alloc_slots[i];
        if (s < 0 || s >= S->cap) return -4;
        memcpy(producer_iv + 6 * s, iv, 6 * sizeof(float));
        has_producer[s] = 1.0f;
        if (O->alloc_prev[i] >= -1) prev[s] = O->alloc_prev[i];
    }
    int64_t n_match = 0;
    for (int64_t i = 0; i < O->n_acc; i++) {
        const int64_t s = O->acc_slots[i];
        O->replay[i] = -1;
        if (s < 0) continue;
        if (s >= S->cap) return -4;
        last[s] = pos;
        last_phase[s] = ph;
        count[s] += 1.0f;
        if (count_phase_of[s] != ph) {
            count_phase_of[s] = ph;
            count_phase[s] = 0.0f;
        }
        count_phase[s] += 1.0f;
        if (ph == 1 && stack_idx[s] >= 0 && acc_phase[3 * s + 1] == 0.0f)
            O->frontier = stack_pos[s];  /* popped: backward has reached its push */
        acc_phase[3 * s + ph] = 1.0f;
        memcpy(consumer_iv + 6 * s, iv, 6 * sizeof(float));
        if (ph == 0 && S->saved[s] > 0.0f && S->kind[s] > 2 && (S->born[s] < 0 || stack_idx[s] < 0)) {
            stack_idx[s] = O->stack_counter++;
            stack_pos[s] = pos;
        }
        if (prev[s] < 0 && S->born[s] < 0 && count[s] == 1.0f) {
            O->match[n_match++] = i;  /* Python matches it, then replays it */
            continue;
        }
        const int64_t pi = prev[s];
        if (pi >= 0) {
            if (pi >= S->n_prev) return -4;
            const int64_t k = (int64_t)count[s], lo = S->prev_off[pi], n = S->prev_off[pi + 1] - lo;
            if (k < n) O->replay[i] = pos + S->prev_pos[lo + k] - S->prev_pos[lo + k - 1];
        }
    }
    O->n_match = n_match;
    return 0;
}

/* FeatureState.alloc's writes for slot s (position -1: alive when the iteration started) */
int64_t dynn_pilot_alloc(const dynn_state *S, int64_t s, int64_t kind, double saved, double log_bytes,
                         int64_t announce, int64_t position, int64_t phase, int64_t prev)
{
    if (s < 0 || s >= S->cap) return -4;
    ((int64_t *)S->kind)[s] = kind;
    ((float *)S->saved)[s] = (float)saved;
    ((float *)S->log_bytes)[s] = (float)log_bytes;  /* float64 -> float32, as numpy assigns */
    ((int64_t *)S->last)[s] = -1;
    ((int64_t *)S->last_phase)[s] = -1;
    ((float *)S->count)[s] = 0.0f;
    ((float *)S->count_phase)[s] = 0.0f;
    memset((float *)S->acc_phase + 3 * s, 0, 3 * sizeof(float));
    ((int64_t *)S->stack_idx)[s] = -1;
    ((int64_t *)S->stack_pos)[s] = -1;
    ((int64_t *)S->announce)[s] = announce;
    memset((float *)S->consumer_iv + 6 * s, 0, 6 * sizeof(float));
    memset((float *)S->producer_iv + 6 * s, 0, 6 * sizeof(float));
    ((float *)S->has_producer)[s] = 0.0f;
    ((float *)S->persistent)[s] = position < 0 ? 1.0f : 0.0f;
    ((int64_t *)S->born)[s] = position < 0 ? -1 : position;
    ((int64_t *)S->born_phase)[s] = position < 0 ? -1 : phase;
    ((int64_t *)S->prev)[s] = prev;
    return 0;
}

/* ---- the eviction heap (PilotPolicy's NextUsePolicy._res) ------------------------------------- */
/* A binary min-heap of (key, sid) entries, ordered as Python orders the tuples (key, then sid), so it
 * pops the same sequence heapq does from the same entries. Each entry also carries the storage's slot
 * in the state, so that pop and compact can tell a stale entry without Python: the slot no longer
 * holds that storage, or the key is not the storage's current prediction (key != -pred[slot]; pred is
 * the policy's cache, NaN for "never predicted this iteration", which Python judges itself). */
typedef struct {
    double key;
    int64_t sid, slot;
} hent;

typedef struct {
    hent *a;
    int64_t n, cap;
} dynn_heap;

static inline int hless(const hent *x, const hent *y)
{
    return x->key < y->key || (x->key == y->key && x->sid < y->sid);
}

static void sift_up(hent *a, int64_t i)
{
    hent e = a[i];
    while (i > 0) {
        int64_t p = (i - 1) >> 1;
        if (!hless(&e, &a[p])) break;
        a[i] = a[p];
        i = p;
    }
    a[i] = e;
}

static void sift_down(hent *a, int64_t n, int64_t i)
{
    hent e = a[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && hless(&a[c + 1], &a[c])) c++;
        if (!hless(&a[c], &e)) break;
        a[i] = a[c];
        i = c;
    }
    a[i] = e;
}

dynn_heap *dynn_heap_new(void)
{
    return (dynn_heap *)calloc(1, sizeof(dynn_heap));
}

void dynn_heap_free(dynn_heap *h)
{
    if (h) free(h->a);
    free(h);
}

int64_t dynn_heap_len(const dynn_heap *h)
{
    return h->n;
}

static int reserve(dynn_heap *h, int64_t need)
{
    if (need <= h->cap) return 0;
    int64_t cap = h->cap ? h->cap : 1024;
    while (cap < need) cap *= 2;
    hent *a = (hent *)realloc(h->a, sizeof(hent) * (size_t)cap);
    if (!a) return -2;
    h->a = a;
    h->cap = cap;
    return 0;
}

/* push n entries (keys, sids, slots); 0, or -2 out of memory */
int64_t dynn_heap_push(dynn_heap *h, const double *keys, const int64_t *sids, const int64_t *slots, int64_t n)
{
    if (reserve(h, h->n + n)) return -2;
    for (int64_t i = 0; i < n; i++) {
        hent *e = &h->a[h->n];
        e->key = keys[i];
        e->sid = sids[i];
        e->slot = slots[i];
        sift_up(h->a, h->n++);
    }
    return 0;
}

static inline int stale(const dynn_state *S, const hent *e)
{
    const int64_t s = e->slot;
    if (s < 0 || s >= S->cap || !S->active[s] || S->sid[s] != e->sid) return 1;
    const double v = S->pred[s];
    return v == v && e->key != -v;  /* NaN: Python's call */
}

/* pop the least entry that is not stale to out (key, sid, slot as three words); 1, or 0: empty */
int64_t dynn_heap_pop(dynn_heap *h, const dynn_state *S, int64_t *out)
{
    while (h->n) {
        hent e = h->a[0];
        h->a[0] = h->a[--h->n];
        if (h->n) sift_down(h->a, h->n, 0);
        if (stale(S, &e)) continue;
        memcpy(out, &e.key, sizeof(double));
        out[1] = e.sid;
        out[2] = e.slot;
        return 1;
    }
    return 0;
}

/* keep the entries that match their storage's prediction (not NaN), one per storage, as a heap
 * (PilotPolicy._compact); mark: an int64 scratch array as long as the state's slots. Returns the
 * entries kept. */
int64_t dynn_heap_compact(dynn_heap *h, const dynn_state *S, int64_t *mark)
{
    for (int64_t i = 0; i < h->n; i++) {
        const int64_t s = h->a[i].slot;
        if (s >= 0 && s < S->cap) mark[s] = 0;
    }
    int64_t n = 0;
    for (int64_t i = 0; i < h->n; i++) {
        const hent *e = &h->a[i];
        if (stale(S, e) || S->pred[e->slot] != S->pred[e->slot] || mark[e->slot]) continue;
        mark[e->slot] = 1;
        h->a[n++] = *e;
    }
    h->n = n;
    for (int64_t i = n / 2 - 1; i >= 0; i--) sift_down(h->a, n, i);
    return n;
}

/* copy the entries (in heap order) to keys, sids, slots (room for len); returns the count */
int64_t dynn_heap_dump(const dynn_heap *h, double *keys, int64_t *sids, int64_t *slots)
{
    for (int64_t i = 0; i < h->n; i++) {
        keys[i] = h->a[i].key;
        sids[i] = h->a[i].sid;
        slots[i] = h->a[i].slot;
    }
    return h->n;
}

/* A decision point's results into the policy's structures (PilotPolicy._update): every row's entry
 * (-score, sid, slot) on the heap, and the rows whose away[slot] is set (evicted by the policy, not
 * seen back) to away_sids / away_scores for the prefetch heap. filter (results that come back from
 * the worker): a row whose slot no longer holds its storage, or was touched since the rows
 * were chosen, is left out (its provisional prediction is newer), the others' pred and due are
 * written here. Returns the number of away rows, or -2 (out of memory). */
int64_t dynn_pilot_merge(const dynn_state *S, dynn_heap *h, const double *score, const double *due_in,
                         const int64_t *sids, const int64_t *slots, int64_t m, int64_t filter, double *due,
                         const uint8_t *away, int64_t *away_sids, double *away_scores, int64_t *n_merged)
{
    if (reserve(h, h->n + m)) return -2;
    int64_t na = 0, nm = 0;
    for (int64_t i = 0; i < m; i++) {
        const int64_t s = slots[i];
        if (filter) {
            if (s < 0 || s >= S->cap || !S->active[s] || S->sid[s] != sids[i] || S->touched[s]) continue;
            S->pred[s] = score[i];
            due[s] = due_in[i];
        }
        hent *e = &h->a[h->n];
        e->key = -score[i];
        e->sid = sids[i];
        e->slot = s;
        sift_up(h->a, h->n++);
        nm++;
        if (away && away[s]) {
            away_sids[na] = sids[i];
            away_scores[na] = score[i];
            na++;
        }
    }
    *n_merged = nm;
    return na;
}

/* version, struct sizes and the column indices (abi.layout()), for the loader's check */
int64_t dynn_pilot_layout(int64_t *out, int64_t n)
{
    const int64_t v[] = DYNN_PILOT_LAYOUT;
    const int64_t len = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < n && i < len; i++) out[i] = v[i];
    return len;
}
