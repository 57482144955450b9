// Metal dispatch of the expert-stack layout's op (moe_gemm): which kernels of
// metal/moe.metal to launch, how. Argument checks are the CPU op's
// (core/checks.h stacked, core/experts_checks.h), so every backend fails alike;
// expert id values are not read (they are on the device): the kernels turn an
// id outside [0, E) into NaN rows instead.
#include <torch/library.h>

#include <algorithm>
#include <sstream>

#include "core/experts_checks.h"
#include "core/metal_plan.h"

namespace marlin {
namespace metal {
namespace {

// Up to this many (token, expert) pairs, one GEMV per pair (each reads its
// expert's weight); above, the pairs are sorted by expert and each expert's
// weight is read once per tile of kMoeTileM rows. A first guess, to be tuned
// on hardware (benchmarks/bench_mps.py).
constexpr int64_t kMoeGemvMaxPairs = 64;

// Argument numbers in the schema (csrc/registration.cpp).
enum MoeArg { kX = 0, kIds, kWeights, kPacked, kScales, kZeros, kBias };
// Workspaces of the plan.
enum MoeWorkspace { kRows = 0, kExpertStart, kOrder, kTiles, kTileCount };

// The routing's workspaces (expert_start, order, tiles, tile_count) at buffer indices first, first + 1, ...
std::vector<Binding> routing_bindings(int first) {
  return {workspace(first, kExpertStart), workspace(first + 1, kOrder), workspace(first + 2, kTiles),
          workspace(first + 3, kTileCount)};
}

std::vector<Binding> operator+(std::vector<Binding> a, const std::vector<Binding>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

int64_t weight_dtype_code(at::ScalarType t) { return t == at::kHalf ? 0 : t == at::kBFloat16 ? 1 : 2; }

Plan plan_moe_gemm(const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& topk_weights,
                   const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                   const c10::optional<at::Tensor>& bias, c10::string_view weight_format, int64_t group_size) {
  const QuantizedShape s =
      check_quantized(packed, scales, zeros, std::string(weight_format), group_size, /*stacked=*/true);
  const MoeShape m = check_moe_inputs(x, expert_ids, topk_weights, bias, packed, s);
  const at::ScalarType dtype = x.scalar_type();
  const int64_t out_rows = m.weighted ? m.tokens : m.pairs;
  Plan p;
  p.op = "moe_gemm";
  p.outputs = {{"out", {out_rows, s.n}, dtype}};
  p.result_shape = m.weighted ? std::vector<int64_t>{m.tokens, s.n} : std::vector<int64_t>{m.tokens, m.top_k, s.n};
  const bool gemv = m.pairs <= kMoeGemvMaxPairs;
  std::ostringstream d;
  d << "\"T\":" << m.tokens << ",\"top_k\":" << m.top_k << ",\"pairs\":" << m.pairs << ",\"E\":" << s.experts
    << ",\"N\":" << s.n << ",\"K\":" << s.k << ",\"group_rows\":" << s.group_rows << ",\"dtype\":\""
    << dtype_name(dtype) << "\",\"format\":\"" << weight_format_name(s.format) << "\",\"path\":\""
    << (gemv ? "gemv" : "grouped") << "\"";
  p.details = d.str();
  if (m.pairs == 0) return p;  // empty result, nothing to launch

  const std::string suffix = std::string(weight_format_name(s.format)) + "_" + dtype_name(dtype);
  const int64_t id_words = expert_ids.scalar_type() == at::kLong ? 2 : 1;
  const int64_t x_row_div = m.shared_x ? m.top_k : 1;  // pair p reads x row p / x_row_div
  u32(m.pairs * id_words, "pairs * id words");
  u32(m.pairs * s.n, "pairs * N");
  // fp32 rows per pair, then the routing of the grouped path (unused, but bound, by the GEMV path).
  const int64_t max_tiles = ceil_div(m.pairs, kMoeTileM) + std::min<int64_t>(s.experts, m.pairs);
  p.workspaces = {{"rows", {m.pairs, s.n}, at::kFloat},
                  {"expert_start", {gemv ? 4 : s.experts + 1}, at::kInt},
                  {"order", {gemv ? 4 : m.pairs}, at::kInt},
                  {"tiles", {gemv ? 4 : 2 * max_tiles}, at::kInt},
                  {"tile_count", {4}, at::kInt}};

  // The matmul kernels are the dense GEMV / fused GEMM (metal/marlin_gemv.h,
  // marlin_gemm_fused.h) on one expert: the same function constants.
  const bool aligned = vector_loads(x, packed, scales, zeros, s.n);
  const uint32_t group_rows = group_rows_constant(group_size);
  if (gemv) {
    Launch l;
    l.source = "moe";
    l.kernel = "marlin_moe_gemv_" + suffix;
    l.threadgroup = {kSimdWidth * kGemvSimdgroups, 1, 1};
    l.min_threads_x = kSimdWidth;  // splits K over however many simdgroups it gets
    l.grid = {ceil_div(s.n, kGemvColumns), m.pairs, 1};
    l.threadgroup_memory = gemv_threadgroup_memory(1);
    l.set(kFcAligned, aligned);
    l.set(kFcGroupRows, group_rows);
    l.bindings = {arg(0, kX),           arg(1, kIds),
                  arg(2, kPacked),      arg(3, kScales),
                  arg(4, kZeros),       workspace(5, kRows),
                  scalar(6, s.n, "N"),  scalar(7, s.k, "K"),
                  scalar(8, s.experts, "E"), scalar(9, id_words, "id words"),
                  scalar(10, x_row_div, "top_k")};
    check_launch(l);
    p.launches.push_back(std::move(l));
  } else {
    Launch route;
    route.source = "moe";
    route.kernel = "marlin_moe_route";
    route.threadgroup = {kMoeRouteThreads, 1, 1};
    route.min_threads_x = kSimdWidth;  // any number of simdgroups (thread 0 does the serial part)
    route.bindings = std::vector<Binding>{arg(0, kIds)} + routing_bindings(1) +
                     std::vector<Binding>{scalar(5, m.pairs, "pairs"), scalar(6, s.experts, "E"),
                                          scalar(7, id_words, "id words")};
    check_launch(route);
    p.launches.push_back(std::move(route));
    Launch g;
    g.source = "moe";
    g.kernel = "marlin_moe_gemm_" + suffix;
    g.threadgroup = {kGemmThreads, 1, 1};
    g.grid = {ceil_div(s.n, kGemmTileN), max_tiles, 1};
    g.threadgroup_memory = fused_threadgroup_memory(kMoeTileM, static_cast<int>(dtype_size(dtype)));
    g.set(kFcAligned, aligned);
    g.set(kFcGroupRows, group_rows);
    g.bindings = std::vector<Binding>{arg(0, kX), arg(1, kPacked), arg(2, kScales), arg(3, kZeros),
                                      workspace(4, kRows)} +
                 routing_bindings(5) +
                 std::vector<Binding>{scalar(9, s.n, "N"), scalar(10, s.k, "K"), scalar(11, x_row_div, "top_k")};
    check_launch(g);
    p.launches.push_back(std::move(g));
  }

  Launch c;
  c.source = "moe";
  c.kernel = std::string("marlin_moe_combine_") + dtype_name(dtype);
  c.set(kFcHasBias, bias.has_value());
  c.set(kFcMoeWeighted, m.weighted);
  c.threadgroup = {kMoeCombineThreads, 1, 1};
  c.grid = {ceil_div(out_rows * s.n, kMoeCombineThreads), 1, 1};
  c.bindings = {workspace(0, kRows),  arg(1, kIds),
                arg(2, kWeights),     arg(3, kBias),
                output(4),            scalar(5, out_rows, "output rows"),
                scalar(6, s.n, "N"),  scalar(7, m.top_k, "top_k"),
                scalar(8, s.experts, "E"), scalar(9, id_words, "id words"),
                scalar(10, m.weighted ? weight_dtype_code(topk_weights->scalar_type()) : 2, "weight dtype")};
  u32(out_rows * s.n, "output size");
  check_launch(c);
  p.launches.push_back(std::move(c));
  return p;
}

}  // namespace

MARLIN_REGISTER_METAL_OP(moe_gemm, plan_moe_gemm)

}  // namespace metal
}  // namespace marlin
