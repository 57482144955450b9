// x as int8 blocks for the int8-activation GEMV (GemmArgs::q8_x, q8_scale,
// q8_gsum; cpu/dense_gemv_q8.h). No torch: ops.cpp and the kernel harness
// (tests/cpu_kernels) share it.
#pragma once
#include <math.h>
#include <stdint.h>

#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

// Rows [0, m) of x ([m, k], any type that converts to float), k and group_rows
// multiples of kQ8Block. Per block of 32: dx = max |x| / 127 and xq = round(x / dx)
// (ties to even) in fp32; an all-zero block gets dx = 0, xq = 0. The bytes go
// in `order` (GemmArgs::q8_x). tests/test_int8_activations.py reproduces it exactly.
template <class T>
void quantize_x_q8(const T* x, int64_t m, int64_t k, int64_t group_rows, Q8Order order, int32_t* q8_x, float* scale,
                   float* gsum) {
  const int64_t blocks = k / kQ8Block, group_blocks = group_rows / kQ8Block, groups = k / group_rows;
  int8_t* xq = reinterpret_cast<int8_t*>(q8_x);
  for (int64_t i = 0; i < m; ++i) {
    float group_sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
        // Written so that compilers vectorize each step: the largest |v| as a tree (a
        // max is exact in any order), the values, the bytes (their sum is an integer's).
        float v[kQ8Block], top[kQ8Block];
        for (int j = 0; j < kQ8Block; ++j) {
          v[j] = static_cast<float>(x[i * k + b * kQ8Block + j]);
          top[j] = fabsf(v[j]) > 0.f ? fabsf(v[j]) : 0.f;  // NaN counts as 0
        }
        for (int w = kQ8Block / 2; w > 0; w /= 2)
          for (int j = 0; j < w; ++j) top[j] = top[j + w] > top[j] ? top[j + w] : top[j];
        const float amax = top[0];
        const float d = amax / 127.f;
        int32_t q[kQ8Block] = {}, sum = 0;
        if (d != 0.f) {
          for (int j = 0; j < kQ8Block; ++j) {  // a vector loop: no libm call
            // Round to nearest even: |v / d| <= 127 (up to rounding) is far below 2^22,
            // where adding and taking away 1.5 * 2^23 rounds exactly as nearbyintf.
            const float r = (v[j] / d + 12582912.f) - 12582912.f;
            q[j] = r > 127.f ? 127 : r < -127.f ? -127 : static_cast<int32_t>(r);
          }
        }
        for (int j = 0; j < kQ8Block; ++j) sum += q[j];
        int8_t* dst = xq + i * k + b * kQ8Block;
        if (order == Q8Order::kNatural) {
          for (int j = 0; j < kQ8Block; ++j) dst[j] = static_cast<int8_t>(q[j]);
        } else {
          // kQuads: word row r = j / 8, its even K rows in the first quad, its odd rows in the second.
          for (int r = 0; r < kQ8Block / 8; ++r)
            for (int e = 0; e < 4; ++e) {
              dst[8 * r + e] = static_cast<int8_t>(q[8 * r + 2 * e]);
              dst[8 * r + 4 + e] = static_cast<int8_t>(q[8 * r + 2 * e + 1]);
            }
        }
        scale[i * blocks + b] = d;
        group_sum += d * static_cast<float>(sum);
      }
      gsum[i * groups + g] = group_sum;
      group_sum = 0.f;
    }
  }
}

}  // namespace cpu
}  // namespace marlin
