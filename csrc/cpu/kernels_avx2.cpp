// The kernels for x86-64 CPUs with AVX2 and FMA (chosen at run time).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#define MARLIN_KERNEL_NS avx2
#define MARLIN_KERNEL_NAME "avx2"
#define MARLIN_KERNEL_AVX2 1  // enables the AVX2/FMA/F16C builtins in kernels_impl.h
#include "cpu/kernels_impl.h"
#include "cpu/sparse24_kernels_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/kernel_args.h"
MARLIN_UNAVAILABLE_CPU_KERNELS(avx2)
// The 2:4 kernels' "avx2" entry points are never chosen here; they forward to the portable build.
#include "cpu/sparse24_kernel_args.h"
namespace marlin {
namespace cpu {
namespace avx2 {
uint32_t sparse24_gemv(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  return generic::sparse24_gemv(a, m0, m1, n0, n1);
}
uint32_t sparse24_gemm_tile(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  return generic::sparse24_gemm_tile(a, m0, m1, nb, scratch);
}
uint32_t sparse24_dequantize_rows(const Sparse24Args& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  return generic::sparse24_dequantize_rows(a, k0, k1, nb, tile);
}
}  // namespace avx2
}  // namespace cpu
}  // namespace marlin
#endif
