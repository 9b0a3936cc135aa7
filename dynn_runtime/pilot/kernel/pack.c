/* The pilot's bulk loop over a batch's events in C, over the policy's own Python objects: ``Run`` holds
 * a run of dynn_pilot_operators records (kernel ABI: int64 words, read by the kernel where they are)
 * and each operator record's mark in flat int64 arrays; ``pack`` packs one operator's record and mark
 * into it; ``walk`` takes the batch's common events as the loop of PilotPolicy._operators_native takes
 * them; ``operators`` calls the kernel over a Run; ``index_ops`` and ``access_positions`` are the
 * feature state's per-iteration walks over the operators (the previous iteration's index, the
 * mirror's forward accesses).
 *
 * PilotPolicy._Run, PilotPolicy._pack_run_op and that loop (dynn_runtime/pilot/policy.py),
 * ReplayState._index_ops_py and MirrorState._access_positions are the reference: this module must
 * write the same words and marks, take the same slots from the free list and leave the slot map, the
 * small-storage classes, the mirror's relink heap and the feature state's scalars as that Python
 * leaves them, in the same order of reads and writes, and build the same dictionaries in the same
 * insertion orders (tests/pilot/test_pilot_pack.py runs random inputs both ways;
 * tests/pilot/test_pilot_operator.py runs the walk in lockstep with a pilot told each notification
 * separately, and against the Python loop under a budget).
 * Every value goes through the Python objects (dict and set lookups, the view's calls, rich
 * comparisons), so no rounding or hashing can differ from the Python path. A Python extension
 * module, not part of the ctypes kernel: it reads dicts and sets, which the kernel never sees. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pilot_kernel.h" /* BATCH_OP, BATCH_FREE, BATCH_LINK */

/* the context tuple PilotPolicy._pack_context builds (its order) */
enum { C_SLOT, C_FREE, C_GROW, C_NBYTES, C_KIND, C_SAVED, C_KIND_IDX, C_TEMP, C_SMALL, C_FRACTION, C_CLS_OF,
       C_CLASSIFY, C_TABLE, C_CLASS_OF_KIND, C_SAVED_KINDS, C_PLAIN_SMALL, C_RECORDLESS, C_N };

static PyObject *s_alloc, *s_small, *s_bytes, *s_fraction, *s_peak, *minus_one, *minus_two, *zero, *one, *two;

static PyObject *a_nbytes, *a_kind, *a_saved, *s_live;

/* the view's nbytes, kind or saved of sid: from the record table where the view reads it there
 * (Residency: ``st[sid].<field>``, else ``recordless[sid].<field>``: a storage the live runtime tells
 * without a record), else through the view's call (a new reference) */
static PyObject *view_read(PyObject *ctx, PyObject *field, PyObject *call, PyObject *sid) {
  PyObject *table = PyTuple_GET_ITEM(ctx, C_TABLE);
  if (table == Py_None) return PyObject_CallOneArg(call, sid);
  PyObject *rec = PyDict_GetItemWithError(table, sid);
  if (rec == NULL) {
    if (PyErr_Occurred()) return NULL;
    rec = PyDict_GetItemWithError(PyTuple_GET_ITEM(ctx, C_RECORDLESS), sid);
    if (rec == NULL) {
      if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, sid);
      return NULL;
    }
  }
  return PyObject_GetAttr(rec, field);
}

/* policies.base.SmallStorages.access (the class is plain: C_PLAIN_SMALL) */
static PyObject *small_access(PyObject *small, PyObject *sid) {
  PyObject *sizes = PyObject_GetAttr(small, s_bytes), *f = NULL, *peak = NULL, *thr = NULL, *smalls = NULL;
  PyObject *out = NULL;
  if (sizes == NULL || (f = PyObject_GetAttr(small, s_fraction)) == NULL || (peak = PyObject_GetAttr(small, s_peak)) == NULL ||
      (thr = PyNumber_Multiply(f, peak)) == NULL || (smalls = PyObject_GetAttr(small, s_small)) == NULL)
    goto done;
  PyObject *b = PyDict_GetItemWithError(sizes, sid);
  if (b == NULL && PyErr_Occurred()) goto done;
  int lt = PyObject_RichCompareBool(b != NULL ? b : zero, thr, Py_LT);
  if (lt < 0 || (lt ? PySet_Add(smalls, sid) : PySet_Discard(smalls, sid)) < 0) goto done;
  out = Py_NewRef(lt ? Py_True : Py_False);
done:
  Py_XDECREF(sizes);
  Py_XDECREF(f);
  Py_XDECREF(peak);
  Py_XDECREF(thr);
  Py_XDECREF(smalls);
  return out;
}

/* policies.base.SmallStorages.alloc */
static PyObject *small_alloc(PyObject *small, PyObject *sid, PyObject *nb) {
  PyObject *sizes = PyObject_GetAttr(small, s_bytes), *live = NULL, *peak = NULL, *x = NULL;
  PyObject *out = NULL;
  if (sizes == NULL || (live = PyObject_GetAttr(small, s_live)) == NULL) goto done;
  PyObject *old = PyDict_GetItemWithError(sizes, sid);
  if (old == NULL && PyErr_Occurred()) goto done;
  if (old != NULL) {
    x = PyNumber_Subtract(live, old);
    if (x == NULL) goto done;
    Py_SETREF(live, x);
    x = NULL;
  }
  if (PyDict_SetItem(sizes, sid, nb) < 0 || (x = PyNumber_Add(live, nb)) == NULL) goto done;
  Py_SETREF(live, x);
  x = NULL;
  if (PyObject_SetAttr(small, s_live, live) < 0 || (peak = PyObject_GetAttr(small, s_peak)) == NULL) goto done;
  int gt = PyObject_RichCompareBool(live, peak, Py_GT);
  if (gt < 0 || (gt && PyObject_SetAttr(small, s_peak, live) < 0)) goto done;
  out = small_access(small, sid);
done:
  Py_XDECREF(sizes);
  Py_XDECREF(live);
  Py_XDECREF(peak);
  return out;
}

/* pilot.policy.storage_class(kind, saved, False) */
static PyObject *storage_class(PyObject *ctx, PyObject *kind, PyObject *saved) {
  int sb = PyObject_IsTrue(saved);
  if (sb < 0) return NULL;
  if (sb) {
    int in = PySequence_Contains(PyTuple_GET_ITEM(ctx, C_SAVED_KINDS), kind);
    if (in < 0) return NULL;
    if (in) return PyLong_FromLong(2);
  }
  PyObject *c = PyDict_GetItemWithError(PyTuple_GET_ITEM(ctx, C_CLASS_OF_KIND), kind);
  if (c != NULL) return Py_NewRef(c);
  return PyErr_Occurred() ? NULL : PyLong_FromLong(4);
}

/* ---- the run: its record words and its operators' marks, in flat int64 arrays --------------------- */

/* A run of records for dynn_pilot_operators as the kernel reads it (int64 words, handed over by
 * address: no Python integer per word, no copy) and, per operator record, its mark: where the
 * record ends, its position and phase row, its told storages as (sid, slot) pairs and what it
 * touches as (sid, slot) pairs, kept flat (no Python object per operator). PilotPolicy._Run (a list
 * and a list of mark tuples) is the Python reference of the same interface. */
typedef struct {
  PyObject_HEAD
  int64_t *w;   /* the words */
  Py_ssize_t n, cap;
  int64_t *m;   /* per mark: end, position, phase row, first told pair, first touched pair */
  Py_ssize_t nm, mcap;
  int64_t *t;   /* told (sid, slot) pairs */
  Py_ssize_t nt, tcap;
  int64_t *a;   /* touched (sid, slot) pairs */
  Py_ssize_t na, acap;
} Run;

static PyTypeObject RunType;

static int grow_to(int64_t **v, Py_ssize_t *cap, Py_ssize_t need) {
  if (need <= *cap) return 0;
  Py_ssize_t c = *cap ? *cap : 256;
  while (c < need) c *= 2;
  int64_t *x = PyMem_Realloc(*v, (size_t)c * sizeof(int64_t));
  if (x == NULL) {
    PyErr_NoMemory();
    return -1;
  }
  *v = x;
  *cap = c;
  return 0;
}

static inline int put(Run *r, int64_t x) {
  if (r->n == r->cap && grow_to(&r->w, &r->cap, r->n + 1) < 0) return -1;
  r->w[r->n++] = x;
  return 0;
}

/* a word from a Python integer (a bool is 0 or 1, as ctypes would store it) */
static int put_obj(Run *r, PyObject *o) {
  long long x = PyLong_AsLongLong(o);
  if (x == -1 && PyErr_Occurred()) return -1;
  return put(r, (int64_t)x);
}

static int put_pair(int64_t **v, Py_ssize_t *n, Py_ssize_t *cap, int64_t x, int64_t y) {
  if (*n + 2 > *cap && grow_to(v, cap, *n + 2) < 0) return -1;
  (*v)[(*n)++] = x;
  (*v)[(*n)++] = y;
  return 0;
}

static int put_mark(Run *r, int64_t position, int64_t ph, Py_ssize_t told_lo, Py_ssize_t acc_lo) {
  if (r->nm + 5 > r->mcap && grow_to(&r->m, &r->mcap, r->nm + 5) < 0) return -1;
  int64_t *m = r->m + r->nm;
  m[0] = r->n;
  m[1] = position;
  m[2] = ph;
  m[3] = told_lo;
  m[4] = acc_lo;
  r->nm += 5;
  return 0;
}

