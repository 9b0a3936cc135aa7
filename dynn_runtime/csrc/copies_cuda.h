// A copy between a device block and a pinned host buffer as one cudaMemcpyAsync on a stream
// (copies_cuda.cpp, compiled where heard_cuda.cpp is: torch built with CUDA and CUDA's headers
// found, CMakeLists.txt).
//
// The copy engine moves whole storages into and out of buffers carved from its pool's pinned
// chunks: both sides contiguous bytes. Tensor::copy_ would find that out again for each copy
// (the dispatcher, a TensorIterator) and record an event in the pinned host allocator for the
// chunk, which keeps a chunk from being reused before its copies completed once it is freed. The
// pool frees its chunks only when the manager detaches, after the host waited for every copy
// (MemoryManager.detach: _sync, then HostPool.close), so that event orders nothing here.

#pragma once

#include <c10/core/Stream.h>

#include <cstddef>

namespace dynn::cuda_copy {

// whether copy_async can run: built with CUDA's headers, and the CUDA runtime torch loaded found
// (else it is never called)
bool built();
// n bytes from src to dst on CUDA stream `on` (of the device that owns the device side), issued
// without waiting: both sides must stay valid until the stream passes the copy
void copy_async(void* dst, const void* src, size_t n, const c10::Stream& on);

}  // namespace dynn::cuda_copy
