// 2:4 sparse decode GEMV: y[M, N] = x[M, K] @ B[K, N] (+ bias) for M <= MR <= 8,
// B in the 2:4 layout (metal/sparse24_decode.h). The dense GEMV's structure
// (metal/marlin_gemv.h) on values rows of 16 K instead of packed rows of 8:
// a threadgroup owns 32 output columns and all of K; lane = 8 * kl + cl reads
// 4 consecutive values words (4 columns) of values rows 8 (sg + nsg i) + 2 kl
// and the next (a run of 32 K) and the one metadata word of each column that
// covers both, so every values and metadata byte comes from memory once and
// a group's params once per run (once per simdgroup step at g >= 128). Each
// block of 4 K rows is decoded once per column into a float4 of dense weights (zeros at pruned
// positions) and dotted with the block's x for every row: the bytes are 3/4
// of the dense GEMV's (the point for a memory-bound kernel), the multiplies
// the same. Reduction and output as the dense GEMV.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "sparse24_decode.h"

using namespace metal;

template <typename T, WeightFormat F, int MR>
[[kernel]] void marlin_sparse24_gemv(const device T* x [[buffer(0)]],
                                     const device uint* values [[buffer(1)]],
                                     const device uint* metadata [[buffer(2)]],
                                     const device half* scales [[buffer(3)]],
                                     const device half* zeros [[buffer(4)]],
                                     const device T* bias [[buffer(5)]],
                                     device T* y [[buffer(6)]],
                                     constant uint& M [[buffer(7)]],
                                     constant uint& N [[buffer(8)]],
                                     constant uint& K [[buffer(9)]],
                                     threadgroup float* partial [[threadgroup(0)]],
                                     uint3 tgid [[threadgroup_position_in_grid]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint nsg [[simdgroups_per_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  const uint cl = lane % 8, kl = lane / 8;
  const uint n0 = tgid.x * kGemvColumns + 4 * cl;  // first of this lane's 4 columns
  const uint VR = K / kSparseValueRows;
  const bool full = n0 + 3 < N;

  float acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = 0.0f;

  // Lane kl of simdgroup sg takes the run of values rows r0, r0 + 1 (32 K: one metadata
  // word) of each 8-row step (128 K) of the simdgroup: a group of >= 32 K loads its params
  // once per run, and the 4 runs of a step share one load at g >= 128 (one address).
  const bool run_in_group = marlin_group_rows == 0 || marlin_group_rows >= 4;
  for (uint r0 = 8 * sg + 2 * kl; r0 < VR; r0 += 8 * nsg) {  // VR is even: r0 + 1 < VR
    uint mw[4];
    MarlinParams p[4];
    for (uint c = 0; c < 4; ++c) {
      const bool ok = full || n0 + c < N;
      mw[c] = ok ? metadata[ulong(r0 / 2) * N + n0 + c] : 0x44444444u;  // tail: (0,1), weight 0
    }
    for (uint h = 0; h < 2; ++h) {
      const uint r = r0 + h;
      uint w[4], meta[4];
      for (uint c = 0; c < 4; ++c) {
        const bool ok = full || n0 + c < N;
        w[c] = ok ? values[ulong(r) * N + n0 + c] : 0u;
        meta[c] = marlin_sparse_meta(mw[c], r);
        // a values row lies in one group (group sizes are multiples of 16)
        if (h == 0 || !run_in_group)
          p[c] = ok ? marlin_sparse_params<F>(scales, zeros, r, n0 + c, N) : MarlinParams{0.0f, 0.0f};
      }
      for (uint b = 0; b < 4; ++b) {
        float4 xv[MR];
        for (int m = 0; m < MR; ++m) {
          if (uint(m) < M) {
            const device T* xb = x + ulong(m) * K + kSparseValueRows * r + 4 * b;
            xv[m] = float4(float(xb[0]), float(xb[1]), float(xb[2]), float(xb[3]));
          } else {
            xv[m] = float4(0.0f);
          }
        }
        for (uint c = 0; c < 4; ++c) {
          const float4 wb = marlin_sparse_block<F>(w[c], meta[c], b, p[c]);
          for (int m = 0; m < MR; ++m) acc[m][c] += dot(wb, xv[m]);
        }
      }
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
