// Hearing of a CUDA storage's death from the caching allocator, without touching its deleter.
//
// The CUDA caching allocator reports each block it is asked to free to its trace trackers
// (`attachAllocatorTraceTracker`) as a FREE_REQUESTED entry carrying the block's address, which is
// the data pointer of the storage whose data it was. `attach_cuda()` (heard_cuda.cpp, compiled
// where torch was built with CUDA) attaches one tracker per process; a tracker cannot be detached,
// so it records the addresses freed on the listening device only while an observer listens
// (`listen`). The observer maps them back to its entries (events.cpp, invariant 9). Covering
// (covered.h) cannot serve CUDA data: the allocator's recordStream ignores a pointer whose
// deleter is not its own.
//
// The tracker runs on whatever thread frees, with the allocator's lock held: it takes only this
// state's mutex, never the GIL, and nothing holding that mutex calls into the allocator. Its cost
// to every allocation and free in the process is the allocator building the trace entry.
//
// `report` is also how the tests feed the observer's by-address books on the CPU (`_C.report_free`).
// The state is never destroyed: the allocator may free blocks while the process exits.

#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

namespace dynn::heard {

constexpr int kNobody = -2;  // no observer listens (a CPU observer listens as device -1)

struct State {
  std::mutex mu;
  std::vector<uint64_t> freed;  // addresses freed on the listening device since the last take()
  std::atomic<bool> any{false};
  std::atomic<int> device{kNobody};
};

inline State& state() {
  static auto* s = new State();
  return *s;
}

// The allocator (or a test) freed the block at `addr` on device `device`.
inline void report(int device, uint64_t addr) {
  State& st = state();
  if (st.device.load(std::memory_order_relaxed) != device) return;
  std::lock_guard<std::mutex> lock(st.mu);
  st.freed.push_back(addr);
  st.any.store(true, std::memory_order_release);
}

// Records the frees of `device` from now on (kNobody: none, and forgets what was recorded).
inline void listen(int device) {
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.device.store(device, std::memory_order_relaxed);
  if (device == kNobody) {
    st.freed.clear();
    st.any.store(false, std::memory_order_relaxed);
  }
}

inline bool any() { return state().any.load(std::memory_order_acquire); }

// Replaces `out` with the addresses freed since the last call (the two vectors trade buffers).
inline void take(std::vector<uint64_t>& out) {
  out.clear();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  out.swap(st.freed);
  st.any.store(false, std::memory_order_relaxed);
}

// Attaches the process's tracker to the CUDA caching allocator, once; true where it is attached.
// False where torch has no CUDA, where this build was made without CUDA's headers, or where the
// active allocator refuses trackers (the cudaMallocAsync backend).
bool attach_cuda();

// Whether this build can hear CUDA frees at all (heard_cuda.cpp compiled with DYNN_HEAR_CUDA).
bool built();

}  // namespace dynn::heard
