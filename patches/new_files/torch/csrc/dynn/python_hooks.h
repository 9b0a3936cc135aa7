#pragma once
// DyNN-Offload: Python bindings torch._C._dynn_* (registration of the native
// fetch hooks and the feature probe). Contract: patches/README.md.

#include <torch/csrc/python_headers.h>

namespace torch::dynn {

// Called once from initModule in torch/csrc/Module.cpp.
void initDynnBindings(PyObject* module);

} // namespace torch::dynn
