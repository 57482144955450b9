// The kernels for aarch64 CPUs with the BF16 extension (BFDOT: Armv8.6,
// Neoverse V1/N2, Apple M2 and later) for bf16 activations, chosen at run time.
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("bf16,dotprod"))), apply_to = function)
#else
#pragma GCC target("arch=armv8.2-a+bf16+dotprod")
#endif
#define MARLIN_KERNEL_NS neon_bf16
#define MARLIN_KERNEL_NAME "neon_bf16"
#define MARLIN_KERNEL_BF16_DOT 1
#define MARLIN_KERNEL_DOTPROD 1  // sdot for int8 activations (every BF16 core has it)
#include "cpu/kernels_impl.h"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
#include "cpu/kernel_args.h"
MARLIN_UNAVAILABLE_CPU_KERNELS(neon_bf16)
#endif
