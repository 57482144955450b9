// CPU implementations of the 2:4 sparse ops torch.ops.marlin.sparse24_*
// (schemas in csrc/registration.cpp, layout in docs/FORMAT.md). Kernels in
// csrc/cpu/sparse24_kernels_impl.h, compiled into every per-ISA unit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/sparse24_checks.h"
#include "cpu/ops.h"
#include "cpu/sparse24_kernel_args.h"

namespace marlin {
namespace cpu {
namespace {

// The 2:4 kernels have two builds: AVX2, which every x86 build of the dense
// kernels implies (avx512_bf16, avx512, avx2), and the portable one, which the
// other builds (generic, neon_bf16) run. The dense choice decides (ops.h), so
// TORCH_MARLIN_CPU_KERNELS=generic forces the portable 2:4 kernels too.
bool use_avx2() {
  static const bool x86 = std::string(kernels().name).rfind("avx", 0) == 0;
  return x86;
}

Sparse24Args make_args(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, const QuantizedShape& s) {
  TORCH_CHECK(values.device().is_cpu(), "values must be a CPU tensor for the CPU kernel, got ", values.device());
  Sparse24Args a{};
  a.packed = values.data_ptr<int32_t>();
  a.metadata = metadata.data_ptr<int32_t>();
  a.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  a.zeros = zeros ? reinterpret_cast<const uint16_t*>(zeros->data_ptr<at::Half>()) : nullptr;
  a.k = s.k;
  a.n = s.n;
  a.groups = s.groups;
  a.group_rows = s.group_rows;
  a.format = static_cast<int>(s.format);
  return a;
}

at::Tensor sparse24_gemm_cpu(const at::Tensor& x, const at::Tensor& values, const at::Tensor& metadata,
                             const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                             const c10::optional<at::Tensor>& bias, c10::string_view weight_format,
                             int64_t group_size) {
  const QuantizedShape s = check_sparse24(values, metadata, scales, zeros, std::string(weight_format), group_size);
  check_sparse24_gemm_inputs(x, bias, values, s);
  Sparse24Args a = make_args(values, metadata, scales, zeros, s);

  auto out_sizes = x.sizes().vec();
  out_sizes.back() = s.n;
  const at::Tensor x2 = x.reshape({-1, s.k}).to(at::kFloat).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, s.n}, x.options().dtype(at::kFloat));
  std::atomic<uint32_t> bad{0};
  if (m > 0) {
    a.x = x2.data_ptr<float>();
    a.out = out.data_ptr<float>();
    a.m = m;
    const bool avx2 = use_avx2();
    if (m <= kGemvMaxRows) {
      const int64_t blocks = (s.n + kGemvBlockCols - 1) / kGemvBlockCols;
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        const int64_t n0 = b0 * kGemvBlockCols, n1 = std::min(s.n, b1 * kGemvBlockCols);
        bad |= avx2 ? avx2::sparse24_gemv(a, 0, m, n0, n1) : generic::sparse24_gemv(a, 0, m, n0, n1);
      });
    } else {
      // Work items as the dense gemm: column tiles x row blocks.
      const int64_t col_tiles = (s.n + kGemmBlockCols - 1) / kGemmBlockCols;
      const int64_t want_row_blocks = (2 * at::get_num_threads() + col_tiles - 1) / col_tiles;
      const int64_t rows_per_item = std::max<int64_t>(64, (m + want_row_blocks - 1) / want_row_blocks);
      const int64_t row_blocks = (m + rows_per_item - 1) / rows_per_item;
      at::parallel_for(0, col_tiles * row_blocks, 1, [&](int64_t i0, int64_t i1) {
        std::unique_ptr<float[]> scratch(new float[(kGemmBlockRows + rows_per_item) * kGemmBlockCols]);
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t nb = (i % col_tiles) * kGemmBlockCols;
          const int64_t m0 = (i / col_tiles) * rows_per_item, m1 = std::min(m, m0 + rows_per_item);
          bad |= avx2 ? avx2::sparse24_gemm_tile(a, m0, m1, nb, scratch.get())
                      : generic::sparse24_gemm_tile(a, m0, m1, nb, scratch.get());
        }
      });
    }
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
  const int64_t col_tiles = (s.n + kGemmBlockCols - 1) / kGemmBlockCols;
  const int64_t row_tiles = (s.k + kGemmBlockRows - 1) / kGemmBlockRows;
  const bool avx2 = use_avx2();
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, col_tiles * row_tiles, 1, [&](int64_t i0, int64_t i1) {
    std::unique_ptr<float[]> tile(new float[kGemmBlockRows * kGemmBlockCols]);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t nb = (i % col_tiles) * kGemmBlockCols, k0 = (i / col_tiles) * kGemmBlockRows;
      const int64_t k1 = std::min(s.k, k0 + kGemmBlockRows);
      const int64_t cols = std::min(kGemmBlockCols, s.n - nb);
      bad |= avx2 ? avx2::sparse24_dequantize_rows(a, k0, k1, nb, tile.get())
                  : generic::sparse24_dequantize_rows(a, k0, k1, nb, tile.get());
      float* dst = out.data_ptr<float>();
      for (int64_t k = k0; k < k1; ++k)
        std::memcpy(dst + k * s.n + nb, tile.get() + (k - k0) * kGemmBlockCols, cols * sizeof(float));
    }
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
