// Routed expert matmuls of the expert-stack layout (marlin::moe_gemm,
// docs/FORMAT.md): T tokens each routed to top_k experts; pair p = t * top_k + j
// multiplies x row (p / x_row_div) by expert expert_ids[p]'s matrix
// B_e [K, N] (packed [E, K/8, N], scales/zeros [E, K/group, N]). Planned by
// csrc/core/metal_plan_experts.cpp:
//
// * few pairs (decode): marlin_moe_gemv, one threadgroup per (pair, 32
//   columns): the decode GEMV (metal/marlin_gemv.h) on the pair's x row and
//   expert;
// * many pairs (prefill): marlin_moe_route (one threadgroup) counting-sorts
//   the pairs by expert (stable, no atomics: a simdgroup per expert counts and
//   places its pairs with simd prefix sums) and lists the tiles of kMoeTileM
//   sorted rows of one expert; marlin_moe_gemm runs the fused
//   dequant-in-registers GEMM (metal/marlin_gemm_fused.h) on such a tile, its
//   x rows gathered and its output rows scattered through the sorted pair list. The grid has the largest possible number of tiles
//   (S / kMoeTileM + E); threadgroups past the routed count return at once.
//
// Both write fp32 rows [S, N] per pair, without bias; marlin_moe_combine adds
// the expert's bias, weights by topk_weights and sums a token's experts (or
// copies each pair's row), in fp32 in the CPU op's order, and rounds once.
//
// expert_ids are int32 (id_words = 1) or int64 (id_words = 2, read as two
// little-endian words). An id outside [0, E) is never dereferenced: its pair's
// row, and the token's combined output, is NaN (the planner cannot read ids
// on the device without a sync; the CPU op raises instead).
#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_gemm_fused.h"
#include "marlin_gemv.h"

using namespace metal;

// The value of a row whose expert id is invalid (a quiet NaN).
inline float marlin_moe_nan() { return as_type<float>(0x7FC00000u); }

// Expert of pair p, or -1 when the id is not in [0, E).
inline int marlin_moe_expert(const device int* ids, uint p, uint id_words, uint E) {
  const int low = ids[ulong(p) * id_words];
  const bool high_ok = id_words == 1 || ids[ulong(p) * id_words + 1] == 0;
  return (high_ok && low >= 0 && uint(low) < E) ? low : -1;
}

// --- per-pair GEMV ---------------------------------------------------------------

// Expert e's matrix in the stacks: packed [K/8, N], scales/zeros [groups, N].
struct MarlinExpert {
  const device uint* packed;
  const device half* scales;
  const device half* zeros;
};

template <WeightFormat F>
inline MarlinExpert marlin_expert(const device uint* packed, const device half* scales, const device half* zeros,
                                  uint e, uint N, uint K) {
  const uint KR = K / 8, groups = marlin_group_rows == 0 ? 1u : KR / marlin_group_rows;
  return MarlinExpert{packed + ulong(e) * KR * N, scales + ulong(e) * groups * N,
                      zeros + (has_zeros(F) ? ulong(e) * groups * N : 0)};
}

// The GEMV's output: fp32 row `row` [N] of one pair (one row of x).
struct MarlinPairRow {
  device float* row;
  uint N;
  void store(uint m, uint n, float v) const {
    if (n < N) row[n] = v;
  }
};

