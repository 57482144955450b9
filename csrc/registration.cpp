// The one place where torch.ops.marlin.* schemas are defined. Backends
// register implementations with TORCH_LIBRARY_IMPL: CPU in csrc/cpu, MPS
// through the layouts' Metal planners (csrc/core/metal_plan_*.cpp); fake
// kernels and autograd live in torch_marlin/ (torch_marlin/layouts/).
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "core/formats.h"
#include "cpu/decode_engine.h"

namespace {

// The facts of metal/marlin_common.h, for tests/test_shared_constants.py to
// compare with torch_marlin/formats.py.
PyObject* shared_constants() {
  PyObject* formats = PyTuple_New(marlin::kNumWeightFormats);
  PyObject* with_zeros = PyList_New(0);
  for (int i = 0; i < marlin::kNumWeightFormats; ++i) {
    const auto f = static_cast<marlin::WeightFormat>(i);
    PyTuple_SET_ITEM(formats, i, PyUnicode_FromString(marlin::weight_format_name(f)));
    if (marlin::has_zeros(f)) {
      PyObject* name = PyUnicode_FromString(marlin::weight_format_name(f));
      PyList_Append(with_zeros, name);
      Py_DECREF(name);
    }
  }
  PyObject* groups = PyTuple_New(marlin::kNumGroupSizes);
  for (int i = 0; i < marlin::kNumGroupSizes; ++i) PyTuple_SET_ITEM(groups, i, PyLong_FromLong(marlin::kGroupSizes[i]));
  PyObject* zeros_tuple = PyList_AsTuple(with_zeros);
  Py_DECREF(with_zeros);
  // Metal function constants: MSL name -> (index, MSL type).
  PyObject* constants = PyDict_New();
#define MARLIN_FC_ENTRY(e, name, index, type)                    \
  {                                                              \
    PyObject* entry = Py_BuildValue("(is)", index, #type);       \
    PyDict_SetItemString(constants, #name, entry);               \
    Py_DECREF(entry);                                            \
  }
  MARLIN_FOR_EACH_FUNCTION_CONSTANT(MARLIN_FC_ENTRY)
#undef MARLIN_FC_ENTRY
  // Metal tile sizes, for the estimates of benchmarks/bench_mps.py.
  PyObject* tiles = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}", "GEMV_COLUMNS", marlin::kGemvColumns,
                                  "GEMV_SIMDGROUPS", marlin::kGemvSimdgroups, "GEMV_LANE_ROWS",
                                  marlin::kGemvLaneRows, "GEMM_THREADS", marlin::kGemmThreads, "GEMM_TILE_N",
                                  marlin::kGemmTileN, "GEMM_TILE_K", marlin::kGemmTileK, "TILED_TILE_M",
                                  marlin::kTiledTileM, "TILE_PAD_BYTES", marlin::kTilePadBytes);
  return Py_BuildValue("{s:N,s:N,s:N,s:i,s:i,s:N,s:N}", "WEIGHT_FORMATS", formats, "FORMATS_WITH_ZEROS", zeros_tuple,
                       "GROUP_SIZES", groups, "PACK_FACTOR", marlin::kPackFactor, "INT4_OFFSET",
                       marlin::kInt4Offset, "FUNCTION_CONSTANTS", constants, "METAL_TILES", tiles);
}

// An op with Metal kernels also gets `_metal_plan_<name>`: the same arguments,
// returning the dispatch plan as JSON (torch_marlin.testing.run_metal); a
// `checked` one (its plan has a status output) `_metal_check_<name>`: the
// status, then the same arguments; raises if the status says bad input.
void def_metal_op(torch::Library& m, const std::string& name, const std::string& arguments,
                  const std::string& returns, bool checked = false) {
  m.def((name + arguments + " -> " + returns).c_str());
  m.def(("_metal_plan_" + name + arguments + " -> str").c_str());
  if (checked) m.def(("_metal_check_" + name + "(Tensor status, " + arguments.substr(1) + " -> ()").c_str());
}

}  // namespace

