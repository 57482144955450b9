// Metal dispatch of the expert-stack layout's op (moe_gemm): which kernels of
// metal/moe.metal to launch, how. Argument checks are the CPU op's
// (core/checks.h stacked, core/experts_checks.h), so every backend fails alike;
// expert id values are not read (they are on the device): the kernels turn an
// id outside [0, E) into NaN rows instead.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/experts_checks.h"
#include "core/metal_plan.h"

namespace marlin {
namespace metal {
namespace {

// GEMV per pair or grouped GEMM. The per-pair GEMV reads its expert's weight
// once per pair; the grouped GEMM once per tile of kMoeTileM rows of one expert,
// but a tile is a TM = 32 simdgroup_matrix GEMM, ALU-bound: docs/KERNELS.md
// counts about 44 lane-cycles per weight and tile against 0.516 DRAM bytes per
// weight of the memory-bound GEMV, so on M1-M4 Pro/Max one tile costs about
// 5-6.6 GEMV passes over the same weight. The plan takes the grouped GEMM when
// the pairs outnumber kMoeTileCost x its expected tiles: the experts a uniform
// routing of S pairs over E experts touches, E (1 - (1 - 1/E)^S), times the
// tiles each needs. Mixtral (E = 8, top-2) at 32 tokens: 64 pairs, 8 experts
// of 8 rows, 8 tiles: grouped (the GEMV would read each expert 8 times);
// E = 128, top-8 at 16 tokens: 128 pairs over ~81 experts: GEMV.
// A first guess from the accounting, to be tuned on hardware (benchmarks/bench_mps.py).
constexpr double kMoeTileCost = 5.0;

bool moe_use_gemv(int64_t pairs, int64_t experts) {
  if (pairs == 0) return true;  // nothing to launch either way
  const double s = static_cast<double>(pairs), e = static_cast<double>(experts);
  const double touched = e * (1.0 - std::pow(1.0 - 1.0 / e, s));
  const double tiles = touched * std::ceil(s / (touched * kMoeTileM));
  return s <= kMoeTileCost * tiles;
}

// The routing's counting sort: a chunk of pairs per count threadgroup (one
// simdgroup), at least kMoeChunkPairs and at most kMoeMaxChunks chunks, so its
// [chunks, E] count table stays small for the one-threadgroup offsets kernel.
constexpr int64_t kMoeChunkPairs = 256;
constexpr int64_t kMoeMaxChunks = 1024;

// Argument numbers in the schema (csrc/registration.cpp).
enum MoeArg { kX = 0, kIds, kWeights, kPacked, kScales, kZeros, kBias };
// Workspaces of the plan.
enum MoeWorkspace { kRows = 0, kExpertStart, kOrder, kTiles, kTileCount, kCounts, kRank };

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
  const bool gemv = moe_use_gemv(m.pairs, s.experts);
  // The GEMV's K split (as the dense GEMV's) when its (column block, pair) threadgroups are few.
  const auto [splits, split_rows] =
      gemv && m.pairs > 0 ? k_slices(ceil_div(s.n, kGemvColumns) * m.pairs, s.k / kPackFactor, kGemvMinThreadgroups,
                                     kGemvMinSplitRows, kGemvBlockRows)
                          : std::pair<int64_t, int64_t>{1, s.k / kPackFactor};
  std::ostringstream d;
  d << "\"T\":" << m.tokens << ",\"top_k\":" << m.top_k << ",\"pairs\":" << m.pairs << ",\"E\":" << s.experts
    << ",\"N\":" << s.n << ",\"K\":" << s.k << ",\"group_rows\":" << s.group_rows << ",\"dtype\":\""
    << dtype_name(dtype) << "\",\"format\":\"" << weight_format_name(s.format) << "\",\"path\":\""
    << (gemv ? "gemv" : "grouped") << "\",\"splits\":" << splits;
  p.details = d.str();
  if (m.pairs == 0) return p;  // empty result, nothing to launch

