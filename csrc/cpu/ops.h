// Pieces of the dense CPU op (ops.cpp) that the other layouts' CPU ops reuse.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "core/checks.h"
#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

// The kernel build for this CPU (kernel_builds.h), chosen once;
// TORCH_MARLIN_CPU_KERNELS=<build> forces one.
const CpuKernels& kernels();

void check_cpu(const at::Tensor& t, const char* name);

// Kernel arguments of a packed weight (the first matrix of a stack); x, out and m are the caller's.
GemmArgs make_args(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                   const QuantizedShape& s);

}  // namespace cpu
}  // namespace marlin
