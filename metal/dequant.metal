// Standalone dequantize: packed int32 [K/8, N] (+ scales, zeros) -> dense B [K, N].
// One thread per packed word: reads word [r, n] once, writes B[8r .. 8r+7, n].
// Threadgroup 32 x 4 threads = 32 columns x 4 packed rows; lanes run along N,
// so every load and store of a simdgroup is contiguous.
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
                               constant uint& group_rows [[buffer(6)]],
                               uint3 tgid [[threadgroup_position_in_grid]],
                               uint3 tid [[thread_position_in_threadgroup]],
                               uint3 tgsize [[threads_per_threadgroup]]) {
  const uint n = tgid.x * tgsize.x + tid.x;
  const uint r = tgid.y * tgsize.y + tid.y;
  if (n >= N || r >= KR) return;
  const uint w = packed[ulong(r) * N + n];
  const MarlinDequantParams p = marlin_load_params<F>(scales, zeros, r, n, N, group_rows);
  device T* dst = out + ulong(8u * r) * N + n;
  for (uint j = 0; j < 8; j += 2) {
    const float2 v = marlin_dequant_pair<F>(w, j, p);
    dst[j * N] = T(v.x);
    dst[(j + 1) * N] = T(v.y);
  }
}

#define MARLIN_DEQUANT(dt, T, Tname, fmt, F)                                        \
  template [[host_name("marlin_dequant_" #fmt "_" #dt)]] [[kernel]] decltype( \
      marlin_dequant<T, F>) marlin_dequant<T, F>;
#define MARLIN_DEQUANT_DTYPES(fmt, F, _) MARLIN_FOR_EACH_DTYPE(MARLIN_DEQUANT, fmt, F)
MARLIN_FOR_EACH_FORMAT(MARLIN_DEQUANT_DTYPES, )
