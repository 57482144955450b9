// Fused dequant-in-registers GEMM (8 < M <= 64), with an optional K split
// (grid.z slices of K, reduced by metal/marlin_reduce.h).
//
// y[M, N] = x[M, K] @ B[K, N] (+ bias). A threadgroup of 4 simdgroups owns a
// TM x 64 output tile (TM = 32 or 64); simdgroup s owns all TM rows and the
// 16 columns [16 s, 16 s + 16), i.e. (TM / 8) x 2 fragments of 8 x 8, so the
// four simdgroups cover the whole tile and every packed weight word of the
// tile is decoded by exactly one simdgroup.
//
// The simdgroup computes the transposed product C^T = B^T x^T in fp32
// simdgroup_matrix fragments, the B^T fragment (rows = 8 columns n, cols = 8
// K values) built in registers: lane (row, col) of a fragment (marlin_lane)
// owns output column `row` and the two K values of fragment columns col,
// col + 1, which the K permutation of marlin_fragment_k makes the nibble pair
// (col / 2, col / 2 + 4) of one packed word: one device load and one
// marlin_dequant_pair per lane, written straight into thread_elements(). No B
// staging in threadgroup memory, no simdgroup barrier (docs/KERNELS.md
// compares it with staging B).
//
// x goes through a double-buffered, padded threadgroup tile
// [2][TM][x_tile_stride] of T (zero past M and past the K slice), one
// threadgroup barrier per kGemmTileK-deep stage; the x^T fragment is read
// from it per lane with the same K permutation.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_tile.h"

using namespace metal;

// One TM x kGemmTileN output tile (column block n_block) over packed rows
// [r_begin, r_end): tile row i reads x row rows.x_row(i) (zero where
// !rows.has(i)) and stores output row m0 + i through `out` (MarlinOutput, or
// the routed expert GEMM's row scatter, metal/moe.metal).
template <typename T, WeightFormat F, int TM, typename Rows, typename Out>
inline void marlin_gemm_fused_tile(const device T* x, thread const Rows& rows, const device uint* packed,
                                   const device half* scales, const device half* zeros, uint N, uint K,
                                   uint n_block, uint r_begin, uint r_end, thread const Out& out, uint m0,
                                   threadgroup T* x_tiles, uint tid, uint sg, uint lane) {
  constexpr int MF = TM / 8;  // fragments along M
  constexpr uint S = x_tile_stride(sizeof(T)), XS = TM * S;
  const MarlinLane l = marlin_lane(lane);
  const uint p = l.col / 2;                   // nibble pair (p, p + 4) of this lane
  const uint k_lane = marlin_fragment_k(l.row);  // K row of this lane in an x^T fragment
  const uint nb = n_block * kGemmTileN + sg * (kGemmTileN / 4);
  const uint k_begin = 8 * r_begin, k_end = 8 * r_end;

  simdgroup_matrix<float, 8, 8> acc[2][MF];
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < MF; ++i) acc[j][i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  // This lane's two B columns (one per N fragment).
  const uint n_lane[2] = {nb + l.row, nb + 8 + l.row};

  marlin_load_x_rows<T, TM>(x_tiles, x, rows, k_begin, K, k_end, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint buf = 0;
  for (uint k0 = k_begin; k0 < k_end; k0 += kGemmTileK) {
    if (k0 + kGemmTileK < k_end)
      marlin_load_x_rows<T, TM>(x_tiles + (buf ^ 1) * XS, x, rows, k0 + kGemmTileK, K, k_end, tid);
    const threadgroup T* a = x_tiles + buf * XS;
    // A stage lies in one group (the smallest group, 16 K, is one stage: marlin_common.h).
    MarlinParams params[2];
    for (int j = 0; j < 2; ++j)
      params[j] = n_lane[j] < N ? marlin_load_params<F>(scales, zeros, marlin_group_of(k0 / 8), n_lane[j], N)
                                : MarlinParams{0.0f, 0.0f};  // columns past N: weight 0
    for (uint kk = 0; kk < kGemmTileK / 8; ++kk) {
      const uint r = k0 / 8 + kk;  // packed row
      if (r >= r_end) break;       // uniform: last, partial stage of the slice
      simdgroup_matrix<float, 8, 8> wt[2];
      for (int j = 0; j < 2; ++j) {
        const uint w = n_lane[j] < N ? packed[ulong(r) * N + n_lane[j]] : 0u;
        marlin_set_elements(wt[j], marlin_dequant_pair<F>(w, p, params[j]));
      }
      for (int i = 0; i < MF; ++i) {
        simdgroup_matrix<float, 8, 8> xt;  // rows = K (permuted), cols = M
        const uint row = 8 * i + l.col, col = 8 * kk + k_lane;
        marlin_set_elements(xt, float2(float(a[row * S + col]), float(a[(row + 1) * S + col])));
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[j][i], wt[j], xt, acc[j][i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf ^= 1;
  }

  // acc[j][i] is a fragment of C^T: element (r, c) is y[m0 + 8 i + c, nb + 8 j + r].
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < MF; ++i) marlin_store_fragment(out, acc[j][i], l, nb + 8 * j, m0 + 8 * i, true);
}

template <typename T, WeightFormat F, int TM>
[[kernel]] void marlin_gemm_fused(MARLIN_GEMM_BUFFERS(T),
                                  threadgroup T* x_tiles [[threadgroup(0)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  const uint m0 = tgid.y * TM;
  const uint r_begin = tgid.z * split_rows, r_end = min(K / 8, r_begin + split_rows);
  const MarlinDenseRows rows{m0, M};
  const MarlinOutput<T> out{y, partial, bias, M, N, tgid.z};
  marlin_gemm_fused_tile<T, F, TM>(x, rows, packed, scales, zeros, N, K, tgid.x, r_begin, r_end, out, m0,
                                   x_tiles, tid, sg, lane);
}
