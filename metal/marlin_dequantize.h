// Standalone dequantize: packed int32 [K/8, N] (+ scales, zeros) -> dense B [K, N].
// One thread per packed word: reads word [r, n] and its group's params once,
// writes B[8r .. 8r+7, n]. Threadgroup kDequantColumns x kDequantRows threads
// = 32 columns x 4 packed rows; lanes run along N, so every load and store of
// a simdgroup is contiguous.
#pragma once

#include <metal_stdlib>

#include "marlin_dequant.h"

using namespace metal;

template <typename T, WeightFormat F>
[[kernel]] void marlin_dequant(const device uint* packed [[buffer(0)]],
                               const device half* scales [[buffer(1)]],
                               const device half* zeros [[buffer(2)]],
                               device T* out [[buffer(3)]],
                               constant uint& N [[buffer(4)]],
                               constant uint& KR [[buffer(5)]],  // K / 8 packed rows
                               uint3 tgid [[threadgroup_position_in_grid]],
                               uint3 tid [[thread_position_in_threadgroup]],
                               uint3 tgsize [[threads_per_threadgroup]]) {
  const uint n = tgid.x * tgsize.x + tid.x;
  const uint r = tgid.y * tgsize.y + tid.y;
  if (n >= N || r >= KR) return;
  const uint w = packed[ulong(r) * N + n];
  const MarlinParams params = marlin_load_params<F>(scales, zeros, marlin_group_of(r), n, N);
  device T* dst = out + ulong(8u * r) * N + n;
  for (uint p = 0; p < 4; ++p) {
    const float2 v = marlin_dequant_pair<F>(w, p, params);
    dst[p * N] = T(v.x);
    dst[(p + 4) * N] = T(v.y);
  }
}
