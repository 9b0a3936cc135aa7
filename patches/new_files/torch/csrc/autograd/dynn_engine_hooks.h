#pragma once
// DyNN-Offload: fetch and look-ahead hooks of the patched autograd engine.
// Contract: patches/README.md ("Fetch hook", "Look-ahead hook"); protocol
// core: torch/csrc/autograd/dynn_engine_core.h.

#include <torch/csrc/Export.h>
#include <torch/csrc/autograd/dynn_engine_core.h>

namespace torch::autograd {
struct Node;
} // namespace torch::autograd

namespace torch::autograd::dynn {

using dynn_native::EngineHookStats;
using dynn_native::FetchHook;
using dynn_native::LookaheadHook;
using dynn_native::ReadyNode;

TORCH_API dynn_native::EngineHookRegistry& engine_hooks();

// Call site in ReadyQueue::push (queue mutex held; never calls a hook).
TORCH_API void note_ready(const Node* fn);
// Call site in Engine::evaluate_function, right before call_function.
TORCH_API void before_node(Node& fn);

} // namespace torch::autograd::dynn
