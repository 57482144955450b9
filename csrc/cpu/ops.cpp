// CPU implementations of torch.ops.marlin.* (schemas in csrc/registration.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "cpu/activation_q8.h"
#include "cpu/kernel_builds.h"
#include "cpu/ops.h"

namespace marlin {
namespace cpu {

// The kernel build for this CPU (kernel_builds.h), chosen once;
// TORCH_MARLIN_CPU_KERNELS=<build> forces one (the tests check every build).
const CpuKernels& kernels() {
  static const KernelSelection selected = select_kernel_build(std::getenv("TORCH_MARLIN_CPU_KERNELS"));
  TORCH_CHECK(selected.kernels, selected.error);
  return *selected.kernels;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor for the CPU kernel, got ", t.device());
}

namespace {
std::atomic<bool> g_int8_activations{false};
}  // namespace

bool int8_activations() { return g_int8_activations.load(std::memory_order_relaxed); }

bool use_gemv_q8(const CpuKernels& kern, const QuantizedShape& s, int64_t m) {
  return m <= kGemvMaxRows && int8_activations() && s.group_rows % kQ8Block == 0 &&
         kern.gemv_q8_applies(static_cast<int>(s.format));
}

const Q8Kernels& q8_kernels() {
  static const Q8Selection selected = select_q8_kernels(kernels(), std::getenv("TORCH_MARLIN_CPU_INT_DOT"));
  TORCH_CHECK(selected.kernels, selected.error);
  return *selected.kernels;
}

Q8Activations quantize_activations_q8(const at::Tensor& x, const QuantizedShape& s, Q8Order order, GemmArgs& a) {
  const int64_t m = x.size(0);
  Q8Activations q{at::empty({m, s.k / 4}, x.options().dtype(at::kInt)),
                  at::empty({m, s.k / kQ8Block}, x.options().dtype(at::kFloat)),
                  at::empty({m, s.groups}, x.options().dtype(at::kFloat))};
  a.q8_x = q.x.data_ptr<int32_t>();
  a.q8_scale = q.scale.data_ptr<float>();
  a.q8_gsum = q.gsum.data_ptr<float>();
  auto run = [&](const auto* xs) {
    quantize_x_q8(xs, m, s.k, s.group_rows, order, q.x.data_ptr<int32_t>(), q.scale.data_ptr<float>(),
                  q.gsum.data_ptr<float>());
  };
  if (x.scalar_type() == at::kFloat)
    run(x.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    run(x.data_ptr<at::BFloat16>());
  else
    run(x.data_ptr<at::Half>());
  return q;
}

GemmArgs make_args(const at::Tensor& packed, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& zeros, const QuantizedShape& s) {
  GemmArgs a{};
  a.packed = packed.data_ptr<int32_t>();
  a.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  a.zeros = zeros ? reinterpret_cast<const uint16_t*>(zeros->data_ptr<at::Half>()) : nullptr;
  a.k = s.k;
  a.n = s.n;
  a.groups = s.groups;
  a.group_rows = s.group_rows;
  a.format = static_cast<int>(s.format);
  return a;
}

namespace {

at::Tensor gemm_cpu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                    c10::string_view weight_format, int64_t group_size) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, std::string(weight_format), group_size);
  check_gemm_inputs(x, bias, packed, s);
  check_cpu(packed, "packed");

  const CpuKernels& kern = kernels();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = s.n;
  if (use_gemv_q8(kern, s, x.numel() / s.k)) {  // int8 x, from x's own dtype
    const at::Tensor x2 = x.reshape({-1, s.k}).contiguous();
    const int64_t m = x2.size(0);
    at::Tensor out = at::empty({m, s.n}, x.options().dtype(at::kFloat));
    if (m > 0) {
      GemmArgs a = make_args(packed, scales, zeros, s);
      const Q8Activations q = quantize_activations_q8(x2, s, Q8Order::kQuads, a);
      a.out = out.data_ptr<float>();
      a.m = m;
      const Q8Kernels& q8 = q8_kernels();
      parallel_gemv(s.n, [&](int64_t n0, int64_t n1) { q8.gemv_q8(a, 0, m, n0, n1); });
    }
    if (bias) out.add_(bias->to(at::kFloat));
    return out.to(x.scalar_type()).view(out_sizes);
  }
  // Builds with bf16 dot products take bf16 x as it is (for formats whose values bf16
  // holds); the others take fp32.
  const bool bf16_x = kern.bf16_x && x.scalar_type() == at::kBFloat16 && values_exact_in_bf16(s.format);
  const at::Tensor x2 = bf16_x ? x.reshape({-1, s.k}).contiguous() : x.reshape({-1, s.k}).to(at::kFloat).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, s.n}, x.options().dtype(at::kFloat));
  if (m > 0) {
    GemmArgs a = make_args(packed, scales, zeros, s);
    if (bf16_x)
      a.x_bf16 = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
    else
      a.x = x2.data_ptr<float>();
    a.out = out.data_ptr<float>();
    a.m = m;
    // uint4's zero point is applied per group, as zero * sum of x over the group.
    at::Tensor xsum;
    if (has_zeros(s.format)) {
      xsum = x2.view({m, s.groups, s.group_rows}).sum(-1, false, at::kFloat).contiguous();
      a.xsum = xsum.data_ptr<float>();
    }
    parallel_gemm(
        m, s.n, [&](int64_t n0, int64_t n1) { kern.gemv(a, 0, m, n0, n1); },
        [&](int64_t m0, int64_t m1, int64_t nb, float* scratch) { kern.gemm_tile(a, m0, m1, nb, scratch); });
  }
  if (bias) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).view(out_sizes);
}

