// The kernels for x86-64 CPUs with AVX-512 F/BW/VL/DQ (Skylake-X and later,
// Zen 4 and later), chosen at run time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif
#define MARLIN_KERNEL_NS avx512
#define MARLIN_KERNEL_NAME "avx512"
#define MARLIN_KERNEL_AVX512 1
#include "cpu/kernels_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/kernel_args.h"
MARLIN_UNAVAILABLE_CPU_KERNELS(avx512)
#endif
