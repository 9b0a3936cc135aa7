// A uint8 tensor over the whole of a storage: what a copy reads or writes when it moves a storage
// (runtime/storages.py's _u8, natively). Made as at::empty + set_ make it (the storage's own
// StorageImpl, offset 0, sizes {nbytes}, strides {1}, the backend's dispatch keys), without their two
// trips through the dispatcher.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/Storage.h>
#include <c10/core/TensorImpl.h>

#include <optional>
#include <utility>

namespace dynn {

inline at::Tensor bytes_of(c10::Storage st) {
  const auto n = static_cast<int64_t>(st.nbytes());
  const c10::DispatchKey key = c10::computeDispatchKey(std::nullopt, at::kStrided, st.device());
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(st), c10::DispatchKeySet(key),
                                                         caffe2::TypeMeta::Make<uint8_t>());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({n});
  return t;
}

}  // namespace dynn