static PyObject *Run_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  if (PyTuple_GET_SIZE(args) || (kw != NULL && PyDict_GET_SIZE(kw))) {
    PyErr_SetString(PyExc_TypeError, "pilot Run: takes no arguments");
    return NULL;
  }
  return type->tp_alloc(type, 0); /* zeroed: empty arrays */
}

static void Run_dealloc(Run *r) {
  PyMem_Free(r->w);
  PyMem_Free(r->m);
  PyMem_Free(r->t);
  PyMem_Free(r->a);
  Py_TYPE(r)->tp_free((PyObject *)r);
}

static Py_ssize_t Run_len(Run *r) { return r->n; }

static PyObject *Run_item(Run *r, Py_ssize_t i) {
  if (i < 0 || i >= r->n) {
    PyErr_SetString(PyExc_IndexError, "pilot Run: word index out of range");
    return NULL;
  }
  return PyLong_FromLongLong(r->w[i]);
}

static int Run_ass_item(Run *r, Py_ssize_t i, PyObject *v) {
  if (v == NULL) {
    PyErr_SetString(PyExc_TypeError, "pilot Run: words cannot be deleted (clear() empties the run)");
    return -1;
  }
  if (i < 0 || i >= r->n) {
    PyErr_SetString(PyExc_IndexError, "pilot Run: word index out of range");
    return -1;
  }
  long long x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) return -1;
  r->w[i] = (int64_t)x;
  return 0;
}

/* run += words (a tuple or list of integers) */
static PyObject *Run_iadd(Run *r, PyObject *other) {
  PyObject *seq = PySequence_Fast(other, "pilot Run: += takes a sequence of integers");
  if (seq == NULL) return NULL;
  Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
  if (grow_to(&r->w, &r->cap, r->n + k) < 0) {
    Py_DECREF(seq);
    return NULL;
  }
  for (Py_ssize_t i = 0; i < k; i++) {
    if (put_obj(r, PySequence_Fast_GET_ITEM(seq, i)) < 0) {
      Py_DECREF(seq);
      return NULL;
    }
  }
  Py_DECREF(seq);
  return Py_NewRef((PyObject *)r);
}

static PyObject *Run_clear(Run *r, PyObject *unused) {
  (void)unused;
  r->n = r->nm = r->nt = r->na = 0;
  return Py_NewRef(Py_None);
}

static PyObject *Run_addr(Run *r, void *unused) {
  (void)unused;
  return PyLong_FromVoidPtr(r->w);
}

static PyObject *Run_n_marks(Run *r, PyObject *unused) {
  (void)unused;
  return PyLong_FromSsize_t(r->nm / 5);
}

/* find(end, k): the first mark from k on whose record ends at word end */
static PyObject *Run_find(Run *r, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "pilot Run.find: expected (end, k)");
    return NULL;
  }
  long long end = PyLong_AsLongLong(args[0]);
  Py_ssize_t k = PyLong_AsSsize_t(args[1]);
  if (PyErr_Occurred()) return NULL;
  for (; k >= 0 && 5 * k < r->nm; k++)
    if (r->m[5 * k] == end) return PyLong_FromSsize_t(k);
  PyErr_SetString(PyExc_IndexError, "pilot Run.find: no operator record ends there");
  return NULL;
}

static PyObject *pairs_list(const int64_t *v, Py_ssize_t lo, Py_ssize_t hi, int which) {
  /* which -1: both, flat; 0: the first of each pair; 1: the second */
  Py_ssize_t n = which < 0 ? hi - lo : (hi - lo) / 2;
  PyObject *out = PyList_New(n);
  if (out == NULL) return NULL;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *o = PyLong_FromLongLong(which < 0 ? v[lo + i] : v[lo + 2 * i + which]);
    if (o == NULL) {
      Py_DECREF(out);
      return NULL;
    }
    PyList_SET_ITEM(out, i, o);
  }
  return out;
}

/* mark(k) -> (end, position, told, acc, acc_slots, phase row): PilotPolicy._Run's mark tuple */
static PyObject *Run_mark(Run *r, PyObject *arg) {
  Py_ssize_t k = PyLong_AsSsize_t(arg);
  if (k == -1 && PyErr_Occurred()) return NULL;
  Py_ssize_t nk = r->nm / 5;
  if (k < 0) k += nk;
  if (k < 0 || k >= nk) {
    PyErr_SetString(PyExc_IndexError, "pilot Run.mark: no such operator");
    return NULL;
  }
  const int64_t *m = r->m + 5 * k;
  Py_ssize_t t_hi = k + 1 < nk ? m[5 + 3] : r->nt, a_hi = k + 1 < nk ? m[5 + 4] : r->na;
  PyObject *told = pairs_list(r->t, m[3], t_hi, -1);
  PyObject *acc = told ? pairs_list(r->a, m[4], a_hi, 0) : NULL;
  PyObject *slots = acc ? pairs_list(r->a, m[4], a_hi, 1) : NULL;
  if (slots == NULL) {
    Py_XDECREF(told);
    Py_XDECREF(acc);
    return NULL;
  }
  return Py_BuildValue("(LLNNNL)", (long long)m[0], (long long)m[1], told, acc, slots, (long long)m[2]);
}

static PyObject *Run_words(Run *r, PyObject *unused) {
  (void)unused;
  return pairs_list(r->w, 0, r->n, -1);
}

static PySequenceMethods Run_as_sequence = {
    .sq_length = (lenfunc)Run_len,
    .sq_item = (ssizeargfunc)Run_item,
    .sq_ass_item = (ssizeobjargproc)Run_ass_item,
    .sq_inplace_concat = (binaryfunc)Run_iadd,
};

