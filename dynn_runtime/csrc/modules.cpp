// Which module made each autograd node: trace/modules.py's forward post hook, natively.
//
// A module's forward post hook tags the autograd nodes its forward made with the module's interned
// path: a walk from the grad_fn of every tensor in its output along the nodes' next edges, which
// stops at nodes already tagged (an inner module's post hook ran first and tagged its own) and passes
// over AccumulateGrad (a parameter's node belongs to no forward). `tag_nodes` does that walk in C++
// with the tags in the tracker's own dict (autograd sequence number -> module id), which is also what
// stops it, so no node's Python object or metadata dict is made.
//
// Invariant: the tensors `tag_nodes` walks from are exactly those `torch.utils._pytree.tree_flatten`
// finds in the output. It descends only into exact tuples, lists and dicts (pytree's own nodes, whose
// order does not matter here: tagging depends on which nodes are reached, not when) and skips None,
// booleans, numbers and strings; on anything else it returns kUnknown before tagging a node, and the
// caller flattens with pytree and calls again with the flat list, whose items are then leaves.

#include <Python.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <vector>

namespace py = pybind11;

namespace dynn {
namespace {

constexpr int64_t kUnknown = -2;  // an output holds a type the walk does not descend into

// Collects the grad_fn of every tensor in `obj`; false if `obj` holds a container type the walk does
// not know (with `strict`; without it, such an object is a leaf and holds no tensor).
bool collect(PyObject* obj, bool strict, std::vector<torch::autograd::Node*>& roots, int depth) {
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.defined()) {
      if (torch::autograd::Node* fn = t.grad_fn().get()) roots.push_back(fn);
    }
    return true;
  }
  if (obj == Py_None || PyBool_Check(obj) || PyLong_CheckExact(obj) || PyFloat_CheckExact(obj) ||
      PyUnicode_CheckExact(obj)) {
    return true;
  }
  if (depth > 64) return !strict;  // deeper than any output a module returns: let pytree judge it
  if (PyTuple_CheckExact(obj)) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
      if (!collect(PyTuple_GET_ITEM(obj, i), strict, roots, depth + 1)) return false;
    }
    return true;
  }
  if (PyList_CheckExact(obj)) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(obj); i++) {
      if (!collect(PyList_GET_ITEM(obj, i), strict, roots, depth + 1)) return false;
    }
    return true;
  }
  if (PyDict_CheckExact(obj)) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(obj, &pos, &key, &value)) {
      if (!collect(value, strict, roots, depth + 1)) return false;
    }
    return true;
  }
  return !strict;
}

// Tags every node reachable from `output`'s tensors that `tags` does not hold with `mid`; returns the
// largest sequence number tagged (-1: none), or kUnknown (nothing tagged) where `strict` and the
// output holds a type the walk does not descend into.
int64_t tag_nodes(py::handle output, int64_t mid, py::dict tags, bool strict) {
  std::vector<torch::autograd::Node*> stack;
  if (!collect(output.ptr(), strict, stack, 0)) return kUnknown;
  py::int_ value(mid);
  int64_t hi = -1;
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr) continue;
    const uint64_t seq = node->sequence_nr();
    py::int_ key(seq);
    const int held = PyDict_Contains(tags.ptr(), key.ptr());
    if (held < 0) throw py::error_already_set();
    if (held) continue;
    if (PyDict_SetItem(tags.ptr(), key.ptr(), value.ptr()) < 0) throw py::error_already_set();
    if (static_cast<int64_t>(seq) > hi) hi = static_cast<int64_t>(seq);
    for (const torch::autograd::Edge& e : node->next_edges()) {
      if (e.function) stack.push_back(e.function.get());
    }
  }
  return hi;
}

}  // namespace

void define_modules(py::module_& m) {
  m.def("tag_nodes", &tag_nodes, py::arg("output"), py::arg("mid"), py::arg("tags"), py::arg("strict") = true,
        "trace/modules.py: tag the autograd nodes a module's forward made (csrc/modules.cpp)");
}

}  // namespace dynn
