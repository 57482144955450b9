// The entropy-coded layout's kernels (csrc/cpu/rans_kernels_impl.h) in the avx512_bf16 build.
#define MARLIN_KERNEL_RANS 1
#include "cpu/rans_kernel_args.h"  // first: it completes kernel_args.h
#include "cpu/kernels_avx512_bf16.cpp"