static PyMethodDef Run_methods[] = {
    {"clear", (PyCFunction)Run_clear, METH_NOARGS, "empty the words and the marks"},
    {"n_marks", (PyCFunction)Run_n_marks, METH_NOARGS, "the number of operator records marked"},
    {"find", (PyCFunction)(void (*)(void))Run_find, METH_FASTCALL, "find(end, k): the first mark from k ending at end"},
    {"mark", (PyCFunction)Run_mark, METH_O, "mark(k) -> (end, position, told, acc, acc_slots, phase row)"},
    {"words", (PyCFunction)Run_words, METH_NOARGS, "the words as a list"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Run_getset[] = {
    {"addr", (getter)Run_addr, NULL, "the words' address (valid until the run grows)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject RunType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dynn_runtime.pilot.kernel._pack.Run",
    .tp_basicsize = sizeof(Run),
    .tp_dealloc = (destructor)Run_dealloc,
    .tp_as_sequence = &Run_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A run of kernel records and their operators' marks in flat int64 arrays.",
    .tp_methods = Run_methods,
    .tp_getset = Run_getset,
    .tp_new = Run_new,
};

/* pack(run, ctx, prev_idx, position, ph, iv, ivk, allocs, prev_allocs, accessed, inputs, outputs, writes)
 *   -> (widest, top): one operator's record (its header, PilotPolicy._pack_allocs' words, the accesses
 * told, what it touches) and its mark appended to run; widest: the most of its allocations, accesses
 * told and storages touched; top: the largest slot it allocated (-1: none). */
static PyObject *pack_op(Run *run, PyObject *const *args, long *widest, long *top_out) {
  PyObject *ctx = args[0], *prev_idx = args[1];
  if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != C_N || !PyDict_Check(prev_idx)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: arguments of the wrong types");
    return NULL;
  }
  long long position = PyLong_AsLongLong(args[2]), ph = PyLong_AsLongLong(args[3]);
  if (PyErr_Occurred()) return NULL;
  PyObject *slot = PyTuple_GET_ITEM(ctx, C_SLOT), *free_list = PyTuple_GET_ITEM(ctx, C_FREE),
           *grow = PyTuple_GET_ITEM(ctx, C_GROW), *nbytes_of = PyTuple_GET_ITEM(ctx, C_NBYTES),
           *kind_of = PyTuple_GET_ITEM(ctx, C_KIND), *saved_of = PyTuple_GET_ITEM(ctx, C_SAVED),
           *kind_idx = PyTuple_GET_ITEM(ctx, C_KIND_IDX), *temp = PyTuple_GET_ITEM(ctx, C_TEMP),
           *small = PyTuple_GET_ITEM(ctx, C_SMALL), *cls_of = PyTuple_GET_ITEM(ctx, C_CLS_OF),
           *classify = PyTuple_GET_ITEM(ctx, C_CLASSIFY), *table = PyTuple_GET_ITEM(ctx, C_TABLE);
  int fraction = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, C_FRACTION));
  if (fraction < 0) return NULL;
  int plain_small = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, C_PLAIN_SMALL));
  if (plain_small < 0) return NULL;
  if (table != Py_None && (!PyDict_Check(table) || !PyDict_Check(PyTuple_GET_ITEM(ctx, C_RECORDLESS)))) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: the record table or the recordless table is not a dict");
    return NULL;
  }
  if (!PyDict_Check(slot) || !PyList_Check(free_list) || !PyDict_Check(kind_idx) || !PyDict_Check(cls_of)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: a context of the wrong types");
    return NULL;
  }
  PyObject *smalls = PyObject_GetAttr(small, s_small);
  if (smalls == NULL) return NULL;
  PyObject *sizes = NULL, *thr = NULL, *set = NULL, *it = NULL, *result = NULL;
  PyObject *allocs = PySequence_Fast(args[6], "pilot pack: the allocations are not a sequence");
  PyObject *prev_allocs = allocs ? PySequence_Fast(args[7], "pilot pack: the previous allocations are not a sequence")
                                 : NULL;
  PyObject *accessed = prev_allocs ? PySequence_Fast(args[8], "pilot pack: the accesses are not a sequence") : NULL;
  if (accessed == NULL) goto done;
  if (!PySet_Check(smalls)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: the small-storage classes are not a set");
    goto done;
  }
  Py_ssize_t n_alloc = PySequence_Fast_GET_SIZE(allocs), n_prev = PySequence_Fast_GET_SIZE(prev_allocs),
             n_acc = PySequence_Fast_GET_SIZE(accessed);
  Py_ssize_t t_lo = run->nt, a_lo = run->na, h = run->n;
  /* the header (its count of touched storages is known once they are packed) */
  if (put(run, BATCH_OP) < 0 || put(run, position) < 0 || put(run, ph) < 0 || put(run, ph) < 0 || put_obj(run, args[4]) < 0 ||
      put_obj(run, args[5]) < 0 || put(run, n_alloc) < 0 || put(run, n_acc) < 0 || put(run, 0) < 0 || put(run, ph) < 0)
    goto done;
  /* the allocations: eight words each (PilotPolicy._pack_allocs) */
  long top = -1;
  for (Py_ssize_t i = 0; i < n_alloc; i++) {
    PyObject *sid = PySequence_Fast_GET_ITEM(allocs, i);
    PyObject *s = PyDict_GetItemWithError(slot, sid); /* borrowed */
    if (s == NULL) {
      if (PyErr_Occurred()) goto done;
      if (PyList_GET_SIZE(free_list) == 0) { /* FeatureState._grow extends the same free list */
        PyObject *r = PyObject_CallNoArgs(grow);
        if (r == NULL) goto done;
        Py_DECREF(r);
        if (PyList_GET_SIZE(free_list) == 0) {
          PyErr_SetString(PyExc_RuntimeError, "pilot pack: the feature state grew no free slot");
          goto done;
        }
      }
      Py_ssize_t last = PyList_GET_SIZE(free_list) - 1;
      s = PyList_GET_ITEM(free_list, last);
      Py_INCREF(s);
      if (PyList_SetSlice(free_list, last, last + 1, NULL) < 0 || PyDict_SetItem(slot, sid, s) < 0) {
        Py_DECREF(s);
        goto done;
      }
      Py_DECREF(s); /* the slot map holds it */
    }
    long sv = PyLong_AsLong(s);
    if (sv == -1 && PyErr_Occurred()) goto done;
    if (sv > top) top = sv;
    /* the words in the Python tuple's order; the slot first, before the view's calls */
    if (put(run, sv) < 0 || put_obj(run, sid) < 0) goto done;
    PyObject *nb = view_read(ctx, a_nbytes, nbytes_of, sid);
    if (nb == NULL) goto done;
    PyObject *kind = view_read(ctx, a_kind, kind_of, sid);
    if (kind == NULL) { Py_DECREF(nb); goto done; }
    PyObject *k = PyDict_GetItemWithError(kind_idx, kind);
    Py_DECREF(kind);
    if (k == NULL && PyErr_Occurred()) { Py_DECREF(nb); goto done; }
    if (put_obj(run, k != NULL ? k : temp) < 0) { Py_DECREF(nb); goto done; }
    PyObject *saved = view_read(ctx, a_saved, saved_of, sid);
    if (saved == NULL) { Py_DECREF(nb); goto done; }
    int sb = PyObject_IsTrue(saved);
    Py_DECREF(saved);
    if (sb < 0 || put(run, sb) < 0 || put_obj(run, nb) < 0) { Py_DECREF(nb); goto done; }
    PyObject *p = PyDict_GetItemWithError(prev_idx, sid);
    if (p == NULL && PyErr_Occurred()) { Py_DECREF(nb); goto done; }
    if (p != NULL ? put_obj(run, p) < 0 : put(run, -1) < 0) { Py_DECREF(nb); goto done; }
    if (i < n_prev) {
      p = PyDict_GetItemWithError(prev_idx, PySequence_Fast_GET_ITEM(prev_allocs, i));
      if (p == NULL && PyErr_Occurred()) { Py_DECREF(nb); goto done; }
      if (p != NULL ? put_obj(run, p) < 0 : put(run, -1) < 0) { Py_DECREF(nb); goto done; }
    } else if (put(run, -2) < 0) {
      Py_DECREF(nb);
      goto done;
    }
    if (fraction) {
      PyObject *r = plain_small ? small_alloc(small, sid, nb) : PyObject_CallMethodObjArgs(small, s_alloc, sid, nb, NULL);
      Py_DECREF(nb);
      if (r == NULL) goto done;
      int bad = put_obj(run, r) < 0;
      Py_DECREF(r);
      if (bad) goto done;
    } else {
      Py_DECREF(nb);
      int c = PySet_Contains(smalls, sid);
      if (c < 0 || put(run, c) < 0) goto done;
    }
  }
  /* the accesses told: four words each (slot, sid, small, storage class), and their (sid, slot) pairs */
  if (fraction) {
    sizes = PyObject_GetAttr(small, s_bytes);
    if (sizes == NULL) goto done;
    if (!PyDict_Check(sizes)) {
      PyErr_SetString(PyExc_TypeError, "pilot pack: the small storages' sizes are not a dict");
      goto done;
    }
    PyObject *f = PyObject_GetAttr(small, s_fraction);
    if (f == NULL) goto done;
    PyObject *peak = PyObject_GetAttr(small, s_peak); /* after the allocations raised it */
    if (peak == NULL) { Py_DECREF(f); goto done; }
    thr = PyNumber_Multiply(f, peak);
    Py_DECREF(f);
    Py_DECREF(peak);
    if (thr == NULL) goto done;
  }
  for (Py_ssize_t i = 0; i < n_acc; i++) {
    PyObject *sid = PySequence_Fast_GET_ITEM(accessed, i);
    PyObject *s = PyDict_GetItemWithError(slot, sid);
    if (s == NULL && PyErr_Occurred()) goto done;
    int sk;
    if (fraction) { /* SmallStorages.access */
      PyObject *b = PyDict_GetItemWithError(sizes, sid);
      if (b == NULL && PyErr_Occurred()) goto done;
      int lt = PyObject_RichCompareBool(b != NULL ? b : zero, thr, Py_LT);
      if (lt < 0) goto done;
      if (lt ? PySet_Add(smalls, sid) < 0 : PySet_Discard(smalls, sid) < 0) goto done;
      sk = lt;
    } else {
      sk = PySet_Contains(smalls, sid);
      if (sk < 0) goto done;
    }
    long long sidv = PyLong_AsLongLong(sid);
    if (sidv == -1 && PyErr_Occurred()) goto done;
    if (s == NULL) {
      if (put(run, -1) < 0 || put(run, sidv) < 0 || put(run, 0) < 0 || put(run, 0) < 0) goto done;
      continue;
    }
    long long sv = PyLong_AsLongLong(s); /* before the view's calls, which may change the slot map */
    if (sv == -1 && PyErr_Occurred()) goto done;
    PyObject *c = PyDict_GetItemWithError(cls_of, sid);
    if (c == NULL) {
      if (PyErr_Occurred()) goto done;
      if (table == Py_None) {
        c = PyObject_CallOneArg(classify, sid);
      } else {
        PyObject *kind = view_read(ctx, a_kind, kind_of, sid);
        PyObject *saved = kind ? view_read(ctx, a_saved, saved_of, sid) : NULL;
        c = saved ? storage_class(ctx, kind, saved) : NULL;
        Py_XDECREF(kind);
        Py_XDECREF(saved);
      }
      if (c == NULL || PyDict_SetItem(cls_of, sid, c) < 0) { Py_XDECREF(c); goto done; }
      Py_DECREF(c); /* cls_of holds it */
    }
    if (put(run, sv) < 0 || put(run, sidv) < 0 || put(run, sk) < 0 || put_obj(run, c) < 0 ||
        put_pair(&run->t, &run->nt, &run->tcap, sidv, sv) < 0)
      goto done;
  }
  /* what the operator touches, in the order of the set {*inputs, *outputs, *writes}, and their slots */
  set = PySet_New(args[9]);
  if (set == NULL) goto done;
  for (int a = 10; a < 12; a++) {
    PyObject *iter = PyObject_GetIter(args[a]);
    if (iter == NULL) goto done;
    PyObject *x;
    while ((x = PyIter_Next(iter)) != NULL) {
      int rc = PySet_Add(set, x);
      Py_DECREF(x);
      if (rc < 0) { Py_DECREF(iter); goto done; }
    }
    Py_DECREF(iter);
    if (PyErr_Occurred()) goto done;
  }
  it = PyObject_GetIter(set);
  if (it == NULL) goto done;
  PyObject *sid;
  while ((sid = PyIter_Next(it)) != NULL) {
    PyObject *s = PyDict_GetItemWithError(slot, sid);
    long long sidv = PyLong_AsLongLong(sid), sv = s != NULL ? PyLong_AsLongLong(s) : -1;
    Py_DECREF(sid);
    if (PyErr_Occurred() || put(run, sv) < 0 || put_pair(&run->a, &run->na, &run->acap, sidv, sv) < 0) goto done;
  }
  if (PyErr_Occurred()) goto done;
  Py_ssize_t n_set = (run->na - a_lo) / 2;
  run->w[h + 8] = n_set;
  if (put_mark(run, position, ph, t_lo, a_lo) < 0) goto done;
  long n = (long)n_alloc;
  if ((long)n_acc > n) n = (long)n_acc;
  if ((long)n_set > n) n = (long)n_set;
  *widest = n;
  *top_out = top;
  result = Py_NewRef(Py_None);
