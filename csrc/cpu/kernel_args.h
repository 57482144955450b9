// Plain-pointer arguments of the CPU kernels (no torch types, see kernels_impl.h),
// and the format traits the kernels and the quantizer share.
#pragma once
#include <stdint.h>

#include "marlin_common.h"  // WeightFormat, with_format
#if MARLIN_KERNEL_RANS
#include "cpu/rans_kernel_args.h"
#endif

namespace marlin {
namespace cpu {

// Formats with a second tensor per group (`zeros`): a zero point, w = (value - zero)
// * scale (uint4), or a bias added after the scale, w = value * scale + bias (affine).
template <int F>
constexpr bool kHasZeros = has_zeros(WeightFormat(F));
template <int F>
constexpr bool kZerosAreBias = zeros_are_bias(WeightFormat(F));

struct GemmArgs {
  const float* x;          // [m, k] fp32, contiguous (null for dequantize, or when x_bf16 is set)
  const uint16_t* x_bf16;  // [m, k] bf16 bits, contiguous: instead of x, for builds with bf16_x
  const float* xsum;       // [m, groups]: fp32 sums of x over each group (uint4: gemv, and gemm_tile on x_bf16)
  const int32_t* packed;   // [k / 8, n]
  const uint16_t* scales;  // [groups, n] fp16 bits
  const uint16_t* zeros;   // [groups, n] fp16 bits, uint4 only
  float* out;              // [m, n] fp32
  // int8 activations (gemv_q8; ops.cpp's quantize_x_q8 writes them): x per block of
  // kQ8Block K rows as int8 values xq with an fp32 scale dx, x ~ dx * xq.
  const int32_t* q8_x;     // [m, k / 4]: per word row r (K rows 8r..8r+7) the quads
                           // (xq[8r], xq[8r+2], xq[8r+4], xq[8r+6]) and (xq[8r+1], ..., xq[8r+7]);
                           // for the 2:4 layout the bytes xq in K order (Q8Order)
  const float* q8_scale;   // [m, k / kQ8Block]: dx per block
  const float* q8_gsum;    // [m, groups]: sum over the group's blocks of dx * (sum of the block's xq)
  int64_t m, k, n, groups, group_rows;
  int format;
  // gemv_q8 and the one-row gemv: their per-column sums for a call on n0:n1, at least
  // gemv_scratch_floats(n1 - n0) floats; null: the kernel allocates them per call.
  float* scratch;
};

// GemmArgs of the 2:4 layout (docs/FORMAT.md): `packed` = values [k / 16, n]
// (8 kept codes per word) plus the position metadata; `xsum` and `q8_gsum` are
// unused (zeros are applied per kept value). With x_bf16 set, `x` is set too
// (fp32): the kernels take the pair path where they have one, else fp32.
struct Sparse24Args : GemmArgs {
  const int32_t* metadata;  // [k / 32, n]
};

// Up to this many rows of x, gemv decodes each weight word once in registers
// and applies it to all rows (any m works; this is the crossover ops.cpp uses);
// above, gemm_tile dequantizes cache-sized tiles.
constexpr int64_t kGemvMaxRows = 8;

// K rows per int8 block of x (one scale each), as llama.cpp's Q8_0.
constexpr int64_t kQ8Block = 32;

// Byte order of int8 x (GemmArgs::q8_x): the dense GEMV's quads, or K order (2:4).
enum class Q8Order { kQuads, kNatural };

// Columns per work item of each kernel; ops.cpp splits work along these.
constexpr int64_t kGemvBlockCols = 64;
constexpr int64_t kGemmBlockCols = 64;
constexpr int64_t kGemmBlockRows = 256;

// Floats of GemmArgs::scratch for a gemv or gemv_q8 call on `cols` columns: up to
// 3 * 4 rows of sums and 2 rows of scales/zeros (dense_gemv_q8.h; gemv_stream: 2 rows).
constexpr int64_t kGemvScratchRows = 14;
constexpr int64_t gemv_scratch_floats(int64_t cols) {
  return kGemvScratchRows * ((cols + kGemvBlockCols) / kGemvBlockCols * kGemvBlockCols);
}

// Floats of scratch that gemm_tile needs for `rows` rows of x.
constexpr int64_t gemm_scratch_floats(int64_t rows) { return (kGemmBlockRows + rows) * kGemmBlockCols; }

// Rows of a kernel's next register block with `left` rows to go, at most `most`: blocks as
// even as they go (32 rows in 6s: 6, 6, 5, 5, 5, 5, not 6 x 5 + 2). A thin block wastes
// decodes (the GEMVs), or waits on its FMAs' latency (the tile GEMM's micro-kernel: at M = 32
// the dense tile GEMM took 0.95x the time on Zen 3, the rans one 0.96-0.97x, in one process).
constexpr int even_rows(int64_t left, int most) {
  const int64_t blocks = (left + most - 1) / most;
  return int((left + blocks - 1) / blocks);
}

// The GEMVs with int8 x (q8_x, q8_scale, q8_gsum; dense: Q8Order::kQuads, 2:4:
// kNatural) of one integer dot product; group_rows a multiple of kQ8Block.
struct Q8Kernels {
  const char* int_dot;   // "vpdpbusd", "vpmaddubsw", "sdot", "portable"; the avx2 build's
                         // vpdpbusd on 256-bit registers: "avx_vnni" (VEX), "avx512_vnni_256" (EVEX)
  const char* features;  // CPU features it needs beyond its build's (space-separated)
  void (*gemv_q8)(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  uint32_t (*sparse24_gemv_q8)(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
};

// One build of the kernels (one instruction set). Entry points:
//   gemv(a, m0, m1, n0, n1)    out[m0:m1, n0:n1]: every weight word is decoded once
//                              in registers for (up to kGemvMaxRows) rows
//   gemm_tile(a, m0, m1, nb, scratch)  out[m0:m1, nb:nb+64]: dequantizes cache-sized
//                              tiles once and reuses them for every row
//   dequantize_rows(a, k0, k1, nb, tile)  fp32 B[k0:k1, nb:nb+64] into tile (row stride 64)
// and the same three for the 2:4 layout (csrc/cpu/sparse24_kernels_impl.h),
// which return nonzero if a metadata word they decoded holds an invalid
// pattern (the op then reports which one).
struct CpuKernels {
  const char* name;
  void (*gemv)(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  void (*gemm_tile)(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch);
  void (*dequantize_rows)(const GemmArgs& a, int64_t k0, int64_t k1, int64_t nb, float* tile);
  bool bf16_x;  // takes bf16 activations as x_bf16 (exact bf16 products, fp32 sums)
  uint32_t (*sparse24_gemv)(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1);
  uint32_t (*sparse24_gemm_tile)(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch);
  uint32_t (*sparse24_dequantize_rows)(const Sparse24Args& a, int64_t k0, int64_t k1, int64_t nb, float* tile);
  bool sparse24_bf16_x;  // the 2:4 kernels take x_bf16 (with x) for bf16 activations
  bool (*gemv_q8_applies)(int format);  // the int8-x GEMVs serve the format (group_rows % kQ8Block == 0)
  // The build's int8-x GEMVs, best first, null-terminated: variants on CPU
  // features beyond the build's (the avx2 build's vpdpbusd), then its own.
  const Q8Kernels* q8[4];
};

// Each kernels_<isa>.cpp defines its table; a build that the compiler cannot
// produce for this architecture has name == nullptr.
#define MARLIN_DECLARE_CPU_KERNELS(NS) \
  namespace NS {                       \
  extern const CpuKernels kernels;     \
  }
// The int8-x GEMVs of a build compiled again for more CPU features (kernels_avx2_vnni.cpp).
#define MARLIN_DECLARE_Q8_KERNELS(NS) \
  namespace NS {                      \
  extern const Q8Kernels q8_kernels;  \
  }

// A build this architecture cannot run: an empty table (of the entropy-coded
// layout's kernels in csrc/cpu/rans_kernels_<isa>.cpp).
#if MARLIN_KERNEL_RANS
#define MARLIN_UNAVAILABLE_CPU_KERNELS(NS)          \
  namespace marlin::cpu::NS {                      \
  extern const RansKernels rans_kernels = {};      \
  }
#else
#define MARLIN_UNAVAILABLE_CPU_KERNELS(NS)          \
  namespace marlin::cpu::NS {                      \
  extern const CpuKernels kernels = {};            \
  }
#endif
#define MARLIN_UNAVAILABLE_Q8_KERNELS(NS)            \
  namespace marlin::cpu::NS {                        \
  extern const Q8Kernels q8_kernels = {};            \
  }

MARLIN_DECLARE_CPU_KERNELS(avx512_bf16)
MARLIN_DECLARE_CPU_KERNELS(avx512)
MARLIN_DECLARE_CPU_KERNELS(avx2)
MARLIN_DECLARE_CPU_KERNELS(neon_bf16)
MARLIN_DECLARE_CPU_KERNELS(generic)
MARLIN_DECLARE_Q8_KERNELS(avx2_avx_vnni)
MARLIN_DECLARE_Q8_KERNELS(avx2_avx512_vnni)

}  // namespace cpu
}  // namespace marlin
