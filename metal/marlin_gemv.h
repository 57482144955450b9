// Decode GEMV: y[M, N] = x[M, K] @ B[K, N] (+ bias) for M <= MR <= 8,
// designed to run at memory bandwidth (docs/KERNELS.md counts it).
//
// Work split. A threadgroup owns kGemvColumns = 32 output columns of one K
// slice (grid.y; a slice is whole kGemvBlockRows-row blocks). Lane
// 8 * kl + cl owns the 4 columns 4 cl .. 4 cl + 3: one 16-byte load gives it
// 4 adjacent packed words of a row, and the 8 cl lanes read 128 contiguous
// bytes. A simdgroup takes a block of 16 packed rows (128 K values) at a time,
// lane kl the run of kGemvLaneRows = 4 consecutive rows kl * 4 .. kl * 4 + 3,
// so its 4 word loads are in flight together and its x values are 32
// contiguous K values; the simdgroups take blocks round-robin. Every packed
// word is loaded once in the whole grid.
//
// Arithmetic. A packed word is decoded into 4 half2 pairs (marlin_raw_pair:
// masks, ors, one shift and one half op per pair, no conversion instruction:
// the half operands of the fp32 fmas are free), multiplied with x in fp32 and
// summed *raw* over the lane's run of rows in one group; the group's scale
// (and zero point or bias: uint4 and affine sum q * x and x separately and
// apply scale * (sum q x - zero * sum x), or scale * sum q x + bias * sum x:
// marlin_group_dot) is applied once per run. The row count MR (1, 4 or 8:
// MARLIN_FOR_EACH_GEMV_ROWS) is a template parameter, so the per-row register
// arrays (acc, raw, xsum) are indexed by constants once the MR-bounded loops
// are unrolled; rows past M are skipped (a branch uniform over the grid), so
// all work is bounded by M.
//
// Reduction. The 4 kl lanes of a column are summed with simd_shuffle_xor, the
// simdgroups through threadgroup memory (sized for kGemvSimdgroups, filled
// for the simdgroups actually launched: the kernel is correct with 1 to 8, and
// the bridge launches fewer when a pipeline allows fewer threads:
// csrc/core/metal_plan.cpp fit_threadgroup), then each (row, column) goes
// through the shared epilogue (bias and one rounding, or an fp32 partial of
// the K split), looping when there are fewer threads than outputs.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_tile.h"

using namespace metal;

// The 4 packed words at p = &packed[r, n0] (columns n0 .. n0 + 3); zeros past N.
inline uint4 marlin_gemv_words(const device uint* p, uint n0, uint N) {
  if (marlin_aligned) return n0 < N ? *(const device uint4*)p : uint4(0u);
  uint4 w;
  for (uint c = 0; c < 4; ++c) w[c] = n0 + c < N ? p[c] : 0u;
  return w;
}

// Scales (and zeros) of columns n0 .. n0 + 3 in group g.
template <WeightFormat F>
inline void marlin_gemv_params(const device half* scales, const device half* zeros, uint g, uint n0, uint N,
                               thread float4& s, thread float4& z) {
  const ulong i = ulong(g) * N + n0;
  s = float4(0.0f);
  z = float4(0.0f);
  if (marlin_aligned) {
    if (n0 < N) {
      s = float4(*(const device half4*)(scales + i));
      if (has_zeros(F)) z = float4(*(const device half4*)(zeros + i));
    }
  } else {
    for (uint c = 0; c < 4; ++c) {
      if (n0 + c < N) {
        s[c] = float(scales[i + c]);
        if (has_zeros(F)) z[c] = float(zeros[i + c]);
      }
    }
  }
  s = MarlinFormat<F>::scale(s);
}

// x[m, k .. k + 8) as the two float4 (k .. k + 3) and (k + 4 .. k + 7): pair p
// of a packed word multiplies (lo[p], hi[p]).
template <typename T>
inline void marlin_gemv_x8(const device T* x, thread float4& lo, thread float4& hi) {
  if (marlin_aligned) {
    lo = float4(*(const device vec<T, 4>*)x);
    hi = float4(*(const device vec<T, 4>*)(x + 4));
  } else {
    lo = float4(float(x[0]), float(x[1]), float(x[2]), float(x[3]));
    hi = float4(float(x[4]), float(x[5]), float(x[6]), float(x[7]));
  }
}