done:
  Py_DECREF(smalls);
  Py_XDECREF(allocs);
  Py_XDECREF(prev_allocs);
  Py_XDECREF(accessed);
  Py_XDECREF(sizes);
  Py_XDECREF(thr);
  Py_XDECREF(set);
  Py_XDECREF(it);
  return result;
}

static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 13) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: expected 13 arguments");
    return NULL;
  }
  if (!PyObject_TypeCheck(args[0], &RunType)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: the run is not a pack.Run");
    return NULL;
  }
  Run *run = (Run *)args[0];
  Py_ssize_t n0 = run->n, nm0 = run->nm, nt0 = run->nt, na0 = run->na;
  long widest = 0, top = -1;
  PyObject *r = pack_op(run, args + 1, &widest, &top);
  if (r == NULL) { /* nothing half-written stays in the run */
    run->n = n0;
    run->nm = nm0;
    run->nt = nt0;
    run->na = na0;
    return NULL;
  }
  Py_DECREF(r);
  return Py_BuildValue("(ll)", widest, top);
}

/* ---- the walk over a batch's events (PilotPolicy._operators_native's loop) ------------------------ */

/* the walk context tuple PilotPolicy._walk_context builds (its order) */
enum { W_POLICY, W_STATE, W_SL, W_GROUP, W_IV_CACHE, W_PHASES, W_OPERATOR, W_FREE, W_N };

static PyObject *a_phase, *a_pending, *a_fwd_log, *a_fwd_node, *a_node, *a_mirror, *a_decays, *a_hist_decays,
    *a_idiom, *a_bulk_phase, *a_ops, *a_allocs, *a_name, *a_module, *a_op_seen, *a_prev_ops, *a_prev_allocs,
    *a_anchor, *a_skip, *a_grow_due, *a_position, *a_hist_allocs, *a_last_decision, *a_job, *a_force_decision,
    *a_policy_phase, *a_inputs, *a_outputs, *a_writes, *a_live, *a_relink, *a_mir_first, *a_mir_index, *a_log_bytes,
    *a_fwd_freed, *heappush;

/* a truth value of obj.attr (-1: error) */
static int attr_true(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  int t = PyObject_IsTrue(v);
  Py_DECREF(v);
  return t;
}

/* obj.attr as a C long (error: -1 with an exception set) */
static long attr_long(PyObject *obj, PyObject *name) {
  PyObject *v = PyObject_GetAttr(obj, name);
  if (v == NULL) return -1;
  long x = PyLong_AsLong(v);
  Py_DECREF(v);
  return x;
}

static int set_long(PyObject *obj, PyObject *name, long x) {
  PyObject *v = PyLong_FromLong(x);
  if (v == NULL) return -1;
  int rc = PyObject_SetAttr(obj, name, v);
  Py_DECREF(v);
  return rc;
}

/* MirrorState._nearest_input(own, inputs): the mirror segment of the input of the nearest size at
 * least own (the first on ties), or -1; sizes as log_bytes (the state's row, or the log_bytes forward
 * reported when it freed the input). Every value compared is a float32's, so comparing as doubles
 * orders them as numpy does. *tgt: the segment index object (borrowed from the mirror's index). */
static int nearest_input(PyObject *state, PyObject *slot, double own, PyObject *inputs, PyObject **tgt) {
  PyObject *mi = PyObject_GetAttr(state, a_mir_index), *lb = NULL, *freed = NULL, *seq = NULL;
  int rc = -1;
  *tgt = NULL;
  if (mi == NULL || (lb = PyObject_GetAttr(state, a_log_bytes)) == NULL ||
      (freed = PyObject_GetAttr(state, a_fwd_freed)) == NULL ||
      (seq = PySequence_Fast(inputs, "pilot walk: a forward node's inputs are not a sequence")) == NULL)
    goto done;
  if (!PyDict_Check(mi) || !PyDict_Check(freed)) {
    PyErr_SetString(PyExc_TypeError, "pilot walk: the mirror's index or forward's freed sizes are not dicts");
    goto done;
  }
  double best_lb = INFINITY;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    PyObject *f = PySequence_Fast_GET_ITEM(seq, i);
    PyObject *t = PyDict_GetItemWithError(mi, f);
    if (t == NULL) {
      if (PyErr_Occurred()) goto done;
      continue;
    }
    PyObject *fs = PyDict_GetItemWithError(slot, f);
    if (fs == NULL && PyErr_Occurred()) goto done;
    double v;
    if (fs != NULL) {
      PyObject *x = PyObject_GetItem(lb, fs);
      if (x == NULL) goto done;
      v = PyFloat_AsDouble(x);
      Py_DECREF(x);
    } else {
      PyObject *x = PyDict_GetItemWithError(freed, f);
      if (x == NULL) {
        if (PyErr_Occurred()) goto done;
        continue;
      }
      v = PyFloat_AsDouble(x);
    }
    if (v == -1.0 && PyErr_Occurred()) goto done;
    if (own <= v && v < best_lb) {
      *tgt = t;
      best_lb = v;
    }
  }
  rc = 0;
done:
  Py_XDECREF(mi);
  Py_XDECREF(lb);
  Py_XDECREF(freed);
  Py_XDECREF(seq);
  return rc;
}

/* MirrorState._link as the Python loop does it for a run: per allocation with a slot, its target from
 * its size (the row's log_bytes as the kernel will write it, float32(log2(size) / 30)), a link record
 * the kernel writes after the row, and the relink heap's entry (-first access of the target, slot,
 * sid, target). */
static int link_allocs(Run *run, PyObject *state, PyObject *ctx, PyObject *allocs, PyObject *inputs) {
  PyObject *slot = PyTuple_GET_ITEM(ctx, C_SLOT), *nbytes_of = PyTuple_GET_ITEM(ctx, C_NBYTES);
  PyObject *seq = PySequence_Fast(allocs, "pilot walk: the allocations are not a sequence");
  PyObject *relink = seq ? PyObject_GetAttr(state, a_relink) : NULL;
  PyObject *first = relink ? PyObject_GetAttr(state, a_mir_first) : NULL;
  int rc = -1;
  if (first == NULL) goto done;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    PyObject *sid = PySequence_Fast_GET_ITEM(seq, i);
    PyObject *s = PyDict_GetItemWithError(slot, sid);
    if (s == NULL) {
      if (PyErr_Occurred()) goto done;
      continue;
    }
    Py_INCREF(s);
    PyObject *nb = view_read(ctx, a_nbytes, nbytes_of, sid);
    long long nbv = nb ? PyLong_AsLongLong(nb) : -1;
    Py_XDECREF(nb);
    if (nbv == -1 && PyErr_Occurred()) { Py_DECREF(s); goto done; }
    double own = (double)(float)(log2((double)(nbv > 1 ? nbv : 1)) / 30.0);
    PyObject *tgt;
    if (nearest_input(state, slot, own, inputs, &tgt) < 0) { Py_DECREF(s); goto done; }
    long long tv = -1;
    if (tgt != NULL) {
      tv = PyLong_AsLongLong(tgt);
      if (tv == -1 && PyErr_Occurred()) { Py_DECREF(s); goto done; }
    }
    if (put(run, BATCH_LINK) < 0 || put_obj(run, s) < 0 || put(run, tv) < 0) { Py_DECREF(s); goto done; }
    if (tgt != NULL) {
      Py_INCREF(tgt);
      PyObject *f0 = PyObject_GetItem(first, tgt), *fi = f0 ? PyNumber_Long(f0) : NULL;
      PyObject *neg = fi ? PyNumber_Negative(fi) : NULL;
      PyObject *entry = neg ? PyTuple_Pack(4, neg, s, sid, tgt) : NULL;
      PyObject *r = entry ? PyObject_CallFunctionObjArgs(heappush, relink, entry, NULL) : NULL;
      Py_XDECREF(f0);
      Py_XDECREF(fi);
      Py_XDECREF(neg);
      Py_XDECREF(entry);
      Py_DECREF(tgt);
      if (r == NULL) { Py_DECREF(s); goto done; }
      Py_DECREF(r);
    }
    Py_DECREF(s);
  }
  rc = 0;
done:
  Py_XDECREF(seq);
  Py_XDECREF(relink);
  Py_XDECREF(first);
  return rc;
}

/* log.append((position, op)), the pair out of the cyclic collector: an int and an Op (whose fields
   are strings, numbers and tuples of them) cannot close a reference cycle through it, and the pair
   lives from forward into backward, so a tracked one would be promoted to the oldest generation
   (reference counts still free it) */
static int append_pair(PyObject *log, PyObject *position, PyObject *op) {
  PyObject *entry = PyTuple_Pack(2, position, op);
  if (entry == NULL) return -1;
  PyObject_GC_UnTrack(entry);
  int rc = PyList_Append(log, entry);
  Py_DECREF(entry);
  return rc;
}

/* One operator of the state's phase past the iteration's first, handled as the Python loop handles it.
 * Returns 1: done, 0: left to Python (nothing was changed), -1: error. *tick and *decide: the decision
 * point's inputs (FeatureState._tick, and whether _after_update must run now). */
