/* The pilot kernel's eviction heap and dynn_pilot_merge (see kernel.c for the units). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_internal.h"

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

/* one entry, from the kernel's other units (dynn_pilot_operator); 0, or -2 out of memory */
int pilot_heap_push1(void *heap, double key, int64_t sid, int64_t slot)
{
    dynn_heap *h = (dynn_heap *)heap;
    if (h->n == h->cap && reserve(h, h->n + 1)) return -2;
    hent *e = &h->a[h->n];
    e->key = key;
    e->sid = sid;
    e->slot = slot;
    sift_up(h->a, h->n++);
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
