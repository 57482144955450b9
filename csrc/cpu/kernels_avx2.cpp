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
// vpdpbusd where the CPU has it (kernels_avx2_*vnni.cpp), else vpmaddubsw.
#define MARLIN_KERNEL_Q8_VARIANTS &avx2_avx_vnni::q8_kernels, &avx2_avx512_vnni::q8_kernels,
#include "cpu/kernels_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/kernel_args.h"
MARLIN_UNAVAILABLE_CPU_KERNELS(avx2)
#endif