static int walk_op(PyObject *ev, PyObject *const *w, PyObject *ctx, PyObject *prev_idx, Run *run,
                   long *widest, int *tick, int *decide) {
  PyObject *policy = w[W_POLICY], *state = w[W_STATE];
  PyObject *pos_obj = PyTuple_GET_ITEM(ev, 1), *op = PyTuple_GET_ITEM(ev, 2), *accessed = PyTuple_GET_ITEM(ev, 3);
  long position = PyLong_AsLong(pos_obj);
  if (position == -1 && PyErr_Occurred()) return -1;
  int rc = -1, left = 0;
  PyObject *phase = NULL, *hit = NULL, *decays = NULL, *hist = NULL, *key = NULL, *allocs = NULL, *name = NULL,
           *module = NULL, *seen = NULL, *prev_ops = NULL, *prev_allocs = NULL, *packed = NULL,
           *inputs = NULL, *outputs = NULL, *writes = NULL, *skip = NULL, *move_to = NULL;
  phase = PyObject_GetAttr(op, a_phase);
  if (phase == NULL) goto done;
  PyObject *ph_obj = PyDict_GetItemWithError(w[W_PHASES], phase);
  if (ph_obj == NULL) {
    if (!PyErr_Occurred()) left = 1; /* a phase the table does not know: Python says what it is */
    goto done;
  }
  long ph = PyLong_AsLong(ph_obj), st_phase = attr_long(state, a_phase);
  if (PyErr_Occurred()) goto done;
  int pending = attr_true(policy, a_pending);
  if (pending < 0) goto done;
  int fwd_log = ph == 1 ? attr_true(state, a_fwd_log) : 0;
  if (fwd_log < 0) goto done;
  if (ph != st_phase || position == 0 || pending || (ph == 1 && fwd_log)) {
    left = 1; /* a phase begins, the iteration's first operator, or the mirror is built: Python's fused paths */
    goto done;
  }
  allocs = PyObject_GetAttr(op, a_allocs);
  if (allocs == NULL) goto done;
  Py_ssize_t na = PyObject_Length(allocs);
  if (na < 0) goto done;
  if (ph == 1) { /* FeatureState.enter in backward: the mirror moves to the operator's node, links its allocations */
    PyObject *node = PyObject_GetAttr(op, a_node);
    if (node == NULL) {
      if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto done;
      PyErr_Clear();
      node = PyLong_FromLong(-1);
      if (node == NULL) goto done;
    }
    PyObject *fwd_node = PyObject_GetAttr(state, a_fwd_node);
    if (fwd_node == NULL) { Py_DECREF(node); goto done; }
    if (PyDict_Check(fwd_node)) {
      hit = PyDict_GetItemWithError(fwd_node, node);
      if (hit != NULL) Py_INCREF(hit);
      else if (!PyErr_Occurred()) hit = Py_NewRef(Py_None);
    } else {
      PyErr_SetString(PyExc_TypeError, "pilot walk: the forward nodes are not a dict");
    }
    Py_DECREF(fwd_node);
    Py_DECREF(node);
    if (hit == NULL) goto done;
    if (hit != Py_None) {
      if (!PyTuple_Check(hit) || PyTuple_GET_SIZE(hit) != 2) {
        PyErr_SetString(PyExc_TypeError, "pilot walk: a forward node is not a (position, inputs) tuple");
        goto done;
      }
      PyObject *mirror = PyObject_GetAttr(state, a_mirror);
      if (mirror == NULL) goto done;
      PyObject *target = PyTuple_GET_ITEM(hit, 0);
      int moves = PyObject_RichCompareBool(target, mirror, Py_NE);
      Py_DECREF(mirror);
      if (moves < 0) goto done;
      if (moves) {
        /* MirrorState._pass_through has a gradient to pass on (it reads the arrays the run has not
         * written yet): Python's; otherwise the move is only the mirror's new node */
        PyObject *relink = PyObject_GetAttr(state, a_relink);
        if (relink == NULL) goto done;
        int due = 0;
        if (!PyList_Check(relink)) {
          PyErr_SetString(PyExc_TypeError, "pilot walk: the mirror's relink heap is not a list");
          due = -1;
        } else if (PyList_GET_SIZE(relink)) {
          PyObject *top = PySequence_GetItem(PyList_GET_ITEM(relink, 0), 0);
          PyObject *neg = top ? PyNumber_Negative(top) : NULL;
          Py_XDECREF(top);
          due = neg ? PyObject_RichCompareBool(neg, target, Py_GE) : -1;
          Py_XDECREF(neg);
        }
        Py_DECREF(relink);
        if (due < 0) goto done;
        if (due) { left = 1; goto done; }
        move_to = Py_NewRef(target);
      }
    }
  }
  /* FeatureState.native_iv, its cache hit only */
  decays = PyObject_GetAttr(state, a_decays);
  if (decays == NULL) goto done;
  hist = PyObject_GetAttr(state, a_hist_decays);
  if (hist == NULL) goto done;
  if (decays != hist || !PyTuple_Check(decays) || PyTuple_GET_SIZE(decays) != 2) { left = 1; goto done; }
  PyObject *idiom = PyObject_GetAttr(op, a_idiom);
  if (idiom == NULL) goto done;
  key = PyTuple_Pack(3, idiom, PyTuple_GET_ITEM(decays, 0), PyTuple_GET_ITEM(decays, 1));
  Py_DECREF(idiom);
  if (key == NULL) goto done;
  PyObject *iv = PyDict_GetItemWithError(w[W_IV_CACHE], key);
  if (iv == NULL) {
    if (!PyErr_Occurred()) left = 1;
    goto done;
  }
  PyObject *iv_addr = PyTuple_GET_ITEM(PyTuple_GET_ITEM(iv, 0), 1), *ivk_addr = PyTuple_GET_ITEM(PyTuple_GET_ITEM(iv, 1), 1);
  /* from here on the operator is this walk's: the Python loop's writes, in its order */
  if (PyObject_SetAttr(policy, a_bulk_phase, phase) < 0) goto done;
  if (move_to != NULL && PyObject_SetAttr(state, a_mirror, move_to) < 0) goto done;
  long ops = attr_long(policy, a_ops);
  if ((ops == -1 && PyErr_Occurred()) || set_long(policy, a_ops, ops + 1) < 0) goto done;
  /* FeatureState._align */
  name = PyObject_GetAttr(op, a_name);
  module = name ? PyObject_GetAttr(op, a_module) : NULL;
  if (module == NULL) goto done;
  PyObject *k3 = PyTuple_Pack(3, name, module, phase);
  if (k3 == NULL) goto done;
  seen = PyObject_GetAttr(state, a_op_seen);
  if (seen == NULL) { Py_DECREF(k3); goto done; }
  PyObject *c = PyDict_GetItemWithError(seen, k3);
  if (c == NULL && PyErr_Occurred()) { Py_DECREF(k3); goto done; }
  long cv = c == NULL ? 0 : PyLong_AsLong(c);
  if (cv == -1 && PyErr_Occurred()) { Py_DECREF(k3); goto done; }
  PyObject *c1 = PyLong_FromLong(cv + 1);
  int bad = c1 == NULL || PyDict_SetItem(seen, k3, c1) < 0;
  Py_XDECREF(c1);
  Py_DECREF(k3);
  if (bad) goto done;
  PyObject *cobj = PyLong_FromLong(cv);
  PyObject *k4 = cobj ? PyTuple_Pack(4, name, module, phase, cobj) : NULL;
  Py_XDECREF(cobj);
  if (k4 == NULL) goto done;
  prev_ops = PyObject_GetAttr(state, a_prev_ops);
  PyObject *q = prev_ops ? PyDict_GetItemWithError(prev_ops, k4) : NULL;
  Py_DECREF(k4);
  if (q == NULL && PyErr_Occurred()) goto done;
  if (q == NULL) {
    prev_allocs = PyTuple_New(0);
  } else {
    PyObject *anchor = PyTuple_Pack(2, pos_obj, q);
    if (anchor == NULL) goto done;
    bad = PyObject_SetAttr(state, a_anchor, anchor) < 0;
    Py_DECREF(anchor);
    if (bad) goto done;
    PyObject *pa = PyObject_GetAttr(state, a_prev_allocs);
    if (pa == NULL) goto done;
    if (PyDict_Check(pa)) {
      prev_allocs = PyDict_GetItemWithError(pa, q);
      if (prev_allocs != NULL) Py_INCREF(prev_allocs);
      else if (!PyErr_Occurred()) prev_allocs = PyTuple_New(0);
    } else {
      PyErr_SetString(PyExc_TypeError, "pilot walk: the previous iteration's allocations are not a dict");
    }
    Py_DECREF(pa);
  }
  if (prev_allocs == NULL) goto done;
  /* the record and its mark (PilotPolicy._pack_run_op) */
  inputs = PyObject_GetAttr(op, a_inputs);
  outputs = inputs ? PyObject_GetAttr(op, a_outputs) : NULL;
  writes = outputs ? PyObject_GetAttr(op, a_writes) : NULL;
  if (writes == NULL) goto done;
  PyObject *pargs[12] = {ctx, prev_idx, pos_obj, ph_obj, iv_addr, ivk_addr, allocs, prev_allocs, accessed, inputs, outputs, writes};
  long n = 0, top = -1;
  packed = pack_op(run, pargs, &n, &top);
  if (packed == NULL) goto done;
  skip = PyObject_GetAttr(policy, a_skip);
  if (skip == NULL) goto done;
  Py_ssize_t n_skip = PyObject_Length(skip);
  if (n_skip < 0) goto done;
  if (top >= n_skip) {
    PyObject *r = PyObject_CallMethodNoArgs(policy, a_grow_due);
    if (r == NULL) goto done;
    Py_DECREF(r);
  }
  if (n > *widest) *widest = n;
  if (hit != NULL && hit != Py_None && na && link_allocs(run, state, ctx, allocs, PyTuple_GET_ITEM(hit, 1)) < 0)
    goto done;
  /* FeatureState.enter in the same phase past the first operator, and _tick */
  if (PyObject_SetAttr(state, a_position, pos_obj) < 0) goto done;
  if (ph == 0) {
    PyObject *log = PyObject_GetAttr(state, a_fwd_log);
    if (log == NULL) goto done;
    bad = append_pair(log, pos_obj, op) < 0;
    Py_DECREF(log);
    if (bad) goto done;
  }
  PyObject *ha = PyObject_GetAttr(state, a_hist_allocs);
  if (ha == NULL) goto done;
  double hv = PyFloat_AsDouble(ha), sl = PyFloat_AsDouble(w[W_SL]);
  Py_DECREF(ha);
  if (PyErr_Occurred()) goto done;
  PyObject *hn = PyFloat_FromDouble(hv * sl + (double)na * (1.0 - sl));
  if (hn == NULL) goto done;
  bad = PyObject_SetAttr(state, a_hist_allocs, hn) < 0;
  Py_DECREF(hn);
  if (bad) goto done;
  long last = attr_long(state, a_last_decision), group = PyLong_AsLong(w[W_GROUP]);
  if (PyErr_Occurred()) goto done;
  *tick = position - last >= group;
  if (*tick && PyObject_SetAttr(state, a_last_decision, pos_obj) < 0) goto done;
  /* what _after_update would do: nothing unless a decision point is due or the worker holds one */
  PyObject *job = PyObject_GetAttr(policy, a_job);
  if (job == NULL) goto done;
  int busy = job != Py_None;
  Py_DECREF(job);
  int force = attr_true(policy, a_force_decision);
  if (force < 0) goto done;
  PyObject *pph = PyObject_GetAttr(policy, a_policy_phase);
  if (pph == NULL) goto done;
  PyObject *sph = PyObject_GetAttr(state, a_phase);
  if (sph == NULL) { Py_DECREF(pph); goto done; }
  int other = PyObject_RichCompareBool(pph, sph, Py_NE);
  Py_DECREF(pph);
  Py_DECREF(sph);
  if (other < 0) goto done;
  *decide = *tick || busy || force || other;
  rc = 1;
done:
  Py_XDECREF(phase);
  Py_XDECREF(hit);
  Py_XDECREF(decays);
  Py_XDECREF(hist);
  Py_XDECREF(key);
  Py_XDECREF(allocs);
  Py_XDECREF(name);
  Py_XDECREF(module);
  Py_XDECREF(seen);
  Py_XDECREF(prev_ops);
  Py_XDECREF(prev_allocs);
  Py_XDECREF(packed);
  Py_XDECREF(inputs);
  Py_XDECREF(outputs);
  Py_XDECREF(writes);
  Py_XDECREF(skip);
  Py_XDECREF(move_to);
  if (rc < 0 && left && !PyErr_Occurred()) rc = 0;
  return rc;
}