at::Tensor dequantize_cpu(const at::Tensor& packed, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& zeros, c10::string_view weight_format,
                          int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const QuantizedShape s = check_quantized(packed, scales, zeros, std::string(weight_format), group_size);
  check_cpu(packed, "packed");
  const at::ScalarType out_dtype = dtype.value_or(at::kHalf);
  TORCH_CHECK(out_dtype == at::kHalf || out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "dtype must be float16, bfloat16 or float32, got ", out_dtype);
  at::Tensor out = at::empty({s.k, s.n}, packed.options().dtype(at::kFloat));
  GemmArgs a = make_args(packed, scales, zeros, s);
  const CpuKernels& kern = kernels();
  parallel_dequantize(s.k, s.n, out.data_ptr<float>(), [&](int64_t k0, int64_t k1, int64_t nb, float* tile) {
    kern.dequantize_rows(a, k0, k1, nb, tile);
  });
  return out.to(out_dtype);
}

// The int8-activation setting: sets it when `enabled` is given; returns the one before.
bool cpu_int8_activations(c10::optional<bool> enabled) {
  return enabled ? g_int8_activations.exchange(*enabled) : int8_activations();
}

// JSON: {"selected": build or null, "error": why none, "builds": {build: "" if
// this CPU runs it, else why not}, "passed_over": {build: why the automatic
// choice skips it, for builds this CPU runs}, "int_dot": the selected build's int8
// dot product (null: `error` says why), "int_dots": {build: {each of its int8 dot
// products, best first: "" if this CPU runs it, else why not}}}; the tests and
// benchmarks report it.
std::string cpu_kernels_info() {
  const KernelSelection selected = select_kernel_build(std::getenv("TORCH_MARLIN_CPU_KERNELS"));
  std::string builds, passed_over, int_dots;
  for (const std::string& name : kernel_build_names()) {
    builds += (builds.empty() ? "\"" : ", \"") + name + "\": \"" + unsupported_reason(name) + "\"";
    if (const CpuKernels* build = find_kernel_build(name)) {
      std::string dots;
      for (const Q8Kernels* const* k = build->q8; *k; ++k)
        if ((*k)->int_dot)
          dots += (dots.empty() ? "\"" : ", \"") + std::string((*k)->int_dot) + "\": \"" + q8_unsupported_reason(**k) + "\"";
      int_dots += (int_dots.empty() ? "\"" : ", \"") + name + "\": {" + dots + "}";
    }
    const std::string why = passed_over_reason(name);
    if (unsupported_reason(name).empty() && !why.empty())
      passed_over += (passed_over.empty() ? "\"" : ", \"") + name + "\": \"" + why + "\"";
  }
  const std::string name = selected.kernels ? "\"" + std::string(selected.kernels->name) + "\"" : "null";
  std::string int_dot = "null", error = selected.error;
  if (selected.kernels) {
    const Q8Selection q8 = select_q8_kernels(*selected.kernels, std::getenv("TORCH_MARLIN_CPU_INT_DOT"));
    if (q8.kernels) int_dot = "\"" + std::string(q8.kernels->int_dot) + "\"";
    error = q8.error;
  }
  return "{\"selected\": " + name + ", \"error\": \"" + error + "\", \"builds\": {" + builds +
         "}, \"passed_over\": {" + passed_over + "}, \"int_dot\": " + int_dot + ", \"int_dots\": {" + int_dots +
         "}}";
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("gemm", &gemm_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

TORCH_LIBRARY_IMPL(marlin, CompositeExplicitAutograd, m) {
  m.impl("_cpu_kernels", &cpu_kernels_info);
  m.impl("_cpu_int8_activations", &cpu_int8_activations);
}

}  // namespace cpu
}  // namespace marlin
