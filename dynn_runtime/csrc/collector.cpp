// What the runtime keeps per operator, taken out of Python's cyclic collector.
//
// In a step the native event source makes an `Op` record per operator (the step's history) and,
// per position, lists of the storage ids freed or first seen there and of the workload's hints.
// They live as long as the history keeps the step, so the young collections promote them to the
// oldest generation, and a full collection follows whenever those promotions reach a quarter of
// what survived the last one. A full collection visits every tracked object of the process (the
// framework's included). Untracked, the records are never visited and never promoted.
//
// Invariant: an object untracked here holds only strings, integers, floats, None and tuples of them
// (an `Op`, a `Hint`, a list of storage ids), so it cannot be part of a reference cycle; its
// references still count, so what it holds lives exactly as long as before. The runtime only ever
// adds integers to such a list. An object later given a container of its own that closes a cycle
// would keep that cycle alive: nothing in the runtime does that.

#include <Python.h>

#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace dynn {
namespace {

// Untracks the items of `seq[start:]` whose type is exactly `type`; returns how many it untracked.
Py_ssize_t untrack_records(py::list seq, Py_ssize_t start, py::handle type) {
  PyObject* list = seq.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  Py_ssize_t done = 0;
  for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
    PyObject* item = PyList_GET_ITEM(list, i);
    if (reinterpret_cast<PyObject*>(Py_TYPE(item)) == type.ptr() && PyObject_GC_IsTracked(item)) {
      PyObject_GC_UnTrack(item);
      done++;
    }
  }
  return done;
}

// Untracks the list `v`'s items whose type is exactly `item_type` (None: none), then `v` itself when
// every item is an integer or such an item. Returns how many objects it untracked.
Py_ssize_t untrack_list(PyObject* v, const py::handle& item_type) {
  if (!PyList_CheckExact(v) || !PyObject_GC_IsTracked(v)) return 0;
  Py_ssize_t done = 0;
  bool atomic = true;
  const Py_ssize_t n = PyList_GET_SIZE(v);
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject* item = PyList_GET_ITEM(v, i);
    if (PyLong_CheckExact(item)) continue;
    if (!item_type.is_none() && reinterpret_cast<PyObject*>(Py_TYPE(item)) == item_type.ptr()) {
      if (PyObject_GC_IsTracked(item)) {
        PyObject_GC_UnTrack(item);
        done++;
      }
      continue;
    }
    atomic = false;
  }
  if (atomic) {
    PyObject_GC_UnTrack(v);
    done++;
  }
  return done;
}

// For each integer key k in [lo, hi] of `table` (a dict of lists): untrack_list(table[k]). Returns
// how many objects it untracked. Reads whichever is shorter, the range or the dict: a step's table
// holds a few positions of thousands, and a step's many short reads each cover a few positions.
Py_ssize_t untrack_lists(py::dict table, Py_ssize_t lo, Py_ssize_t hi, py::handle item_type) {
  PyObject* d = table.ptr();
  const Py_ssize_t size = PyDict_GET_SIZE(d);
  if (size == 0 || hi < lo) return 0;
  Py_ssize_t done = 0;
  if (size < hi - lo + 1) {
    PyObject *key, *v;
    Py_ssize_t i = 0;
    while (PyDict_Next(d, &i, &key, &v)) {
      if (!PyLong_CheckExact(key)) continue;
      int overflow = 0;
      const long long k = PyLong_AsLongLongAndOverflow(key, &overflow);
      if (overflow == 0 && k >= lo && k <= hi) done += untrack_list(v, item_type);
    }
    return done;
  }
  for (Py_ssize_t k = lo; k <= hi; k++) {
    PyObject* key = PyLong_FromSsize_t(k);
    if (key == nullptr) throw py::error_already_set();
    PyObject* v = PyDict_GetItemWithError(d, key);  // borrowed
    Py_DECREF(key);
    if (v == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;
    }
    done += untrack_list(v, item_type);
  }
  return done;
}

}  // namespace

void define_collector(py::module_& m) {
  m.def("untrack_records", &untrack_records, py::arg("seq"), py::arg("start"), py::arg("type"),
        "untrack from the cyclic collector the items of seq[start:] whose type is exactly `type` "
        "(records of atomic values only); returns how many");
  m.def("untrack_lists", &untrack_lists, py::arg("table"), py::arg("lo"), py::arg("hi"),
        py::arg("item_type") = py::none(),
        "untrack the lists table[lo..hi] of integers (and of `item_type` records, untracked too); "
        "returns how many objects");
}

}  // namespace dynn