// The kGemvColumns columns of block n_block over packed rows [r_begin, r_end)
// for the rows <= MR rows of x; output (m, n) goes to out.store(m, n, v)
// (MarlinOutput, or the routed expert GEMV's fp32 row, metal/moe.metal).
template <typename T, WeightFormat F, uint MR, typename Out>
inline void marlin_gemv_columns(const device T* x, const device uint* packed, const device half* scales,
                                const device half* zeros, uint rows, uint N, uint K, uint n_block, uint r_begin,
                                uint r_end, thread const Out& out, threadgroup float* sums, uint tid, uint sg,
                                uint nsg, uint lane) {
  static_assert(MR >= 1 && MR <= kGemvMaxRows, "MR: 1 .. kGemvMaxRows rows of x");
  constexpr uint U = kGemvLaneRows;
  const uint cl = lane % 8, kl = lane / 8;
  const uint n0 = n_block * kGemvColumns + 4 * cl;
  // Rows after which the raw sums are scaled: the end of every run, or of every
  // group inside a run; never for one group over all of K (scaled at the end).
  const uint flush_every = marlin_group_rows == 0 ? 0u : min(marlin_group_rows, U);

  float acc[MR][4], raw[MR][4], xsum[MR];
  for (uint m = 0; m < MR; ++m) {
    if (m < rows) {
      xsum[m] = 0.0f;
      for (uint c = 0; c < 4; ++c) acc[m][c] = raw[m][c] = 0.0f;
    }
  }

  for (uint b = r_begin + kGemvBlockRows * sg; b < r_end; b += kGemvBlockRows * nsg) {
    const uint r0 = b + U * kl;  // this lane's run: rows r0 .. r0 + U - 1
    uint4 w[U];  // all U loads in flight before the first is used
    const device uint* wp = packed + ulong(r0) * N + n0;
    for (uint u = 0; u < U; ++u, wp += N) w[u] = r0 + u < r_end ? marlin_gemv_words(wp, n0, N) : uint4(0u);
    for (uint u = 0; u < U; ++u) {
      const uint r = r0 + u;
      if (r >= r_end) break;
      half2 q[4][4];  // [column][pair]
      for (uint c = 0; c < 4; ++c)
        for (uint p = 0; p < 4; ++p) q[c][p] = marlin_raw_pair<F>(w[u][c], p);
      for (uint m = 0; m < MR; ++m) {
        if (m >= rows) break;
        float4 lo, hi;
        marlin_gemv_x8<T>(x + ulong(m) * K + 8 * r, lo, hi);
        for (uint c = 0; c < 4; ++c) {
          float s = raw[m][c];
          for (uint p = 0; p < 4; ++p) {
            s = fma(float(q[c][p].x), lo[p], s);
            s = fma(float(q[c][p].y), hi[p], s);
          }
          raw[m][c] = s;
        }
        if (has_zeros(F)) xsum[m] += (lo.x + lo.y + lo.z + lo.w) + (hi.x + hi.y + hi.z + hi.w);
      }
      if (flush_every != 0 && (u + 1) % flush_every == 0) {
        float4 s, z;
        marlin_gemv_params<F>(scales, zeros, marlin_group_of(r), n0, N, s, z);
        for (uint m = 0; m < MR; ++m) {
          if (m >= rows) break;
          for (uint c = 0; c < 4; ++c) {
            acc[m][c] = marlin_group_dot<F>(acc[m][c], raw[m][c], xsum[m], s[c], z[c]);
            raw[m][c] = 0.0f;
          }
          xsum[m] = 0.0f;
        }
      }
    }
  }
  if (marlin_group_rows == 0) {  // one group: scale the whole sum once
    float4 s, z;
    marlin_gemv_params<F>(scales, zeros, 0, n0, N, s, z);
    for (uint m = 0; m < MR; ++m) {
      if (m >= rows) break;
      for (uint c = 0; c < 4; ++c)
        acc[m][c] = marlin_group_dot<F>(0.0f, raw[m][c], xsum[m], s[c], z[c]);
    }
  }

  // Sum the 4 kl lanes of each column, then the simdgroups.
  for (uint m = 0; m < MR; ++m) {
    if (m >= rows) break;
    for (uint c = 0; c < 4; ++c) {
      float v = acc[m][c];
      v += simd_shuffle_xor(v, ushort(8));
      v += simd_shuffle_xor(v, ushort(16));
      if (kl == 0) sums[(sg * rows + m) * kGemvColumns + 4 * cl + c] = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint i = tid; i < rows * kGemvColumns; i += nsg * kSimdWidth) {
    const uint m = i / kGemvColumns, col = i % kGemvColumns;
    float v = 0.0f;
    for (uint g = 0; g < nsg; ++g) v += sums[(g * rows + m) * kGemvColumns + col];
    out.store(m, n_block * kGemvColumns + col, v);
  }
}

template <typename T, WeightFormat F, uint MR>
[[kernel]] void marlin_gemv(MARLIN_GEMM_BUFFERS(T),
                            threadgroup float* sums [[threadgroup(0)]],
                            uint3 tgid [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint nsg [[simdgroups_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  const uint r_begin = tgid.y * split_rows, r_end = min(K / 8, r_begin + split_rows);
  const MarlinOutput<T> out{y, partial, bias, M, N, tgid.y};
  marlin_gemv_columns<T, F, MR>(x, packed, scales, zeros, M, N, K, tgid.x, r_begin, r_end, out, sums, tid, sg,
                                nsg, lane);
}
