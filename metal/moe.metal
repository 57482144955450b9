// Routed expert matmuls of the expert-stack layout (marlin::moe_gemm,
// docs/FORMAT.md): T tokens each routed to top_k experts; pair p = t * top_k + j
// multiplies x row (p / x_row_div) by expert expert_ids[p]'s matrix
// B_e [K, N] (packed [E, K/8, N], scales/zeros [E, K/group, N]). Planned by
// csrc/core/metal_plan_experts.cpp:
//
// * few pairs per expert (decode): marlin_moe_gemv, one threadgroup per
//   (32 columns, pair, K slice): the decode GEMV (metal/marlin_gemv.h) on the
//   pair's x row and expert, its K split for narrow layers;
// * many pairs per expert (prefill): marlin_moe_count, marlin_moe_offsets and
//   marlin_moe_scatter counting-sort the pairs by expert (stable, no atomics)
//   and list the tiles of kMoeTileM sorted rows of one expert; marlin_moe_gemm runs the fused
//   dequant-in-registers GEMM (metal/marlin_gemm_fused.h) on such a tile, its
//   x rows gathered and its output rows scattered through the sorted pair list. The grid has the largest possible number of tiles
//   (S / kMoeTileM + E); threadgroups past the routed count return at once.
//
// Both write fp32 rows [splits, S, N] per pair (one slice but for the GEMV's K
// split), without bias; marlin_moe_combine sums the slices in order, adds
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
                                constant uint& S [[buffer(11)]],
                                constant uint& split_rows [[buffer(12)]],
                                threadgroup float* sums [[threadgroup(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint nsg [[simdgroups_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  const uint p = tgid.y;  // K slice tgid.z writes its partial row to rows[tgid.z, p]
  const MarlinPairRow out{rows + (ulong(tgid.z) * S + p) * N, N};
  const int e = marlin_moe_expert(ids, p, id_words, E);
  if (e < 0) {  // uniform in the threadgroup
    for (uint i = tid; i < uint(kGemvColumns); i += nsg * kSimdWidth)
      out.store(0, tgid.x * kGemvColumns + i, marlin_moe_nan());
    return;
  }
  const MarlinExpert w = marlin_expert<F>(packed, scales, zeros, uint(e), N, K);
  const uint r_begin = tgid.z * split_rows, r_end = min(K / 8, r_begin + split_rows);
  marlin_gemv_columns<T, F, 1>(x + ulong(p / x_row_div) * K, w.packed, w.scales, w.zeros, 1, N, K, tgid.x, r_begin,
                               r_end, out, sums, tid, sg, nsg, lane);
}

// --- routing: pairs sorted by expert, tiles of one expert's rows ----------------------
//
// Three launches, each pair looked at a constant number of times (a counting
// sort: O(S + E x chunks) in all, where one scan per expert was O(E x S)):
//
// 1. marlin_moe_count: threadgroup c (one simdgroup) owns the chunk of pairs
//    [c * chunk, (c + 1) * chunk): its histogram counts[c, E] and each pair's
//    rank among the chunk's earlier pairs of its expert (32 pairs per step, the
//    ranks inside a step from shuffles: stable).
// 2. marlin_moe_offsets (one threadgroup): expert totals, their exclusive scan
//    (expert_start [E + 1]), the tile list, and counts[c, e] turned in place
//    into the first sorted row of chunk c's pairs of expert e.
// 3. marlin_moe_scatter (a thread per pair): order[counts[c, e] + rank] = pair.
//
// Pairs of one expert end up in increasing order, as before: deterministic.

// Chunk tgid.x of `chunk` pairs: histogram counts[tgid.x, :] and rank[pair].
[[kernel]] void marlin_moe_count(const device int* ids [[buffer(0)]],
                                 device uint* counts [[buffer(1)]],
                                 device uint* rank [[buffer(2)]],
                                 constant uint& S [[buffer(3)]],
                                 constant uint& E [[buffer(4)]],
                                 constant uint& id_words [[buffer(5)]],
                                 constant uint& chunk [[buffer(6)]],
                                 uint3 tgid [[threadgroup_position_in_grid]],
                                 uint lane [[thread_index_in_simdgroup]]) {
  device uint* hist = counts + ulong(tgid.x) * E;
  for (uint e = lane; e < E; e += kSimdWidth) hist[e] = 0;
  threadgroup_barrier(mem_flags::mem_device);  // the threadgroup is one simdgroup
  const uint begin = tgid.x * chunk, end = min(S, begin + chunk);
  for (uint base = begin; base < end; base += kSimdWidth) {
    const uint i = base + lane;
    const int e = i < end ? marlin_moe_expert(ids, i, id_words, E) : -1;
    uint before = 0, same = 0;  // lanes of this step with the same expert: below this one, all
    for (ushort j = 0; j < ushort(kSimdWidth); ++j) {
      const bool match = simd_shuffle(e, j) == e;
      same += match ? 1u : 0u;
      before += match && j < lane ? 1u : 0u;
    }
    const uint first = e >= 0 ? hist[e] : 0u;
    threadgroup_barrier(mem_flags::mem_device);  // every lane has read hist before the first lane updates it
    if (e >= 0) {
      rank[i] = first + before;
      if (before == 0) hist[e] = first + same;
    }
    threadgroup_barrier(mem_flags::mem_device);
  }
}

// One threadgroup, any number of simdgroups (up to 32). expert_start [E + 1]:
// expert e's sorted rows are [expert_start[e], expert_start[e + 1]); tiles
// [*, 2]: (expert, first sorted row) of each tile of kMoeTileM rows in expert
// order; tile_count [1]; counts [chunks, E] -> first sorted row of each
// (chunk, expert). Thread t owns a contiguous range of experts.
[[kernel]] void marlin_moe_offsets(device uint* counts [[buffer(0)]],
                                   device uint* expert_start [[buffer(1)]],
                                   device uint* tiles [[buffer(2)]],
                                   device uint* tile_count [[buffer(3)]],
                                   constant uint& E [[buffer(4)]],
                                   constant uint& chunks [[buffer(5)]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint nsg [[simdgroups_per_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint sg_rows[kSimdWidth];  // per simdgroup: its inclusive sums
  threadgroup uint sg_tiles[kSimdWidth];
  const uint threads = nsg * kSimdWidth, per = (E + threads - 1) / threads;
  const uint e_begin = min(E, tid * per), e_end = min(E, e_begin + per);
  uint rows = 0, ntiles = 0;
  for (uint e = e_begin; e < e_end; ++e) {
    uint total = 0;
    for (uint c = 0; c < chunks; ++c) total += counts[ulong(c) * E + e];
    rows += total;
    ntiles += (total + kMoeTileM - 1) / kMoeTileM;
  }
  // Exclusive scan over the threads: in the simdgroup, then over the simdgroups.
  uint rows_before = simd_prefix_exclusive_sum(rows), tiles_before = simd_prefix_exclusive_sum(ntiles);
  if (lane == kSimdWidth - 1) {
    sg_rows[sg] = rows_before + rows;
    sg_tiles[sg] = tiles_before + ntiles;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint g = 0; g < sg; ++g) {
    rows_before += sg_rows[g];
    tiles_before += sg_tiles[g];
  }
  if (tid == threads - 1) {
    expert_start[E] = rows_before + rows;
    tile_count[0] = tiles_before + ntiles;
  }
  uint start = rows_before, t = tiles_before;
  for (uint e = e_begin; e < e_end; ++e) {
    expert_start[e] = start;
    uint row = start;
    for (uint c = 0; c < chunks; ++c) {
      device uint* count = counts + ulong(c) * E + e;
      const uint n = *count;
      *count = row;
      row += n;
    }
    for (uint r = start; r < row; r += kMoeTileM, ++t) {
      tiles[2 * t] = e;
      tiles[2 * t + 1] = r;
    }
    start = row;
  }
}

// A thread per pair: its sorted row is its chunk's first row of its expert plus its rank.
[[kernel]] void marlin_moe_scatter(const device int* ids [[buffer(0)]],
                                   const device uint* counts [[buffer(1)]],
                                   const device uint* rank [[buffer(2)]],
                                   device uint* order [[buffer(3)]],
                                   constant uint& S [[buffer(4)]],
                                   constant uint& E [[buffer(5)]],
                                   constant uint& id_words [[buffer(6)]],
                                   constant uint& chunk [[buffer(7)]],
                                   uint i [[thread_position_in_grid]]) {
  if (i >= S) return;
  const int e = marlin_moe_expert(ids, i, id_words, E);
  if (e >= 0) order[counts[ulong(i / chunk) * E + uint(e)] + rank[i]] = i;
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
// them when weighted, else the pair itself) of weight * (sum_z rows[z, p, n] + bias[e, n]),
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
                                   constant uint& splits [[buffer(11)]],
                                   uint gid [[thread_position_in_grid]]) {
  if (gid >= out_rows * N) return;
  const uint row = gid / N, n = gid % N;
  const uint per_row = marlin_moe_weighted ? top_k : 1u, out_pairs = out_rows * per_row;
  float s = 0.0f;
  for (uint j = 0; j < per_row; ++j) {
    const uint p = row * per_row + j;
    const int e = marlin_moe_expert(ids, p, id_words, E);
    if (e < 0) {
      s = marlin_moe_nan();
      break;
    }
    float v = rows[ulong(p) * N + n];  // the GEMV's K slices, summed in a fixed order
    for (uint z = 1; z < splits; ++z) v += rows[(ulong(z) * out_pairs + p) * N + n];
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
