/* The pilot's packing of one operator's record for a run of dynn_pilot_operators (kernel ABI: the
 * words of a _BATCH_OP record after its header), in C over the policy's own Python objects.
 *
 * PilotPolicy._pack_run_op (dynn_runtime/pilot/policy.py) is the reference: this module must append
 * the same words to the run, the same (sid, slot) pairs to ``told``, take the same slots from the
 * free list and leave the slot map and the small-storage classes as that Python leaves them, in the
 * same order of reads and writes (tests/pilot/test_pilot_operator.py packs every operator both ways).
 * Every value goes through the Python objects (dict and set lookups, the view's calls, rich
 * comparisons), so no rounding or hashing can differ from the Python path. A Python extension
 * module, not part of the ctypes kernel: it reads dicts and sets, which the kernel never sees. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* the context tuple PilotPolicy._pack_context builds (its order) */
enum { C_SLOT, C_FREE, C_GROW, C_NBYTES, C_KIND, C_SAVED, C_KIND_IDX, C_TEMP, C_SMALL, C_FRACTION, C_CLS_OF,
       C_CLASSIFY, C_N };

static PyObject *s_alloc, *s_small, *s_bytes, *s_fraction, *s_peak, *minus_one, *minus_two, *zero, *one;

static int append_new(PyObject *list, PyObject *v) { /* steals v */
  if (v == NULL) return -1;
  int rc = PyList_Append(list, v);
  Py_DECREF(v);
  return rc;
}

/* pack(run, told, ctx, prev_idx, allocs, prev_allocs, accessed, inputs, outputs, writes)
 *   -> (acc, acc_slots, top) */
