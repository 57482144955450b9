// Fused dequant-in-registers GEMM, with an optional K split (each
// threadgroup of a grid.z slice takes a stripe of K) and its reduction kernel.
//
// y[M, N] = x[M, K] @ B[K, N] (+ bias). A threadgroup of 4 simdgroups owns a
// TM x 64 output tile (TM = 32 or 64); simdgroup s owns all TM rows and the
// 16 columns [16 s, 16 s + 16), i.e. (TM / 8) x 2 fragments of 8 x 8, so the
// four simdgroups cover the whole TM x 64 tile and every packed weight word
// of the tile is loaded by exactly one simdgroup.
//
// The simdgroup computes the transposed product C^T = B^T x^T in fp32
// simdgroup_matrix fragments: the B^T fragment (rows = 8 columns n, cols = 8
// K values) is built in registers. Lane l owns row R(l) and columns C(l),
// C(l) + 1 of a fragment (Apple's layout: R = (l / 4 & 4) + (l / 2) % 4,
// C = (l / 4 & 2) * 2 + (l % 2) * 2), i.e. two consecutive K values of one
// output column = the consecutive nibble pair (C, C + 1) of one packed word:
// one device load and one marlin_dequant_pair per lane, written straight into
// thread_elements(). No B staging in threadgroup memory, no simdgroup barrier
// (staging B through threadgroup memory, 8 lanes dequantizing 8 x 8 values,
// needs a staging tile per simdgroup and two simdgroup barriers per fragment
// while 24 lanes idle; docs/KERNELS.md compares the two).
//
// x goes through a double-buffered threadgroup tile [2][TM][32] of T
// (zero-filled past M and past the K slice), one threadgroup barrier per
// 32-deep K stage. The x^T fragment is read from it per lane the same way.
//
// K split (grid.z = splits > 1, function constant marlin_write_partial):
// slice z handles packed rows [z * split_rows, (z + 1) * split_rows) and
// stores its fp32 partial tile to partial[z][M][N]; marlin_reduce sums the
// slices in a fixed order (deterministic, no atomics, no zeroing pass since
// every slice writes its whole tile) and adds the bias.
#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_dequant.h"

using namespace metal;

// Cooperative load (kGemmThreads threads) of x[m0 .. m0 + TM, k0 .. k0 + 32] into a
// threadgroup tile, zero past M and past k_end.
template <typename T, int TM>
inline void marlin_load_x_tile(threadgroup T* dst, const device T* x, uint m0, uint k0, uint M,
                               uint K, uint k_end, uint tid) {
  for (uint e = tid; e < uint(TM * kGemmTileK); e += kGemmThreads) {
    const uint row = e / kGemmTileK, col = e % kGemmTileK;
    const uint m = m0 + row, k = k0 + col;
    dst[e] = (m < M && k < k_end) ? x[ulong(m) * K + k] : T(0.0f);
  }
}

