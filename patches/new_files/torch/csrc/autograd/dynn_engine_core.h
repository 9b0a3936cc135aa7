#pragma once
// DyNN-Offload: the engine-hook protocol core of the patched autograd engine.
// Free of PyTorch includes so dynn-runtime can compile and test it without a
// PyTorch tree. Node-facing glue: torch/csrc/autograd/dynn_engine_hooks.cpp.
//
// Rules (contract in patches/README.md, "Fetch hook" / "Look-ahead hook"):
//  1. note_ready() runs inside ReadyQueue::push with the queue mutex held. It
//     therefore never calls a hook: it only appends (sequence_nr, name) to a
//     bounded ring under the ring's own leaf mutex (oldest dropped, counted).
//  2. before_node() runs on the engine thread that is about to execute the
//     node, with no engine lock held. It first drains the ring into the
//     look-ahead hook, then calls the fetch hook for the node.
//  3. Re-entrancy: while a hook runs on a thread, before_node() on that thread
//     (a backward started from inside the hook) calls no hook.
//  4. Exceptions: a look-ahead hook's exception is swallowed and counted (it
//     is advice). A fetch hook's exception propagates into the engine and
//     fails the backward like an exception in the node itself.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace dynn_native {

constexpr int kEngineProtocolVersion = 1;

struct ReadyNode {
  std::uint64_t sequence_nr;
  std::string name;
};

using FetchHook = std::function<void(std::uint64_t, const std::string&)>;
using LookaheadHook = std::function<void(const std::vector<ReadyNode>&)>;

struct EngineHookStats {
  std::uint64_t fetch_calls = 0;
  std::uint64_t lookahead_calls = 0;
  std::uint64_t lookahead_nodes = 0;
  std::uint64_t dropped = 0; // ring overflow (rule 1)
  std::uint64_t nested_skipped = 0; // rule 3
  std::uint64_t lookahead_errors = 0; // rule 4
};

class EngineHookRegistry {
 public:
  explicit EngineHookRegistry(std::size_t ring_capacity = 256)
      : capacity_(ring_capacity ? ring_capacity : 1) {}

  void set_fetch_hook(FetchHook hook) {
    std::lock_guard<std::mutex> g(mu_);
    fetch_ = hook ? std::make_shared<const FetchHook>(std::move(hook)) : nullptr;
    any_.store(fetch_ || lookahead_);
  }
  void set_lookahead_hook(LookaheadHook hook) {
    std::lock_guard<std::mutex> g(mu_);
    lookahead_ =
        hook ? std::make_shared<const LookaheadHook>(std::move(hook)) : nullptr;
    wants_ready_.store(static_cast<bool>(lookahead_));
    any_.store(fetch_ || lookahead_);
    if (!lookahead_) {
      ring_.clear();
    }
  }
  void clear() {
    set_fetch_hook(nullptr);
    set_lookahead_hook(nullptr);
  }
  bool active() const {
    return any_.load(std::memory_order_acquire);
  }
  bool wants_ready() const {
    return wants_ready_.load(std::memory_order_acquire);
  }

  // Rule 1. `name_fn` is only evaluated when a look-ahead hook is installed.
  template <class NameFn>
  void note_ready(std::uint64_t sequence_nr, NameFn&& name_fn) {
    if (!wants_ready()) {
      return;
    }
    ReadyNode node{sequence_nr, name_fn()};
    std::lock_guard<std::mutex> g(mu_);
    if (ring_.size() >= capacity_) {
      ring_.pop_front();
      stats_.dropped += 1;
    }
    ring_.push_back(std::move(node));
  }

  // Rules 2-4.
  template <class NameFn>
  void before_node(std::uint64_t sequence_nr, NameFn&& name_fn) {
    if (!active()) {
      return;
    }
    if (in_hook()) {
      std::lock_guard<std::mutex> g(mu_);
      stats_.nested_skipped += 1;
      return;
    }
    std::shared_ptr<const FetchHook> fetch;
    std::shared_ptr<const LookaheadHook> lookahead;
    std::vector<ReadyNode> ready;
    {
      std::lock_guard<std::mutex> g(mu_);
      fetch = fetch_;
      lookahead = lookahead_;
      if (lookahead && !ring_.empty()) {
        ready.assign(
            std::make_move_iterator(ring_.begin()),
            std::make_move_iterator(ring_.end()));
        ring_.clear();
      }
    }
    InHook guard;
    if (lookahead && !ready.empty()) {
      bool failed = false;
      try {
        (*lookahead)(ready);
      } catch (...) {
        failed = true;
      }
      std::lock_guard<std::mutex> g(mu_);
      stats_.lookahead_calls += 1;
      stats_.lookahead_nodes += ready.size();
      stats_.lookahead_errors += failed ? 1 : 0;
    }
    if (fetch) {
      {
        std::lock_guard<std::mutex> g(mu_);
        stats_.fetch_calls += 1;
      }
      (*fetch)(sequence_nr, name_fn()); // may throw (rule 4)
    }
  }

  EngineHookStats stats() const {
    std::lock_guard<std::mutex> g(mu_);
    return stats_;
  }
  std::size_t pending() const {
    std::lock_guard<std::mutex> g(mu_);
    return ring_.size();
  }

 private:
  static int& hook_depth() {
    static thread_local int depth = 0;
    return depth;
  }
  static bool in_hook() {
    return hook_depth() > 0;
  }
  struct InHook {
    InHook() {
      hook_depth() += 1;
    }
    ~InHook() {
      hook_depth() -= 1;
    }
  };

  mutable std::mutex mu_; // leaf lock: never held while a hook runs
  std::shared_ptr<const FetchHook> fetch_;
  std::shared_ptr<const LookaheadHook> lookahead_;
  std::atomic<bool> any_{false};
  std::atomic<bool> wants_ready_{false};
  std::size_t capacity_;
  std::deque<ReadyNode> ring_;
  EngineHookStats stats_;
};

} // namespace dynn_native
