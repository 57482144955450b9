// CPU kernels for torch.ops.marlin.* on raw pointers, written once and
// compiled once per instruction set (kernels_<isa>.cpp); csrc/cpu/ops.cpp
// picks a build at run time. This file puts one build together: the vector
// primitives (cpu/cpu_vec.h), the value decode (cpu/format_decode.h), the
// dense GEMV and GEMM (cpu/dense_gemv.h, cpu/dense_gemm.h), the 2:4 kernels
// (cpu/sparse24_kernels_impl.h) and the build's entry-point table.
//
// MARLIN_KERNEL_RANS (csrc/cpu/rans_kernels_<isa>.cpp): instead of the dense
// and 2:4 entry points, the entropy-coded layout's (csrc/cpu/rans_kernels_impl.h,
// its own table rans_kernels), on the same pieces.
//
// MARLIN_KERNEL_Q8_ONLY (csrc/cpu/kernels_avx2_*vnni.cpp): only the int8-x
// GEMVs (the table q8_kernels), for a build's variant on more CPU features.
//
// Usage: define MARLIN_KERNEL_NS, MARLIN_KERNEL_NAME and the feature macros of
// cpu/cpu_vec.h, then include this file (once per translation unit). Optional:
// MARLIN_KERNEL_INT_DOT and MARLIN_KERNEL_Q8_FEATURES name the int8 dot product
// and the features it needs beyond the build's; MARLIN_KERNEL_Q8_VARIANTS lists
// the build's better int8-x GEMVs (&ns::q8_kernels, ...) before its own.
#define MARLIN_ISA_NS MARLIN_KERNEL_NS
#ifndef MARLIN_KERNEL_RANS
#define MARLIN_KERNEL_RANS 0
#endif
#if MARLIN_KERNEL_RANS
#include "cpu/dense_gemm.h"
#include "cpu/dense_gemv.h"

namespace marlin {
namespace cpu {
namespace MARLIN_KERNEL_NS {
namespace {
#include "cpu/rans_kernels_impl.h"
}  // namespace

extern const RansKernels rans_kernels = {MARLIN_KERNEL_NAME, rans_gemv, rans_gemm_tile, rans_decode_chunk};

}  // namespace MARLIN_KERNEL_NS
}  // namespace cpu
}  // namespace marlin
#else
#ifndef MARLIN_KERNEL_Q8_ONLY
#define MARLIN_KERNEL_Q8_ONLY 0
#endif
#include "cpu/dense_gemv_q8.h"
#include "cpu/sparse24_gemv_q8.h"
#if !MARLIN_KERNEL_Q8_ONLY
#include "cpu/dense_gemm.h"
#include "cpu/dense_gemv.h"
#include "cpu/sparse24_kernels_impl.h"
#endif

namespace marlin {
namespace cpu {
namespace MARLIN_KERNEL_NS {
namespace {

void gemv_q8(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  with_format(a.format, [&]<int F>() { q8_gemv<F, DenseQ8>(a, m0, m1, n0, n1); });
}

uint32_t sparse24_gemv_q8(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  return with_format(a.format, [&]<int F>() { return any_lane(q8_gemv<F, Sparse24Q8>(a, m0, m1, n0, n1)); });
}

#ifndef MARLIN_KERNEL_INT_DOT
#define MARLIN_KERNEL_INT_DOT                                                  \
  (MARLIN_KERNEL_AVX512 && MARLIN_KERNEL_VNNI         ? "vpdpbusd"             \
   : MARLIN_KERNEL_AVX512 || MARLIN_KERNEL_AVX2       ? "vpmaddubsw"           \
   : MARLIN_KERNEL_DOTPROD                            ? "sdot"                 \
                                                      : "portable")
#endif
#ifndef MARLIN_KERNEL_Q8_FEATURES
#define MARLIN_KERNEL_Q8_FEATURES ""
#endif
#ifndef MARLIN_KERNEL_Q8_VARIANTS
#define MARLIN_KERNEL_Q8_VARIANTS
#endif

}  // namespace

extern const Q8Kernels q8_kernels = {MARLIN_KERNEL_INT_DOT, MARLIN_KERNEL_Q8_FEATURES, gemv_q8, sparse24_gemv_q8};

#if !MARLIN_KERNEL_Q8_ONLY
namespace {

// The format (and x's type) is dispatched once here so the inner loops are branch-free.
template <int F>
void gemv_format(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; m += kMaxRows) {
    const int64_t e = m1 - m < kMaxRows ? m1 : m + kMaxRows;
#if MARLIN_KERNEL_BF16_DOT
    if (a.x_bf16) {
      if (kGemvStream && e - m == 1 && n1 - n0 >= kStreamMinCols)
        gemv_stream<F, true>(a, m, n0, n1);
      else
        gemv_impl<F, true>(a, m, e, n0, n1);
      continue;
    }
#endif
    if (kGemvStream && e - m == 1 && n1 - n0 >= kStreamMinCols)
      gemv_stream<F, false>(a, m, n0, n1);
    else
      gemv_impl<F, false>(a, m, e, n0, n1);
  }
}

template <int F>
void gemm_tile_format(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
#if MARLIN_KERNEL_BF16_DOT
  if (a.x_bf16) return gemm_tile_dot<F>(a, m0, m1, nb, scratch);
#endif
  gemm_tile_impl<F>(a, m0, m1, nb, scratch);
}

void gemv(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  with_format(a.format, [&]<int F>() { gemv_format<F>(a, m0, m1, n0, n1); });
}

// out[m0:m1, nb:nb+64] = x @ B for one column tile; `scratch` holds
// gemm_scratch_floats(m1 - m0) floats.
void gemm_tile(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  with_format(a.format, [&]<int F>() { gemm_tile_format<F>(a, m0, m1, nb, scratch); });
}

void dequantize_rows(const GemmArgs& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  with_format(a.format, [&]<int F>() { dequant_tile<F>(a, k0, k1 - k0, nb, tile); });
}

bool gemv_q8_applies(int format) {
  return with_format(format, [&]<int F>() { return Q8Decode<F>::kApplies; });
}

}  // namespace

extern const CpuKernels kernels = {MARLIN_KERNEL_NAME,
                                   gemv,
                                   gemm_tile,
                                   dequantize_rows,
                                   bool(MARLIN_KERNEL_BF16_DOT),
                                   sparse24_gemv,
                                   sparse24_gemm_tile,
                                   sparse24_dequantize_rows,
                                   kSparseDot,
                                   gemv_q8_applies,
                                   {MARLIN_KERNEL_Q8_VARIANTS & q8_kernels, nullptr}};
#endif  // !MARLIN_KERNEL_Q8_ONLY

}  // namespace MARLIN_KERNEL_NS
}  // namespace cpu
}  // namespace marlin
#endif  // MARLIN_KERNEL_RANS
