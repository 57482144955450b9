#include "core/metal_plan.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <sstream>

namespace marlin {
namespace metal {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

const char* format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFp4: return "fp4";
    case WeightFormat::kUint4: return "uint4";
    case WeightFormat::kInt4: return "int4";
  }
  return "?";
}

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    case at::kFloat: return "f32";
    default: TORCH_CHECK(false, "Metal kernels support float16, bfloat16 and float32, got ", t);
  }
}

int64_t dtype_size(at::ScalarType t) { return t == at::kFloat ? 4 : 2; }

uint32_t u32(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= int64_t(UINT32_MAX), what, " = ", v, " does not fit the Metal kernels' 32-bit sizes");
  return static_cast<uint32_t>(v);
}

void check_launch(const Launch& l) {
  TORCH_INTERNAL_ASSERT(l.threadgroup_memory % 16 == 0 && l.threadgroup_memory <= kMaxThreadgroupMemory,
                        l.kernel, ": threadgroup memory ", l.threadgroup_memory);
  TORCH_INTERNAL_ASSERT(l.threadgroup[0] * l.threadgroup[1] * l.threadgroup[2] <= 1024, l.kernel);
  for (int64_t g : l.grid) TORCH_INTERNAL_ASSERT(g >= 1 && g <= int64_t(UINT32_MAX), l.kernel, ": grid");
}

// Fused dequant-in-registers GEMM (metal/gemm_fused.metal): M-tile rows.
int64_t gemm_tile_m(int64_t m) { return m <= 32 ? 32 : 64; }

// Number of K slices so that few output tiles still fill the GPU.
int64_t choose_splits(int64_t tiles, int64_t k) {
  if (tiles >= kSplitTargetThreadgroups) return 1;
  const int64_t want = ceil_div(kSplitTargetThreadgroups, tiles);
  return std::max<int64_t>(1, std::min({want, k / kSplitMinK, kSplitMax}));
}

}  // namespace

const char* arg_name(Arg arg) {
  switch (arg) {
    case Arg::kX: return "x";
    case Arg::kPacked: return "packed";
    case Arg::kScales: return "scales";
    case Arg::kZeros: return "zeros";
    case Arg::kBias: return "bias";
    case Arg::kOut: return "out";
    case Arg::kPartial: return "partial";
    case Arg::kScalar: return "scalar";
  }
  return "?";
}

// A plan with its problem filled in and no launches yet.
static Plan empty_plan(const char* op, int64_t m, int64_t n, int64_t k, WeightFormat format, at::ScalarType dtype,
                       int64_t group_rows) {
  Plan p;
  p.op = op;
  p.m = m;
  p.n = n;
  p.k = k;
  p.group_rows = group_rows;
  p.dtype = dtype;
  p.format = format;
  return p;
}

Plan plan_dequantize(int64_t n, int64_t k, WeightFormat format, at::ScalarType dtype,
                     int64_t group_rows) {
  Plan p = empty_plan("dequantize", 0, n, k, format, dtype, group_rows);
  Launch l;
  l.source = "dequant";
  l.kernel = std::string("marlin_dequant_") + format_name(format) + "_" + dtype_name(dtype);
  l.threadgroup = {32, 4, 1};
  l.grid = {ceil_div(n, 32), ceil_div(k / 8, 4), 1};
  l.bindings = {{0, Arg::kPacked},
                {1, Arg::kScales},
                {2, Arg::kZeros},
                {3, Arg::kOut},
                {4, Arg::kScalar, u32(n, "N")},
                {5, Arg::kScalar, u32(k / 8, "K/8")},
                {6, Arg::kScalar, u32(group_rows, "group rows")}};
  check_launch(l);
  p.launches.push_back(std::move(l));
  return p;
}

