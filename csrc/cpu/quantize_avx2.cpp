// The quantizer for x86-64 CPUs with AVX2 and F16C (quantize.cpp picks a build at
// run time); elsewhere this name forwards to the portable build.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,f16c")
#endif
#define MARLIN_QUANT_NS avx2
#define MARLIN_KERNEL_AVX2 1
#include "cpu/quantize_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/quantize_args.h"
namespace marlin::cpu {
MARLIN_QUANTIZE_FORWARD_TO_GENERIC(avx2)
}  // namespace marlin::cpu
#endif