/* A death, inlined as the Python loop inlines it (FeatureState.free into the run, SmallStorages.free).
 * Returns 1: done, 0: left to Python (a storage of the previous iteration while a run is open), -1: error. */
static int walk_free(PyObject *ev, PyObject *const *w, PyObject *ctx, PyObject *prev_idx, Run *run, PyObject *freed) {
  PyObject *sid = PyTuple_GET_ITEM(ev, 1);
  int in_prev = PyDict_Contains(prev_idx, sid);
  if (in_prev < 0) return -1;
  if (in_prev && run->n) return 0;
  PyObject *slot = PyTuple_GET_ITEM(ctx, C_SLOT), *free_list = PyTuple_GET_ITEM(ctx, C_FREE),
           *small = PyTuple_GET_ITEM(ctx, C_SMALL);
  PyObject *s = PyDict_GetItemWithError(slot, sid);
  if (s == NULL && PyErr_Occurred()) return -1;
  if (s != NULL) {
    Py_INCREF(s);
    if (PyDict_DelItem(slot, sid) < 0) { Py_DECREF(s); return -1; }
    long st_phase = attr_long(w[W_STATE], a_phase);
    if (st_phase == -1 && PyErr_Occurred()) { Py_DECREF(s); return -1; }
    /* the record: (_BATCH_FREE, slot, whether it reports its log_bytes) */
    int bad = put(run, BATCH_FREE) < 0 || put_obj(run, s) < 0 || put(run, st_phase == 0) < 0 ||
              (st_phase == 0 && PyList_Append(freed, sid) < 0) || PyList_Append(free_list, s) < 0;
    Py_DECREF(s);
    if (bad) return -1;
  }
  PyObject *sizes = PyObject_GetAttr(small, s_bytes);
  if (sizes == NULL) return -1;
  PyObject *b = PyDict_GetItemWithError(sizes, sid);
  if (b == NULL && PyErr_Occurred()) { Py_DECREF(sizes); return -1; }
  PyObject *nb = b != NULL ? b : zero;
  Py_INCREF(nb);
  if (b != NULL && PyDict_DelItem(sizes, sid) < 0) { Py_DECREF(nb); Py_DECREF(sizes); return -1; }
  Py_DECREF(sizes);
  PyObject *live = PyObject_GetAttr(small, a_live);
  PyObject *left = live ? PyNumber_Subtract(live, nb) : NULL;
  Py_XDECREF(live);
  Py_DECREF(nb);
  if (left == NULL) return -1;
  int bad = PyObject_SetAttr(small, a_live, left) < 0;
  Py_DECREF(left);
  if (bad) return -1;
  PyObject *smalls = PyObject_GetAttr(small, s_small);
  if (smalls == NULL) return -1;
  bad = PySet_Discard(smalls, sid) < 0;
  Py_DECREF(smalls);
  return bad ? -1 : 1;
}

static PyObject *log_forward(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 3 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "log_forward(log: list, position, op)");
    return NULL;
  }
  if (append_pair(args[0], args[1], args[2]) < 0) return NULL;
  Py_RETURN_NONE;
}

/* walk(events, i, ctx, wctx, prev_idx, run, freed, widest) -> (i, decide, position, tick, widest)
 * From event i, the events the Python loop handles the common way; stops before the first it leaves to
 * Python (decide False) or after an operator whose decision point is due (decide True: the run goes to
 * the kernel and _after_update(position, tick) runs next), or at the end. */
static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "pilot walk: expected 8 arguments");
    return NULL;
  }
  PyObject *events = args[0], *ctx = args[2], *wctx = args[3], *prev_idx = args[4], *freed = args[6];
  Py_ssize_t i = PyLong_AsSsize_t(args[1]);
  long widest = PyLong_AsLong(args[7]);
  if (PyErr_Occurred()) return NULL;
  if (!PyList_Check(events) || !PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != C_N || !PyTuple_Check(wctx) ||
      PyTuple_GET_SIZE(wctx) != W_N || !PyDict_Check(prev_idx) || !PyObject_TypeCheck(args[5], &RunType) ||
      !PyList_Check(freed) || !PyDict_Check(PyTuple_GET_ITEM(wctx, W_IV_CACHE)) ||
      !PyDict_Check(PyTuple_GET_ITEM(wctx, W_PHASES))) {
    PyErr_SetString(PyExc_TypeError, "pilot walk: arguments of the wrong types");
    return NULL;
  }
  PyObject *const *w = &PyTuple_GET_ITEM(wctx, 0);
  Run *run = (Run *)args[5];
  Py_ssize_t n = PyList_GET_SIZE(events);
  int decide = 0, tick = 0;
  PyObject *position = Py_None;
  while (i < n) {
    PyObject *ev = PyList_GET_ITEM(events, i);
    if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) < 2) break;
    PyObject *tag = PyTuple_GET_ITEM(ev, 0);
    int eq = PyObject_RichCompareBool(tag, w[W_OPERATOR], Py_EQ), rc;
    if (eq < 0) return NULL;
    if (eq) {
      if (PyTuple_GET_SIZE(ev) != 4) break;
      Py_INCREF(ev); /* the walk's calls into Python must not free it */
      rc = walk_op(ev, w, ctx, prev_idx, run, &widest, &tick, &decide);
      if (rc > 0) position = PyTuple_GET_ITEM(ev, 1);
      Py_DECREF(ev);
    } else {
      eq = PyObject_RichCompareBool(tag, w[W_FREE], Py_EQ);
      if (eq < 0) return NULL;
      if (!eq) break; /* a birth between operators: on_alloc in Python */
      Py_INCREF(ev);
      rc = walk_free(ev, w, ctx, prev_idx, run, freed);
      Py_DECREF(ev);
    }
    if (rc < 0) return NULL;
    if (rc == 0) break;
    i++;
    if (decide) break;
  }
  return Py_BuildValue("(niOil)", i, decide, position, tick, widest);
}

/* ---- the previous iteration's index (ReplayState._index_ops_py) --------------------------------- */

typedef struct {
  int64_t *v;
  Py_ssize_t n, cap;
} ivec;

