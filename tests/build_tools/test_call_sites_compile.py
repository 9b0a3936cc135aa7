"""The inserted call-site lines type-check in their upstream context.

The patched upstream translation units themselves cannot be compiled here (the stored upstream
versions and the installed torch's headers disagree, and internal headers are not shipped: see
patches/README.md, "What was verified"). So each call site's lines, taken verbatim from
``patches/edits/*.json``, are compiled (``-fsyntax-only``) inside a fragment that declares the
surrounding names with the types and signatures they have in upstream text (commits named in
patches/README.md), against the new headers of ``patches/new_files`` and the installed torch's
headers. A call site that stops matching its hook's declaration fails here.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from build_tools import anchored_edit as ae

ROOT = Path(__file__).resolve().parents[2]
NEW_FILES = ROOT / "patches" / "new_files"
CXX = shutil.which("g++") or shutil.which("c++")


def _torch_include() -> Path | None:
    try:
        import torch
    except ImportError:
        return None
    inc = Path(torch.__file__).parent / "include"
    return inc if (inc / "torch" / "csrc" / "autograd" / "engine.h").is_file() else None


def _lines(edit_id: str) -> str:
    for spec in ae.load_series():
        for e in spec.edits:
            if e.id == edit_id:
                return "\n".join(e.lines)
    raise KeyError(edit_id)


# Upstream context per call site: c10/cuda/CUDACachingAllocator.cpp @ 001074d25084 (DeviceCachingAllocator::malloc
# and NativeCachingAllocator::malloc/free), torch/csrc/autograd/engine.cpp (ReadyQueue::push,
# Engine::evaluate_function), torch/csrc/Module.cpp (initModule).
ALLOCATOR = """
#include <c10/cuda/DynnHooks.h>
#include <cuda_runtime_api.h>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>
namespace harness {
using MempoolId_t = std::pair<unsigned long long, unsigned long long>;
struct GatheredContext {};
struct Block {
  c10::DeviceIndex device; cudaStream_t stream; size_t size; size_t requested_size; void* ptr{nullptr};
};
struct AllocParams {
  c10::DeviceIndex device() const; cudaStream_t stream() const; size_t size() const;
};
struct DeviceCachingAllocator {
  mutable std::recursive_mutex mutex;
  std::vector<std::pair<MempoolId_t, std::function<bool(cudaStream_t)>>> captures_underway;
  bool get_free_block(AllocParams& p);
  bool alloc_block(AllocParams& p, bool isRetry, const std::shared_ptr<GatheredContext>& ctx,
                   std::unique_lock<std::recursive_mutex>& lock);
  bool release_available_cached_blocks(const AllocParams& p, const std::shared_ptr<GatheredContext>& context);
  Block* malloc(c10::DeviceIndex device, size_t orig_size, cudaStream_t stream) {
    auto context = std::shared_ptr<GatheredContext>();
    std::unique_lock<std::recursive_mutex> lock(mutex);
    AllocParams params;
    bool block_found = get_free_block(params);
@RECLAIM@
    return nullptr;
  }
};
struct NativeCachingAllocator {
  std::vector<std::unique_ptr<DeviceCachingAllocator>> device_allocator;
  void malloc(void** devPtr, c10::DeviceIndex device, size_t size, cudaStream_t stream) {
    Block* block = device_allocator[device]->malloc(device, size, stream);
    *devPtr = (void*)block->ptr;
@ALLOC_OBSERVER@
  }
  void free(Block* block) {
@FREE_OBSERVER@
  }
};
}  // namespace harness
"""

ENGINE = """
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/dynn_engine_hooks.h>
namespace harness {
using torch::autograd::Node;
using torch::autograd::NodeTask;
void push(NodeTask item) {
@READY@
}
void evaluate_function(Node* func) {
@FETCH@
}
}  // namespace harness
"""

MODULE = """
#include <torch/csrc/dynn/python_hooks.h>
namespace harness {
PyObject* initModule(PyObject* module) {
@INIT@
  return module;
}
}  // namespace harness
"""

CASES = {
    "allocator": (ALLOCATOR, {"@RECLAIM@": "alloc-reclaim-call-site", "@ALLOC_OBSERVER@": "alloc-observer-call-site",
                              "@FREE_OBSERVER@": "free-observer-call-site"}),
    "engine": (ENGINE, {"@READY@": "engine-ready-call-site", "@FETCH@": "engine-fetch-call-site"}),
    "module": (MODULE, {"@INIT@": "module-init-call-site"}),
}


@pytest.mark.skipif(CXX is None, reason="no C++ compiler (g++) on PATH")
@pytest.mark.skipif(_torch_include() is None, reason="torch headers not installed")
@pytest.mark.parametrize("case", sorted(CASES))
def test_call_site_lines_compile_in_their_upstream_context(case, tmp_path):
    inc = _torch_include()
    cuda = Path("/usr/local/cuda/include")
    if case == "allocator" and not (cuda / "cuda_runtime_api.h").is_file():
        pytest.skip("CUDA headers not installed (/usr/local/cuda/include)")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    template, slots = CASES[case]
    src = template
    for slot, edit_id in slots.items():
        src = src.replace(slot, _lines(edit_id))
    f = tmp_path / f"{case}_call_sites.cpp"
    f.write_text(src)
    cmd = [CXX, "-std=c++17", "-fsyntax-only", "-w", f"-I{NEW_FILES}", f"-I{inc}", f"-I{tmp_path}",
           f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{sysconfig.get_paths()['include']}",
           f"-I{cuda}", "-DUSE_CUDA", str(f)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{case}:\n{proc.stderr[-3000:]}"
