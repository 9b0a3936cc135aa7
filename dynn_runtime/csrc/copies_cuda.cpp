// copies_cuda.h's copy as one cudaMemcpyAsync. Compiled with DYNN_HEAR_CUDA (CMakeLists.txt);
// without it built() says no and the engine copies with Tensor::copy_.
//
// cudaMemcpyAsync is looked up in the CUDA runtime torch already loaded (by name, then by its
// soname), never linked: a torch whose runtime cannot be found that way leaves built() false and the
// engine on copy_, rather than an extension that fails to load.

#include "copies_cuda.h"

#ifdef DYNN_HEAR_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <string>
#else
#include <c10/util/Exception.h>
#endif

namespace dynn::cuda_copy {

#ifdef DYNN_HEAR_CUDA
namespace {

using MemcpyAsync = cudaError_t (*)(void*, const void*, size_t, cudaMemcpyKind, cudaStream_t);

MemcpyAsync memcpy_async() {
  static const MemcpyAsync fn = [] {
    void* sym = dlsym(RTLD_DEFAULT, "cudaMemcpyAsync");
    if (sym == nullptr) {  // loaded without RTLD_GLOBAL: the runtime of this header's major version
      const std::string soname = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
      if (void* lib = dlopen(soname.c_str(), RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(lib, "cudaMemcpyAsync");
    }
    return reinterpret_cast<MemcpyAsync>(sym);
  }();
  return fn;
}

}  // namespace

bool built() { return memcpy_async() != nullptr; }

void copy_async(void* dst, const void* src, size_t n, const c10::Stream& on) {
  const c10::cuda::CUDAStream stream(c10::cuda::CUDAStream::UNCHECKED, on);
  const c10::cuda::CUDAGuard guard(stream.device_index());
  C10_CUDA_CHECK(memcpy_async()(dst, src, n, cudaMemcpyDefault, stream.stream()));
}
#else
bool built() { return false; }

void copy_async(void*, const void*, size_t, const c10::Stream&) {
  TORCH_CHECK(false, "dynn_runtime: built without CUDA's headers: no raw CUDA copy");
}
#endif

}  // namespace dynn::cuda_copy