Plan plan_gemm(int64_t m, int64_t n, int64_t k, WeightFormat format, at::ScalarType dtype,
               int64_t group_rows, bool has_bias) {
  Plan p = empty_plan("gemm", m, n, k, format, dtype, group_rows);
  if (m == 0) return p;  // empty output, nothing to launch
  // Kernels index with 32-bit sizes and 64-bit offsets: any M, N, K < 2^32.
  u32(m, "M");
  const std::string suffix = std::string(format_name(format)) + "_" + dtype_name(dtype);

  if (m <= kGemvMaxRows) {
    const int64_t mr = m == 1 ? 1 : (m <= 4 ? 4 : 8);
    Launch l;
    l.source = "gemv";
    l.kernel = "marlin_gemv_" + suffix + "_m" + std::to_string(mr);
    l.bool_constants = {{0, has_bias}, {1, false}};
    l.threadgroup = {32 * kGemvSimdgroups, 1, 1};
    l.grid = {ceil_div(n, 32), 1, 1};
    l.threadgroup_memory = kGemvSimdgroups * mr * 32 * 4;
    l.bindings = {{0, Arg::kX},     {1, Arg::kPacked}, {2, Arg::kScales},
                  {3, Arg::kZeros}, {4, Arg::kBias},   {5, Arg::kOut},
                  {6, Arg::kScalar, u32(m, "M")},      {7, Arg::kScalar, u32(n, "N")},
                  {8, Arg::kScalar, u32(k, "K")},      {9, Arg::kScalar, u32(group_rows, "group rows")}};
    check_launch(l);
    p.launches.push_back(std::move(l));
    return p;
  }

  // M <= 64: fused dequant-in-registers GEMM (TM x 64 tiles); larger M: the
  // tiled double-buffered GEMM (64 x 64 tiles, B dequantized once per stage
  // into threadgroup memory and shared by all four simdgroups).
  const bool tiled = m > kFusedMaxRows;
  const int64_t tm = tiled ? 64 : gemm_tile_m(m);
  const int64_t tiles = ceil_div(n, kGemmTileN) * ceil_div(m, tm);
  int64_t splits = choose_splits(tiles, k);
  // Packed rows per split: whole pipeline stages (kGemmTileK / 8 rows each).
  const int64_t stage_rows = kGemmTileK / 8;
  const int64_t split_rows = ceil_div(ceil_div(k / 8, splits), stage_rows) * stage_rows;
  splits = ceil_div(k / 8, split_rows);
  p.splits = splits;

  Launch l;
  if (tiled) {
    l.source = "gemm_tiled";
    l.kernel = "marlin_gemm_tiled_" + suffix;
    // double-buffered x tile [64][32] (T) + dequantized B tile [32][64] (fp32)
    l.threadgroup_memory = 2 * (64 * kGemmTileK * dtype_size(dtype) + kGemmTileK * kGemmTileN * 4);
  } else {
    l.source = "gemm_fused";
    l.kernel = "marlin_gemm_fused_" + suffix + "_tm" + std::to_string(tm);
    l.threadgroup_memory = 2 * tm * kGemmTileK * dtype_size(dtype);  // double-buffered x tile
  }
  l.bool_constants = {{0, has_bias && splits == 1}, {1, splits > 1}};
  l.threadgroup = {128, 1, 1};
  l.grid = {ceil_div(n, kGemmTileN), ceil_div(m, tm), splits};
  l.bindings = {{0, Arg::kX},      {1, Arg::kPacked}, {2, Arg::kScales},
                {3, Arg::kZeros},  {4, Arg::kBias},   {5, Arg::kOut},
                {6, Arg::kPartial},
                {7, Arg::kScalar, u32(m, "M")},      {8, Arg::kScalar, u32(n, "N")},
                {9, Arg::kScalar, u32(k, "K")},      {10, Arg::kScalar, u32(group_rows, "group rows")},
                {11, Arg::kScalar, u32(split_rows, "split rows")}};
  check_launch(l);
  p.launches.push_back(std::move(l));

  if (splits > 1) {
    p.partial_floats = splits * m * n;
    u32(p.partial_floats, "workspace size");
    Launch r;
    r.source = "gemm_fused";
    r.kernel = std::string("marlin_reduce_") + dtype_name(dtype);
    r.bool_constants = {{0, has_bias}};
    r.threadgroup = {256, 1, 1};
    r.grid = {ceil_div(m * n, 256), 1, 1};
    r.bindings = {{0, Arg::kPartial}, {1, Arg::kBias}, {2, Arg::kOut},
                  {3, Arg::kScalar, u32(m, "M")}, {4, Arg::kScalar, u32(n, "N")},
                  {5, Arg::kScalar, u32(splits, "splits")}};
    check_launch(r);
    p.launches.push_back(std::move(r));
  }
  return p;
}

