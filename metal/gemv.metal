// Decode GEMV: y[M, N] = x[M, K] @ B[K, N] (+ bias) for M <= MR <= 8.
//
// Memory-bound: every packed weight word is loaded exactly once by exactly one
// lane of the whole grid. A threadgroup owns 32 output columns and all of K;
// its SG simdgroups split the packed rows (8 K values each) round-robin.
// Inside a simdgroup, lane = 8 * kl + cl: the 8 lanes with the same kl read
// 4 consecutive words each, i.e. 128 contiguous bytes of one packed row, and
// the 4 kl lanes take 4 different rows. Each lane keeps MR x 4 fp32 partial
// dot products; the 4 kl lanes of a column are summed with simd_shuffle_xor
// (a 4-lane simd reduction), the simdgroups through threadgroup memory
// (SG * MR * 32 floats), then one thread per (row, column) adds the bias and
// rounds once to T. SG is read at run time (simdgroups_per_threadgroup): the
// bridge may launch fewer simdgroups than planned when a pipeline allows fewer
// threads (csrc/core/metal_plan.cpp fit_threadgroup).
#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_dequant.h"

using namespace metal;

template <typename T, WeightFormat F, int MR>
[[kernel]] void marlin_gemv(const device T* x [[buffer(0)]],
                            const device uint* packed [[buffer(1)]],
                            const device half* scales [[buffer(2)]],
                            const device half* zeros [[buffer(3)]],
                            const device T* bias [[buffer(4)]],
                            device T* y [[buffer(5)]],
                            constant uint& M [[buffer(6)]],
                            constant uint& N [[buffer(7)]],
                            constant uint& K [[buffer(8)]],
                            constant uint& group_rows [[buffer(9)]],
                            threadgroup float* partial [[threadgroup(0)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  const uint cl = lane % 8, kl = lane / 8;
  const uint n0 = tgid.x * kGemvColumns + 4 * cl;  // first of this lane's 4 columns
  const uint KR = K / 8;
  const bool full = n0 + 3 < N;

  float acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

  for (uint r = 4 * sg + kl; r < KR; r += 4 * nsg) {
    uint w[4];
    MarlinDequantParams p[4];
    for (uint c = 0; c < 4; ++c) {
      const bool ok = full || n0 + c < N;
      w[c] = ok ? packed[ulong(r) * N + n0 + c] : 0u;
      p[c] = ok ? marlin_load_params<F>(scales, zeros, r, n0 + c, N, group_rows)
                : MarlinDequantParams{0.0f, 0.0f, 0.0f};
    }
    float4 xv[MR][2];
    for (int m = 0; m < MR; ++m) {
      if (uint(m) < M) {
        const device T* xr = x + ulong(m) * K + 8 * r;
        xv[m][0] = float4(float(xr[0]), float(xr[1]), float(xr[2]), float(xr[3]));
        xv[m][1] = float4(float(xr[4]), float(xr[5]), float(xr[6]), float(xr[7]));
      } else {
        xv[m][0] = float4(0.0f);
        xv[m][1] = float4(0.0f);
      }
    }
    for (uint c = 0; c < 4; ++c) {
      const float2 d0 = marlin_dequant_pair<F>(w[c], 0, p[c]);
      const float2 d1 = marlin_dequant_pair<F>(w[c], 2, p[c]);
      const float2 d2 = marlin_dequant_pair<F>(w[c], 4, p[c]);
      const float2 d3 = marlin_dequant_pair<F>(w[c], 6, p[c]);
      const float4 lo = float4(d0, d1), hi = float4(d2, d3);
      for (int m = 0; m < MR; ++m) acc[m][c] += dot(lo, xv[m][0]) + dot(hi, xv[m][1]);
    }
  }

  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < 4; ++c) {
      float v = acc[m][c];
      v += simd_shuffle_xor(v, ushort(8));
      v += simd_shuffle_xor(v, ushort(16));
      if (kl == 0) partial[(sg * MR + m) * kGemvColumns + 4 * cl + c] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // One thread per (row, column); a threadgroup shrunk below MR simdgroups
  // (fit_threadgroup) loops.
  for (uint i = tid; i < uint(MR) * kGemvColumns; i += nsg * kSimdWidth) {
    const uint m = i / kGemvColumns, col = i % kGemvColumns, n = tgid.x * kGemvColumns + col;
    if (m < M && n < N) {
      float s = 0.0f;
      for (uint g = 0; g < nsg; ++g) s += partial[(g * MR + m) * kGemvColumns + col];
      if (marlin_has_bias) s += float(bias[n]);
      y[ulong(m) * N + n] = T(s);
    }
  }
}

#define MARLIN_GEMV(dt, T, fmt, F, MR)                                            \
  template [[host_name("marlin_gemv_" #fmt "_" #dt "_m" #MR)]] [[kernel]] decltype( \
      marlin_gemv<T, F, MR>) marlin_gemv<T, F, MR>;
// MR: rows of x held per lane; the planner picks the smallest >= M.
#define MARLIN_GEMV_ROWS(dt, T, Tname, fmt, F) \
  MARLIN_GEMV(dt, T, fmt, F, 1) MARLIN_GEMV(dt, T, fmt, F, 4) MARLIN_GEMV(dt, T, fmt, F, 8)
#define MARLIN_GEMV_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_GEMV_ROWS, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_GEMV_DTYPES, )
