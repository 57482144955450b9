// Fused rANS decode + GEMV: y[M, N] = x[M, K] @ W^T (+ bias) for M <=
// rans::kGemvMaxRows, W entropy-coded (metal/rans_decode.h). The dense weight is
// never written anywhere: each decoded symbol's raw value (from the table
// entry the decode step loads anyway, through the lane's value state V for
// tcq's trellis) is multiplied into per-lane fp32 accumulators right away.
//
// Work split: one simdgroup per chunk (32 columns x chunk_k K rows), lane l =
// column 32 b + l; at step t every lane needs x[m, k0 + t], one address for
// all lanes (a broadcast load). As the dense GEMV, raw products are summed
// per group and the group's scale (and zero point or bias: marlin_group_dot)
// applied once per group; "grid" has one step per column (one group).
//
// K chunks are reduced deterministically: with one K chunk the lane writes
// y (bias, one rounding); with several, chunk c writes its fp32 partial to
// partial[c][M][N] and marlin_reduce (metal/marlin_reduce.h) sums them in
// order. A bad chunk writes NaN for all its outputs.
#pragma once

#include "marlin_tile.h"
#include "rans_decode.h"

using namespace metal;

template <typename T, typename V>
[[kernel]] void rans_gemv(const device T* x [[buffer(0)]],
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
                          constant uint& n_chunks [[buffer(16)]],
                          threadgroup RansEntry* table_mem [[threadgroup(0)]],
                          uint3 tgid [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint nsg [[simdgroups_per_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint R = rans::kGemvMaxRows;
  constexpr WeightFormat P = V::kParams;
  const RansTable table = rans_build_table<V>(table_mem, freqs, prob_bits, tid, nsg * kSimdWidth, sg, lane);
  // K rows per group: a power of two, or 0 for one group over all of K.
  const uint group_k = 8u * marlin_group_rows;
  const uint first = tgid.x * rans::kChunkSimdgroups, last = min(n_chunks, first + rans::kChunkSimdgroups);
  for (uint chunk = first + sg; chunk < last; chunk += nsg) {
    const RansChunkPos pos = rans_chunk_pos(chunk, K, chunk_k);
    const uint n = pos.b * rans::kLanes + lane;
    RansChunk dec = RansChunk::start(words, word_offsets, states, n_words, chunk, lane);
    V values;
    float acc[R], raw[R], xsum[R];
    for (uint m = 0; m < R; ++m) acc[m] = raw[m] = xsum[m] = 0.0f;
    // Groups of the chunk (chunks start on group boundaries): raw sums, then the group's params.
    const uint step = group_k == 0 ? pos.len : group_k;
    for (uint t0 = 0; t0 < pos.len; t0 += step) {
      const device T* xk = x + pos.k0 + t0;
      const uint t1 = min(pos.len, t0 + step);
      for (uint t = t0; t < t1; ++t, ++xk) {
        RansEntry e;
        const uint s = dec.next(table, e);
        const float v = float(values.value(s, e));
        for (uint m = 0; m < R; ++m) {
          if (m >= M) break;
          const float xv = float(xk[ulong(m) * K]);
          raw[m] = fma(v, xv, raw[m]);
          if (has_zeros(P)) xsum[m] += xv;
        }
      }
      const uint g = group_k == 0 ? 0u : (pos.k0 + t0) / group_k;
      const MarlinParams p = n < N ? marlin_load_params<P>(scales, zeros, g, n, N) : MarlinParams{0.0f, 0.0f};
      for (uint m = 0; m < R; ++m) {
        if (m >= M) break;
        acc[m] = marlin_group_dot<P>(acc[m], raw[m], xsum[m], p.scale, p.zero);
        raw[m] = xsum[m] = 0.0f;
      }
    }
    const bool bad = dec.finish();
    const MarlinOutput<T> out{y, partial, bias, M, N, pos.c};
    for (uint m = 0; m < R; ++m) {
      if (m >= M) break;
      out.store(m, n, bad ? NAN : acc[m]);
    }
  }
}
