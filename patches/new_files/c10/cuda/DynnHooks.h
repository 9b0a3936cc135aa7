#pragma once
// DyNN-Offload: allocator hooks of the patched CUDA caching allocator.
// Contract: patches/README.md of dynn-runtime ("Reclaim hook", "Allocation
// observers"). The protocol core is c10/cuda/DynnReclaim.h.

#include <c10/core/Device.h>
#include <c10/cuda/CUDAMacros.h>
#include <c10/cuda/DynnReclaim.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace c10::cuda::dynn {

using dynn_native::ReclaimHook;
using dynn_native::ReclaimRequest;
using dynn_native::ReclaimStats;

// One allocation or free, as seen by an observer. `stream` is the
// cudaStream_t of the allocation, passed opaquely.
struct MemoryEvent {
  void* ptr;
  std::size_t requested_bytes; // what the caller asked for
  std::size_t block_bytes; // what the allocator reserved for it (rounded)
  c10::DeviceIndex device;
  void* stream;
};
using MemoryObserver = std::function<void(const MemoryEvent&)>;

// --- registration (called from Python bindings; thread-safe) -------------
C10_CUDA_API std::uint64_t set_reclaim_hook(ReclaimHook hook);
C10_CUDA_API bool clear_reclaim_hook(std::uint64_t token = 0);
C10_CUDA_API void set_reclaim_max_attempts(int n);
C10_CUDA_API ReclaimStats reclaim_stats();
C10_CUDA_API std::string reclaim_last_error();
// Observers are called outside the allocator mutex, on the allocating or
// freeing thread, and must not throw (an exception is dropped and counted).
C10_CUDA_API std::uint64_t add_alloc_observer(MemoryObserver fn);
C10_CUDA_API std::uint64_t add_free_observer(MemoryObserver fn);
C10_CUDA_API bool remove_observer(std::uint64_t id);
C10_CUDA_API std::uint64_t observer_errors();

// --- call sites in CUDACachingAllocator.cpp --------------------------------
C10_CUDA_API dynn_native::ReclaimRegistry& reclaim_registry();
C10_CUDA_API void notify_alloc(const MemoryEvent& ev);
C10_CUDA_API void notify_free(const MemoryEvent& ev);

// DeviceCachingAllocator::malloc calls this after its own recovery failed,
// with its held lock; `retry` re-runs the allocation under the lock.
template <class Lock, class Retry>
bool reclaim_and_retry(
    c10::DeviceIndex device,
    std::size_t bytes,
    void* stream,
    Lock& lock,
    Retry&& retry) {
  ReclaimRequest req;
  req.device = device;
  req.bytes = bytes;
  req.stream = stream;
  return dynn_native::reclaim_and_retry(
      reclaim_registry(), req, lock, std::forward<Retry>(retry));
}

} // namespace c10::cuda::dynn