Plan plan_for_tensors(const std::string& op, const at::Tensor& packed, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& x,
                      const c10::optional<at::Tensor>& bias, const std::string& weight_format,
                      int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, weight_format, group_size);
  if (op == "gemm") {
    TORCH_CHECK(x.has_value(), "_metal_plan('gemm') needs x");
    check_gemm_inputs(*x, bias, packed, s);
    const int64_t m = s.k ? x->numel() / s.k : 0;
    return plan_gemm(m, s.n, s.k, s.format, x->scalar_type(), s.group_rows, bias.has_value());
  }
  TORCH_CHECK(op == "dequantize", "_metal_plan: op must be 'gemm' or 'dequantize', got '", op, "'");
  const at::ScalarType out = dtype.value_or(at::kHalf);
  TORCH_CHECK(out == at::kHalf || out == at::kBFloat16 || out == at::kFloat,
              "dtype must be float16, bfloat16 or float32, got ", out);
  return plan_dequantize(s.n, s.k, s.format, out, s.group_rows);
}

std::string to_json(const Plan& p) {
  std::ostringstream o;
  o << "{\"op\":\"" << p.op << "\",\"M\":" << p.m << ",\"N\":" << p.n << ",\"K\":" << p.k
    << ",\"group_rows\":" << p.group_rows << ",\"splits\":" << p.splits << ",\"dtype\":\""
    << dtype_name(p.dtype) << "\",\"format\":\"" << format_name(p.format)
    << "\",\"partial_floats\":" << p.partial_floats << ",\"launches\":[";
  for (size_t i = 0; i < p.launches.size(); ++i) {
    const Launch& l = p.launches[i];
    o << (i ? "," : "") << "{\"source\":\"" << l.source << "\",\"kernel\":\"" << l.kernel
      << "\",\"grid\":[" << l.grid[0] << "," << l.grid[1] << "," << l.grid[2] << "],\"threadgroup\":["
      << l.threadgroup[0] << "," << l.threadgroup[1] << "," << l.threadgroup[2]
      << "],\"threadgroup_memory\":" << l.threadgroup_memory << ",\"constants\":{";
    for (size_t c = 0; c < l.bool_constants.size(); ++c)
      o << (c ? "," : "") << "\"" << l.bool_constants[c].first << "\":" << (l.bool_constants[c].second ? "true" : "false");
    o << "},\"bindings\":[";
    for (size_t b = 0; b < l.bindings.size(); ++b) {
      const Binding& bd = l.bindings[b];
      o << (b ? "," : "") << "[" << bd.index << ",\"" << arg_name(bd.arg) << "\"," << bd.value << "]";
    }
    o << "]}";
  }
  o << "]}";
  return o.str();
}

namespace {

std::string metal_plan_op(c10::string_view op, const at::Tensor& packed, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& x,
                          const c10::optional<at::Tensor>& bias, c10::string_view weight_format,
                          int64_t group_size, c10::optional<at::ScalarType> dtype) {
  return to_json(plan_for_tensors(std::string(op), packed, scales, zeros, x, bias,
                                  std::string(weight_format), group_size, dtype));
}

}  // namespace

// Device-independent (works on CPU, meta and MPS tensors: only shapes are read).
TORCH_LIBRARY_IMPL(marlin, CompositeExplicitAutograd, m) { m.impl("_metal_plan", &metal_plan_op); }

}  // namespace metal
}  // namespace marlin
