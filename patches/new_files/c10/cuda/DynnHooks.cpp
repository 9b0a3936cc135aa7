// DyNN-Offload: allocator hook registry of the patched CUDA caching allocator.
#include <c10/cuda/DynnHooks.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace c10::cuda::dynn {
namespace {

struct ObserverList {
  std::mutex mu; // leaf lock: never held while an observer runs
  std::vector<std::pair<std::uint64_t, std::shared_ptr<const MemoryObserver>>>
      alloc, free;
  std::atomic<bool> any{false};
  std::atomic<std::uint64_t> errors{0};
};

ObserverList& observers() {
  // Leaked on purpose: frees can happen during static destruction.
  static auto* list = new ObserverList();
  return *list;
}

std::atomic<std::uint64_t> next_observer_id{1};

std::uint64_t add_to(
    std::vector<std::pair<std::uint64_t, std::shared_ptr<const MemoryObserver>>>&
        vec,
    MemoryObserver fn) {
  auto& o = observers();
  std::lock_guard<std::mutex> g(o.mu);
  auto id = next_observer_id.fetch_add(1);
  vec.emplace_back(id, std::make_shared<const MemoryObserver>(std::move(fn)));
  o.any.store(true);
  return id;
}

void dispatch(bool is_alloc, const MemoryEvent& ev) {
  auto& o = observers();
  if (!o.any.load(std::memory_order_acquire)) {
    return;
  }
  std::vector<std::shared_ptr<const MemoryObserver>> snapshot;
  {
    std::lock_guard<std::mutex> g(o.mu);
    for (auto& entry : is_alloc ? o.alloc : o.free) {
      snapshot.push_back(entry.second);
    }
  }
  for (auto& fn : snapshot) {
    try {
      (*fn)(ev);
    } catch (...) {
      o.errors.fetch_add(1);
    }
  }
}

} // namespace

dynn_native::ReclaimRegistry& reclaim_registry() {
  static auto* registry = new dynn_native::ReclaimRegistry();
  return *registry;
}

std::uint64_t set_reclaim_hook(ReclaimHook hook) {
  return reclaim_registry().set_hook(std::move(hook));
}
bool clear_reclaim_hook(std::uint64_t token) {
  return reclaim_registry().clear_hook(token);
}
void set_reclaim_max_attempts(int n) {
  reclaim_registry().set_max_attempts(n);
}
ReclaimStats reclaim_stats() {
  return reclaim_registry().stats();
}
std::string reclaim_last_error() {
  return reclaim_registry().last_error();
}

std::uint64_t add_alloc_observer(MemoryObserver fn) {
  return add_to(observers().alloc, std::move(fn));
}
std::uint64_t add_free_observer(MemoryObserver fn) {
  return add_to(observers().free, std::move(fn));
}
bool remove_observer(std::uint64_t id) {
  auto& o = observers();
  std::lock_guard<std::mutex> g(o.mu);
  for (auto* vec : {&o.alloc, &o.free}) {
    for (auto it = vec->begin(); it != vec->end(); ++it) {
      if (it->first == id) {
        vec->erase(it);
        o.any.store(!o.alloc.empty() || !o.free.empty());
        return true;
      }
    }
  }
  return false;
}
std::uint64_t observer_errors() {
  return observers().errors.load();
}

void notify_alloc(const MemoryEvent& ev) {
  dispatch(/*is_alloc=*/true, ev);
}

void notify_free(const MemoryEvent& ev) {
  // Rule 3 of DynnReclaim.h: frees made from inside a reclaim hook count.
  reclaim_registry().note_free(ev.device, ev.block_bytes);
  dispatch(/*is_alloc=*/false, ev);
}

} // namespace c10::cuda::dynn
