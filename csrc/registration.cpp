// The one place where torch.ops.marlin.* schemas are defined. Backends
// (csrc/cpu, csrc/mps) register implementations with TORCH_LIBRARY_IMPL;
// fake kernels and autograd live in torch_marlin/ops.py.
#include <Python.h>
#include <torch/library.h>

// Importing torch_marlin._C runs the static registrations below.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(marlin, m) {
  m.def(
      "gemm(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? bias, "
      "str weight_format, int group_size) -> Tensor");
  m.def(
      "dequantize(Tensor packed, Tensor scales, Tensor? zeros, str weight_format, "
      "int group_size, ScalarType? dtype=None) -> Tensor");
  m.def("_cpu_kernels() -> str");
  m.def("_metal_plan(str op, Tensor packed, Tensor scales, Tensor? zeros, Tensor? x, Tensor? bias, str weight_format, int group_size, ScalarType? dtype=None) -> str");
}
