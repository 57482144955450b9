// 2:4 sparse GEMM (M > 8), decoding straight into simdgroup_matrix fragments,
// with the optional K split of the dense GEMMs.
//
// The dense fused GEMM's structure (metal/marlin_gemm_fused.h): a threadgroup of
// 4 simdgroups owns a TM x 64 output tile (TM = 32 or 64), simdgroup s all TM
// rows and columns [16 s, 16 s + 16); it computes C^T = B^T x^T. Lane l of a
// B^T fragment (8 columns n x 8 K rows) owns column R(l) and the two K rows
// C(l), C(l) + 1, which are positions (C % 4, C % 4 + 1) of one 2:4 block:
// the lane decodes that block's kept pair (one marlin_dequant_pair of the
// values word), reads its two positions from the metadata and writes the two
// dense values (a kept value or 0) into thread_elements(). No dense B tile is
// ever materialized; the multiplies are the dense kernel's (Apple GPUs have
// no sparse MMA), the weight bytes 3/4 of them.
//
// Per 32-deep stage (2 values rows, exactly one metadata row) a lane loads
// its column's 2 values words and 1 metadata word once. x goes through the
// dense kernel's double-buffered threadgroup tile [2][TM][32], its columns
// swizzled so that a fragment read is free of bank conflicts. K split as the
// dense GEMMs: slice z takes values rows [z * split_rows, ...) (whole stages)
// and stores fp32 partials; marlin_reduce (metal/marlin_reduce.h) sums them.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_tile.h"
#include "sparse24_decode.h"

using namespace metal;

// Element (row, col) of an x tile [TM][kSparseGemmTileK]. A fragment read
// touches rows 8 i + fc (+ 1), fc = 0, 2, 4, 6, at the same columns; with a
// 32-element row those rows start in the same bank (4-way conflict). Padding
// the rows as the dense GEMMs do would take f32 at TM = 64 past the 16 KiB
// budget, so the columns are XOR-swizzled by 8 x ((row / 2) % 4) instead: the
// four rows fall in four different 8-bank groups (f32; f16/bf16: 4-bank
// groups), and a 4-element chunk stays contiguous.
inline uint marlin_sparse24_x_index(uint row, uint col) {
  return row * kSparseGemmTileK + (col ^ (8u * ((row >> 1) & 3u)));
}

// Cooperative load of x[m0 .. m0 + TM, k0 .. k0 + 32] into a swizzled
// threadgroup tile (zero past M), 4 elements per thread and step (one vector
// load with marlin_aligned), as the dense fused GEMM's marlin_load_x_rows.
template <typename T, int TM>
inline void marlin_sparse24_load_x(threadgroup T* dst, const device T* x, uint m0, uint k0, uint M, uint K, uint tid) {
  constexpr uint kChunks = kSparseGemmTileK / 4;
  for (uint e = tid; e < uint(TM) * kChunks; e += kGemmThreads) {
    const uint row = e / kChunks, col = 4 * (e % kChunks), m = m0 + row;
    vec<T, 4> v = vec<T, 4>(T(0.0f));
    if (m < M) {
      const device T* src = x + ulong(m) * K + k0 + col;
      v = marlin_aligned ? *(const device vec<T, 4>*)src : vec<T, 4>(src[0], src[1], src[2], src[3]);
    }
    *(threadgroup vec<T, 4>*)(dst + marlin_sparse24_x_index(row, col)) = v;
  }
}

template <typename T, WeightFormat F, int TM>
[[kernel]] void marlin_sparse24_gemm(MARLIN_SPARSE24_BUFFERS(T),
                                     threadgroup T* a_tiles [[threadgroup(0)]],
                                     uint3 tgid [[threadgroup_position_in_grid]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  constexpr int MF = TM / 8;  // fragments along M
  const MarlinLane l = marlin_lane(lane);
  const uint fr = l.row, fc = l.col;  // this lane's fragment row and first column (0, 2, 4, 6)
  const uint m0 = tgid.y * TM;
  const uint nb = tgid.x * kGemmTileN + sg * (kGemmTileN / 4);
  const uint VR = K / kSparseValueRows;
  const uint r_begin = tgid.z * split_rows;  // whole stages: K and split_rows are multiples of 2 values rows
  const uint r_end = min(VR, r_begin + split_rows);
  const uint k_begin = kSparseValueRows * r_begin, k_end = kSparseValueRows * r_end;

  simdgroup_matrix<float, 8, 8> acc[2][MF];
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < MF; ++i) acc[j][i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  const uint n_lane[2] = {nb + fr, nb + 8 + fr};  // this lane's column in each N fragment

  marlin_sparse24_load_x<T, TM>(a_tiles, x, m0, k_begin, M, K, tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint buf = 0;
  for (uint k0 = k_begin; k0 < k_end; k0 += kSparseGemmTileK) {
    if (k0 + kSparseGemmTileK < k_end)
      marlin_sparse24_load_x<T, TM>(a_tiles + (buf ^ 1) * (TM * kSparseGemmTileK), x, m0, k0 + kSparseGemmTileK, M, K, tid);
    const threadgroup T* a = a_tiles + buf * (TM * kSparseGemmTileK);
    const uint r0 = k0 / kSparseValueRows;  // even: this stage is values rows r0, r0 + 1 and metadata row r0 / 2
    uint w[2][2], meta[2];
    MarlinParams p[2][2];
    for (int j = 0; j < 2; ++j) {
      const uint n = n_lane[j];
      const bool ok = n < N;  // columns past N: weight 0 (pattern (0,1), zero params)
      meta[j] = ok ? metadata[ulong(r0 / 2) * N + n] : 0x44444444u;
      for (uint h = 0; h < 2; ++h) {
        w[j][h] = ok ? values[ulong(r0 + h) * N + n] : 0u;
        p[j][h] = ok ? marlin_sparse_params<F>(scales, zeros, r0 + h, n, N) : MarlinParams{0.0f, 0.0f};
      }
    }
    for (uint kk = 0; kk < kSparseGemmTileK / 8; ++kk) {
      const uint h = kk / 2;                 // values row r0 + h
      const uint block = 2 * (kk % 2) + fc / 4, q = fc % 4;  // this lane's block and positions q, q + 1
      simdgroup_matrix<float, 8, 8> wt[2];
      for (int j = 0; j < 2; ++j)
        marlin_set_elements(wt[j], marlin_sparse_pair<F>(w[j][h], marlin_sparse_meta(meta[j], r0 + h), block, q,
                                                         p[j][h]));
      for (int i = 0; i < MF; ++i) {
        simdgroup_matrix<float, 8, 8> xt;  // rows = K, cols = M
        const uint row = 8 * i + fc, col = 8 * kk + fr;
        marlin_set_elements(xt, float2(float(a[marlin_sparse24_x_index(row, col)]),
                                         float(a[marlin_sparse24_x_index(row + 1, col)])));
        for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[j][i], wt[j], xt, acc[j][i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    buf ^= 1;
  }

  // acc[j][i] holds C^T: element (fr, fc + e) is y[m0 + 8 i + fc + e, nb + 8 j + fr].
  const MarlinOutput<T> out{y, partial, bias, M, N, tgid.z};
  for (int j = 0; j < 2; ++j)
    for (int i = 0; i < MF; ++i) marlin_store_fragment(out, acc[j][i], l, nb + 8 * j, m0 + 8 * i, true);
}
