// Tiled GEMM (M > 64), with the same optional K split as the fused GEMM.
//
// A threadgroup of 4 simdgroups computes a 64 x 64 output tile; simdgroup s
// owns the 32 x 32 quadrant (rows 32 * (s / 2), cols 32 * (s % 2)) = 4 x 4
// fp32 8x8 fragments. Per kGemmTileK-deep stage all 128 threads
//   * load the x tile [64][x_tile_stride] (T, zero past M and past the slice), and
//   * dequantize the B tile [kGemmTileK][b_tile_stride] into fp32: one packed
//     word per thread (lanes along N: a simdgroup reads 128 contiguous bytes
//     of a row), its 8 values written to rows 8 rr + p and 8 rr + p + 4;
// a barrier; the simdgroups multiply (x fragments read per lane as T pairs, B
// fragments with simdgroup_load); a barrier before the next stage overwrites
// the tiles. Single-buffered: both tiles, padded against bank conflicts, stay
// within kThreadgroupMemoryBudget for fp32 x too (a double buffer would not);
// latency is hidden by the other threadgroups on the core instead.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_tile.h"

using namespace metal;

template <typename T, WeightFormat F>
[[kernel]] void marlin_gemm_tiled(MARLIN_GEMM_BUFFERS(T),
                                  threadgroup uchar* smem [[threadgroup(0)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint SX = x_tile_stride(sizeof(T)), SB = b_tile_stride();
  threadgroup T* xs = (threadgroup T*)smem;                                         // [64][SX] T
  threadgroup float* bs = (threadgroup float*)(smem + tiled_x_tile_bytes(sizeof(T)));  // [16][SB] fp32

  const MarlinLane l = marlin_lane(lane);
  const uint m0 = tgid.y * kTiledTileM, n0 = tgid.x * kGemmTileN;
  const uint sm = 32 * (sg / 2), sn = 32 * (sg % 2);  // this simdgroup's quadrant
  const uint KR = K / 8;
  const uint r_begin = tgid.z * split_rows;
  const uint r_end = min(KR, r_begin + split_rows);
  const uint k_begin = 8 * r_begin, k_end = 8 * r_end;
  // This thread's word of each stage: packed row k0 / 8 + rr, column n0 + col
  // (kGemmTileK / 8 rows x kGemmTileN columns = kGemmThreads words).
  const uint rr = tid / kGemmTileN, col = tid % kGemmTileN;
  const uint n = n0 + col;

  simdgroup_matrix<float, 8, 8> acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = k_begin; k0 < k_end; k0 += kGemmTileK) {
    marlin_load_x_tile<T, kTiledTileM>(xs, x, m0, k0, M, K, k_end, tid);
    {
      const uint r = k0 / 8 + rr;
      uint w = 0;
      MarlinParams params = {0.0f, 0.0f};  // past N or past the slice: zeros
      if (n < N && r < r_end) {
        w = packed[ulong(r) * N + n];
        params = marlin_load_params<F>(scales, zeros, marlin_group_of(r), n, N);
      }
      threadgroup float* dst = bs + 8 * rr * SB + col;
      for (uint p = 0; p < 4; ++p) {
        const float2 v = marlin_dequant_pair<F>(w, p, params);
        dst[p * SB] = v.x;
        dst[(p + 4) * SB] = v.y;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < kGemmTileK; kk += 8) {
      simdgroup_matrix<float, 8, 8> a[4], b[4];
      for (int i = 0; i < 4; ++i) {
        const vec<T, 2> v = *(const threadgroup vec<T, 2>*)(xs + (sm + 8 * i + l.row) * SX + kk + l.col);
        marlin_set_elements(a[i], float2(v));
      }
      for (int j = 0; j < 4; ++j) simdgroup_load(b[j], bs + kk * SB + sn + 8 * j, SB);
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // acc[i][j] element (r, c) is y[m0 + sm + 8 i + r, n0 + sn + 8 j + c].
  const MarlinOutput<T> out{y, partial, bias, M, N, tgid.z};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) marlin_store_fragment(out, acc[i][j], l, m0 + sm + 8 * i, n0 + sn + 8 * j, false);
}
