// The K split's reduction: y[i] = sum over slices z of partial[z][i] (+ bias),
// one thread per output, slices summed in a fixed order (deterministic; no
// atomics and no zeroing pass: every slice of the GEMV and GEMMs writes its
// whole tile).
#pragma once

#include <metal_stdlib>

#include "marlin_dequant.h"

using namespace metal;

template <typename T>
[[kernel]] void marlin_reduce(const device float* partial [[buffer(0)]],
                              const device T* bias [[buffer(1)]],
                              device T* y [[buffer(2)]],
                              constant uint& M [[buffer(3)]],
                              constant uint& N [[buffer(4)]],
                              constant uint& splits [[buffer(5)]],
                              uint gid [[thread_position_in_grid]]) {
  const uint total = M * N;
  if (gid >= total) return;
  float s = 0.0f;
  for (uint z = 0; z < splits; ++z) s += partial[ulong(z) * total + gid];
  if (marlin_has_bias) s += float(bias[gid % N]);
  y[gid] = T(s);
}
