// Arguments and entry points of the 2:4 sparse CPU kernels
// (csrc/cpu/sparse24_kernels_impl.h, compiled into every per-ISA unit).
#pragma once
#include <stdint.h>

#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

// GemmArgs with `packed` = values [k / 16, n] (8 kept codes per word) plus
// the position metadata; `xsum` is unused (zeros are applied per value).
struct Sparse24Args : GemmArgs {
  const int32_t* metadata;  // [k / 32, n]
};

// Every entry point returns nonzero if a metadata word it decoded holds an
// invalid pattern (the op then reports which one).
//   sparse24_gemv(a, m0, m1, n0, n1)   out[m0:m1, n0:n1], m1 - m0 <= kGemvMaxRows: values and
//                                      metadata decoded in registers, x gathered by position
//   sparse24_gemm_tile(a, m0, m1, nb, scratch)  out[m0:m1, nb:nb+64] through dense fp32 tiles
//                                      of kGemmBlockRows rows (scratch as gemm_tile)
//   sparse24_dequantize_rows(a, k0, k1, nb, tile)  B[k0:k1, nb:nb+64] into tile (row stride 64)
#define MARLIN_DECLARE_SPARSE24_KERNELS(NS)                                                                   \
  namespace NS {                                                                                             \
  uint32_t sparse24_gemv(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);              \
  uint32_t sparse24_gemm_tile(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch);     \
  uint32_t sparse24_dequantize_rows(const Sparse24Args& a, int64_t k0, int64_t k1, int64_t nb, float* tile); \
  }

MARLIN_DECLARE_SPARSE24_KERNELS(avx2)
MARLIN_DECLARE_SPARSE24_KERNELS(generic)

}  // namespace cpu
}  // namespace marlin