static int ivec_push(ivec *a, int64_t x, int64_t y) {
  if (a->n + 2 > a->cap) {
    Py_ssize_t cap = a->cap ? 2 * a->cap : 1024;
    int64_t *v = PyMem_Realloc(a->v, (size_t)cap * sizeof(int64_t));
    if (v == NULL) {
      PyErr_NoMemory();
      return -1;
    }
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n++] = x;
  a->v[a->n++] = y;
  return 0;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

/* sid's counterpart index in idx (a new one, in first-access order, where it has none); -1: error */
static Py_ssize_t index_of(PyObject *idx, PyObject *sid) {
  PyObject *i = PyDict_GetItemWithError(idx, sid);
  if (i != NULL) return PyLong_AsSsize_t(i);
  if (PyErr_Occurred()) return -1;
  Py_ssize_t n = PyDict_GET_SIZE(idx);
  PyObject *o = PyLong_FromSsize_t(n);
  if (o == NULL) return -1;
  int rc = PyDict_SetItem(idx, sid, o);
  Py_DECREF(o);
  return rc < 0 ? -1 : n;
}

/* index_ops(ops, extra) -> (prev_ops, prev_allocs, seen, prev_idx, flat, start): ReplayState._index_ops_py's
 * dicts in its insertion orders (each operator's storages in the order of the set {*inputs, *outputs,
 * *writes}, built as that display builds it), and each counterpart's positions as one flat list cut by
 * start, each segment sorted (in operator order already, but for the extra accesses). */
static PyObject *index_ops(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "pilot index_ops: expected 2 arguments");
    return NULL;
  }
  PyObject *ops = PySequence_Fast(args[0], "pilot index_ops: the operators are not a sequence");
  if (ops == NULL) return NULL;
  PyObject *extra = PySequence_Fast(args[1], "pilot index_ops: the extra accesses are not a sequence");
  PyObject *prev_ops = PyDict_New(), *prev_allocs = PyDict_New(), *seen = PyDict_New(), *idx = PyDict_New();
  PyObject *flat = NULL, *start = NULL, *result = NULL;
  ivec pairs = {NULL, 0, 0};
  Py_ssize_t *cnt = NULL;
  char *unsorted = NULL;
  if (extra == NULL || prev_ops == NULL || prev_allocs == NULL || seen == NULL || idx == NULL) goto done;
  Py_ssize_t n_ops = PySequence_Fast_GET_SIZE(ops);
  for (Py_ssize_t j = 0; j < n_ops; j++) {
    PyObject *op = PySequence_Fast_GET_ITEM(ops, j);
    PyObject *name = PyObject_GetAttr(op, a_name), *module = NULL, *phase = NULL, *k = NULL, *k4 = NULL, *jo = NULL,
             *cobj = NULL, *allocs = NULL, *set = NULL;
    int bad = 1;
    if (name == NULL || (module = PyObject_GetAttr(op, a_module)) == NULL ||
        (phase = PyObject_GetAttr(op, a_phase)) == NULL || (k = PyTuple_Pack(3, name, module, phase)) == NULL)
      goto op_done;
    PyObject *c = PyDict_GetItemWithError(seen, k);
    if (c == NULL && PyErr_Occurred()) goto op_done;
    long cv = c == NULL ? 0 : PyLong_AsLong(c);
    if (cv == -1 && PyErr_Occurred()) goto op_done;
    PyObject *c1 = PyLong_FromLong(cv + 1);
    if (c1 == NULL) goto op_done;
    int rc = PyDict_SetItem(seen, k, c1);
    Py_DECREF(c1);
    if (rc < 0 || (cobj = PyLong_FromLong(cv)) == NULL || (k4 = PyTuple_Pack(4, name, module, phase, cobj)) == NULL ||
        (jo = PyLong_FromSsize_t(j)) == NULL || PyDict_SetItem(prev_ops, k4, jo) < 0)
      goto op_done;
    if ((allocs = PyObject_GetAttr(op, a_allocs)) == NULL) goto op_done;
    int any = PyObject_IsTrue(allocs);
    if (any < 0 || (any && PyDict_SetItem(prev_allocs, jo, allocs) < 0)) goto op_done;
    /* {*op.inputs, *op.outputs, *op.writes} */
    PyObject *ins = PyObject_GetAttr(op, a_inputs);
    if (ins == NULL) goto op_done;
    set = PySet_New(ins);
    Py_DECREF(ins);
    if (set == NULL) goto op_done;
    PyObject *const more[2] = {a_outputs, a_writes};
    for (int m = 0; m < 2; m++) {
      PyObject *seq = PyObject_GetAttr(op, more[m]);
      if (seq == NULL) goto op_done;
      PyObject *it = PyObject_GetIter(seq);
      Py_DECREF(seq);
      if (it == NULL) goto op_done;
      PyObject *x;
      while ((x = PyIter_Next(it)) != NULL) {
        rc = PySet_Add(set, x);
        Py_DECREF(x);
        if (rc < 0) break;
      }
      Py_DECREF(it);
      if (PyErr_Occurred()) goto op_done;
    }
    PyObject *it = PyObject_GetIter(set), *sid;
    if (it == NULL) goto op_done;
    while ((sid = PyIter_Next(it)) != NULL) {
      Py_ssize_t i = index_of(idx, sid);
      Py_DECREF(sid);
      if ((i == -1 && PyErr_Occurred()) || ivec_push(&pairs, i, j) < 0) break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) goto op_done;
    bad = 0;
  op_done:
    Py_XDECREF(name);
    Py_XDECREF(module);
    Py_XDECREF(phase);
    Py_XDECREF(k);
    Py_XDECREF(k4);
    Py_XDECREF(jo);
    Py_XDECREF(cobj);
    Py_XDECREF(allocs);
    Py_XDECREF(set);
    if (bad) goto done;
  }
  Py_ssize_t n_main = pairs.n, n_extra = PySequence_Fast_GET_SIZE(extra);
  for (Py_ssize_t e = 0; e < n_extra; e++) {
    PyObject *pair = PySequence_Fast(PySequence_Fast_GET_ITEM(extra, e), "pilot index_ops: an extra access is not a "
                                     "(storage, position) pair");
    if (pair == NULL) goto done;
    if (PySequence_Fast_GET_SIZE(pair) != 2) {
      Py_DECREF(pair);
      PyErr_SetString(PyExc_TypeError, "pilot index_ops: an extra access is not a (storage, position) pair");
      goto done;
    }
    Py_ssize_t i = index_of(idx, PySequence_Fast_GET_ITEM(pair, 0));
    long long j = i == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(PySequence_Fast_GET_ITEM(pair, 1));
    Py_DECREF(pair);
    if (PyErr_Occurred() || ivec_push(&pairs, i, j) < 0) goto done;
  }
  /* a stable counting sort of the (index, position) pairs by index: each segment in the pairs' order */
  Py_ssize_t n = PyDict_GET_SIZE(idx), total = pairs.n / 2;
  cnt = PyMem_Calloc((size_t)n + 1, sizeof(Py_ssize_t));
  unsorted = PyMem_Calloc((size_t)n + 1, 1);
  int64_t *pos_of = PyMem_Malloc(((size_t)total + 1) * sizeof(int64_t));
  if (cnt == NULL || unsorted == NULL || pos_of == NULL) {
    PyMem_Free(pos_of);
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t p = 0; p < pairs.n; p += 2) cnt[pairs.v[p] + 1]++;
  for (Py_ssize_t i = 0; i < n; i++) cnt[i + 1] += cnt[i];
  start = PyList_New(n + 1);
  if (start == NULL) {
    PyMem_Free(pos_of);
    goto done;
  }
  for (Py_ssize_t i = 0; i <= n; i++) {
    PyObject *o = PyLong_FromSsize_t(cnt[i]);
    if (o == NULL) {
      PyMem_Free(pos_of);
      goto done;
    }
    PyList_SET_ITEM(start, i, o);
  }
  for (Py_ssize_t p = 0; p < pairs.n; p += 2) {
    int64_t i = pairs.v[p];
    if (p >= n_main) unsorted[i] = 1; /* Python sorts the lists of the storages with extra accesses */
    pos_of[cnt[i]++] = pairs.v[p + 1];
  }
  /* cnt[i] is now the end of segment i, the start of segment i + 1 */
  for (Py_ssize_t i = 0; i < n; i++) {
    if (!unsorted[i]) continue;
    Py_ssize_t lo = i ? cnt[i - 1] : 0;
    qsort(pos_of + lo, (size_t)(cnt[i] - lo), sizeof(int64_t), cmp_i64);
  }
  flat = PyList_New(total);
  if (flat == NULL) {
    PyMem_Free(pos_of);
    goto done;
  }
  for (Py_ssize_t p = 0; p < total; p++) {
    PyObject *o = PyLong_FromLongLong(pos_of[p]);
    if (o == NULL) {
      PyMem_Free(pos_of);
      goto done;
    }
    PyList_SET_ITEM(flat, p, o);
  }
  PyMem_Free(pos_of);
  result = PyTuple_Pack(6, prev_ops, prev_allocs, seen, idx, flat, start);
done:
  Py_DECREF(ops);
  Py_XDECREF(extra);
  Py_XDECREF(prev_ops);
  Py_XDECREF(prev_allocs);
  Py_XDECREF(seen);
  Py_XDECREF(idx);
  Py_XDECREF(flat);
  Py_XDECREF(start);
  PyMem_Free(pairs.v);
  PyMem_Free(cnt);
  PyMem_Free(unsorted);
  return result;
}

/* access_positions(log) -> (sids, positions): for the forward log's (position, operator) entries, every
 * storage each operator touches in the order of the set {*inputs, *outputs, *writes} (built as that
 * display builds it) and the operator's position beside it, as two buffers of int64 (MirrorState.
 * _build_mirror's flattened lists) */