  const std::string suffix = std::string(weight_format_name(s.format)) + "_" + dtype_name(dtype);
  const int64_t id_words = expert_ids.scalar_type() == at::kLong ? 2 : 1;
  const int64_t x_row_div = m.shared_x ? m.top_k : 1;  // pair p reads x row p / x_row_div
  u32(m.pairs * id_words, "pairs * id words");
  u32(m.pairs * s.n, "pairs * N");
  u32(splits * m.pairs * s.n, "splits * pairs * N");
  const int64_t chunk = std::max(kMoeChunkPairs, ceil_div(ceil_div(m.pairs, kMoeMaxChunks), kSimdWidth) * kSimdWidth);
  const int64_t chunks = ceil_div(m.pairs, chunk);
  u32(chunks * s.experts, "chunks * E");
  // fp32 rows per K slice and pair, then the routing of the grouped path (unused, but bound, by the GEMV path).
  const int64_t max_tiles = ceil_div(m.pairs, kMoeTileM) + std::min<int64_t>(s.experts, m.pairs);
  p.workspaces = {{"rows", {splits * m.pairs, s.n}, at::kFloat},
                  {"expert_start", {gemv ? 4 : s.experts + 1}, at::kInt},
                  {"order", {gemv ? 4 : m.pairs}, at::kInt},
                  {"tiles", {gemv ? 4 : 2 * max_tiles}, at::kInt},
                  {"tile_count", {4}, at::kInt},
                  {"counts", {gemv ? 4 : chunks * s.experts}, at::kInt},
                  {"rank", {gemv ? 4 : m.pairs}, at::kInt}};

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
    l.grid = {ceil_div(s.n, kGemvColumns), m.pairs, splits};
    l.threadgroup_memory = gemv_threadgroup_memory(1);
    l.set(kFcAligned, aligned);
    l.set(kFcGroupRows, group_rows);
    l.bindings = {arg(0, kX),           arg(1, kIds),
                  arg(2, kPacked),      arg(3, kScales),
                  arg(4, kZeros),       workspace(5, kRows),
                  scalar(6, s.n, "N"),  scalar(7, s.k, "K"),
                  scalar(8, s.experts, "E"), scalar(9, id_words, "id words"),
                  scalar(10, x_row_div, "top_k"), scalar(11, m.pairs, "pairs"),
                  scalar(12, split_rows, "split rows")};
    check_launch(l);
    p.launches.push_back(std::move(l));
  } else {
    Launch count;
    count.source = "moe";
    count.kernel = "marlin_moe_count";
    count.threadgroup = {kSimdWidth, 1, 1};  // one simdgroup per chunk
    count.grid = {chunks, 1, 1};
    count.bindings = {arg(0, kIds), workspace(1, kCounts), workspace(2, kRank), scalar(3, m.pairs, "pairs"),
                      scalar(4, s.experts, "E"), scalar(5, id_words, "id words"), scalar(6, chunk, "chunk")};
    check_launch(count);
    p.launches.push_back(std::move(count));
    Launch offsets;
    offsets.source = "moe";
    offsets.kernel = "marlin_moe_offsets";
    offsets.threadgroup = {kMoeRouteThreads, 1, 1};
    offsets.min_threads_x = kSimdWidth;  // any number of simdgroups
    offsets.bindings = {workspace(0, kCounts), workspace(1, kExpertStart), workspace(2, kTiles),
                        workspace(3, kTileCount), scalar(4, s.experts, "E"), scalar(5, chunks, "chunks")};
    check_launch(offsets);
    p.launches.push_back(std::move(offsets));
    Launch scatter;
    scatter.source = "moe";
    scatter.kernel = "marlin_moe_scatter";
    scatter.threadgroup = {kMoeRouteThreads, 1, 1};
    scatter.grid = {ceil_div(m.pairs, kMoeRouteThreads), 1, 1};
    scatter.bindings = {arg(0, kIds),      workspace(1, kCounts), workspace(2, kRank), workspace(3, kOrder),
                        scalar(4, m.pairs, "pairs"), scalar(5, s.experts, "E"), scalar(6, id_words, "id words"),
                        scalar(7, chunk, "chunk")};
    check_launch(scatter);
    p.launches.push_back(std::move(scatter));
    Launch g;
    g.source = "moe";
    g.kernel = "marlin_moe_gemm_" + suffix;
    g.threadgroup = {kGemmThreads, 1, 1};
    g.grid = {ceil_div(s.n, kGemmTileN), max_tiles, 1};
    g.threadgroup_memory = fused_threadgroup_memory(kMoeTileM, static_cast<int>(dtype_size(dtype)));
    g.set(kFcAligned, aligned);
    g.set(kFcGroupRows, group_rows);
    g.bindings = {arg(0, kX),
                  arg(1, kPacked),
                  arg(2, kScales),
                  arg(3, kZeros),
                  workspace(4, kRows),
                  workspace(5, kExpertStart),
                  workspace(6, kOrder),
                  workspace(7, kTiles),
                  workspace(8, kTileCount),
                  scalar(9, s.n, "N"),
                  scalar(10, s.k, "K"),
                  scalar(11, x_row_div, "top_k")};
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
                scalar(10, m.weighted ? weight_dtype_code(topk_weights->scalar_type()) : 2, "weight dtype"),
                scalar(11, splits, "splits")};
  u32(out_rows * s.n, "output size");
  check_launch(c);
  p.launches.push_back(std::move(c));
  return p;
}

}  // namespace

MARLIN_REGISTER_METAL_OP(moe_gemm, plan_moe_gemm)

}  // namespace metal
}  // namespace marlin