template <typename T, WeightFormat F>
[[kernel]] void marlin_moe_gemv(const device T* x [[buffer(0)]],
                                const device int* ids [[buffer(1)]],
                                const device uint* packed [[buffer(2)]],
                                const device half* scales [[buffer(3)]],
                                const device half* zeros [[buffer(4)]],
                                device float* rows [[buffer(5)]],
                                constant uint& N [[buffer(6)]],
                                constant uint& K [[buffer(7)]],
                                constant uint& E [[buffer(8)]],
                                constant uint& id_words [[buffer(9)]],
                                constant uint& x_row_div [[buffer(10)]],
                                threadgroup float* sums [[threadgroup(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint nsg [[simdgroups_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  const uint p = tgid.y;
  const MarlinPairRow out{rows + ulong(p) * N, N};
  const int e = marlin_moe_expert(ids, p, id_words, E);
  if (e < 0) {  // uniform in the threadgroup
    for (uint i = tid; i < uint(kGemvColumns); i += nsg * kSimdWidth)
      out.store(0, tgid.x * kGemvColumns + i, marlin_moe_nan());
    return;
  }
  const MarlinExpert w = marlin_expert<F>(packed, scales, zeros, uint(e), N, K);
  marlin_gemv_columns<T, F, 1>(x + ulong(p / x_row_div) * K, w.packed, w.scales, w.zeros, 1, N, K, tgid.x, 0,
                               K / 8, out, sums, tid, sg, nsg, lane);
}

// --- routing: pairs sorted by expert, tiles of one expert's rows ----------------------

// One threadgroup. expert_start [E + 1]: expert e's sorted rows are
// [expert_start[e], expert_start[e + 1]); order [S]: the pair of each sorted
// row (stable: pairs of one expert in increasing order); tiles [*, 2]: (expert,
// first sorted row) of each tile of kMoeTileM rows; tile_count [1].
[[kernel]] void marlin_moe_route(const device int* ids [[buffer(0)]],
                                 device uint* expert_start [[buffer(1)]],
                                 device uint* order [[buffer(2)]],
                                 device uint* tiles [[buffer(3)]],
                                 device uint* tile_count [[buffer(4)]],
                                 constant uint& S [[buffer(5)]],
                                 constant uint& E [[buffer(6)]],
                                 constant uint& id_words [[buffer(7)]],
                                 uint tid [[thread_index_in_threadgroup]],
                                 uint sg [[simdgroup_index_in_threadgroup]],
                                 uint nsg [[simdgroups_per_threadgroup]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  // 1. Rows per expert: a simdgroup scans all pairs for one expert at a time.
  for (uint e = sg; e < E; e += nsg) {
    uint count = 0;
    for (uint base = 0; base < S; base += kSimdWidth) {
      const uint i = base + lane;
      const bool hit = i < S && marlin_moe_expert(ids, i, id_words, E) == int(e);
      count += simd_sum(hit ? 1u : 0u);
    }
    if (lane == 0) expert_start[e + 1] = count;
  }
  threadgroup_barrier(mem_flags::mem_device);
  // 2. Offsets and the tile list (E and the tile count are small: one thread).
  if (tid == 0) {
    uint start = 0, t = 0;
    expert_start[0] = 0;
    for (uint e = 0; e < E; ++e) {
      const uint count = expert_start[e + 1];
      for (uint r = 0; r < count; r += kMoeTileM) {
        tiles[2 * t] = e;
        tiles[2 * t + 1] = start + r;
        ++t;
      }
      start += count;
      expert_start[e + 1] = start;
    }
    tile_count[0] = t;
  }
  threadgroup_barrier(mem_flags::mem_device);
  // 3. Each expert's pairs in order: a prefix sum over the simdgroup's hits.
  for (uint e = sg; e < E; e += nsg) {
    uint pos = expert_start[e];
    for (uint base = 0; base < S; base += kSimdWidth) {
      const uint i = base + lane;
      const bool hit = i < S && marlin_moe_expert(ids, i, id_words, E) == int(e);
      const uint before = simd_prefix_exclusive_sum(hit ? 1u : 0u);
      if (hit) order[pos + before] = i;
      pos += simd_sum(hit ? 1u : 0u);
    }
  }
}

// --- grouped GEMM over expert-sorted rows -----------------------------------------

constant constexpr uint kMoeNoPair = 0xFFFFFFFFu;  // a tile row past its expert's rows

// The tile's rows: tile row i is pair pair_of_row[i] (x row pair / x_row_div)
// or none; its output goes to the pair's fp32 row.
struct MarlinPairRows {
  const threadgroup uint* pair_of_row;
  uint x_row_div;
  bool has(uint row) const { return pair_of_row[row] != kMoeNoPair; }
  ulong x_row(uint row) const { return pair_of_row[row] / x_row_div; }
};

struct MarlinPairRowsOutput {
  const threadgroup uint* pair_of_row;
  device float* rows;
  uint N;
  void store(uint m, uint n, float v) const {
    const uint pair = pair_of_row[m];
    if (pair != kMoeNoPair && n < N) rows[ulong(pair) * N + n] = v;
  }
};

// Tile tgid.y of the routing, columns of block tgid.x: the fused GEMM over all
// of K (no K split) with TM = kMoeTileM.
template <typename T, WeightFormat F>
[[kernel]] void marlin_moe_gemm(const device T* x [[buffer(0)]],
                                const device uint* packed [[buffer(1)]],
                                const device half* scales [[buffer(2)]],
                                const device half* zeros [[buffer(3)]],
                                device float* rows [[buffer(4)]],
                                const device uint* expert_start [[buffer(5)]],
                                const device uint* order [[buffer(6)]],
                                const device uint* tiles [[buffer(7)]],
                                const device uint* tile_count [[buffer(8)]],
                                constant uint& N [[buffer(9)]],
                                constant uint& K [[buffer(10)]],
                                constant uint& x_row_div [[buffer(11)]],
                                threadgroup T* x_tiles [[threadgroup(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint pair_of_row[kMoeTileM];
  if (tgid.y >= tile_count[0]) return;  // uniform: the grid is sized for the most tiles possible
  const uint e = tiles[2 * tgid.y], q0 = tiles[2 * tgid.y + 1], q_end = expert_start[e + 1];
  if (tid < uint(kMoeTileM)) pair_of_row[tid] = q0 + tid < q_end ? order[q0 + tid] : kMoeNoPair;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const MarlinExpert w = marlin_expert<F>(packed, scales, zeros, e, N, K);
  const MarlinPairRows tile_rows{pair_of_row, x_row_div};
  const MarlinPairRowsOutput out{pair_of_row, rows, N};
  marlin_gemm_fused_tile<T, F, kMoeTileM>(x, tile_rows, w.packed, w.scales, w.zeros, N, K, tgid.x, 0, K / 8, out,
                                          0, x_tiles, tid, sg, lane);
}

// --- epilogue --------------------------------------------------------------------

// Weight of pair p in the weights' own dtype (0: half, 1: bfloat, 2: float).
inline float marlin_moe_weight(const device uchar* weights, uint p, uint weight_dtype) {
  if (weight_dtype == 0) return float(reinterpret_cast<const device half*>(weights)[p]);
#if defined(__HAVE_BFLOAT__)
  if (weight_dtype == 1) return float(reinterpret_cast<const device bfloat*>(weights)[p]);
#endif
  return reinterpret_cast<const device float*>(weights)[p];
}

// y[row, n] for one thread per output: the sum over the row's pairs (top_k of
// them when weighted, else the pair itself) of weight * (rows[p, n] + bias[e, n]),
// in fp32 in pair order, rounded once; NaN if one of its experts is invalid.
template <typename T>
[[kernel]] void marlin_moe_combine(const device float* rows [[buffer(0)]],
                                   const device int* ids [[buffer(1)]],
                                   const device uchar* weights [[buffer(2)]],
                                   const device T* bias [[buffer(3)]],
                                   device T* y [[buffer(4)]],
                                   constant uint& out_rows [[buffer(5)]],
                                   constant uint& N [[buffer(6)]],
                                   constant uint& top_k [[buffer(7)]],
                                   constant uint& E [[buffer(8)]],
                                   constant uint& id_words [[buffer(9)]],
                                   constant uint& weight_dtype [[buffer(10)]],
                                   uint gid [[thread_position_in_grid]]) {
  if (gid >= out_rows * N) return;
  const uint row = gid / N, n = gid % N;
  const uint per_row = marlin_moe_weighted ? top_k : 1u;
  float s = 0.0f;
  for (uint j = 0; j < per_row; ++j) {
    const uint p = row * per_row + j;
    const int e = marlin_moe_expert(ids, p, id_words, E);
    if (e < 0) {
      s = marlin_moe_nan();
      break;
    }
    float v = rows[ulong(p) * N + n];
    if (marlin_has_bias) v += float(bias[ulong(e) * N + n]);
    s += (marlin_moe_weighted ? marlin_moe_weight(weights, p, weight_dtype) : 1.0f) * v;
  }
  y[gid] = T(s);
}

#define MARLIN_MOE_MATMULS(dt, T, Tname, fmt, F)                                                    \
  template [[host_name("marlin_moe_gemv_" #fmt "_" #dt)]] [[kernel]] decltype(marlin_moe_gemv<T, F>) \
      marlin_moe_gemv<T, F>;                                                                       \
  template [[host_name("marlin_moe_gemm_" #fmt "_" #dt)]] [[kernel]] decltype(marlin_moe_gemm<T, F>) \
      marlin_moe_gemm<T, F>;
#define MARLIN_MOE_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_MOE_MATMULS, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_MOE_DTYPES, )

#define MARLIN_MOE_COMBINE(dt, T, Tname, _)                                                        \
  template [[host_name("marlin_moe_combine_" #dt)]] [[kernel]] decltype(marlin_moe_combine<T>) \
      marlin_moe_combine<T>;
MARLIN_FOR_EACH_DTYPE(MARLIN_MOE_COMBINE, )
