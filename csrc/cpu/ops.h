// Pieces of the dense CPU op (ops.cpp) that the other layouts' CPU ops reuse.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "core/checks.h"
#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

// The kernel build for this CPU (kernel_builds.h), chosen once;
// TORCH_MARLIN_CPU_KERNELS=<build> forces one.
const CpuKernels& kernels();

void check_cpu(const at::Tensor& t, const char* name);

// Whether GEMVs (m <= kGemvMaxRows) quantize x to int8 blocks (the process-wide
// setting of torch.ops.marlin._cpu_int8_activations, docs/CPU.md), and whether
// that path takes this weight.
bool int8_activations();
bool use_gemv_q8(const CpuKernels& kern, const QuantizedShape& s, int64_t m);

// The int8-x GEMVs of kernels()' build (kernel_builds.h), chosen once;
// TORCH_MARLIN_CPU_INT_DOT=<int_dot> forces one of the build's.
const Q8Kernels& q8_kernels();

// x [m, k] (fp32, bf16 or fp16, contiguous) as int8 blocks for the int8-x GEMVs:
// sets a.q8_x, a.q8_scale, a.q8_gsum to the returned tensors' data.
struct Q8Activations {
  at::Tensor x, scale, gsum;
};
Q8Activations quantize_activations_q8(const at::Tensor& x, const QuantizedShape& s, Q8Order order, GemmArgs& a);

// Kernel arguments of a packed weight (the first matrix of a stack); x, out and m are the caller's.
GemmArgs make_args(const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                   const QuantizedShape& s);

// Tile GEMM scratch on a 64-byte boundary (new float[] gives 16): at 16 or 48 bytes past one,
// every other 32-byte access of the tile and the sums splits a cache line (Zen 3, avx2, M = 32,
// kernels alone: the rans grid tile GEMM 1.05-1.10x the time at 16 bytes, the dense one
// 1.03-1.07x), so the two ops' speed depended on where a process's allocation landed.
struct FreeScratch {
  void operator()(float* p) const { std::free(p); }
};
using Scratch = std::unique_ptr<float[], FreeScratch>;
inline Scratch aligned_scratch(int64_t floats) {
  const size_t bytes = (size_t(floats) * sizeof(float) + 63) / 64 * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!p) throw std::bad_alloc();
  return Scratch(p);
}

// The work split of the dense and 2:4 gemm ops over threads. m <= kGemvMaxRows:
// gemv(n0, n1) on column blocks; above: gemm_tile(m0, m1, nb, scratch) on
// column tiles x row blocks, where row blocks only split large M, since each
// one dequantizes its column tile again.
template <class Gemv>
void parallel_gemv(int64_t n, Gemv&& gemv) {
  const int64_t blocks = (n + kGemvBlockCols - 1) / kGemvBlockCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    gemv(b0 * kGemvBlockCols, std::min(n, b1 * kGemvBlockCols));
  });
}

// ItemCols: the columns of one gemm_tile call (the rans GEMM's 128), whose
// scratch is one gemm_scratch_floats per 64 of them.
template <int64_t ItemCols = kGemmBlockCols, class Gemv, class GemmTile>
void parallel_gemm(int64_t m, int64_t n, Gemv&& gemv, GemmTile&& gemm_tile) {
  static_assert(ItemCols % kGemmBlockCols == 0);
  if (m <= kGemvMaxRows) return parallel_gemv(n, gemv);
  const int64_t col_tiles = (n + ItemCols - 1) / ItemCols;
  const int64_t want_row_blocks = (2 * at::get_num_threads() + col_tiles - 1) / col_tiles;
  const int64_t rows_per_item = std::max<int64_t>(64, (m + want_row_blocks - 1) / want_row_blocks);
  const int64_t row_blocks = (m + rows_per_item - 1) / rows_per_item;
  at::parallel_for(0, col_tiles * row_blocks, 1, [&](int64_t i0, int64_t i1) {
    const Scratch scratch = aligned_scratch(ItemCols / kGemmBlockCols * gemm_scratch_floats(rows_per_item));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t nb = (i % col_tiles) * ItemCols, m0 = (i / col_tiles) * rows_per_item;
      gemm_tile(m0, std::min(m, m0 + rows_per_item), nb, scratch.get());
    }
  });
}

// B = W^T [k, n] in fp32 from tiles that dequantize_rows(k0, k1, nb, tile) writes (row stride 64).
template <class DequantizeRows>
void parallel_dequantize(int64_t k, int64_t n, float* out, DequantizeRows&& dequantize_rows) {
  const int64_t col_tiles = (n + kGemmBlockCols - 1) / kGemmBlockCols;
  const int64_t row_tiles = (k + kGemmBlockRows - 1) / kGemmBlockRows;
  at::parallel_for(0, col_tiles * row_tiles, 1, [&](int64_t i0, int64_t i1) {
    const Scratch tile = aligned_scratch(kGemmBlockRows * kGemmBlockCols);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t nb = (i % col_tiles) * kGemmBlockCols, k0 = (i / col_tiles) * kGemmBlockRows;
      const int64_t k1 = std::min(k, k0 + kGemmBlockRows), cols = std::min(kGemmBlockCols, n - nb);
      dequantize_rows(k0, k1, nb, tile.get());
      for (int64_t r = k0; r < k1; ++r)
        std::memcpy(out + r * n + nb, tile.get() + (r - k0) * kGemmBlockCols, cols * sizeof(float));
    }
  });
}

}  // namespace cpu
}  // namespace marlin
