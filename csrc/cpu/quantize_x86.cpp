// The quantizer's x86-64 builds, AVX-512 and AVX2 (+F16C); quantize.cpp picks
// one at run time. Elsewhere both names forward to the portable build.
#include "cpu/quantize_args.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MARLIN_QUANT_NS avx512
#define MARLIN_QUANT_LANES 16
#define MARLIN_QUANT_TARGET "avx512f,avx512bw,avx512dq,avx512vl,f16c"
#define MARLIN_QUANT_F16C 1
#include "cpu/quantize_impl.h"

#define MARLIN_QUANT_NS avx2
#define MARLIN_QUANT_LANES 8
#define MARLIN_QUANT_TARGET "avx2,f16c"
#define MARLIN_QUANT_F16C 1
#include "cpu/quantize_impl.h"
#else
#define MARLIN_FORWARD_TO_GENERIC(NS)                                                                     \
  namespace NS {                                                                                          \
  int64_t quantize_scratch_floats(const QuantizeArgs& a) { return generic::quantize_scratch_floats(a); } \
  QuantizeSums quantize_rows(const QuantizeArgs& a, int64_t n0, int64_t n1, float* scratch) {            \
    return generic::quantize_rows(a, n0, n1, scratch);                                                    \
  }                                                                                                       \
  }
namespace marlin {
namespace cpu {
MARLIN_FORWARD_TO_GENERIC(avx512)
MARLIN_FORWARD_TO_GENERIC(avx2)
}  // namespace cpu
}  // namespace marlin
#endif
