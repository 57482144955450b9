// Which kernel builds this CPU runs and which one the ops use. No torch
// here: the standalone kernel test (tests/cpu_kernels) links this file too.
#include "cpu/kernel_builds.h"

#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1 << 14)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace marlin {
namespace cpu {
namespace {

struct Build {
  const char* name;
  const CpuKernels* kernels;
  const char* features;  // space-separated CPU features it needs
};

// Best first; the automatic choice is the first one this CPU runs.
const Build kBuilds[] = {
    {"avx512_bf16", &avx512_bf16::kernels, "avx512f avx512bw avx512vl avx512dq avx512bf16 avx512vbmi avx512vbmi2 avx512vnni fma f16c"},
    {"avx512", &avx512::kernels, "avx512f avx512bw avx512vl avx512dq fma f16c"},
    {"avx2", &avx2::kernels, "avx2 fma f16c"},
    {"neon_bf16", &neon_bf16::kernels, "bf16 dotprod"},
    {"generic", &generic::kernels, ""},
};

bool cpu_has(const std::string& feature) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // __builtin_cpu_supports needs literal names; it also checks that the OS
  // saves the AVX/AVX-512 registers.
  __builtin_cpu_init();
#define MARLIN_FEATURE(name) \
  if (feature == #name) return __builtin_cpu_supports(#name);
  MARLIN_FEATURE(avx512f) MARLIN_FEATURE(avx512bw) MARLIN_FEATURE(avx512vl) MARLIN_FEATURE(avx512dq)
  MARLIN_FEATURE(avx512bf16) MARLIN_FEATURE(avx512vbmi) MARLIN_FEATURE(avx512vbmi2) MARLIN_FEATURE(avx512vnni) MARLIN_FEATURE(avx2) MARLIN_FEATURE(fma)
#undef MARLIN_FEATURE
  unsigned eax, ebx, ecx, edx;
  if (feature == "f16c")  // not a name Clang's __builtin_cpu_supports knows
    return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
  if (feature == "avxvnni")  // nor GCC 11's: CPUID leaf 7.1, EAX bit 4 (the OS saves ymm: the avx2 build's check)
    return __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && (eax & (1u << 4));
#elif defined(__aarch64__) && defined(__linux__)
  if (feature == "bf16") return getauxval(AT_HWCAP2) & HWCAP2_BF16;
  if (feature == "dotprod") return getauxval(AT_HWCAP) & HWCAP_ASIMDDP;
#elif defined(__aarch64__) && defined(__APPLE__)
  const char* key = feature == "bf16" ? "hw.optional.arm.FEAT_BF16" : feature == "dotprod" ? "hw.optional.arm.FEAT_DotProd" : nullptr;
  if (key) {
    int value = 0;
    size_t size = sizeof(value);
    return sysctlbyname(key, &value, &size, nullptr, 0) == 0 && value;
  }
#endif
  return false;
}

// Empty when this CPU has every feature (space-separated), else "this CPU lacks ...".
std::string lacking(const std::string& features) {
  std::string missing;
  for (size_t i = 0; i < features.size();) {
    size_t j = features.find(' ', i);
    if (j == std::string::npos) j = features.size();
    const std::string f = features.substr(i, j - i);
    if (!cpu_has(f)) missing += (missing.empty() ? "" : ", ") + f;
    i = j + 1;
  }
  return missing.empty() ? "" : "this CPU lacks " + missing;
}

bool is_intel() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned eax, ebx, ecx, edx;
  // "GenuineIntel": ebx, edx, ecx
  return __get_cpuid(0, &eax, &ebx, &ecx, &edx) && ebx == 0x756E6547 && edx == 0x49656E69 && ecx == 0x6C65746E;
#else
  return false;
#endif
}

}  // namespace

std::string passed_over_reason(const std::string& name) {
  // vdpbf16ps (two multiplies per lane) pays only where it issues about as
  // often as an fp32 FMA: avx512_bf16 was the faster build at M = 1 on AMD Zen 5,
  // avx512 the faster one at every M on an Intel Emerald Rapids VM (docs/CPU.md).
  if (name == "avx512_bf16" && is_intel() && unsupported_reason("avx512").empty())
    return "on Intel CPUs the avx512 build was measured faster (docs/CPU.md)";
  return "";
}

std::vector<std::string> kernel_build_names() {
  std::vector<std::string> names;
  for (const Build& b : kBuilds) names.push_back(b.name);
  return names;
}

std::string unsupported_reason(const std::string& name) {
  for (const Build& b : kBuilds) {
    if (name != b.name) continue;
    if (!b.kernels->name) return "not compiled for this architecture";
    return lacking(b.features);
  }
  return "unknown build";
}

std::string q8_unsupported_reason(const Q8Kernels& q8) {
  return q8.int_dot ? lacking(q8.features) : "not compiled for this architecture";
}

Q8Selection select_q8_kernels(const CpuKernels& build, const char* forced) {
  std::string all, runs;
  for (const Q8Kernels* const* k = build.q8; *k; ++k) {
    if (!(*k)->int_dot) continue;
    all += (all.empty() ? "" : ", ") + std::string((*k)->int_dot);
    if (q8_unsupported_reason(**k).empty()) runs += (runs.empty() ? "" : ", ") + std::string((*k)->int_dot);
  }
  for (const Q8Kernels* const* k = build.q8; *k; ++k) {
    if (!(*k)->int_dot) continue;
    if (forced && *forced ? strcmp(forced, (*k)->int_dot) : !q8_unsupported_reason(**k).empty()) continue;
    const std::string why = q8_unsupported_reason(**k);
    if (!why.empty())
      return {nullptr, "TORCH_MARLIN_CPU_INT_DOT='" + std::string(forced) + "' cannot run here (" + why +
                           "); the " + build.name + " build runs: " + runs};
    return {*k, ""};
  }
  if (forced && *forced)
    return {nullptr, "TORCH_MARLIN_CPU_INT_DOT='" + std::string(forced) + "' is not an int8 dot product of the " +
                         build.name + " build; expected one of " + all};
  return {nullptr, std::string("no int8 dot product of the ") + build.name + " build runs here"};
}

const CpuKernels* find_kernel_build(const std::string& name) {
  for (const Build& b : kBuilds)
    if (name == b.name && b.kernels->name) return b.kernels;
  return nullptr;
}

KernelSelection select_kernel_build(const char* forced) {
  std::string supported;
  const CpuKernels* best = nullptr;
  for (const Build& b : kBuilds) {
    if (!unsupported_reason(b.name).empty()) continue;
    supported += (supported.empty() ? "" : ", ") + std::string(b.name);
    if (!best && passed_over_reason(b.name).empty()) best = b.kernels;
  }
  if (!forced || !*forced) return {best, ""};
  const std::string name = forced;
  std::string all;
  for (const Build& b : kBuilds) all += (all.empty() ? "" : ", ") + std::string(b.name);
  const std::string why = unsupported_reason(name);
  if (why == "unknown build")
    return {nullptr, "TORCH_MARLIN_CPU_KERNELS='" + name + "' is not a kernel build; expected one of " + all};
  if (!why.empty())
    return {nullptr, "TORCH_MARLIN_CPU_KERNELS='" + name + "' cannot run here (" + why +
                         "); this machine runs: " + supported + " (unset the variable to choose automatically)"};
  return {find_kernel_build(name), ""};
}

}  // namespace cpu
}  // namespace marlin
