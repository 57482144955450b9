// The quantizer for x86-64 CPUs with AVX-512 (F/BW/DQ/VL) and F16C (quantize.cpp picks a build at
// run time); elsewhere this name forwards to the portable build.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,f16c")
#endif
#define MARLIN_QUANT_NS avx512
#define MARLIN_KERNEL_AVX512 1
#include "cpu/quantize_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/quantize_args.h"
namespace marlin::cpu {
MARLIN_QUANTIZE_FORWARD_TO_GENERIC(avx512)
}  // namespace marlin::cpu
#endif
