// Routed expert matmuls of the expert-stack layout (marlin::moe_gemm,
// docs/FORMAT.md): T tokens each routed to top_k experts; pair p = t * top_k + j
// multiplies x row (p / x_row_div) by expert expert_ids[p]'s matrix
// B_e [K, N] (packed [E, K/8, N], scales/zeros [E, K/group, N]). Planned by
// csrc/core/metal_plan_experts.cpp:
//
// * few pairs (decode): marlin_moe_gemv, one threadgroup per (pair, 32
//   columns), the decode GEMV's layout (metal/gemv.metal) on one row with the
//   expert picked per pair;
// * many pairs (prefill): marlin_moe_route (one threadgroup) counting-sorts
//   the pairs by expert (stable, no atomics: a simdgroup per expert counts and
//   places its pairs with simd prefix sums) and lists the tiles of kMoeTileM
//   sorted rows of one expert; marlin_moe_gemm, the fused dequant-in-registers
//   GEMM (metal/gemm_fused.metal) on such a tile, gathers its x rows through
//   the sorted pair list. The grid has the largest possible number of tiles
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

#include "marlin_dequant.h"

using namespace metal;

constant bool marlin_moe_weighted [[function_constant(2)]];  // combine: sum top_k pairs with weights

// The value of a row whose expert id is invalid (a quiet NaN).
inline float marlin_moe_nan() { return as_type<float>(0x7FC00000u); }

// Expert of pair p, or -1 when the id is not in [0, E).
inline int marlin_moe_expert(const device int* ids, uint p, uint id_words, uint E) {
  const int low = ids[ulong(p) * id_words];
  const bool high_ok = id_words == 1 || ids[ulong(p) * id_words + 1] == 0;
  return (high_ok && low >= 0 && uint(low) < E) ? low : -1;
}

// --- per-pair GEMV ---------------------------------------------------------------

