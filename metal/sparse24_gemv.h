// 2:4 sparse decode GEMV: y[M, N] = x[M, K] @ B[K, N] (+ bias) for M <= MR <= 8,
// B in the 2:4 layout (metal/sparse24_decode.h), with the dense GEMV's K split.
//
// The dense GEMV's structure (metal/marlin_gemv.h) on values rows of 16 K
// instead of packed rows of 8: a threadgroup owns 32 output columns of one K
// slice (grid.y; whole 8-values-row blocks); lane 8 * kl + cl loads 4
// consecutive values words (4 columns, one 16-byte load with marlin_aligned)
// of values rows r0 = 8 (sg + nsg i) + 2 kl and r0 + 1 (a run of 32 K) and the
// one metadata word of each column that covers both (one 16-byte load too),
// so every values and metadata byte comes from memory once.
//
// Arithmetic, as the dense GEMV: a block's kept pair is decoded raw
// (marlin_raw_pair, the dense decode) and multiplied with the two x values at
// its positions, selected by position (2 selects each, no dense float4 of
// weights with zeros); the products are summed raw over the run (a values row
// for group size 16) and the group's scale (and zero point or bias:
// marlin_group_dot, with the sum of the selected x) applied once per run.
// Metadata is not validated here: MarlinLinear and the CPU op check it where
// it is loaded; an invalid pattern still selects in-bounds x values (positions
// are 2-bit), so it gives a defined, finite result and reads nothing outside
// the block.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_gemv.h"
#include "sparse24_decode.h"

using namespace metal;

// x of the first kept position of a block (0..2 when valid) and of the second (1..3).
inline float marlin_sparse_x_first(float4 x, uint p) { return p == 0u ? x.x : (p == 1u ? x.y : x.z); }
inline float marlin_sparse_x_second(float4 x, uint p) { return p == 3u ? x.w : (p == 2u ? x.z : x.y); }

template <typename T, WeightFormat F, int MR>
[[kernel]] void marlin_sparse24_gemv(MARLIN_SPARSE24_BUFFERS(T),
                                     threadgroup float* sums [[threadgroup(0)]],
                                     uint3 tgid [[threadgroup_position_in_grid]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint nsg [[simdgroups_per_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  const uint cl = lane % 8, kl = lane / 8;
  const uint n0 = tgid.x * kGemvColumns + 4 * cl;  // first of this lane's 4 columns
  const uint VR = K / kSparseValueRows;
  const uint r_begin = tgid.y * split_rows, r_end = min(VR, r_begin + split_rows);  // both even
  // Values rows after which the raw sums are scaled: every row (group size 16),
  // every run of 2 (a run of 32 K lies in one group of >= 32), never (one group).
  const uint flush_every = marlin_group_rows == 0 ? 0u : (marlin_group_rows == 2 ? 1u : 2u);

  float acc[MR][4], raw[MR][4], xsum[MR][4];  // xsum: x at kept positions (zero point or bias)
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = raw[m][c] = xsum[m][c] = 0.0f;

  for (uint r0 = r_begin + 8 * sg + 2 * kl; r0 < r_end; r0 += 8 * nsg) {
    const uint4 mw = marlin_gemv_words(metadata + ulong(r0 / 2) * N + n0, n0, N);
    const uint4 w[2] = {marlin_gemv_words(values + ulong(r0) * N + n0, n0, N),
                        marlin_gemv_words(values + ulong(r0 + 1) * N + n0, n0, N)};
    for (uint h = 0; h < 2; ++h) {
      const uint r = r0 + h;
      for (uint bp = 0; bp < 2; ++bp) {  // blocks 2 bp, 2 bp + 1: 8 K of x per row
        float4 xv[MR][2];
        for (int m = 0; m < MR; ++m)
          if (uint(m) < M) marlin_gemv_x8<T>(x + ulong(m) * K + kSparseValueRows * r + 8 * bp, xv[m][0], xv[m][1]);
        for (uint c = 0; c < 4; ++c) {
          const uint meta = marlin_sparse_meta(mw[c], r);
          for (uint i = 0; i < 2; ++i) {
            const half2 q = marlin_raw_pair<F>(w[h][c], 2 * bp + i);
            const uint2 pos = marlin_sparse_positions(meta, 2 * bp + i);
            for (int m = 0; m < MR; ++m) {
              if (uint(m) >= M) break;
              const float x0 = marlin_sparse_x_first(xv[m][i], pos.x), x1 = marlin_sparse_x_second(xv[m][i], pos.y);
              raw[m][c] = fma(float(q.y), x1, fma(float(q.x), x0, raw[m][c]));
              if (has_zeros(F)) xsum[m][c] += x0 + x1;
            }
          }
        }
      }
      if (flush_every != 0 && (h + 1) % flush_every == 0) {
        float4 s, z;
        marlin_gemv_params<F>(scales, zeros, marlin_group_of(2 * r), n0, N, s, z);
        for (int m = 0; m < MR; ++m) {
          for (int c = 0; c < 4; ++c) {
            acc[m][c] = marlin_group_dot<F>(acc[m][c], raw[m][c], xsum[m][c], s[c], z[c]);
            raw[m][c] = xsum[m][c] = 0.0f;
          }
        }
      }
    }
  }
  if (marlin_group_rows == 0) {  // one group: scale the whole sum once
    float4 s, z;
    marlin_gemv_params<F>(scales, zeros, 0, n0, N, s, z);
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < 4; ++c) acc[m][c] = marlin_group_dot<F>(0.0f, raw[m][c], xsum[m][c], s[c], z[c]);
  }

  // Sum the 4 kl lanes of each column, then the simdgroups.
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < 4; ++c) {
      float v = acc[m][c];
      v += simd_shuffle_xor(v, ushort(8));
      v += simd_shuffle_xor(v, ushort(16));
      if (kl == 0) sums[(sg * MR + m) * kGemvColumns + 4 * cl + c] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // One thread per (row, column); a threadgroup shrunk below MR simdgroups
  // (fit_threadgroup) loops.
  const MarlinOutput<T> out{y, partial, bias, M, N, tgid.y};
  for (uint i = tid; i < uint(MR) * kGemvColumns; i += nsg * kSimdWidth) {
    const uint m = i / kGemvColumns, col = i % kGemvColumns;
    float v = 0.0f;
    for (uint g = 0; g < nsg; ++g) v += sums[(g * MR + m) * kGemvColumns + col];
    out.store(m, tgid.x * kGemvColumns + col, v);
  }
}
