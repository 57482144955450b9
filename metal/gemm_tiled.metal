// Tiled, double-buffered GEMM (for larger M): a threadgroup of 4 simdgroups
// computes a 64 x 64 output tile and simdgroup s owns the 32 x 32 quadrant
// (rows 32 * (s / 2), cols 32 * (s % 2)) = 4 x 4 fp32 8x8 fragments, so the
// four quadrants cover all 64 x 64 (2 x 4 fragments per simdgroup would
// cover only 32 x 64).
//
// Per 32-deep K stage, all 128 threads cooperatively
//   * load the x tile [64][32] (T, zero past M and past the K slice) and
//   * dequantize the B tile [32][64] into fp32 (each thread 2 packed words,
//     lanes along N, so a simdgroup reads 128 contiguous bytes of a row),
// into the other half of a double buffer while the simdgroups multiply the
// current half: one threadgroup barrier per stage. Threadgroup memory:
// 2 * (64 * 32 * sizeof(T) + 32 * 64 * 4) bytes = 24 KiB (f16/bf16), 32 KiB (f32).
// B fragments use simdgroup_load (fp32 tile, row stride 64); x fragments are
// read per lane into thread_elements (converting T to fp32).
//
// Same K split (grid.z, marlin_write_partial, partial[z][M][N]) and output
// rules as metal/gemm_fused.metal; marlin_reduce lives there.
#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_dequant.h"

using namespace metal;

// Stage k0: x tile and dequantized B tile (threadgroup-wide, 128 threads).
template <typename T, WeightFormat F>
inline void marlin_tiled_load_stage(threadgroup T* xs, threadgroup float* bs, const device T* x,
                                    const device uint* packed, const device half* scales,
                                    const device half* zeros, uint m0, uint n0, uint k0, uint M,
                                    uint N, uint K, uint k_end, uint group_rows, uint tid) {
  for (uint e = tid; e < uint(kTiledTileM * kGemmTileK); e += kGemmThreads) {
    const uint row = e / kGemmTileK, col = e % kGemmTileK;
    const uint m = m0 + row, k = k0 + col;
    xs[e] = (m < M && k < k_end) ? x[ulong(m) * K + k] : T(0.0f);
  }
  for (uint e = tid; e < uint(kGemmTileK / 8 * kGemmTileN); e += kGemmThreads) {
    const uint rr = e / kGemmTileN, col = e % kGemmTileN;
    const uint r = k0 / 8 + rr, n = n0 + col;
    uint w = 0;
    MarlinDequantParams p = {0.0f, 0.0f, 0.0f};  // past N or past the slice: zeros
    if (n < N && 8 * r < k_end) {
      w = packed[ulong(r) * N + n];
      p = marlin_load_params<F>(scales, zeros, r, n, N, group_rows);
    }
    threadgroup float* dst = bs + (8 * rr) * kGemmTileN + col;
    for (uint j = 0; j < 8; j += 2) {
      const float2 v = marlin_dequant_pair<F>(w, j, p);
      dst[j * kGemmTileN] = v.x;
      dst[(j + 1) * kGemmTileN] = v.y;
    }
  }
}

template <typename T, WeightFormat F>
[[kernel]] void marlin_gemm_tiled(const device T* x [[buffer(0)]],
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
                                  threadgroup uchar* smem [[threadgroup(0)]],
                                  uint3 tgid [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint XS = kTiledTileM * kGemmTileK;  // elements per x tile
  constexpr uint BS = kGemmTileK * kGemmTileN;  // elements per B tile
  threadgroup float* b_tiles = (threadgroup float*)smem;                  // [2][32][64] fp32
  threadgroup T* x_tiles = (threadgroup T*)(smem + 2 * BS * sizeof(float));  // [2][64][32] T

  const uint fr = (lane / 4 & 4) + (lane / 2) % 4;
  const uint fc = (lane / 4 & 2) * 2 + (lane % 2) * 2;
  const uint m0 = tgid.y * kTiledTileM, n0 = tgid.x * kGemmTileN;
  const uint sm = 32 * (sg / 2), sn = 32 * (sg % 2);  // this simdgroup's quadrant
  const uint KR = K / 8;
  const uint r_begin = tgid.z * split_rows;
  const uint r_end = min(KR, r_begin + split_rows);
  const uint k_begin = 8 * r_begin, k_end = 8 * r_end;

  simdgroup_matrix<float, 8, 8> acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  marlin_tiled_load_stage<T, F>(x_tiles, b_tiles, x, packed, scales, zeros, m0, n0, k_begin, M, N, K,
                                k_end, group_rows, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint buf = 0;
  for (uint k0 = k_begin; k0 < k_end; k0 += kGemmTileK) {
    if (k0 + kGemmTileK < k_end)
      marlin_tiled_load_stage<T, F>(x_tiles + (buf ^ 1) * XS, b_tiles + (buf ^ 1) * BS, x, packed, scales,
                                    zeros, m0, n0, k0 + kGemmTileK, M, N, K, k_end, group_rows, tid);
    const threadgroup T* xs = x_tiles + buf * XS;
    const threadgroup float* bs = b_tiles + buf * BS;
    for (uint kk = 0; kk < kGemmTileK; kk += 8) {
      simdgroup_matrix<float, 8, 8> a[4], b[4];
      for (int i = 0; i < 4; ++i) {
        const uint row = sm + 8 * i + fr, col = kk + fc;
        marlin_set_elements(a[i], float2(float(xs[row * kGemmTileK + col]),
                                         float(xs[row * kGemmTileK + col + 1])));
      }
      for (int j = 0; j < 4; ++j) simdgroup_load(b[j], bs + kk * kGemmTileN + sn + 8 * j, kGemmTileN);
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf ^= 1;
  }

  // acc[i][j] element (fr, fc + e) is y[m0 + sm + 8 i + fr, n0 + sn + 8 j + fc + e].
  for (int i = 0; i < 4; ++i) {
    const uint m = m0 + sm + 8 * i + fr;
    if (m >= M) continue;
    for (int j = 0; j < 4; ++j) {
      const float2 v = float2(acc[i][j].thread_elements()[0], acc[i][j].thread_elements()[1]);
      for (uint e = 0; e < 2; ++e) {
        const uint n = n0 + sn + 8 * j + fc + e;
        if (n >= N) continue;
        if (marlin_write_partial) {
          partial[(ulong(tgid.z) * M + m) * N + n] = v[e];
        } else {
          const float b = marlin_has_bias ? float(bias[n]) : 0.0f;
          y[ulong(m) * N + n] = T(v[e] + b);
        }
      }
    }
  }
}

#define MARLIN_TILED(dt, T, Tname, fmt, F)                                          \
  template [[host_name("marlin_gemm_tiled_" #fmt "_" #dt)]] [[kernel]] decltype( \
      marlin_gemm_tiled<T, F>) marlin_gemm_tiled<T, F>;
#define MARLIN_TILED_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_TILED, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_TILED_DTYPES, )
