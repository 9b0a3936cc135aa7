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
 *   dynn_pilot_operator  PilotPolicy.on_operator and on_op's per-operator work in one call: the
 *                        allocations' and accesses' writes, dynn_pilot_op's update, the provisional
 *                        predictions replayed from the previous iteration and their heap entries;
 *   dynn_pilot_operators PilotPolicy.on_operators' run of forward operators and deaths in one call:
 *                        dynn_pilot_operator's work per operator, the priors too, the dead slots released;
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
 *
 * Three translation units share the generated pilot_kernel.h and the private kernel_internal.h:
 *   kernel.c   the decision point's preparation, feature rows, the per-operator state updates;
 *   network.c  the MLP, its softmax head and the policy's arithmetic on a row's prediction;
 *   heap.c     the policy's eviction heap and the merge of a decision point's results into it.
 * CMakeLists.txt and the run-time compile in kernel/__init__.py (SOURCES) list the same files.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_internal.h"

/* ---- decision-point preparation shared by every row ------------------------------------------- */
static int cmp_pair(const void *a, const void *b)
{
    const int64_t *x = (const int64_t *)a, *y = (const int64_t *)b;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    if (x[1] != y[1]) return x[1] < y[1] ? -1 : 1;
    return 0;
}

void pilot_prep_free(prep_t *P)
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
int64_t pilot_prepare(prep_t *P, const dynn_state *S, const dynn_point *D)
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
            pilot_prep_free(P);
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

/* table entry n, n clamped to [0, ntab - 1]: pilot_prepare() checked that every argument of a decision
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
void pilot_feature_row(const prep_t *P, int64_t s, float *restrict x)
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

void pilot_context_row(const prep_t *P, float *restrict c)
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

/* FeatureState.features for the slots D->rows: X (m, NF), ctx (NC,), sids (m,). Returns pilot_prepare()'s
 * code. */
