// The AVX-512 kernels plus AVX512-BF16 dot products (vdpbf16ps) for bf16
// activations, with AVX512-VBMI for the decode, AVX512-VBMI2 for the
// entropy-coded layout's refills and AVX512-VNNI (vpdpbusd) for int8
// activations (Zen 4 and later, Sapphire Rapids and later: every CPU with
// AVX512-BF16 and VBMI has VBMI2 and VNNI), chosen at run time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx512vbmi2,avx512vnni,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,avx512vbmi2,avx512vnni,fma,f16c")
#endif
#define MARLIN_KERNEL_NS avx512_bf16
#define MARLIN_KERNEL_NAME "avx512_bf16"
#define MARLIN_KERNEL_AVX512 1
#define MARLIN_KERNEL_BF16_DOT 1
#define MARLIN_KERNEL_VBMI2 1  // vpexpandw, vpshrdvw
#define MARLIN_KERNEL_VNNI 1  // int8 dot products (every CPU with AVX512-BF16 and VBMI has it)
#include "cpu/kernels_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/kernel_args.h"
MARLIN_UNAVAILABLE_CPU_KERNELS(avx512_bf16)
#endif
