// Metal dispatch of the dense layout (gemm, dequantize): which of
// metal/{gemv,gemm_fused,gemm_tiled,dequant}.metal to launch, how. Argument
// checks are the CPU op's (core/checks.h), so every backend fails alike.
#include <torch/library.h>

#include <algorithm>
#include <sstream>

#include "core/checks.h"
#include "core/metal_plan.h"

namespace marlin {
namespace metal {
namespace {

// Argument numbers in the schemas (csrc/registration.cpp).
enum GemmArg { kGemmX = 0, kGemmPacked, kGemmScales, kGemmZeros, kGemmBias };
enum DequantizeArg { kDequantPacked = 0, kDequantScales, kDequantZeros };

// Fused dequant-in-registers GEMM (metal/gemm_fused.metal): M-tile rows.
int64_t fused_tile_m(int64_t m) { return m <= 32 ? 32 : 64; }

Plan plan_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
               const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
               c10::string_view weight_format, int64_t group_size) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, std::string(weight_format), group_size);
  check_gemm_inputs(x, bias, packed, s);
  const int64_t m = x.numel() / s.k, n = s.n, k = s.k;
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

  if (m <= kGemvMaxRows) {
    const int64_t mr = m == 1 ? 1 : (m <= 4 ? 4 : 8);
    Launch l;
    l.source = "gemv";
    l.kernel = "marlin_gemv_" + suffix + "_m" + std::to_string(mr);
    l.bool_constants = {{0, has_bias}, {1, false}};
    l.threadgroup = {kSimdWidth * kGemvSimdgroups, 1, 1};
    // The GEMV splits K over however many simdgroups it gets (down to one).
    l.min_threads_x = kSimdWidth;
    l.grid = {ceil_div(n, kGemvColumns), 1, 1};
    l.threadgroup_memory = kGemvSimdgroups * mr * kGemvColumns * 4;
    l.bindings = {arg(0, kGemmX),      arg(1, kGemmPacked), arg(2, kGemmScales),
                  arg(3, kGemmZeros),  arg(4, kGemmBias),   output(5),
                  scalar(6, m, "M"),   scalar(7, n, "N"),   scalar(8, k, "K"),
                  scalar(9, s.group_rows, "group rows")};
    check_launch(l);
    p.launches.push_back(std::move(l));
    return p;
  }

  // M <= kFusedMaxRows: fused dequant-in-registers GEMM (TM x 64 tiles); larger
  // M: the tiled double-buffered GEMM (64 x 64 tiles, B dequantized once per
  // stage into threadgroup memory and shared by all four simdgroups).
  const bool tiled = m > kFusedMaxRows;
  const int64_t tm = tiled ? kTiledTileM : fused_tile_m(m);
  const int64_t tiles = ceil_div(n, kGemmTileN) * ceil_div(m, tm);
  int64_t splits = choose_splits(tiles, k);
  // Packed rows per split: whole pipeline stages (kGemmTileK / 8 rows each).
  const int64_t stage_rows = kGemmTileK / kPackFactor;
  const int64_t split_rows = ceil_div(ceil_div(k / kPackFactor, splits), stage_rows) * stage_rows;
  splits = ceil_div(k / kPackFactor, split_rows);

  Launch l;
  if (tiled) {
    l.source = "gemm_tiled";
    l.kernel = "marlin_gemm_tiled_" + suffix;
    // double-buffered x tile [64][32] (T) + dequantized B tile [32][64] (fp32)
    l.threadgroup_memory = 2 * (kTiledTileM * kGemmTileK * dtype_size(dtype) + kGemmTileK * kGemmTileN * 4);
  } else {
    l.source = "gemm_fused";
    l.kernel = "marlin_gemm_fused_" + suffix + "_tm" + std::to_string(tm);
    l.threadgroup_memory = 2 * tm * kGemmTileK * dtype_size(dtype);  // double-buffered x tile
  }
  l.bool_constants = {{0, has_bias && splits == 1}, {1, splits > 1}};
  l.threadgroup = {kGemmThreads, 1, 1};
  l.grid = {ceil_div(n, kGemmTileN), ceil_div(m, tm), splits};
  l.bindings = {arg(0, kGemmX),     arg(1, kGemmPacked), arg(2, kGemmScales),
                arg(3, kGemmZeros), arg(4, kGemmBias),   output(5),
                workspace(6),       scalar(7, m, "M"),   scalar(8, n, "N"),
                scalar(9, k, "K"),  scalar(10, s.group_rows, "group rows"),
                scalar(11, split_rows, "split rows")};
  check_launch(l);
  p.launches.push_back(std::move(l));

  // K split: fp32 partial tiles [splits, M, N], summed by marlin_reduce (the
  // workspace is still bound, but never written, without a split).
  const int64_t partial_floats = splits > 1 ? splits * m * n : 0;
  p.workspaces = {{"partial", {std::max<int64_t>(partial_floats, 4)}, at::kFloat}};
  p.details = gemm_details(m, n, k, s.group_rows, splits, dtype, s.format, partial_floats);
  if (splits > 1) {
    u32(partial_floats, "workspace size");
    Launch r;
    r.source = "gemm_fused";
    r.kernel = std::string("marlin_reduce_") + dtype_name(dtype);
    r.bool_constants = {{0, has_bias}};
    r.threadgroup = {256, 1, 1};
    r.grid = {ceil_div(m * n, 256), 1, 1};
    r.bindings = {workspace(0), arg(1, kGemmBias), output(2), scalar(3, m, "M"), scalar(4, n, "N"),
                  scalar(5, splits, "splits")};
    check_launch(r);
    p.launches.push_back(std::move(r));
  }
  return p;
}

Plan plan_dequantize(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                     c10::string_view weight_format, int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, std::string(weight_format), group_size);
  const at::ScalarType out = dtype.value_or(at::kHalf);
  TORCH_CHECK(out == at::kHalf || out == at::kBFloat16 || out == at::kFloat,
              "dtype must be float16, bfloat16 or float32, got ", out);
  Plan p;
  p.op = "dequantize";
  p.outputs = {{"out", {s.k, s.n}, out}};
  p.result_shape = {s.k, s.n};
  p.details = gemm_details(0, s.n, s.k, s.group_rows, 1, out, s.format, 0);
  Launch l;
  l.source = "dequant";
  l.kernel = std::string("marlin_dequant_") + weight_format_name(s.format) + "_" + dtype_name(out);
  l.threadgroup = {kDequantColumns, kDequantRows, 1};
  l.grid = {ceil_div(s.n, kDequantColumns), ceil_div(s.k / kPackFactor, kDequantRows), 1};
  l.bindings = {arg(0, kDequantPacked), arg(1, kDequantScales), arg(2, kDequantZeros), output(3),
                scalar(4, s.n, "N"), scalar(5, s.k / kPackFactor, "K/8"), scalar(6, s.group_rows, "group rows")};
  check_launch(l);
  p.launches.push_back(std::move(l));
  return p;
}

}  // namespace

MARLIN_REGISTER_METAL_OP(gemm, plan_gemm)
MARLIN_REGISTER_METAL_OP(dequantize, plan_dequantize)

}  // namespace metal
}  // namespace marlin
