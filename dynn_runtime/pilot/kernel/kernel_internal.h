/* Private to the pilot kernel's units (kernel.c, network.c, heap.c): the decision point's
 * preparation, which kernel.c computes and network.c's dynn_pilot_decide reads. Hand-written, unlike
 * pilot_kernel.h (generated); not part of the ABI Python sees. */
#ifndef DYNN_PILOT_KERNEL_INTERNAL_H
#define DYNN_PILOT_KERNEL_INTERNAL_H

#include <stdint.h>

#include "pilot_kernel.h"

/* kept out of the library's exported symbols: only the dynn_* entry points are loaded by name */
#if defined(__GNUC__)
#define DYNN_INTERNAL __attribute__((visibility("hidden")))
#else
#define DYNN_INTERNAL
/* push (key, sid, slot) on the eviction heap (heap.c's dynn_heap); 0, or -2 out of memory */
DYNN_INTERNAL int pilot_heap_push1(void *heap, double key, int64_t sid, int64_t slot);

#endif

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

/* 0: ready; -1: tables too small; -2: out of memory; -4: a row is no slot; 1 + n: the caller must
 * pass the first n counterparts of the previous iteration's unmatched external storages (rem).
 * Anything but 0 leaves nothing to free; after 0, pilot_prep_free(P) releases P's tables. */
DYNN_INTERNAL int64_t pilot_prepare(prep_t *P, const dynn_state *S, const dynn_point *D);
DYNN_INTERNAL void pilot_prep_free(prep_t *P);
/* FeatureState.features for slot s: NF floats to x */
DYNN_INTERNAL void pilot_feature_row(const prep_t *P, int64_t s, float *restrict x);
/* the decision point's context row: NC floats to c */
DYNN_INTERNAL void pilot_context_row(const prep_t *P, float *restrict c);

/* push (key, sid, slot) on the eviction heap (heap.c's dynn_heap); 0, or -2 out of memory */
DYNN_INTERNAL int pilot_heap_push1(void *heap, double key, int64_t sid, int64_t slot);

#endif
