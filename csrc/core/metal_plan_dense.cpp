// Metal dispatch of the dense layout (gemm, dequantize): which of
// metal/{gemv,gemm_fused,gemm_tiled,reduce,dequant}.metal to launch, how. Argument
// checks are the CPU op's (core/checks.h), so every backend fails alike.
#include <torch/library.h>

#include <algorithm>

#include "core/checks.h"
#include "core/metal_plan.h"

namespace marlin {
namespace metal {
namespace {

// Argument numbers in the schemas (csrc/registration.cpp).
enum GemmArg { kGemmX = 0, kGemmPacked, kGemmScales, kGemmZeros, kGemmBias };
enum DequantizeArg { kDequantPacked = 0, kDequantScales, kDequantZeros };

// Fused dequant-in-registers GEMM (metal/marlin_gemm_fused.h): M-tile rows.
int64_t fused_tile_m(int64_t m) { return m <= 32 ? 32 : 64; }

Plan plan_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
               c10::string_view weight_format, int64_t group_size) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, std::string(weight_format), group_size);
  check_gemm_inputs(x, bias, packed, s);
  const int64_t m = x.numel() / s.k, n = s.n, k = s.k, kr = s.k / kPackFactor;
  const at::ScalarType dtype = x.scalar_type();
  const bool has_bias = bias.has_value();
  Plan p;
  p.op = "gemm";
  p.outputs = {{"out", {m, n}, dtype}};
  p.result_shape = x.sizes().vec();
  p.result_shape.back() = n;
  p.details = gemm_details(m, n, k, s.group_rows, 1, dtype, s.format, 0);
  if (m == 0) return p;  // empty output, nothing to launch
  // Kernels index with 32-bit sizes and 64-bit offsets: any M, N, K < 2^32.
  u32(m, "M");
  const std::string suffix = std::string(weight_format_name(s.format)) + "_" + dtype_name(dtype);

  // M <= kGemvMaxRows: the decode GEMV (32 columns per threadgroup, all rows of
  // x at once). M <= kFusedMaxRows: fused dequant-in-registers GEMM (TM x 64
  // tiles); larger M: the tiled GEMM (64 x 64 tiles, B dequantized once per
  // stage into threadgroup memory and shared by all four simdgroups).
  const bool gemv = m <= kGemvMaxRows, tiled = m > kFusedMaxRows;
  const int64_t tm = gemv ? m : tiled ? kTiledTileM : fused_tile_m(m);
  const int64_t tile_n = gemv ? kGemvColumns : kGemmTileN;
  const int64_t tiles = ceil_div(n, tile_n) * ceil_div(m, tm);
  const auto [splits, split_rows] =
      gemv ? k_slices(tiles, kr, kGemvMinThreadgroups, kGemvMinSplitRows, kGemvBlockRows)
           : k_slices(tiles, kr, kSplitTargetThreadgroups, kSplitMinK / kPackFactor, kGemmTileK / kPackFactor);

  Launch l;
  if (gemv) {
    l.source = "gemv";
    l.kernel = "marlin_gemv_" + suffix + "_m" + std::to_string(gemv_kernel_rows(static_cast<int>(m)));
    l.threadgroup = {kSimdWidth * kGemvSimdgroups, 1, 1};
    // The GEMV splits its K slice over however many simdgroups it gets (down to one).
    l.min_threads_x = kSimdWidth;
    l.grid = {ceil_div(n, kGemvColumns), splits, 1};
    l.threadgroup_memory = gemv_threadgroup_memory(static_cast<int>(m));
  } else if (tiled) {
    l.source = "gemm_tiled";
    l.kernel = "marlin_gemm_tiled_" + suffix;
    l.threadgroup = {kGemmThreads, 1, 1};
    l.grid = {ceil_div(n, kGemmTileN), ceil_div(m, tm), splits};
    l.threadgroup_memory = tiled_threadgroup_memory(static_cast<int>(dtype_size(dtype)));
  } else {
    l.source = "gemm_fused";
    l.kernel = "marlin_gemm_fused_" + suffix + "_tm" + std::to_string(tm);
    l.threadgroup = {kGemmThreads, 1, 1};
    l.grid = {ceil_div(n, kGemmTileN), ceil_div(m, tm), splits};
    l.threadgroup_memory = fused_threadgroup_memory(static_cast<int>(tm), static_cast<int>(dtype_size(dtype)));
  }
  l.set(kFcHasBias, has_bias && splits == 1);
  l.set(kFcWritePartial, splits > 1);
  l.set(kFcAligned, vector_loads(x, packed, scales, zeros, n));
  l.set(kFcGroupRows, group_rows_constant(group_size));
  l.bindings = {arg(0, kGemmX),     arg(1, kGemmPacked), arg(2, kGemmScales), arg(3, kGemmZeros),
                arg(4, kGemmBias),  output(5),           workspace(6),        scalar(7, m, "M"),
                scalar(8, n, "N"),  scalar(9, k, "K"),   scalar(10, split_rows, "split rows")};
  check_launch(l);
  p.launches.push_back(std::move(l));

  // K split: fp32 partial tiles [splits, M, N], summed by marlin_reduce (the
  // workspace is still bound, but never written, without a split).
  const int64_t partial_floats = splits > 1 ? splits * m * n : 0;
  p.workspaces = {{"partial", {std::max<int64_t>(partial_floats, 4)}, at::kFloat}};
  p.details = gemm_details(m, n, k, s.group_rows, splits, dtype, s.format, partial_floats);
  if (splits > 1) p.launches.push_back(reduce_launch(m, n, splits, dtype, has_bias, kGemmBias));
  return p;
}

Plan plan_dequantize(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                     c10::string_view weight_format, int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, std::string(weight_format), group_size);
  Plan p = dequantize_plan("dequantize", "dequant", "marlin_dequant_", s, group_size, s.k / kPackFactor, dtype);
  p.launches.back().bindings = {arg(0, kDequantPacked), arg(1, kDequantScales), arg(2, kDequantZeros), output(3),
                                scalar(4, s.n, "N"), scalar(5, s.k / kPackFactor, "K/8")};
  return p;
}

}  // namespace

MARLIN_REGISTER_METAL_OP(gemm, plan_gemm)
MARLIN_REGISTER_METAL_OP(dequantize, plan_dequantize)

}  // namespace metal
}  // namespace marlin
