/* The pilot kernel's network (see kernel.c for the units): the MLP with the input normalisation folded
 * in, its softmax head, and what the policy does with a row's prediction (dynn_pilot_score,
 * dynn_pilot_finish, dynn_pilot_decide). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernel_internal.h"

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
 * dynn_pilot_merge). Returns pilot_prepare()'s code, or -3 (model shape). */
int64_t dynn_pilot_decide(const dynn_state *S, const dynn_point *D, const dynn_model *M, const dynn_policy *Q)
{
    if (!model_ok(M)) return -3;
    prep_t P;
    int64_t rc = pilot_prepare(&P, S, D);
    if (rc) return rc;
    float ctx[NC], c[MAX_H], x[NF], z[MAX_K], p[MAX_K];
    pilot_context_row(&P, ctx);
    context_term(M, ctx, c);
    const float qf = (float)Q->quantile;
    const double recheck = Q->recheck;
    const int64_t K = M->k, m = D->m;
    const int64_t *idx = D->rows;
    const double position = (double)D->pos;
    for (int64_t i = 0; i < m; i++) {
        const int64_t s = idx[i];
        pilot_feature_row(&P, s, x);
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
    pilot_prep_free(&P);
    return 0;
}