static PyObject *access_positions(PyObject *self, PyObject *log) {
  (void)self;
  PyObject *seq = PySequence_Fast(log, "pilot access_positions: the log is not a sequence");
  if (seq == NULL) return NULL;
  ivec pairs = {NULL, 0, 0};
  PyObject *result = NULL, *sids = NULL, *pos = NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t j = 0; j < n; j++) {
    PyObject *entry = PySequence_Fast_GET_ITEM(seq, j);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
      PyErr_SetString(PyExc_TypeError, "pilot access_positions: a log entry is not a (position, operator) tuple");
      goto done;
    }
    long long p = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 0));
    if (p == -1 && PyErr_Occurred()) goto done;
    PyObject *op = PyTuple_GET_ITEM(entry, 1);
    PyObject *ins = PyObject_GetAttr(op, a_inputs);
    if (ins == NULL) goto done;
    PyObject *set = PySet_New(ins);
    Py_DECREF(ins);
    if (set == NULL) goto done;
    PyObject *const more[2] = {a_outputs, a_writes};
    for (int m = 0; m < 2 && !PyErr_Occurred(); m++) {
      PyObject *xs = PyObject_GetAttr(op, more[m]), *x;
      PyObject *it = xs ? PyObject_GetIter(xs) : NULL;
      Py_XDECREF(xs);
      if (it == NULL) break;
      while ((x = PyIter_Next(it)) != NULL) {
        int rc = PySet_Add(set, x);
        Py_DECREF(x);
        if (rc < 0) break;
      }
      Py_DECREF(it);
    }
    PyObject *it = PyErr_Occurred() ? NULL : PyObject_GetIter(set), *sid;
    if (it != NULL) {
      while ((sid = PyIter_Next(it)) != NULL) {
        long long v = PyLong_AsLongLong(sid);
        Py_DECREF(sid);
        if ((v == -1 && PyErr_Occurred()) || ivec_push(&pairs, v, p) < 0) break;
      }
      Py_DECREF(it);
    }
    Py_DECREF(set);
    if (PyErr_Occurred()) goto done;
  }
  Py_ssize_t k = pairs.n / 2;
  sids = PyBytes_FromStringAndSize(NULL, k * (Py_ssize_t)sizeof(int64_t));
  pos = sids ? PyBytes_FromStringAndSize(NULL, k * (Py_ssize_t)sizeof(int64_t)) : NULL;
  if (pos == NULL) goto done;
  int64_t *a = (int64_t *)PyBytes_AS_STRING(sids), *b = (int64_t *)PyBytes_AS_STRING(pos);
  for (Py_ssize_t i = 0; i < k; i++) {
    a[i] = pairs.v[2 * i];
    b[i] = pairs.v[2 * i + 1];
  }
  result = PyTuple_Pack(2, sids, pos);
done:
  Py_DECREF(seq);
  Py_XDECREF(sids);
  Py_XDECREF(pos);
  PyMem_Free(pairs.v);
  return result;
}

/* ---- the run's kernel call -------------------------------------------------------------------- */

typedef int64_t (*operators_fn)(const void *state, dynn_batch *batch);

static PyObject *a_announced, *a_frontier, *a_stack_counter;

/* operators(fn, state_table, batch, run, state, first) -> rc: one dynn_pilot_operators call (fn: its
 * address) over run's words, where they are. first: the call's structure is pointed at the run from
 * its first word, no death reported yet, and the kernel's scalars taken from the feature state
 * (_announced, _frontier, _stack_counter); after every call the state takes them back, as
 * PilotPolicy._run_native does around its ctypes call. */
static PyObject *operators(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 6 || !PyObject_TypeCheck(args[3], &RunType)) {
    PyErr_SetString(PyExc_TypeError, "pilot operators: expected (fn, state_table, batch, run, state, first)");
    return NULL;
  }
  void *fp = PyLong_AsVoidPtr(args[0]), *t = PyLong_AsVoidPtr(args[1]);
  dynn_batch *b = (dynn_batch *)PyLong_AsVoidPtr(args[2]);
  if (PyErr_Occurred()) return NULL;
  if (fp == NULL || t == NULL || b == NULL || b->fused == NULL) {
    PyErr_SetString(PyExc_ValueError, "pilot operators: a null kernel, table or batch address");
    return NULL;
  }
  Run *run = (Run *)args[3];
  PyObject *state = args[4];
  int first = PyObject_IsTrue(args[5]);
  if (first < 0) return NULL;
  dynn_fused *f = (dynn_fused *)b->fused;
  if (first) {
    long a = attr_long(state, a_announced), fr = attr_long(state, a_frontier), sc = attr_long(state, a_stack_counter);
    if (PyErr_Occurred()) return NULL;
    b->words = run->w;
    b->n_words = run->n;
    b->at = 0;
    b->n_freed = 0;
    f->announced = a;
    f->frontier = fr;
    f->stack_counter = sc;
  }
  operators_fn fn;
  memcpy(&fn, &fp, sizeof(fn)); /* a data address to a function pointer, as ctypes does */
  int64_t rc = fn(t, b);
  if (set_long(state, a_frontier, (long)f->frontier) < 0 || set_long(state, a_stack_counter, (long)f->stack_counter) < 0 ||
      set_long(state, a_announced, (long)f->announced) < 0)
    return NULL;
  return PyLong_FromLongLong(rc);
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(run, ctx, prev_idx, position, ph, iv, ivk, allocs, prev_allocs, accessed, inputs, outputs, writes) -> "
     "(widest, top): PilotPolicy._pack_run_op in C, into a Run"},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL,
     "walk(events, i, ctx, wctx, prev_idx, run, freed, widest) -> (i, decide, position, tick, widest): "
     "the common events of PilotPolicy._operators_native's loop in C"},
    {"access_positions", (PyCFunction)access_positions, METH_O,
     "access_positions(log) -> (sids, positions): MirrorState._build_mirror's flattened accesses as int64 bytes"},
    {"operators", (PyCFunction)(void (*)(void))operators, METH_FASTCALL,
     "operators(fn, state_table, batch, run, state, first) -> rc: dynn_pilot_operators over a Run's words"},
    {"log_forward", (PyCFunction)(void (*)(void))log_forward, METH_FASTCALL,
     "log_forward(log, position, op): MirrorState's forward log gets the pair (position, op), untracked"},
    {"index_ops", (PyCFunction)(void (*)(void))index_ops, METH_FASTCALL,
     "index_ops(ops, extra) -> (prev_ops, prev_allocs, seen, prev_idx, flat, start): ReplayState._index_ops_py in C"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", "The pilot's per-operator packing in C.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__pack(void) {
  s_alloc = PyUnicode_InternFromString("alloc");
  s_small = PyUnicode_InternFromString("_small");
  s_bytes = PyUnicode_InternFromString("_bytes");
  s_fraction = PyUnicode_InternFromString("fraction");
  s_peak = PyUnicode_InternFromString("_peak");
  minus_one = PyLong_FromLong(-1);
  minus_two = PyLong_FromLong(-2);
  zero = PyLong_FromLong(0);
  one = PyLong_FromLong(1);
  two = PyLong_FromLong(2);
  a_nbytes = PyUnicode_InternFromString("nbytes");
  a_kind = PyUnicode_InternFromString("kind");
  a_saved = PyUnicode_InternFromString("saved");
  s_live = PyUnicode_InternFromString("_live");
  if (!a_nbytes || !a_kind || !a_saved || !s_live) return NULL;
  if (!two || !s_alloc || !s_small || !s_bytes || !s_fraction || !s_peak || !minus_one || !minus_two || !zero || !one)
    return NULL;
  struct { PyObject **p; const char *s; } names[] = {
      {&a_phase, "phase"}, {&a_pending, "_pending"}, {&a_fwd_log, "_fwd_log"}, {&a_fwd_node, "_fwd_node"},
      {&a_node, "node"}, {&a_mirror, "_mirror"}, {&a_decays, "decays"}, {&a_hist_decays, "_hist_decays"},
      {&a_idiom, "idiom"}, {&a_bulk_phase, "_bulk_phase"}, {&a_ops, "ops"}, {&a_allocs, "allocs"}, {&a_name, "name"},
      {&a_module, "module"}, {&a_op_seen, "_op_seen"}, {&a_prev_ops, "_prev_ops"}, {&a_prev_allocs, "_prev_allocs"},
      {&a_anchor, "_anchor"}, {&a_skip, "_skip"}, {&a_grow_due, "_grow_due"}, {&a_position, "position"},
      {&a_hist_allocs, "_hist_allocs"}, {&a_last_decision, "_last_decision"}, {&a_job, "_job"},
      {&a_force_decision, "_force_decision"}, {&a_policy_phase, "_phase"}, {&a_inputs, "inputs"},
      {&a_outputs, "outputs"}, {&a_writes, "writes"}, {&a_live, "_live"}, {&a_relink, "_relink"},
      {&a_mir_first, "_mir_first"}, {&a_mir_index, "_mir_index"}, {&a_log_bytes, "log_bytes"},
      {&a_fwd_freed, "_fwd_freed"}, {&a_announced, "_announced"}, {&a_frontier, "_frontier"},
      {&a_stack_counter, "_stack_counter"}};
  for (size_t j = 0; j < sizeof(names) / sizeof(names[0]); j++)
    if ((*names[j].p = PyUnicode_InternFromString(names[j].s)) == NULL) return NULL;
  if (PyType_Ready(&RunType) < 0) return NULL;
  PyObject *heapq = PyImport_ImportModule("heapq");
  if (heapq == NULL) return NULL;
  heappush = PyObject_GetAttrString(heapq, "heappush");
  Py_DECREF(heapq);
  if (heappush == NULL) return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m != NULL && (PyModule_AddIntConstant(m, "VERSION", 10) /* kernel.PACK_VERSION */ < 0 ||
                    PyModule_AddObjectRef(m, "Run", (PyObject *)&RunType) < 0)) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