static PyObject *pack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  (void)self;
  if (nargs != 10) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: expected 10 arguments");
    return NULL;
  }
  PyObject *run = args[0], *told = args[1], *ctx = args[2], *prev_idx = args[3];
  if (!PyList_Check(run) || !PyList_Check(told) || !PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) != C_N ||
      !PyDict_Check(prev_idx)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: arguments of the wrong types");
    return NULL;
  }
  PyObject *slot = PyTuple_GET_ITEM(ctx, C_SLOT), *free_list = PyTuple_GET_ITEM(ctx, C_FREE),
           *grow = PyTuple_GET_ITEM(ctx, C_GROW), *nbytes_of = PyTuple_GET_ITEM(ctx, C_NBYTES),
           *kind_of = PyTuple_GET_ITEM(ctx, C_KIND), *saved_of = PyTuple_GET_ITEM(ctx, C_SAVED),
           *kind_idx = PyTuple_GET_ITEM(ctx, C_KIND_IDX), *temp = PyTuple_GET_ITEM(ctx, C_TEMP),
           *small = PyTuple_GET_ITEM(ctx, C_SMALL), *cls_of = PyTuple_GET_ITEM(ctx, C_CLS_OF),
           *classify = PyTuple_GET_ITEM(ctx, C_CLASSIFY);
  int fraction = PyObject_IsTrue(PyTuple_GET_ITEM(ctx, C_FRACTION));
  if (fraction < 0) return NULL;
  if (!PyDict_Check(slot) || !PyList_Check(free_list) || !PyDict_Check(kind_idx) || !PyDict_Check(cls_of)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: a context of the wrong types");
    return NULL;
  }
  PyObject *smalls = PyObject_GetAttr(small, s_small);
  if (smalls == NULL) return NULL;
  PyObject *acc = NULL, *acc_slots = NULL, *set = NULL, *sizes = NULL, *thr = NULL, *result = NULL;
  PyObject *allocs = PySequence_Fast(args[4], "pilot pack: the allocations are not a sequence");
  PyObject *prev_allocs = allocs ? PySequence_Fast(args[5], "pilot pack: the previous allocations are not a sequence")
                                 : NULL;
  PyObject *accessed = prev_allocs ? PySequence_Fast(args[6], "pilot pack: the accesses are not a sequence") : NULL;
  if (accessed == NULL) goto done;
  if (!PySet_Check(smalls)) {
    PyErr_SetString(PyExc_TypeError, "pilot pack: the small-storage classes are not a set");
    goto done;
  }
  /* the allocations: eight words each (PilotPolicy._pack_allocs) */
  Py_ssize_t n_alloc = PySequence_Fast_GET_SIZE(allocs), n_prev = PySequence_Fast_GET_SIZE(prev_allocs);
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
    if (PyList_Append(run, s) < 0 || PyList_Append(run, sid) < 0) goto done;
    PyObject *nb = PyObject_CallOneArg(nbytes_of, sid);
    if (nb == NULL) goto done;
    PyObject *kind = PyObject_CallOneArg(kind_of, sid);
    if (kind == NULL) { Py_DECREF(nb); goto done; }
    PyObject *k = PyDict_GetItemWithError(kind_idx, kind);
    Py_DECREF(kind);
    if (k == NULL && PyErr_Occurred()) { Py_DECREF(nb); goto done; }
    if (PyList_Append(run, k != NULL ? k : temp) < 0) { Py_DECREF(nb); goto done; }
    PyObject *saved = PyObject_CallOneArg(saved_of, sid);
    if (saved == NULL) { Py_DECREF(nb); goto done; }
    int sb = PyObject_IsTrue(saved);
    Py_DECREF(saved);
    if (sb < 0 || PyList_Append(run, sb ? one : zero) < 0 || PyList_Append(run, nb) < 0) { Py_DECREF(nb); goto done; }
    PyObject *p = PyDict_GetItemWithError(prev_idx, sid);
    if (p == NULL && PyErr_Occurred()) { Py_DECREF(nb); goto done; }
    if (PyList_Append(run, p != NULL ? p : minus_one) < 0) { Py_DECREF(nb); goto done; }
    if (i < n_prev) {
      p = PyDict_GetItemWithError(prev_idx, PySequence_Fast_GET_ITEM(prev_allocs, i));
      if (p == NULL && PyErr_Occurred()) { Py_DECREF(nb); goto done; }
      if (PyList_Append(run, p != NULL ? p : minus_one) < 0) { Py_DECREF(nb); goto done; }
    } else if (PyList_Append(run, minus_two) < 0) {
      Py_DECREF(nb);
      goto done;
    }
    if (fraction) {
      PyObject *r = PyObject_CallMethodObjArgs(small, s_alloc, sid, nb, NULL);
      Py_DECREF(nb);
      if (append_new(run, r) < 0) goto done;
    } else {
      Py_DECREF(nb);
      int c = PySet_Contains(smalls, sid);
      if (c < 0 || PyList_Append(run, c ? Py_True : Py_False) < 0) goto done;
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
  Py_ssize_t n_acc = PySequence_Fast_GET_SIZE(accessed);
  for (Py_ssize_t i = 0; i < n_acc; i++) {
    PyObject *sid = PySequence_Fast_GET_ITEM(accessed, i);
    PyObject *s = PyDict_GetItemWithError(slot, sid);
    if (s == NULL && PyErr_Occurred()) goto done;
    PyObject *sk;
    if (fraction) { /* SmallStorages.access */
      PyObject *b = PyDict_GetItemWithError(sizes, sid);
      if (b == NULL && PyErr_Occurred()) goto done;
      int lt = PyObject_RichCompareBool(b != NULL ? b : zero, thr, Py_LT);
      if (lt < 0) goto done;
      if (lt ? PySet_Add(smalls, sid) < 0 : PySet_Discard(smalls, sid) < 0) goto done;
      sk = lt ? one : zero;
    } else {
      int c = PySet_Contains(smalls, sid);
      if (c < 0) goto done;
      sk = c ? Py_True : Py_False;
    }
    if (s == NULL) {
      if (PyList_Append(run, minus_one) < 0 || PyList_Append(run, sid) < 0 || PyList_Append(run, zero) < 0 ||
          PyList_Append(run, zero) < 0)
        goto done;
      continue;
    }
    Py_INCREF(s); /* the view's calls below may run code that changes the slot map */
    PyObject *c = PyDict_GetItemWithError(cls_of, sid);
    if (c == NULL) {
      if (PyErr_Occurred()) { Py_DECREF(s); goto done; }
      c = PyObject_CallOneArg(classify, sid);
      if (c == NULL || PyDict_SetItem(cls_of, sid, c) < 0) { Py_XDECREF(c); Py_DECREF(s); goto done; }
      Py_DECREF(c); /* cls_of holds it */
    }
    int rc = PyList_Append(run, s) < 0 || PyList_Append(run, sid) < 0 || PyList_Append(run, sk) < 0 ||
             PyList_Append(run, c) < 0 || PyList_Append(told, sid) < 0 || PyList_Append(told, s) < 0;
    Py_DECREF(s);
    if (rc) goto done;
  }
  /* what the operator touches, in the order of the set {*inputs, *outputs, *writes}, and their slots */
  set = PySet_New(args[7]);
  if (set == NULL) goto done;
  for (int a = 8; a < 10; a++) {
    PyObject *it = PyObject_GetIter(args[a]);
    if (it == NULL) goto done;
    PyObject *x;
    while ((x = PyIter_Next(it)) != NULL) {
      int rc = PySet_Add(set, x);
      Py_DECREF(x);
      if (rc < 0) { Py_DECREF(it); goto done; }
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) goto done;
  }
  acc = PySequence_List(set);
  if (acc == NULL) goto done;
  Py_ssize_t n_set = PyList_GET_SIZE(acc);
  acc_slots = PyList_New(n_set);
  if (acc_slots == NULL) goto done;
  for (Py_ssize_t i = 0; i < n_set; i++) {
    PyObject *s = PyDict_GetItemWithError(slot, PyList_GET_ITEM(acc, i));
    if (s == NULL) {
      if (PyErr_Occurred()) goto done;
      s = minus_one;
    }
    Py_INCREF(s);
    PyList_SET_ITEM(acc_slots, i, s);
    if (PyList_Append(run, s) < 0) goto done;
  }
  result = Py_BuildValue("(OOl)", acc, acc_slots, top);
done:
  Py_DECREF(smalls);
  Py_XDECREF(allocs);
  Py_XDECREF(prev_allocs);
  Py_XDECREF(accessed);
  Py_XDECREF(sizes);
  Py_XDECREF(thr);
  Py_XDECREF(set);
  Py_XDECREF(acc);
  Py_XDECREF(acc_slots);
  return result;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(run, told, ctx, prev_idx, allocs, prev_allocs, accessed, inputs, outputs, writes) -> "
     "(acc, acc_slots, top): PilotPolicy._pack_run_op in C"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", "The pilot's per-operator packing in C.", -1,
                                    methods};

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
  if (!s_alloc || !s_small || !s_bytes || !s_fraction || !s_peak || !minus_one || !minus_two || !zero || !one)
    return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m != NULL && PyModule_AddIntConstant(m, "VERSION", 1) /* kernel.PACK_VERSION */ < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
