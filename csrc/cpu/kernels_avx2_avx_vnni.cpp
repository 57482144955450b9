// The avx2 build's int8-x GEMVs with vpdpbusd on 256-bit registers, VEX
// encoded (AVX-VNNI: Alder Lake and later, Zen 5), chosen at run time over its
// vpmaddubsw ones (kernels_avx2.cpp lists them).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
#define MARLIN_KERNEL_NS avx2_avx_vnni
#define MARLIN_KERNEL_NAME "avx2"
#define MARLIN_KERNEL_AVX2 1
#define MARLIN_KERNEL_VNNI 1
#define MARLIN_KERNEL_Q8_ONLY 1
#define MARLIN_KERNEL_INT_DOT "avx_vnni"
#define MARLIN_KERNEL_Q8_FEATURES "avxvnni"
#include "cpu/kernels_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/kernel_args.h"
MARLIN_UNAVAILABLE_Q8_KERNELS(avx2_avx_vnni)
#endif