template <typename T, WeightFormat F, int TM>
[[kernel]] void marlin_gemm_fused(const device T* x [[buffer(0)]],
                                  const device uint* packed [[buffer(1)]],
                                  const device half* scales [[buffer(2)]],
                                  const device half* zeros [[buffer(3)]],
                                  const device T* bias [[buffer(4)]],
                                  device T* y [[buffer(5)]],
                                  device float* partial [[buffer(6)]],
                                  constant uint& M [[buffer(7)]],
                                  constant uint& N [[buffer(8)]],
                                  constant uint& K [[buffer(9)]],
                                  constant uint& group_rows [[buffer(10)]],
                                  constant uint& split_rows [[buffer(11)]],
                                  threadgroup T* a_tiles [[threadgroup(0)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  constexpr int MF = TM / 8;  // fragments along M
  const uint fr = (lane / 4 & 4) + (lane / 2) % 4;    // fragment row of this lane
  const uint fc = (lane / 4 & 2) * 2 + (lane % 2) * 2;  // first fragment column
  const uint m0 = tgid.y * TM;
  const uint nb = tgid.x * kGemmTileN + sg * (kGemmTileN / 4);
  const uint KR = K / 8;
  const uint r_begin = tgid.z * split_rows;
  const uint r_end = min(KR, r_begin + split_rows);
  const uint k_begin = 8 * r_begin, k_end = 8 * r_end;

  simdgroup_matrix<float, 8, 8> acc[2][MF];
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < MF; ++i) acc[j][i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  // This lane's two B columns (one per N fragment) and their group params.
  const uint n_lane0 = nb + fr, n_lane1 = nb + 8 + fr;

  marlin_load_x_tile<T, TM>(a_tiles, x, m0, k_begin, M, K, k_end, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint buf = 0;
  for (uint k0 = k_begin; k0 < k_end; k0 += kGemmTileK) {
    if (k0 + kGemmTileK < k_end)
      marlin_load_x_tile<T, TM>(a_tiles + (buf ^ 1) * (TM * kGemmTileK), x, m0, k0 + kGemmTileK, M, K,
                                k_end, tid);
    const threadgroup T* a = a_tiles + buf * (TM * kGemmTileK);
    for (uint kk = 0; kk < kGemmTileK / 8; ++kk) {
      const uint r = k0 / 8 + kk;  // packed row
      if (r >= r_end) break;      // uniform: last, partial stage of the slice
      simdgroup_matrix<float, 8, 8> wt[2];
      for (int j = 0; j < 2; ++j) {
        const uint n = j ? n_lane1 : n_lane0;
        uint w = 0;
        MarlinDequantParams p = {0.0f, 0.0f, 0.0f};  // columns past N: weight 0
        if (n < N) {
          w = packed[ulong(r) * N + n];
          p = marlin_load_params<F>(scales, zeros, r, n, N, group_rows);
        }
        marlin_set_elements(wt[j], marlin_dequant_pair<F>(w, fc, p));
      }
      for (int i = 0; i < MF; ++i) {
        simdgroup_matrix<float, 8, 8> xt;  // rows = K, cols = M
        const uint row = 8 * i + fc, col = 8 * kk + fr;
        marlin_set_elements(xt, float2(float(a[row * kGemmTileK + col]),
                                       float(a[(row + 1) * kGemmTileK + col])));
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[j][i], wt[j], xt, acc[j][i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf ^= 1;
  }

  // acc[j][i] holds C^T: element (fr, fc + e) is y[m0 + 8 i + fc + e, nb + 8 j + fr].
  for (int j = 0; j < 2; ++j) {
    const uint n = j ? n_lane1 : n_lane0;
    if (n >= N) continue;
    const float b = (!marlin_write_partial && marlin_has_bias) ? float(bias[n]) : 0.0f;
    for (int i = 0; i < MF; ++i) {
      const float2 v = float2(acc[j][i].thread_elements()[0], acc[j][i].thread_elements()[1]);
      for (uint e = 0; e < 2; ++e) {
        const uint m = m0 + 8 * i + fc + e;
        if (m >= M) continue;
        if (marlin_write_partial)
          partial[(ulong(tgid.z) * M + m) * N + n] = v[e];
        else
          y[ulong(m) * N + n] = T(v[e] + b);
      }
    }
  }
}

// y[i] = sum over slices z of partial[z][i] (+ bias), one thread per output.
template <typename T>
[[kernel]] void marlin_reduce(const device float* partial [[buffer(0)]],
                              const device T* bias [[buffer(1)]],
                              device T* y [[buffer(2)]],
                              constant uint& M [[buffer(3)]],
                              constant uint& N [[buffer(4)]],
                              constant uint& splits [[buffer(5)]],
                              uint gid [[thread_position_in_grid]]) {
  const uint total = M * N;
  if (gid >= total) return;
  float s = 0.0f;
  for (uint z = 0; z < splits; ++z) s += partial[z * total + gid];
  if (marlin_has_bias) s += float(bias[gid % N]);
  y[gid] = T(s);
}

#define MARLIN_FUSED(dt, T, fmt, F, TM)                                                  \
  template [[host_name("marlin_gemm_fused_" #fmt "_" #dt "_tm" #TM)]] [[kernel]] decltype( \
      marlin_gemm_fused<T, F, TM>) marlin_gemm_fused<T, F, TM>;
#define MARLIN_FUSED_TILES(dt, T, Tname, fmt, F) MARLIN_FUSED(dt, T, fmt, F, 32) MARLIN_FUSED(dt, T, fmt, F, 64)
#define MARLIN_FUSED_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_FUSED_TILES, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_FUSED_DTYPES, )

#define MARLIN_REDUCE(dt, T, Tname, _)                                                 \
  template [[host_name("marlin_reduce_" #dt)]] [[kernel]] decltype(marlin_reduce<T>) \
      marlin_reduce<T>;
MARLIN_FOR_EACH_DTYPE(MARLIN_REDUCE, )