int64_t dynn_pilot_features(const dynn_state *S, const dynn_point *D, float *X, float *ctx, int64_t *sids)
{
    prep_t P;
    const int64_t *idx = D->rows, m = D->m;
    int64_t rc = pilot_prepare(&P, S, D);
    if (rc) return rc;
    for (int64_t i = 0; i < m; i++) {
        pilot_feature_row(&P, idx[i], X + i * NF);
        sids[i] = S->sid[idx[i]];
    }
    pilot_context_row(&P, ctx);
    pilot_prep_free(&P);
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
 * arrays are written through its table (the table points at writable numpy arrays). The allocations'
 * slots and counterparts (>= -1 set, -2 leave) are read every a_stride words from a_slot and a_prev;
 * per access, replay gets the replayed next use (-1: none), match the accesses Python matches first
 * (FeatureState._match_external, then _replay). Returns 0, or -4 (a slot or counterpart out of range). */
static int64_t op_update(const dynn_state *S, int64_t pos, int64_t ph, const float *iv, const float *ivk,
                         const float *decay, float *hist, const int64_t *a_slot, const int64_t *a_prev,
                         int64_t a_stride, int64_t n_alloc, const int64_t *acc_slots, int64_t n_acc,
                         int64_t *frontier, int64_t *stack_counter, int64_t *replay, int64_t *match,
                         int64_t *n_match_out)
{
    for (int i = 0; i < 12; i++) {
        hist[i] = hist[i] * decay[i];  /* h *= decay; h += ivk: two float32 roundings, as numpy */
        hist[i] = hist[i] + ivk[i];
    }
    float *producer_iv = (float *)S->producer_iv, *has_producer = (float *)S->has_producer;
    float *consumer_iv = (float *)S->consumer_iv, *count = (float *)S->count;
    float *count_phase = (float *)S->count_phase, *acc_phase = (float *)S->acc_phase;
    int64_t *prev = (int64_t *)S->prev, *last = (int64_t *)S->last, *last_phase = (int64_t *)S->last_phase;
    int64_t *count_phase_of = (int64_t *)S->count_phase_of, *stack_idx = (int64_t *)S->stack_idx;
    int64_t *stack_pos = (int64_t *)S->stack_pos;
    for (int64_t i = 0; i < n_alloc; i++) {
        const int64_t s = a_slot[i * a_stride];
        if (s < 0 || s >= S->cap) return -4;
        memcpy(producer_iv + 6 * s, iv, 6 * sizeof(float));
        has_producer[s] = 1.0f;
        if (a_prev[i * a_stride] >= -1) prev[s] = a_prev[i * a_stride];
    }
    int64_t n_match = 0;
    for (int64_t i = 0; i < n_acc; i++) {
        const int64_t s = acc_slots[i];
        replay[i] = -1;
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
            *frontier = stack_pos[s];  /* popped: backward has reached its push */
        acc_phase[3 * s + ph] = 1.0f;
        memcpy(consumer_iv + 6 * s, iv, 6 * sizeof(float));
        if (ph == 0 && S->saved[s] > 0.0f && S->kind[s] > 2 && (S->born[s] < 0 || stack_idx[s] < 0)) {
            stack_idx[s] = (*stack_counter)++;
            stack_pos[s] = pos;
        }
        if (prev[s] < 0 && S->born[s] < 0 && count[s] == 1.0f) {
            match[n_match++] = i;  /* Python matches it, then replays it */
            continue;
        }
        const int64_t pi = prev[s];
        if (pi >= 0) {
            if (pi >= S->n_prev) return -4;
            const int64_t k = (int64_t)count[s], lo = S->prev_off[pi], n = S->prev_off[pi + 1] - lo;
            if (k < n) replay[i] = pos + S->prev_pos[lo + k] - S->prev_pos[lo + k - 1];
        }
    }
    *n_match_out = n_match;
    return 0;
}

int64_t dynn_pilot_op(const dynn_state *S, dynn_op *O)
{
    return op_update(S, O->position, O->phase, O->iv, O->ivk, O->decay, O->hist, O->alloc_slots, O->alloc_prev, 1,
                     O->n_alloc, O->acc_slots, O->n_acc, &O->frontier, &O->stack_counter, O->replay, O->match,
                     &O->n_match);
}

/* FeatureState.alloc's writes for slot s (position -1: alive when the iteration started) */
static void alloc_writes(const dynn_state *S, int64_t s, int64_t kind, double saved, double log_bytes,
                         int64_t announce, int64_t position, int64_t phase, int64_t prev)
{
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
    ((int64_t *)S->mirror_tgt)[s] = -1;
    ((int64_t *)S->hint_at)[s] = -1;
}

/* PilotPolicy.on_operator on the native backend, one operator in one call: on_alloc's writes for its
 * allocations (FeatureState.alloc, the fresh prior as their prediction, their eviction entries),
 * on_access's flags for the accesses told to the policy, FeatureState.op's update (op_update), then
 * on_op's provisional predictions: an access's replayed next use with its eviction entry, or its
 * index in need (the prior: Python's, from the storage's kind and saved flag now). The same writes in
 * the same order as those methods. O->stage 1 does only the allocations' writes, 2 only the rest (the
 * backward mirror reads the allocations' sizes between the two). Returns 0; 1: an access needs FeatureState._match_external (the
 * op's update is done, the provisional predictions are left to Python); -4: a slot out of range; -2:
 * out of memory. */
static int64_t fused_operator(const dynn_state *S, dynn_fused *O, int64_t stride, const double *prior_row,
                              int64_t n_class);

int64_t dynn_pilot_operator(const dynn_state *S, dynn_fused *O)
{
    return fused_operator(S, O, FUSED_ACCESS, NULL, 0);
}

/* dynn_pilot_operator's work: a told access is `stride` words; with `prior_row` (the prior table's row
 * of the operator's phase, n_class columns), a told access without a replayed next use takes
 * position + prior_row[its class] (its fourth word) as its prediction, with its eviction entry, after
 * the replayed ones (the order of PilotPolicy._operator_native's Python), instead of going to need */
static int64_t fused_operator(const dynn_state *S, dynn_fused *O, int64_t stride, const double *prior_row,
                              int64_t n_class)
{
    const int64_t pos = O->position, na = O->n_alloc, nt = O->n_told, nc = O->n_acc, cap = S->cap;
    const int64_t *w = O->words, *told = w + FUSED_ALLOC * na, *acc = told + stride * nt;
    double *pred = S->pred;
    uint8_t *touched = S->touched, *away = O->away, *skip = O->skip;
    O->n_need = 0;
    for (int64_t i = 0; i < na && (O->stage & 1); i++) {
        const int64_t *a = w + FUSED_ALLOC * i, s = a[0], nb = a[4] > 1 ? a[4] : 1;
        if (s < 0 || s >= cap) return -4;
        /* a new slot: FeatureState._new_slot's writes (pred and touched below); a known one: unchanged */
        ((uint8_t *)S->active)[s] = 1;
        ((int64_t *)S->sid)[s] = a[1];
        /* log_bytes: Python's math.log2 is the C library's log2 on the size as a double, as here */
        alloc_writes(S, s, a[2], (double)a[3], log2((double)nb) / 30.0, O->announced++, pos, O->born_phase, a[5]);
        pred[s] = O->prior;
        touched[s] = 1;
        away[s] = 0;
        if (pilot_heap_push1(O->heap, -O->prior, a[1], s)) return -2;
        skip[s] = (uint8_t)a[7];
    }
    if (!(O->stage & 2)) return 0;
    for (int64_t i = 0; i < nt; i++) {
        const int64_t *a = told + stride * i, s = a[0];
        if (s < 0) continue;
        if (s >= cap) return -4;
        touched[s] = 1;
        away[s] = 0;
        skip[s] = (uint8_t)a[2];
    }
    int64_t rc = op_update(S, pos, O->phase, O->iv, O->ivk, O->decay, O->hist, w, w + 6, FUSED_ALLOC, na, acc, nc,
                           &O->frontier, &O->stack_counter, O->replay, O->match, &O->n_match);
    if (rc) return rc;
    if (O->n_match) return 1;
    int64_t *where = O->where;
    for (int64_t i = 0; i < nc; i++)
        if (acc[i] >= 0) where[acc[i]] = i;
    int64_t n_need = 0;
    for (int64_t i = 0; i < nt; i++) {
        const int64_t *a = told + stride * i, s = a[0];
        if (s < 0) continue;
        /* the told accesses are among the operator's: where[s] was just written (checked all the same) */
        const int64_t j = where[s];
        const int64_t r = (j >= 0 && j < nc && acc[j] == s) ? O->replay[j] : -1;
        if (r < 0) {
            O->need[n_need++] = i;
            continue;
        }
        pred[s] = (double)r;
        if (pilot_heap_push1(O->heap, -(double)r, a[1], s)) return -2;
    }
    if (prior_row) {
        /* PilotPolicy._provisional for a storage that is not fresh: max(position, 0) + the prior */
        const double base = (double)(pos > 0 ? pos : 0);
        for (int64_t k = 0; k < n_need; k++) {
            const int64_t *a = told + stride * O->need[k], s = a[0], c = a[3];
            if (c < 0 || c >= n_class) return -4;
            const double v = base + prior_row[c];
            pred[s] = v;
            if (pilot_heap_push1(O->heap, -v, a[1], s)) return -2;
        }
        n_need = 0;
    }
    O->n_need = n_need;
    return 0;
}

/* PilotPolicy.on_operators on the native backend: the records from B->at on, in order. An operator
 * is dynn_pilot_operator's work (stage 3) with its provisional priors here; a death releases its
 * slot as FeatureState.free does (active cleared, sid -1; Python keeps the slot map and the free
 * list) and, if it died in forward, reports its log_bytes (the mirror's _fwd_freed). Returns 0 with
 * B->at at the end; 1 when an operator needs FeatureState._match_external: B->at is past that operator,
 * its update is done and its provisional predictions are left to Python (its replay and match in the
 * dynn_fused), which calls again from B->at. A link sets an allocation's mirror target (the backward
 * mirror's, computed in Python from the size). -4: a slot or class out of range; -5: a malformed
 * record; -2: out of memory. */
int64_t dynn_pilot_operators(const dynn_state *S, dynn_batch *B)
{
    dynn_fused *F = (dynn_fused *)B->fused;
    /* the operators' fields go into a copy: the policy's dynn_fused keeps its own word buffer for
     * dynn_pilot_operator; the scalars in and out and the results are copied back */
    dynn_fused O = *F;
    const int64_t *w = B->words, n = B->n_words, cap = S->cap;
    int64_t at = B->at, rc = 0;
    while (at < n) {
        const int64_t *r = w + at;
        if (r[0] == BATCH_OP) {
            if (at + BATCH_OP_HEAD > n) { rc = -5; break; }
            const int64_t na = r[6], nt = r[7], nc = r[8], row = r[9];
            if (na < 0 || nt < 0 || nc < 0 || row < 0 || row >= B->n_rows) { rc = -5; break; }
            const int64_t len = BATCH_OP_HEAD + FUSED_ALLOC * na + BATCH_ACCESS * nt + nc;
            if (len > n - at) { rc = -5; break; }
            const double *prior_row = B->priors + row * B->n_class;
            O.position = r[1];
            O.phase = r[2];
            O.born_phase = r[3];
            O.stage = 3;
            O.iv = (const float *)(intptr_t)r[4];
            O.ivk = (const float *)(intptr_t)r[5];
            O.words = r + BATCH_OP_HEAD;
            O.n_alloc = na;
            O.n_told = nt;
            O.n_acc = nc;
            /* a fresh storage's prior: storage class 0 */
            O.prior = (double)(r[1] > 0 ? r[1] : 0) + prior_row[0];
            at += len;
            rc = fused_operator(S, &O, BATCH_ACCESS, prior_row, B->n_class);
            if (rc) break;
        } else if (r[0] == BATCH_FREE) {
            if (at + BATCH_FREE_WORDS > n) { rc = -5; break; }
            const int64_t s = r[1];
            if (s < 0 || s >= cap) { rc = -4; break; }
            ((uint8_t *)S->active)[s] = 0;
            ((int64_t *)S->sid)[s] = -1;
            if (r[2]) B->freed_lb[B->n_freed++] = (double)S->log_bytes[s];
            at += BATCH_FREE_WORDS;
        } else if (r[0] == BATCH_LINK) {
            /* MirrorState._link's write, after the allocation's (which reset it); nothing in the
             * operator's update reads it */
            if (at + 3 > n) { rc = -5; break; }
            const int64_t s = r[1];
            if (s < 0 || s >= cap) { rc = -4; break; }
            ((int64_t *)S->mirror_tgt)[s] = r[2];
            at += 3;
        } else {
            rc = -5;
            break;
        }
    }
    B->at = at;
    F->announced = O.announced;
    F->frontier = O.frontier;
    F->stack_counter = O.stack_counter;
    F->n_match = O.n_match;
    F->n_need = O.n_need;
    return rc;
}

/* FeatureState.alloc's writes for slot A->slot (A->position -1: alive when the iteration started) */
int64_t dynn_pilot_alloc(const dynn_state *S, const dynn_alloc *A)
{
    if (A->slot < 0 || A->slot >= S->cap) return -4;
    alloc_writes(S, A->slot, A->kind, A->saved, A->log_bytes, A->announce, A->position, A->phase, A->prev);
    return 0;
}

/* version, struct sizes and the column indices (abi.layout()), for the loader's check */
int64_t dynn_pilot_layout(int64_t *out, int64_t n)
{
    const int64_t v[] = DYNN_PILOT_LAYOUT;
    const int64_t len = (int64_t)(sizeof(v) / sizeof(v[0]));
    for (int64_t i = 0; i < n && i < len; i++) out[i] = v[i];
    return len;
}
