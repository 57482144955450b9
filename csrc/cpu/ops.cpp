// CPU implementations of torch.ops.marlin.* (schemas in csrc/registration.cpp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <memory>
#include <string>

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
  // Builds with bf16 dot products take bf16 x as it is; the others take fp32.
  const bool bf16_x = kern.bf16_x && x.scalar_type() == at::kBFloat16;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = s.n;
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
    if (m <= kGemvMaxRows) {
      const int64_t blocks = (s.n + kGemvBlockCols - 1) / kGemvBlockCols;
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        kern.gemv(a, 0, m, b0 * kGemvBlockCols, std::min(s.n, b1 * kGemvBlockCols));
      });
    } else {
      // Work items: column tiles x row blocks; row blocks only split large M,
      // since each one dequantizes the column tile again.
      const int64_t col_tiles = (s.n + kGemmBlockCols - 1) / kGemmBlockCols;
      const int64_t want_row_blocks = (2 * at::get_num_threads() + col_tiles - 1) / col_tiles;
      const int64_t rows_per_item = std::max<int64_t>(64, (m + want_row_blocks - 1) / want_row_blocks);
      const int64_t row_blocks = (m + rows_per_item - 1) / rows_per_item;
      at::parallel_for(0, col_tiles * row_blocks, 1, [&](int64_t i0, int64_t i1) {
        std::unique_ptr<float[]> scratch(new float[gemm_scratch_floats(rows_per_item)]);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t nb = (i % col_tiles) * kGemmBlockCols;
          const int64_t m0 = (i / col_tiles) * rows_per_item;
          kern.gemm_tile(a, m0, std::min(m, m0 + rows_per_item), nb, scratch.get());
        }
      });
    }
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
  const int64_t col_tiles = (s.n + kGemmBlockCols - 1) / kGemmBlockCols;
  const int64_t row_tiles = (s.k + kGemmBlockRows - 1) / kGemmBlockRows;
  const CpuKernels& kern = kernels();
  at::parallel_for(0, col_tiles * row_tiles, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> tile(new float[kGemmBlockRows * kGemmBlockCols]);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t nb = (i % col_tiles) * kGemmBlockCols, k0 = (i / col_tiles) * kGemmBlockRows;
      const int64_t k1 = std::min(s.k, k0 + kGemmBlockRows);
      const int64_t cols = std::min(kGemmBlockCols, s.n - nb);
      kern.dequantize_rows(a, k0, k1, nb, tile.get());
      float* dst = out.data_ptr<float>();
      for (int64_t k = k0; k < k1; ++k)
        std::memcpy(dst + k * s.n + nb, tile.get() + (k - k0) * kGemmBlockCols, cols * sizeof(float));
    }
  });
  return out.to(out_dtype);
}

// JSON: {"selected": build or null, "error": why none, "builds": {build: "" if
// this CPU runs it, else why not}}; the tests and benchmarks report it.
std::string cpu_kernels_info() {
  const KernelSelection selected = select_kernel_build(std::getenv("TORCH_MARLIN_CPU_KERNELS"));
  std::string builds;
  for (const std::string& name : kernel_build_names())
    builds += (builds.empty() ? "\"" : ", \"") + name + "\": \"" + unsupported_reason(name) + "\"";
  const std::string name = selected.kernels ? "\"" + std::string(selected.kernels->name) + "\"" : "null";
  return "{\"selected\": " + name + ", \"error\": \"" + selected.error + "\", \"builds\": {" + builds + "}}";
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("gemm", &gemm_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

TORCH_LIBRARY_IMPL(marlin, CompositeExplicitAutograd, m) { m.impl("_cpu_kernels", &cpu_kernels_info); }

}  // namespace cpu
}  // namespace marlin
