// Hearing of a storage's death without looking: the deleter of its data is wrapped.
//
// `cover(impl)` replaces the deleter of `impl`'s data with `release_cb`, remembering the original
// by the data pointer; `release_cb` records the storage as released (while someone listens) and
// then frees the data with the original deleter, on whatever thread frees it. Covering never
// changes what is freed or when. Only CPU data whose deleter's context is the data pointer itself
// (the CPU allocator's) is wrapped; `cover` returns false for anything else, and the caller finds
// out about those storages some other way. Not CUDA data: the caching allocator's recordStream
// ignores a pointer whose deleter is not its own, so a covered block would be reused while a copy
// on another stream still reads it. `uncover` restores the original deleter.
//
// The state is never destroyed: covered data may be freed while the process exits, after static
// destructors ran.

#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include "flat_map.h"

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace dynn::covered {

struct Original {
  c10::DeleterFnPtr deleter = nullptr;
  c10::StorageImpl* impl = nullptr;
};

struct State {
  std::mutex mu;
  FlatMap<Original> by_data;  // covered data, by the data pointer (never null)
  std::vector<c10::StorageImpl*> released;     // storages whose covered data was released
  std::atomic<bool> any_released{false};
  std::atomic<bool> listening{false};
};

inline uint64_t key(const void* data) { return reinterpret_cast<uintptr_t>(data); }

inline State& state() {
  static auto* s = new State();
  return *s;
}

inline void release_cb(void* ctx) {
  State& st = state();
  c10::DeleterFnPtr original = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    Original* it = st.by_data.find(key(ctx));
    TORCH_INTERNAL_ASSERT(it != nullptr, "dynn: a covered storage's data has no recorded deleter");
    original = it->deleter;
    if (st.listening.load(std::memory_order_relaxed)) {
      st.released.push_back(it->impl);
      st.any_released.store(true, std::memory_order_release);
    }
    st.by_data.erase(key(ctx));
  }
  original(ctx);
}

// Covers `impl`'s data if its deleter can be wrapped; true if it is covered afterwards.
inline bool cover(c10::StorageImpl* impl) {
  c10::DataPtr& dp = impl->_mutable_data_ptr_no_checks();
  void* ctx = dp.get_context();
  const c10::DeleterFnPtr original = dp.get_deleter();
  if (original == &release_cb) return true;
  if (dp.device().type() != c10::DeviceType::CPU) return false;  // recordStream must keep working
  if (ctx == nullptr || ctx != dp.get() || original == nullptr) return false;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.by_data.find(key(ctx)) != nullptr) return false;
  st.by_data.insert(key(ctx), Original{original, impl});
  if (!dp.compare_exchange_deleter(original, &release_cb)) {
    st.by_data.erase(key(ctx));
    return false;
  }
  return true;
}

// Gives `impl`'s data its own deleter back, if it is covered.
inline void uncover(c10::StorageImpl* impl) {
  c10::DataPtr& dp = impl->_mutable_data_ptr_no_checks();
  if (dp.get_deleter() != &release_cb) return;
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  Original* it = st.by_data.find(key(dp.get_context()));
  if (it == nullptr) return;
  if (dp.compare_exchange_deleter(&release_cb, it->deleter)) st.by_data.erase(key(dp.get_context()));
}

// Whether releases are recorded (an observer is started).
inline void listen(bool on) { state().listening.store(on, std::memory_order_relaxed); }

inline bool any_released() { return state().any_released.load(std::memory_order_acquire); }

// Replaces `out` with the storages released since the last call. The two vectors trade buffers,
// so that a caller passing the same one each time allocates only while the batches grow.
inline void take_released(std::vector<c10::StorageImpl*>& out) {
  out.clear();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  out.swap(st.released);
  st.any_released.store(false, std::memory_order_relaxed);
}

}  // namespace dynn::covered
