// rANS GEMM (M > rans::kGemvMaxRows): each weight tile is decoded once into
// threadgroup memory and reused by all rans::kGemmTileM rows of the tile through
// simdgroup_matrix multiplies (the decode costs per weight what the GEMV's
// does, divided by the rows; docs/KERNELS.md counts it).
//
// A threadgroup of rans::kGemmSimdgroups simdgroups owns a rans::kGemmTileM x
// rans::kGemmTileN output tile: simdgroup s the column block b = 4 tgid.x + s
// (32 columns, one chunk per K chunk). It steps through its slice of K chunks
// kGemmTileK rows at a time; per stage
//   1. all threads load the x tile [TM][kGemmTileK] (zero past M and past the
//      chunk), and simdgroup s decodes 16 steps of its chunk, lane l writing
//      the raw values of column 32 b + l into Bt_s[l][0..16) (half: raw values
//      are exact in half);
//   2. threadgroup barrier; simdgroup s computes its C^T += Bt_s^T-fragments x
//      x^T-fragments, dequantizing each B^T fragment element pair in fp32 from
//      the raw halves and the column's group params (a stage lies in one
//      group) exactly as the dense kernels' marlin_dequant_pair;
//   3. threadgroup barrier (the next stage overwrites both tiles).
// The rANS state and the value state (tcq's trellis) stay in registers
// across stages. The K split of the dense GEMMs: slice z = tgid.z takes
// split_chunks whole K chunks and, when there are several slices, stores fp32
// partials that marlin_reduce sums in order.
// A bad chunk makes its block's outputs of the slice NaN.
#pragma once

#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_tile.h"
#include "rans_decode.h"

using namespace metal;

// The dense weights of raw values r with group params p, in fp32 (marlin_dequant_pair's arithmetic).
template <WeightFormat F>
inline float2 rans_dequant(float2 r, MarlinParams p) {
  if (zeros_are_bias(F)) return fma(r, float2(p.scale), float2(p.zero));
  if (has_zeros(F)) return (r - p.zero) * p.scale;
  return r * p.scale;
}

template <typename T, typename V>
[[kernel]] void rans_gemm(const device T* x [[buffer(0)]],
                          const device ushort* words [[buffer(1)]],
                          const device int* word_offsets [[buffer(2)]],
                          const device uint* states [[buffer(3)]],
                          const device ushort* freqs [[buffer(4)]],
                          const device half* scales [[buffer(5)]],
                          const device half* zeros [[buffer(6)]],
                          const device T* bias [[buffer(7)]],
                          device T* y [[buffer(8)]],
                          device float* partial [[buffer(9)]],
                          constant uint& M [[buffer(10)]],
                          constant uint& N [[buffer(11)]],
                          constant uint& K [[buffer(12)]],
                          constant uint& chunk_k [[buffer(13)]],
                          constant uint& prob_bits [[buffer(14)]],
                          constant uint& n_words [[buffer(15)]],
                          constant uint& split_chunks [[buffer(16)]],
                          threadgroup uchar* mem [[threadgroup(0)]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint TM = rans::kGemmTileM, TK = kGemmTileK, MF = TM / 8, NF = rans::kLanes / 8;
  constexpr uint XS = x_tile_stride(sizeof(T)), BS = rans::kBtStride;
  constexpr WeightFormat P = V::kParams;
  threadgroup half* bt_all = (threadgroup half*)(mem + rans::table_bytes(V::kSymbols));
  threadgroup T* x_tile = (threadgroup T*)(bt_all + rans::kGemmSimdgroups * rans::kLanes * BS);
  threadgroup half* bt = bt_all + sg * rans::kLanes * BS;  // this simdgroup's raw-value tile

  const RansTable table =
      rans_build_table<V>((threadgroup RansEntry*)mem, freqs, prob_bits, tid, kGemmThreads, sg, lane);
  const MarlinLane l = marlin_lane(lane);
  const uint m0 = tgid.y * TM;
  const uint n_blocks = (N + rans::kLanes - 1) / rans::kLanes, n_kchunks = (K + chunk_k - 1) / chunk_k;
  const uint b = tgid.x * rans::kGemmSimdgroups + sg;
  const bool active = b < n_blocks;  // uniform in the simdgroup
  const uint c_begin = tgid.z * split_chunks, c_end = min(n_kchunks, c_begin + split_chunks);
  const uint group_k = 8u * marlin_group_rows;  // 0: one group

  simdgroup_matrix<float, 8, 8> acc[NF][MF];
  for (uint j = 0; j < NF; ++j)
    for (uint i = 0; i < MF; ++i) acc[j][i] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  bool bad = false;
  for (uint c = c_begin; c < c_end; ++c) {
    const uint k0 = c * chunk_k, len = min(K, k0 + chunk_k) - k0;
    RansChunk dec = RansChunk::start(words, word_offsets, states, n_words, active ? b * n_kchunks + c : 0u, lane);
    V values;  // the lane's value state: carried across the chunk's stages, as dec
    for (uint t0 = 0; t0 < len; t0 += TK) {
      for (uint e = tid; e < TM * TK; e += kGemmThreads) {
        const uint row = e / TK, col = e % TK, m = m0 + row;
        x_tile[row * XS + col] = m < M && t0 + col < len ? x[ulong(m) * K + k0 + t0 + col] : T(0.0f);
      }
      if (active) {
        for (uint u = 0; u < TK; ++u) {
          half r = 0.0h;
          if (t0 + u < len) {  // uniform: the chunk's last stage may be partial
            RansEntry e;
            const uint s = dec.next(table, e);
            r = values.value(s, e);
          }
          bt[lane * BS + u] = r;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (active) {
        const uint g = group_k == 0 ? 0u : (k0 + t0) / group_k;
        MarlinParams p[NF];
        for (uint j = 0; j < NF; ++j) {
          const uint n = b * rans::kLanes + 8 * j + l.row;
          p[j] = n < N ? marlin_load_params<P>(scales, zeros, g, n, N) : MarlinParams{0.0f, 0.0f};
        }
        for (uint kk = 0; kk < TK / 8; ++kk) {
          simdgroup_matrix<float, 8, 8> wt[NF];  // B^T: rows = columns n, cols = K
          for (uint j = 0; j < NF; ++j) {
            const threadgroup half* r = bt + (8 * j + l.row) * BS + 8 * kk + l.col;
            marlin_set_elements(wt[j], rans_dequant<P>(float2(float(r[0]), float(r[1])), p[j]));
          }
          for (uint i = 0; i < MF; ++i) {
            simdgroup_matrix<float, 8, 8> xt;  // x^T: rows = K, cols = M
            const threadgroup T* a = x_tile + (8 * i + l.col) * XS + 8 * kk + l.row;
            marlin_set_elements(xt, float2(float(a[0]), float(a[XS])));
            for (uint j = 0; j < NF; ++j) simdgroup_multiply_accumulate(acc[j][i], wt[j], xt, acc[j][i]);
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (active) bad = dec.finish() || bad;
  }

  if (!active) return;
  // acc[j][i] is a fragment of C^T: element (r, c) is y[m0 + 8 i + c, 32 b + 8 j + r].
  const MarlinOutput<T> out{y, partial, bias, M, N, tgid.z};
  for (uint j = 0; j < NF; ++j)
    for (uint i = 0; i < MF; ++i) {
      if (bad) marlin_set_elements(acc[j][i], float2(NAN));
      marlin_store_fragment(out, acc[j][i], l, b * rans::kLanes + 8 * j, m0 + 8 * i, true);
    }
}
