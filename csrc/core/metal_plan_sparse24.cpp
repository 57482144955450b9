// Metal dispatch of the 2:4 sparse layout (sparse24_gemm, sparse24_dequantize):
// which of metal/sparse24_{gemv,gemm,dequant}.metal to launch, how. Argument
// checks are the CPU op's (core/sparse24_checks.h). The K split and its
// reduction (marlin_reduce, metal/marlin_reduce.h) are the dense GEMMs'.
#include <torch/library.h>

#include <algorithm>

#include "core/metal_plan.h"
#include "core/sparse24_checks.h"

namespace marlin {
namespace metal {
namespace {

// Argument numbers in the schemas (csrc/registration.cpp).
enum GemmArg { kGemmX = 0, kGemmValues, kGemmMetadata, kGemmScales, kGemmZeros, kGemmBias };
enum DequantizeArg { kDequantValues = 0, kDequantMetadata, kDequantScales, kDequantZeros };

Plan plan_sparse24_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& metadata,
                        const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                        const c10::optional<at::Tensor>& bias, c10::string_view weight_format, int64_t group_size) {
  const QuantizedShape s = check_sparse24(values, metadata, scales, zeros, std::string(weight_format), group_size);
  check_sparse24_gemm_inputs(x, bias, values, s);
  const int64_t m = x.numel() / s.k, n = s.n, k = s.k;
  const at::ScalarType dtype = x.scalar_type();
  const bool has_bias = bias.has_value();
  Plan p;
  p.op = "sparse24_gemm";
  p.outputs = {{"out", {m, n}, dtype}};
  p.result_shape = x.sizes().vec();
  p.result_shape.back() = n;
  p.details = gemm_details(m, n, k, s.group_rows, 1, dtype, s.format, 0);
  if (m == 0) return p;
  u32(m, "M");
  const std::string suffix = std::string(weight_format_name(s.format)) + "_" + dtype_name(dtype);

  // Vector loads of x, values, metadata and params (N % 4 == 0, 16-byte aligned offsets).
  const bool aligned = vector_loads(x, values, scales, zeros, n) && aligned16(metadata);
  const bool gemv = m <= kGemvMaxRows;
  const int64_t tm = gemv ? gemv_kernel_rows(static_cast<int>(m)) : (m <= 32 ? 32 : 64);
  const int64_t tiles = gemv ? ceil_div(n, kGemvColumns) : ceil_div(n, kGemmTileN) * ceil_div(m, tm);
  // K split as the dense kernels, in values rows: the GEMV in whole 8-row blocks (128 K, a simdgroup's
  // step), at least one per planned simdgroup; the GEMM in whole 32-deep stages (2 values rows, one
  // metadata row).
  constexpr int64_t kGemvBlockValueRows = kGemvBlockRows * kPackFactor / kSparseValueRows;
  const auto [splits, split_rows] =
      gemv ? k_slices(tiles, k / kSparseValueRows, kGemvMinThreadgroups, kGemvSimdgroups * kGemvBlockValueRows,
                      kGemvBlockValueRows)
           : k_slices(tiles, k / kSparseValueRows, kSplitTargetThreadgroups, kSplitMinK / kSparseValueRows,
                      kSparseGemmTileK / kSparseValueRows);

  Launch l;
  if (gemv) {
    l.source = "sparse24_gemv";
    l.kernel = "marlin_sparse24_gemv_" + suffix + "_m" + std::to_string(tm);
    l.threadgroup = {kSimdWidth * kGemvSimdgroups, 1, 1};
    l.min_threads_x = kSimdWidth;  // splits K over however many simdgroups it gets
    l.grid = {ceil_div(n, kGemvColumns), splits, 1};
    l.threadgroup_memory = gemv_threadgroup_memory(static_cast<int>(tm));
  } else {
    // Fragments decoded in registers for every M > 8: TM x 64 tiles (TM 32 or 64).
    l.source = "sparse24_gemm";
    l.kernel = "marlin_sparse24_gemm_" + suffix + "_tm" + std::to_string(tm);
    l.threadgroup = {kGemmThreads, 1, 1};
    l.grid = {ceil_div(n, kGemmTileN), ceil_div(m, tm), splits};
    l.threadgroup_memory = sparse_gemm_threadgroup_memory(static_cast<int>(tm), static_cast<int>(dtype_size(dtype)));
  }
  l.set(kFcHasBias, has_bias && splits == 1);
  l.set(kFcWritePartial, splits > 1);
  l.set(kFcGroupRows, group_rows_constant(group_size));
  l.set(kFcAligned, aligned);
  l.bindings = {arg(0, kGemmX),          arg(1, kGemmValues), arg(2, kGemmMetadata), arg(3, kGemmScales),
                arg(4, kGemmZeros),      arg(5, kGemmBias),   output(6),             workspace(7),
                scalar(8, m, "M"),       scalar(9, n, "N"),   scalar(10, k, "K"),    scalar(11, split_rows, "split rows")};
  check_launch(l);
  p.launches.push_back(std::move(l));

  const int64_t partial_floats = splits > 1 ? splits * m * n : 0;
  p.workspaces = {{"partial", {std::max<int64_t>(partial_floats, 4)}, at::kFloat}};
  p.details = gemm_details(m, n, k, s.group_rows, splits, dtype, s.format, partial_floats);
  if (splits > 1) p.launches.push_back(reduce_launch(m, n, splits, dtype, has_bias, kGemmBias));
  return p;
}

Plan plan_sparse24_dequantize(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, c10::string_view weight_format,
                              int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const QuantizedShape s = check_sparse24(values, metadata, scales, zeros, std::string(weight_format), group_size);
  const int64_t value_rows = s.k / kSparseValueRows;
  Plan p = dequantize_plan("sparse24_dequantize", "sparse24_dequant", "marlin_sparse24_dequant_", s, group_size,
                           value_rows, dtype);
  p.launches.back().bindings = {arg(0, kDequantValues), arg(1, kDequantMetadata), arg(2, kDequantScales),
                                arg(3, kDequantZeros),  output(4),
                                scalar(5, s.n, "N"),     scalar(6, value_rows, "K/16")};
  return p;
}

}  // namespace

MARLIN_REGISTER_METAL_OP(sparse24_gemm, plan_sparse24_gemm)
MARLIN_REGISTER_METAL_OP(sparse24_dequantize, plan_sparse24_dequantize)

}  // namespace metal
}  // namespace marlin
