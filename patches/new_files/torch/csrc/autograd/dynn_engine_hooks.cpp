// DyNN-Offload: engine call-site glue (Node -> protocol core).
#include <torch/csrc/autograd/dynn_engine_hooks.h>

#include <torch/csrc/autograd/function.h>

namespace torch::autograd::dynn {

dynn_native::EngineHookRegistry& engine_hooks() {
  // Leaked on purpose: engine threads may outlive static destruction.
  static auto* registry = new dynn_native::EngineHookRegistry();
  return *registry;
}

void note_ready(const Node* fn) {
  if (fn == nullptr) {
    return; // dummy task that only wakes a worker up
  }
  engine_hooks().note_ready(fn->sequence_nr(), [fn] { return fn->name(); });
}

void before_node(Node& fn) {
  engine_hooks().before_node(fn.sequence_nr(), [&fn] { return fn.name(); });
}

} // namespace torch::autograd::dynn
