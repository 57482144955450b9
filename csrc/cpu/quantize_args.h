// Plain-pointer arguments of the quantizer kernels (quantize_impl.h), shared
// with the op that calls them (quantize.cpp).
#pragma once
#include <stdint.h>

#include "cpu/kernel_args.h"  // WeightFormat, with_format

namespace marlin {
namespace cpu {

enum { kSourceFloat32 = 0, kSourceBFloat16 = 1, kSourceFloat16 = 2 };

struct QuantizeArgs {
  const void* weight;  // [n, k] rows `row_stride` elements apart, dtype `source`
  int64_t row_stride, n, k;
  int64_t padded_k;    // K of the packed layout (zero-padded)
  int64_t group_len;   // K values per group (padded_k for group_size = -1)
  int source, format;
  // The search space of quantize.py: every clip ratio is tried with `rounds`
  // candidates (the clipped scale, then rounds - 1 least-squares refits).
  const float* ratios;
  int64_t num_ratios, rounds;
  int32_t* packed;     // [padded_k / 8, n]
  uint16_t* scales;    // [groups, n] fp16 bits
  uint16_t* zeros;     // [groups, n] fp16 bits, uint4 only
  // 2:4 (docs/FORMAT.md) when `metadata` is set: each row keeps the two largest
  // scores of every block of 4 along K (ties to the lower index), the scores
  // being |w| or `scores`. Its kept half is quantized in groups of group_len;
  // `packed` receives the values [padded_k / 16, n], `metadata` the positions.
  int32_t* metadata;     // [padded_k / 32, n], or null: dense
  const float* scores;   // [n, k] rows `scores_stride` apart, or null: |w|
  int64_t scores_stride;
};

struct QuantizeSums {
  double err2;      // sum of squared reconstruction errors
  double norm2;     // sum of squared weights
  int64_t bad_row;  // first row holding NaN or Inf, or -1
};

// Bound on num_ratios * rounds (the search keeps every candidate's error).
constexpr int64_t kMaxQuantizeCandidates = 512;

// Rows quantized before their codes are packed: 16 int32 columns of `packed`
// and fp16 columns of `scales` make whole 64-byte lines.
constexpr int64_t kQuantizeBlockRows = 16;

// quantize_rows quantizes rows [n0, n1) (n0 a multiple of kQuantizeBlockRows)
// with `scratch` of quantize_scratch_floats(a) floats, aligned to 64 bytes.
#define MARLIN_DECLARE_QUANTIZE_KERNELS(NS)                                                   \
  namespace NS {                                                                              \
  int64_t quantize_scratch_floats(const QuantizeArgs& a);                                     \
  QuantizeSums quantize_rows(const QuantizeArgs& a, int64_t n0, int64_t n1, float* scratch); \
  }

// A build this architecture cannot compile (x86 builds elsewhere): the portable one under its name.
#define MARLIN_QUANTIZE_FORWARD_TO_GENERIC(NS)                                                          \
  namespace NS {                                                                                          \
  int64_t quantize_scratch_floats(const QuantizeArgs& a) { return generic::quantize_scratch_floats(a); } \
  QuantizeSums quantize_rows(const QuantizeArgs& a, int64_t n0, int64_t n1, float* scratch) {            \
    return generic::quantize_rows(a, n0, n1, scratch);                                                    \
  }                                                                                                       \
  }

MARLIN_DECLARE_QUANTIZE_KERNELS(avx512)
MARLIN_DECLARE_QUANTIZE_KERNELS(avx2)
MARLIN_DECLARE_QUANTIZE_KERNELS(generic)

}  // namespace cpu
}  // namespace marlin