// Importing torch_marlin._C runs the static registrations below.
PyMODINIT_FUNC PyInit__C(void) {  // PyMODINIT_FUNC is extern "C" in C++
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module && PyModule_AddObject(module, "SHARED_CONSTANTS", shared_constants()) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

TORCH_LIBRARY(marlin, m) {
  // Dense layout (torch_marlin/layouts/dense.py, docs/FORMAT.md).
  def_metal_op(m, "gemm",
               "(Tensor x, Tensor packed, Tensor scales, Tensor? zeros, Tensor? bias, str weight_format, "
               "int group_size)",
               "Tensor");
  def_metal_op(m, "dequantize",
               "(Tensor packed, Tensor scales, Tensor? zeros, str weight_format, int group_size, "
               "ScalarType? dtype=None)",
               "Tensor");
  // Expert-stack layout (torch_marlin/layouts/experts.py, docs/FORMAT.md): rows of
  // T tokens routed to their top_k experts, each times that expert's matrix.
  def_metal_op(m, "moe_gemm",
               "(Tensor x, Tensor expert_ids, Tensor? topk_weights, Tensor packed, Tensor scales, Tensor? zeros, "
               "Tensor? bias, str weight_format, int group_size)",
               "Tensor");
  // Its backward for x: grad [T, top_k, N] of each routed row times its expert's B^T.
  // One opaque op, so that traced backward graphs do not see the per-expert loop
  // (implemented in Python on the dense dequantize op, torch_marlin/layouts/experts.py).
  m.def("_moe_gemm_grad_x(Tensor grad, Tensor expert_ids, Tensor packed, Tensor scales, Tensor? zeros, "
        "str weight_format, int group_size) -> Tensor");
  // What the MPS bridge decides from the device and its pipelines
  // (csrc/core/metal_plan.cpp), exposed so run_metal and the tests apply the same rules.
  m.def("_metal_fit_threadgroup(str kernel, int[] threadgroup, int min_threads_x, int max_threads, "
        "int thread_execution_width=32) -> int[]");
  m.def("_metal_support_problem(int macos_major, int macos_minor, bool apple7_gpu) -> str");
  // 2:4 sparse layout (torch_marlin/layouts/sparse24.py, docs/FORMAT.md).
  def_metal_op(m, "sparse24_gemm",
               "(Tensor x, Tensor values, Tensor metadata, Tensor scales, Tensor? zeros, Tensor? bias, "
               "str weight_format, int group_size)",
               "Tensor");
  def_metal_op(m, "sparse24_dequantize",
               "(Tensor values, Tensor metadata, Tensor scales, Tensor? zeros, str weight_format, "
               "int group_size, ScalarType? dtype=None)",
               "Tensor");
  // Entropy-coded layout (docs/FORMAT.md, issue 23): rANS streams of 32 lanes per
  // column block and chunk_k rows per chunk. rans_decode gives the symbols uint8
  // [K, N] (a corrupt stream raises, on MPS too); rans_gemm decodes fused into the
  // matmul (the weight is never stored; on MPS a corrupt chunk's outputs are NaN):
  // weight_format is a value format (lossless: the dense op's result for the same
  // codes, scales, zeros), "grid" (value (s - 128) * scales[0, n]) or "tcq" (the grid's
  // symbols read through a 4-state trellis per lane: docs/FORMAT.md).
  def_metal_op(m, "rans_decode",
               "(Tensor words, Tensor word_offsets, Tensor states, Tensor freqs, int K, int N, int chunk_k, "
               "int prob_bits)",
               "Tensor", /*checked=*/true);
  def_metal_op(m, "rans_gemm",
               "(Tensor x, Tensor words, Tensor word_offsets, Tensor states, Tensor freqs, Tensor scales, "
               "Tensor? zeros, Tensor? bias, str weight_format, int K, int chunk_k, int prob_bits, int group_size)",
               "Tensor");
  // Internal: the built-in quantizers of torch_marlin/quantize.py (CPU), dense and 2:4 (sparsity.py).
  m.def(
      "_quantize_weight(Tensor weight, str weight_format, int group_size, float[] clip_ratios, "
      "int rounds) -> (Tensor packed, Tensor scales, Tensor zeros, Tensor sums)");
  m.def(
      "_quantize_weight_sparse24(Tensor weight, str weight_format, int group_size, float[] clip_ratios, "
      "int rounds, Tensor? scores=None) -> (Tensor values, Tensor metadata, Tensor scales, Tensor zeros, "
      "Tensor sums)");
  // Internal: which CPU kernel builds this machine runs and which one was chosen (JSON).
  m.def("_cpu_kernels() -> str");
  // Internal: whether CPU GEMVs quantize x to int8 blocks (docs/CPU.md); sets it when
  // given, returns the setting before the call.
  m.def("_cpu_int8_activations(bool? enabled=None) -> bool");
  // The whole-token CPU decode engine of Llama-family models (csrc/cpu/decode_engine.h,
  // torch_marlin/cpu_decoder.py builds it from a transformers model).
  using marlin::cpu::DecodeEngine;
  m.class_<DecodeEngine>("CpuDecodeEngine")
      .def(torch::init<std::vector<int64_t>, double>())
      .def("set_float", &DecodeEngine::set_float)
      .def("set_linear", &DecodeEngine::set_linear)
      .def("finish", &DecodeEngine::finish)
      .def("reset", &DecodeEngine::reset)
      .def("position", &DecodeEngine::position)
      .def("step", &DecodeEngine::step)
      .def("kernel_build", &DecodeEngine::kernel_build)
      .def("time_gemvs", &DecodeEngine::time_gemvs)
      .def("gemv_seconds", &DecodeEngine::gemv_seconds);
}
