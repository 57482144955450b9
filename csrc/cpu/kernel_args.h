// Plain-pointer arguments of the CPU kernels (no torch types, see kernels_impl.h).
#pragma once
#include <stdint.h>

#include "marlin_common.h"  // WeightFormat

namespace marlin {
namespace cpu {

// The kernels' template argument F (int) takes these.
constexpr int kFormatFp4 = kFp4, kFormatUint4 = kUint4, kFormatInt4 = kInt4;

struct GemmArgs {
  const float* x;          // [m, k] fp32, contiguous (null for dequantize)
  const float* xsum;       // [m, groups]: sum of x over each group (uint4 gemv only)
  const int32_t* packed;   // [k / 8, n]
  const uint16_t* scales;  // [groups, n] fp16 bits
  const uint16_t* zeros;   // [groups, n] fp16 bits, uint4 only
  float* out;              // [m, n] fp32
  int64_t m, k, n, groups, group_rows;
  int format;
};

// Up to this many rows of x, gemv decodes each weight word once in registers
// and applies it to all rows; above, gemm_tile dequantizes cache-sized tiles.
constexpr int64_t kGemvMaxRows = 8;

// Columns per work item of each kernel; ops.cpp splits work along these.
constexpr int64_t kGemvBlockCols = 64;
constexpr int64_t kGemmBlockCols = 64;
constexpr int64_t kGemmBlockRows = 256;

#define MARLIN_DECLARE_CPU_KERNELS(NS)                                                       \
  namespace NS {                                                                             \
  void gemv(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);              \
  void gemm_tile(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch);     \
  void dequantize_rows(const GemmArgs& a, int64_t k0, int64_t k1, int64_t nb, float* tile); \
  }

MARLIN_DECLARE_CPU_KERNELS(avx2)
MARLIN_DECLARE_CPU_KERNELS(generic)

}  // namespace cpu
}  // namespace marlin
