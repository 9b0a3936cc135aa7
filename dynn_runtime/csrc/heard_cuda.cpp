// The CUDA caching allocator's trace tracker that feeds heard.h. Compiled with DYNN_HEAR_CUDA where
// the installed torch has CUDA (libc10_cuda) and CUDA's headers are found (CMakeLists.txt); without
// it, attach_cuda() says no and the observer sweeps for CUDA storages' deaths instead.

#include "heard.h"

#ifdef DYNN_HEAR_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

#include <exception>
#include <mutex>
#endif

namespace dynn::heard {

#ifdef DYNN_HEAR_CUDA
bool attach_cuda() {
  static std::once_flag once;
  static bool attached = false;
  std::call_once(once, [] {
    namespace alloc = c10::cuda::CUDACachingAllocator;
    try {
      alloc::attachAllocatorTraceTracker([](const alloc::TraceEntry& te) {
        if (te.action_ == alloc::TraceEntry::FREE_REQUESTED)
          report(static_cast<int>(te.device_), static_cast<uint64_t>(te.addr_));
      });
      attached = true;
    } catch (const std::exception&) {
      attached = false;  // an allocator without trackers: the observer sweeps instead
    }
  });
  return attached;
}
bool built() { return true; }
#else
bool attach_cuda() { return false; }
bool built() { return false; }
#endif

}  // namespace dynn::heard