template <typename T, WeightFormat F>
[[kernel]] void marlin_moe_gemv(const device T* x [[buffer(0)]],
                                const device int* ids [[buffer(1)]],
                                const device uint* packed [[buffer(2)]],
                                const device half* scales [[buffer(3)]],
                                const device half* zeros [[buffer(4)]],
                                device float* rows [[buffer(5)]],
                                constant uint& N [[buffer(6)]],
                                constant uint& K [[buffer(7)]],
                                constant uint& group_rows [[buffer(8)]],
                                constant uint& E [[buffer(9)]],
                                constant uint& id_words [[buffer(10)]],
                                constant uint& x_row_div [[buffer(11)]],
                                threadgroup float* partial [[threadgroup(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint nsg [[simdgroups_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  const uint p = tgid.y, n_base = tgid.x * kGemvColumns;
  device float* out = rows + ulong(p) * N;
  const int e = marlin_moe_expert(ids, p, id_words, E);
  if (e < 0) {  // uniform in the threadgroup
    for (uint i = tid; i < uint(kGemvColumns); i += nsg * kSimdWidth)
      if (n_base + i < N) out[n_base + i] = marlin_moe_nan();
    return;
  }
  const uint KR = K / 8, groups = K / group_rows;
  const device uint* w_e = packed + ulong(e) * KR * N;
  const device half* s_e = scales + ulong(e) * groups * N;
  const device half* z_e = zeros + (has_zeros(F) ? ulong(e) * groups * N : 0);
  const device T* xr = x + ulong(p / x_row_div) * K;

  // Lane 8 * kl + cl: 4 consecutive words of packed row 4 * sg + kl + 4 * nsg * i.
  const uint cl = lane % 8, kl = lane / 8;
  const uint n0 = n_base + 4 * cl;
  const bool full = n0 + 3 < N;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (uint r = 4 * sg + kl; r < KR; r += 4 * nsg) {
    const float4 x0 = float4(float(xr[8 * r]), float(xr[8 * r + 1]), float(xr[8 * r + 2]), float(xr[8 * r + 3]));
    const float4 x1 = float4(float(xr[8 * r + 4]), float(xr[8 * r + 5]), float(xr[8 * r + 6]), float(xr[8 * r + 7]));
    for (uint c = 0; c < 4; ++c) {
      if (!full && n0 + c >= N) continue;
      const uint w = w_e[ulong(r) * N + n0 + c];
      const MarlinDequantParams prm = marlin_load_params<F>(s_e, z_e, r, n0 + c, N, group_rows);
      const float4 lo = float4(marlin_dequant_pair<F>(w, 0, prm), marlin_dequant_pair<F>(w, 2, prm));
      const float4 hi = float4(marlin_dequant_pair<F>(w, 4, prm), marlin_dequant_pair<F>(w, 6, prm));
      acc[c] += dot(lo, x0) + dot(hi, x1);
    }
  }
  for (uint c = 0; c < 4; ++c) {
    float v = acc[c];
    v += simd_shuffle_xor(v, ushort(8));
    v += simd_shuffle_xor(v, ushort(16));
    if (kl == 0) partial[sg * kGemvColumns + 4 * cl + c] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = tid; i < uint(kGemvColumns); i += nsg * kSimdWidth) {
    if (n_base + i >= N) continue;
    float s = 0.0f;
    for (uint g = 0; g < nsg; ++g) s += partial[g * kGemvColumns + i];
    out[n_base + i] = s;
  }
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

// Cooperative load (kGemmThreads threads) of x[row of each tile row's pair, k0 .. k0 + 32]
// into a threadgroup tile, zero for rows without a pair and past K.
template <typename T>
inline void marlin_moe_load_x_tile(threadgroup T* dst, const device T* x, const threadgroup uint* pair_of_row,
                                   uint k0, uint K, uint x_row_div, uint tid) {
  for (uint i = tid; i < uint(kMoeTileM * kGemmTileK); i += kGemmThreads) {
    const uint row = i / kGemmTileK, k = k0 + i % kGemmTileK, pair = pair_of_row[row];
    dst[i] = (pair != kMoeNoPair && k < K) ? x[ulong(pair / x_row_div) * K + k] : T(0.0f);
  }
}

// The fused GEMM of metal/gemm_fused.metal (TM = kMoeTileM) on tile tgid.y of
// the routing: simdgroup s owns the tile's kMoeTileM rows and columns
// [16 s, 16 s + 16) of the tgid.x-th 64-column block, B^T fragments
// dequantized per lane straight from one packed word, x^T fragments from a
// double-buffered threadgroup tile gathered through the sorted pair list.
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
                                constant uint& group_rows [[buffer(11)]],
                                constant uint& x_row_div [[buffer(12)]],
                                threadgroup T* a_tiles [[threadgroup(0)]],
                                uint3 tgid [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  constexpr int TM = kMoeTileM, MF = TM / 8;
  threadgroup uint pair_of_row[TM];
  if (tgid.y >= tile_count[0]) return;  // uniform: the grid is sized for the most tiles possible
  const uint e = tiles[2 * tgid.y], q0 = tiles[2 * tgid.y + 1], q_end = expert_start[e + 1];
  if (tid < uint(TM)) pair_of_row[tid] = q0 + tid < q_end ? order[q0 + tid] : kMoeNoPair;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  const uint KR = K / 8, groups = K / group_rows;
  const device uint* w_e = packed + ulong(e) * KR * N;
  const device half* s_e = scales + ulong(e) * groups * N;
  const device half* z_e = zeros + (has_zeros(F) ? ulong(e) * groups * N : 0);
  const uint fr = (lane / 4 & 4) + (lane / 2) % 4;    // fragment row of this lane
  const uint fc = (lane / 4 & 2) * 2 + (lane % 2) * 2;  // first fragment column
  const uint nb = tgid.x * kGemmTileN + sg * (kGemmTileN / 4);
  const uint n_lane0 = nb + fr, n_lane1 = nb + 8 + fr;

  simdgroup_matrix<float, 8, 8> acc[2][MF];
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < MF; ++i) acc[j][i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  marlin_moe_load_x_tile<T>(a_tiles, x, pair_of_row, 0, K, x_row_div, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint buf = 0;
  for (uint k0 = 0; k0 < K; k0 += kGemmTileK) {
    if (k0 + kGemmTileK < K)
      marlin_moe_load_x_tile<T>(a_tiles + (buf ^ 1) * (TM * kGemmTileK), x, pair_of_row, k0 + kGemmTileK, K,
                                x_row_div, tid);
    const threadgroup T* a = a_tiles + buf * (TM * kGemmTileK);
    for (uint kk = 0; kk < uint(kGemmTileK / 8); ++kk) {
      const uint r = k0 / 8 + kk;  // packed row
      if (r >= KR) break;         // uniform: the last, partial stage
      simdgroup_matrix<float, 8, 8> wt[2];
      for (int j = 0; j < 2; ++j) {
        const uint n = j ? n_lane1 : n_lane0;
        uint w = 0;
        MarlinDequantParams prm = {0.0f, 0.0f, 0.0f};  // columns past N: weight 0
        if (n < N) {
          w = w_e[ulong(r) * N + n];
          prm = marlin_load_params<F>(s_e, z_e, r, n, N, group_rows);
        }
        marlin_set_elements(wt[j], marlin_dequant_pair<F>(w, fc, prm));
      }
      for (int i = 0; i < MF; ++i) {
        simdgroup_matrix<float, 8, 8> xt;  // rows = K, cols = tile rows
        const uint row = 8 * i + fc, col = 8 * kk + fr;
        marlin_set_elements(xt, float2(float(a[row * kGemmTileK + col]), float(a[(row + 1) * kGemmTileK + col])));
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[j][i], wt[j], xt, acc[j][i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf ^= 1;
  }

  // acc[j][i] element (fr, fc + v) is the tile's row 8 i + fc + v, column nb + 8 j + fr.
  for (int j = 0; j < 2; ++j) {
    const uint n = j ? n_lane1 : n_lane0;
    if (n >= N) continue;
    for (int i = 0; i < MF; ++i) {
      const float2 v = float2(acc[j][i].thread_elements()[0], acc[j][i].thread_elements()[1]);
      for (uint c = 0; c < 2; ++c) {
        const uint pair = pair_of_row[8 * i + fc + c];
        if (pair != kMoeNoPair) rows[ulong(pair) * N + n] = v[c];
      }
    }
  }
}

// --- epilogue --------------------------------------------------------------------

// Weight of pair p in the weights' own dtype (0: half, 1: bfloat, 2: float).
inline float marlin_moe_weight(const device uchar* weights, uint p, uint weight_dtype) {
  if (weight_dtype == 0) return float(reinterpret_cast<const device half*>(weights)[p]);
#if __METAL_VERSION__ >= 310
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
