// The CPU kernel builds (one per instruction set, csrc/cpu/kernels_<isa>.cpp)
// and the run-time choice among them. No torch types.
#pragma once
#include <string>
#include <vector>

#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

// Every build name, best first: avx512_bf16, avx512, avx2, neon_bf16, generic.
std::vector<std::string> kernel_build_names();

// Empty when this CPU runs the build, else why not ("this CPU lacks avx512bf16").
std::string unsupported_reason(const std::string& name);

// The build's kernels if compiled for this architecture (supported or not), else null.
const CpuKernels* find_kernel_build(const std::string& name);

// Empty unless the automatic choice skips this build although the CPU runs
// it, because another build it runs is faster here (then: why).
std::string passed_over_reason(const std::string& name);

struct KernelSelection {
  const CpuKernels* kernels;  // null when `error` says why
  std::string error;
};

// The best build this CPU runs (the first not passed over), or `forced` (TORCH_MARLIN_CPU_KERNELS) when
// set: an unknown or unsupported name is an error, never a SIGILL.
KernelSelection select_kernel_build(const char* forced);

// Empty when this CPU runs the int8-x GEMVs (the features beyond their build's), else why not.
std::string q8_unsupported_reason(const Q8Kernels& q8);

struct Q8Selection {
  const Q8Kernels* kernels;  // null when `error` says why
  std::string error;
};

// The best of the build's int8-x GEMVs that this CPU runs, or `forced`
// (TORCH_MARLIN_CPU_INT_DOT, one of the build's int_dot names) when set.
Q8Selection select_q8_kernels(const CpuKernels& build, const char* forced);

}  // namespace cpu
}  // namespace marlin
