// CPU implementations of the 2:4 sparse ops torch.ops.marlin.sparse24_*
// (schemas in csrc/registration.cpp, layout in docs/FORMAT.md). Kernels in
// csrc/cpu/sparse24_kernels_impl.h, part of every kernel build: the build the
// dense op runs (TORCH_MARLIN_CPU_KERNELS included) runs these too.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/sparse24_checks.h"
#include "cpu/ops.h"

namespace marlin {
namespace cpu {
namespace {

Sparse24Args make_args(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, const QuantizedShape& s) {
  check_cpu(values, "values");
  Sparse24Args a{};
  static_cast<GemmArgs&>(a) = cpu::make_args(values, scales, zeros, s);  // values in place of packed
  a.metadata = metadata.data_ptr<int32_t>();
  return a;
}

at::Tensor sparse24_gemm_cpu(const at::Tensor& x, const at::Tensor& values, const at::Tensor& metadata,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                             const c10::optional<at::Tensor>& bias, c10::string_view weight_format,
                             int64_t group_size) {
  const QuantizedShape s = check_sparse24(values, metadata, scales, zeros, std::string(weight_format), group_size);
  check_sparse24_gemm_inputs(x, bias, values, s);
  Sparse24Args a = make_args(values, metadata, scales, zeros, s);

  const CpuKernels& kern = kernels();
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = s.n;
  const bool q8 = use_gemv_q8(kern, s, x.numel() / s.k);  // int8 x, from x's own dtype
  const at::Tensor x2 = q8 ? x.reshape({-1, s.k}).contiguous() : x.reshape({-1, s.k}).to(at::kFloat).contiguous();
  // Builds with 2:4 bf16 pair kernels also take bf16 x as it is (x2 stays for the paths without).
  const bool bf16_x =
      !q8 && kern.sparse24_bf16_x && x.scalar_type() == at::kBFloat16 && values_exact_in_bf16(s.format);
  const at::Tensor x_bf16 = bf16_x ? x.reshape({-1, s.k}).contiguous() : at::Tensor();
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, s.n}, x.options().dtype(at::kFloat));
  std::atomic<uint32_t> bad{0};
  if (m > 0 && q8) {
    const Q8Activations xq = quantize_activations_q8(x2, s, Q8Order::kNatural, a);
    a.out = out.data_ptr<float>();
    a.m = m;
    const Q8Kernels& int8 = q8_kernels();
    parallel_gemv(s.n, [&](int64_t n0, int64_t n1) { bad |= int8.sparse24_gemv_q8(a, 0, m, n0, n1); });
  } else if (m > 0) {
    a.x = x2.data_ptr<float>();
    if (bf16_x) a.x_bf16 = reinterpret_cast<const uint16_t*>(x_bf16.data_ptr<at::BFloat16>());
    a.out = out.data_ptr<float>();
    a.m = m;
    parallel_gemm(
        m, s.n, [&](int64_t n0, int64_t n1) { bad |= kern.sparse24_gemv(a, 0, m, n0, n1); },
        [&](int64_t m0, int64_t m1, int64_t nb, float* scratch) {
          bad |= kern.sparse24_gemm_tile(a, m0, m1, nb, scratch);
        });
  }
  if (bad) throw_invalid_metadata(metadata);
  if (bias) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).view(out_sizes);
}

at::Tensor sparse24_dequantize_cpu(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& scales,
                                   const c10::optional<at::Tensor>& zeros, c10::string_view weight_format,
                                   int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const QuantizedShape s = check_sparse24(values, metadata, scales, zeros, std::string(weight_format), group_size);
  const at::ScalarType out_dtype = dtype.value_or(at::kHalf);
  TORCH_CHECK(out_dtype == at::kHalf || out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "dtype must be float16, bfloat16 or float32, got ", out_dtype);
  const Sparse24Args a = make_args(values, metadata, scales, zeros, s);
  at::Tensor out = at::empty({s.k, s.n}, values.options().dtype(at::kFloat));
  const CpuKernels& kern = kernels();
  std::atomic<uint32_t> bad{0};
  parallel_dequantize(s.k, s.n, out.data_ptr<float>(), [&](int64_t k0, int64_t k1, int64_t nb, float* tile) {
    bad |= kern.sparse24_dequantize_rows(a, k0, k1, nb, tile);
  });
  if (bad) throw_invalid_metadata(metadata);
  return out.to(out_dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("sparse24_gemm", &sparse24_gemm_cpu);
  m.impl("sparse24_dequantize", &sparse24_dequantize_cpu);
}

}  // namespace cpu
}  // namespace marlin
