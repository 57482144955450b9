// 2:4 sparse standalone dequantize: values [K/16, N] + metadata [K/32, N]
// (+ scales, zeros) -> dense B [K, N], pruned weights +0.0. One thread per
// values word (16 K rows of one column); threadgroup 32 x 4 (32 columns x 4
// values rows), lanes along N: contiguous loads and stores per simdgroup.
#pragma once

#include <metal_stdlib>

#include "sparse24_decode.h"

using namespace metal;

template <typename T, WeightFormat F>
[[kernel]] void marlin_sparse24_dequant(const device uint* values [[buffer(0)]],
                                        const device uint* metadata [[buffer(1)]],
                                        const device half* scales [[buffer(2)]],
                                        const device half* zeros [[buffer(3)]],
                                        device T* out [[buffer(4)]],
                                        constant uint& N [[buffer(5)]],
                                        constant uint& VR [[buffer(6)]],  // K / 16 values rows
                                        uint3 tgid [[threadgroup_position_in_grid]],
                                        uint3 tid [[thread_position_in_threadgroup]],
                                        uint3 tgsize [[threads_per_threadgroup]]) {
  const uint n = tgid.x * tgsize.x + tid.x;
  const uint r = tgid.y * tgsize.y + tid.y;
  if (n >= N || r >= VR) return;
  const uint w = values[ulong(r) * N + n];
  const uint meta = marlin_sparse_meta(metadata[ulong(r / 2) * N + n], r);
  const MarlinParams p = marlin_sparse_params<F>(scales, zeros, r, n, N);
  device T* dst = out + ulong(kSparseValueRows * r) * N + n;
  for (uint b = 0; b < 4; ++b) {
    const float4 d = marlin_sparse_block<F>(w, meta, b, p);
    for (uint q = 0; q < 4; ++q) dst[(4 * b + q) * N] = T(d[q]);
  }
}
