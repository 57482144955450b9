// The K split's reduction: y[i] = sum over slices z of partial[z][i] (+ bias),
// slices summed in a fixed order (deterministic; no atomics and no zeroing
// pass: every slice of the GEMV and GEMMs writes its whole tile). A
// threadgroup owns kReduceOutputs outputs and loops over them with the
// threads it has (a pipeline may allow fewer than planned).
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
                              uint tgid [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint nthreads [[threads_per_threadgroup]]) {
  const uint total = M * N;
  const uint end = min(total, (tgid + 1) * kReduceOutputs);
  for (uint i = tgid * kReduceOutputs + tid; i < end; i += nthreads) {
    float s = 0.0f;
    for (uint z = 0; z < splits; ++z) s += partial[ulong(z) * total + i];
    if (marlin_has_bias) s += float(bias[i % N]);
    y[i] = T(s);
  }
}
