// DyNN-Offload: torch._C._dynn_* bindings.
//
// GIL protocol: every trampoline below acquires the GIL itself
// (pybind11::gil_scoped_acquire). The native call sites guarantee that no
// allocator or engine lock is held when a trampoline runs (DynnReclaim.h rule
// 2, dynn_engine_core.h rule 2), so waiting for the GIL cannot deadlock with
// a GIL-holding thread that is itself waiting for one of those locks.

#include <torch/csrc/dynn/python_hooks.h>

#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/dynn_engine_hooks.h>
#include <torch/csrc/utils/pybind.h>

#ifdef USE_CUDA
#include <c10/cuda/DynnHooks.h>
#endif

#include <memory>
#include <string>
#include <vector>

namespace py = pybind11;

namespace torch::dynn {
namespace {

// The series version; bump with any change of a hook's contract.
constexpr const char* kPatchSeries = "dynn-hooks-1";

// A Python callable kept alive by native registries. Its last reference may be
// dropped on any thread, so the deleter takes the GIL (and leaks the object if
// the interpreter is already gone, rather than touching a dead interpreter).
std::shared_ptr<py::object> hold(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete p;
    }
  });
}

// Converts a Python exception to a C++ one while the GIL is still held (the
// error_already_set is destroyed, under the GIL, as the new one propagates).
[[noreturn]] void rethrow_native(py::error_already_set& e, const char* where) {
  throw std::runtime_error(std::string("dynn: ") + where + " raised: " + e.what());
}

py::dict features() {
  py::dict d;
  std::vector<std::string> feats = {"fetch_hook", "lookahead_hook", "sequence_nr"};
#ifdef USE_CUDA
  feats.emplace_back("reclaim_hook");
  feats.emplace_back("alloc_observers");
  d["reclaim_protocol"] = dynn_native::kReclaimProtocolVersion;
#endif
  d["engine_protocol"] = dynn_native::kEngineProtocolVersion;
  d["series"] = kPatchSeries;
  d["features"] = feats;
  return d;
}

} // namespace

void initDynnBindings(PyObject* module) {
  auto m = py::handle(module).cast<py::module>();

  m.def("_dynn_features", &features,
        "Feature probe of the DyNN-Offload patch series (absent on stock torch).");

  // ---- autograd engine -------------------------------------------------
  m.def("_dynn_set_fetch_hook", [](py::object fn) {
    auto& reg = torch::autograd::dynn::engine_hooks();
    if (fn.is_none()) {
      reg.set_fetch_hook(nullptr);
      return;
    }
    auto held = hold(std::move(fn));
    reg.set_fetch_hook([held](std::uint64_t seq, const std::string& name) {
      py::gil_scoped_acquire gil;
      try {
        (*held)(seq, name);
      } catch (py::error_already_set& e) {
        rethrow_native(e, "fetch hook");
      }
    });
  });
  m.def("_dynn_set_lookahead_hook", [](py::object fn) {
    auto& reg = torch::autograd::dynn::engine_hooks();
    if (fn.is_none()) {
      reg.set_lookahead_hook(nullptr);
      return;
    }
    auto held = hold(std::move(fn));
    reg.set_lookahead_hook([held](const std::vector<dynn_native::ReadyNode>& nodes) {
      py::gil_scoped_acquire gil;
      py::list items;
      for (const auto& n : nodes) {
        items.append(py::make_tuple(n.sequence_nr, n.name));
      }
      try {
        (*held)(items);
      } catch (py::error_already_set& e) {
        rethrow_native(e, "look-ahead hook");
      }
    });
  });
  m.def("_dynn_engine_stats", []() {
    auto s = torch::autograd::dynn::engine_hooks().stats();
    py::dict d;
    d["fetch_calls"] = s.fetch_calls;
    d["lookahead_calls"] = s.lookahead_calls;
    d["lookahead_nodes"] = s.lookahead_nodes;
    d["dropped"] = s.dropped;
    d["nested_skipped"] = s.nested_skipped;
    d["lookahead_errors"] = s.lookahead_errors;
    return d;
  });
  // Sequence number the next autograd Node created on this thread will get;
  // a pack hook runs after its Node was constructed, so that Node is peek()-1.
  m.def("_dynn_peek_sequence_nr", []() { return at::sequence_number::peek(); });

#ifdef USE_CUDA
  // ---- CUDA caching allocator -------------------------------------------
  m.def("_dynn_set_reclaim_hook", [](py::object fn) -> std::uint64_t {
    if (fn.is_none()) {
      c10::cuda::dynn::clear_reclaim_hook();
      return 0;
    }
    auto held = hold(std::move(fn));
    return c10::cuda::dynn::set_reclaim_hook(
        [held](const dynn_native::ReclaimRequest& req) -> std::size_t {
          if (!Py_IsInitialized()) {
            return 0;
          }
          py::gil_scoped_acquire gil;
          try {
            py::object freed = (*held)(
                req.device, req.bytes,
                reinterpret_cast<std::uintptr_t>(req.stream), req.attempt);
            return freed.is_none() ? 0 : freed.cast<std::size_t>();
          } catch (py::error_already_set& e) {
            rethrow_native(e, "reclaim hook");
          }
        });
  });
  m.def("_dynn_clear_reclaim_hook", [](std::uint64_t token) {
    return c10::cuda::dynn::clear_reclaim_hook(token);
  }, py::arg("token") = 0);
  m.def("_dynn_set_reclaim_max_attempts", &c10::cuda::dynn::set_reclaim_max_attempts);
  m.def("_dynn_reclaim_stats", []() {
    auto s = c10::cuda::dynn::reclaim_stats();
    py::dict d;
    d["calls"] = s.calls;
    d["recovered"] = s.recovered;
    d["exhausted"] = s.exhausted;
    d["nested_skipped"] = s.nested_skipped;
    d["errors"] = s.errors;
    d["bytes_reported"] = s.bytes_reported;
    d["bytes_observed"] = s.bytes_observed;
    d["last_error"] = c10::cuda::dynn::reclaim_last_error();
    return d;
  });
  auto observer = [](bool is_alloc, py::object fn) -> std::uint64_t {
    auto held = hold(std::move(fn));
    c10::cuda::dynn::MemoryObserver cb = [held](const c10::cuda::dynn::MemoryEvent& ev) {
      if (!Py_IsInitialized()) {
        return;
      }
      py::gil_scoped_acquire gil;
      try {
        (*held)(reinterpret_cast<std::uintptr_t>(ev.ptr), ev.requested_bytes,
                ev.block_bytes, ev.device, reinterpret_cast<std::uintptr_t>(ev.stream));
      } catch (py::error_already_set& e) {
        rethrow_native(e, "memory observer"); // counted by DynnHooks.cpp
      }
    };
    return is_alloc ? c10::cuda::dynn::add_alloc_observer(std::move(cb))
                    : c10::cuda::dynn::add_free_observer(std::move(cb));
  };
  m.def("_dynn_add_alloc_observer", [observer](py::object fn) { return observer(true, std::move(fn)); });
  m.def("_dynn_add_free_observer", [observer](py::object fn) { return observer(false, std::move(fn)); });
  m.def("_dynn_remove_observer", &c10::cuda::dynn::remove_observer);
#endif
}

} // namespace torch::dynn
