// Facts shared by the host C++ (csrc/) and the Metal kernels (metal/), in the
// manner of PyTorch's c10/metal headers: the weight-format enum (its values
// are persisted), the allowed group sizes, the packing constants, the X-macros
// that generate kernel instantiations and their host-side names, and the tile
// sizes both the dispatch planner (csrc/core/metal_plan_*.cpp) and the kernels
// depend on. torch_marlin/formats.py holds the same facts for Python; a test
// (tests/test_shared_constants.py) checks that they agree.
#pragma once

#if defined(__METAL_VERSION__)
#define MARLIN_CONSTEXPR constant constexpr
#else
#include <cstdint>
#define MARLIN_CONSTEXPR inline constexpr
#endif

namespace marlin {

// Value formats. The numbers are persisted (MarlinLinear's _extra_state,
// torch_marlin/formats.py WEIGHT_FORMATS is in this order): append only.
enum WeightFormat : int { kFp4 = 0, kUint4 = 1, kInt4 = 2, kNf4 = 3, kAffine = 4 };

// X(name, enumerator, ...): every value format once. Kernel instantiations
// (metal/*.metal) and the names the host builds kernel names from
// (csrc/core/formats.cpp) both come from this list.
#define MARLIN_FOR_EACH_FORMAT(X, ...) \
  X(fp4, kFp4, __VA_ARGS__)            \
  X(uint4, kUint4, __VA_ARGS__)        \
  X(int4, kInt4, __VA_ARGS__)          \
  X(nf4, kNf4, __VA_ARGS__)            \
  X(affine, kAffine, __VA_ARGS__)

MARLIN_CONSTEXPR int kNumWeightFormats = 5;

// Formats with a second fp16 tensor per group (`zeros`) besides the scale. It is a
// zero point subtracted before the scale, w = (q - zero) * scale (uint4), or,
// for zeros_are_bias formats, a bias added after it, w = q * scale + bias (affine).
inline constexpr bool has_zeros(WeightFormat f) { return f == kUint4 || f == kAffine; }
inline constexpr bool zeros_are_bias(WeightFormat f) { return f == kAffine; }

// Whether every code value (before the scale) is exact in bf16, so that bf16
// activations may take the CPU's bf16 pair-dot kernels (csrc/cpu/format_decode.h
// checks the claim). nf4's values have up to 11 significant bits: its bf16
// activations take the fp32 path.
inline constexpr bool values_exact_in_bf16(WeightFormat f) { return f != kNf4; }

// nf4: bitsandbytes' NF4 table (normal-distribution quantiles), each value
// rounded to the nearest fp16 (docs/FORMAT.md), so that every decode (fp32 on
// the CPU, half on Metal) holds it exactly. Indexed by code, ascending.
MARLIN_CONSTEXPR float kNf4Values[16] = {
    -1.0f,          -0.6962890625f,  -0.52490234375f, -0.39501953125f, -0.284423828125f, -0.184814453125f,
    -0.091064453125f, 0.0f,          0.07958984375f,  0.160888671875f, 0.24609375f,      0.337890625f,
    0.440673828125f, 0.5625f,        0.72314453125f,  1.0f};

#if !defined(__METAL_VERSION__)
// The C++ kernels' run-time dispatch on a format: calls
// body.template operator()<F>() with f as the template argument F. One case per
// MARLIN_FOR_EACH_FORMAT entry and no default, so every kernel is instantiated for
// every format, and a format whose decode is missing does not compile (each
// decode is a template declared without a body and specialised per format).
// The ops check f (csrc/core/formats.cpp) before any kernel runs.
#define MARLIN_FORMAT_CASE(name, F, body) \
  case F:                                \
    return body.template operator()<F>();
template <class Body>
inline auto with_format(int f, Body&& body) {
  switch (f) { MARLIN_FOR_EACH_FORMAT(MARLIN_FORMAT_CASE, body) }
  __builtin_trap();  // not a format: unreachable behind the ops' checks
}
#undef MARLIN_FORMAT_CASE
#endif

MARLIN_CONSTEXPR int kPackFactor = 8;  // 4-bit codes per int32 word, along K
MARLIN_CONSTEXPR int kInt4Offset = 8;  // int4 is offset-binary: q - 8 is the value

// 2:4 sparse layout (docs/FORMAT.md): a values word holds the 8 kept codes of
// 16 K rows (4 blocks), a metadata word the 8 position nibbles of 32 K rows.
MARLIN_CONSTEXPR int kSparseValueRows = 16;
MARLIN_CONSTEXPR int kSparseMetadataRows = 32;
// The 2:4 GEMM (metal/sparse24_gemm.h) steps through K in stages of one
// metadata row: 2 values rows, 32 K (the dense GEMMs' stage is kGemmTileK).
MARLIN_CONSTEXPR int kSparseGemmTileK = kSparseMetadataRows;

// Allowed group sizes along K; -1 is one group over all of K (per channel).
MARLIN_CONSTEXPR int kNumGroupSizes = 6;
MARLIN_CONSTEXPR int kGroupSizes[kNumGroupSizes] = {16, 32, 64, 128, 256, -1};

// Activation / output dtypes of the Metal kernels: X(name, Metal type,
// at::ScalarType enumerator, ...). bfloat only where the Metal compiler has it
// (it defines __HAVE_BFLOAT__: MSL 3.1 and newer).
#if defined(__METAL_VERSION__) && !defined(__HAVE_BFLOAT__)
#define MARLIN_FOR_EACH_DTYPE(X, ...) \
  X(f16, half, Half, __VA_ARGS__)     \
  X(f32, float, Float, __VA_ARGS__)
#else
#define MARLIN_FOR_EACH_DTYPE(X, ...)     \
  X(f16, half, Half, __VA_ARGS__)         \
  X(bf16, bfloat, BFloat16, __VA_ARGS__) \
  X(f32, float, Float, __VA_ARGS__)
#endif

// --- Metal kernels: function constants, tiles ------------------------------------

// Function constants, X(enumerator, MSL name, index, MSL type): metal/marlin_dequant.h
// declares them from this list and the planner (csrc/core/metal_plan_dense.cpp)
// sets them by enumerator, so the indices cannot drift apart. A pipeline is
// specialized per value (the Metal compiler folds them: no runtime division by
// the group size, loops bounded by the exact row count).
#define MARLIN_FOR_EACH_FUNCTION_CONSTANT(X)                                                      \
  X(kFcHasBias, marlin_has_bias, 0, bool)           /* add bias[n] before rounding */             \
  X(kFcWritePartial, marlin_write_partial, 1, bool) /* K split: store fp32 partial tiles */       \
  X(kFcAligned, marlin_aligned, 2, bool)            /* N % 4 == 0, buffers 16-byte aligned */     \
  X(kFcGroupRows, marlin_group_rows, 3, uint)       /* packed rows per group, 0: one group */     \
  X(kFcMoeWeighted, marlin_moe_weighted, 5, bool)   /* moe combine: weighted sum of top_k rows */

#if !defined(__METAL_VERSION__)
#define MARLIN_FC_ENUM(e, name, index, type) e = index,
enum FunctionConstant : int { MARLIN_FOR_EACH_FUNCTION_CONSTANT(MARLIN_FC_ENUM) };
#undef MARLIN_FC_ENUM
#endif

MARLIN_CONSTEXPR int kMaxThreadgroupMemory = 32 * 1024;  // bytes, every Apple GPU
// Budget per 128 threads: at least two threadgroups of every kernel fit a GPU
// core's threadgroup memory (docs/KERNELS.md).
MARLIN_CONSTEXPR int kThreadgroupMemoryBudget = 16 * 1024;
// Lanes per simdgroup on Apple GPUs; every kernel's lane arithmetic assumes it
// (the MPS bridge checks each pipeline's threadExecutionWidth).
MARLIN_CONSTEXPR int kSimdWidth = 32;

// Decode GEMV (metal/marlin_gemv.h): a threadgroup of up to kGemvSimdgroups
// simdgroups owns kGemvColumns output columns of one K slice. Lane 8 * kl + cl
// reads 4 adjacent packed words (16 bytes: columns 4 cl .. 4 cl + 3) of
// kGemvLaneRows consecutive packed rows; the 4 kl lanes take the 4 runs of a
// block of kGemvBlockRows rows, the simdgroups take blocks round-robin.
MARLIN_CONSTEXPR int kGemvColumns = 32;
MARLIN_CONSTEXPR int kGemvSimdgroups = 8;
MARLIN_CONSTEXPR int kGemvMaxRows = 8;
MARLIN_CONSTEXPR int kGemvLaneRows = 4;
// The row counts the GEMVs (metal/gemv.metal, metal/sparse24_gemv.metal) are
// instantiated for: a template parameter sizing their per-row register arrays.
// M rows of x run the kernel of the smallest count >= M (gemv_kernel_rows).
#define MARLIN_FOR_EACH_GEMV_ROWS(X, ...) X(1, __VA_ARGS__) X(4, __VA_ARGS__) X(8, __VA_ARGS__)
inline constexpr int gemv_kernel_rows(int m) { return m <= 1 ? 1 : m <= 4 ? 4 : 8; }
MARLIN_CONSTEXPR int kGemvBlockRows = 4 * kGemvLaneRows;

// GEMMs (metal/marlin_gemm_fused.h, metal/marlin_gemm_tiled.h): kGemmThreads
// threads (4 simdgroups) own a TM x kGemmTileN output tile and step through K
// in stages of kGemmTileK (the K split cuts K at stage boundaries). The fused
// GEMM has TM = 32 or 64 (template), the tiled GEMM kTiledTileM.
MARLIN_CONSTEXPR int kGemmThreads = 128;
MARLIN_CONSTEXPR int kGemmTileN = 64;
MARLIN_CONSTEXPR int kGemmTileK = 16;
MARLIN_CONSTEXPR int kFusedMaxRows = 64;  // M above this: the tiled GEMM
MARLIN_CONSTEXPR int kTiledTileM = 64;
static_assert(kGemmTileK % 8 == 0 && kGemmTileK <= 16,
              "a GEMM stage is whole packed rows inside one group (the smallest group is 16 K)");
static_assert(kGemmTileK / 8 * kGemmTileN == kGemmThreads, "the tiled GEMM decodes one word per thread and stage");

// Threadgroup tiles: every row is padded by 16 bytes so that the rows an
// 8 x 8 fragment read touches start in different banks.
MARLIN_CONSTEXPR int kTilePadBytes = 16;
// Row stride (elements) of an x tile [TM][kGemmTileK] of elements of `size` bytes.
inline constexpr int x_tile_stride(int size) { return kGemmTileK + kTilePadBytes / size; }
// Row stride (floats) of the tiled GEMM's dequantized B tile [kGemmTileK][kGemmTileN].
inline constexpr int b_tile_stride() { return kGemmTileN + kTilePadBytes / 4; }

// Threadgroup memory (bytes) of each kernel, for the planner and the kernels alike.
inline constexpr int gemv_threadgroup_memory(int rows) { return kGemvSimdgroups * rows * kGemvColumns * 4; }
// Fused GEMM: double-buffered x tile [2][TM][x_tile_stride] of T.
inline constexpr int fused_threadgroup_memory(int tm, int size) { return 2 * tm * x_tile_stride(size) * size; }
// 2:4 GEMM: double-buffered x tile [2][TM][kSparseGemmTileK] of T, unpadded
// (padding f32 at TM = 64 would exceed the 16 KiB budget): its columns are
// swizzled instead (metal/sparse24_gemm.h, marlin_sparse24_x_index).
inline constexpr int sparse_gemm_threadgroup_memory(int tm, int size) { return 2 * tm * kSparseGemmTileK * size; }
// Tiled GEMM: x tile [kTiledTileM][x_tile_stride] of T, then the fp32 B tile.
inline constexpr int tiled_x_tile_bytes(int size) { return kTiledTileM * x_tile_stride(size) * size; }
inline constexpr int tiled_threadgroup_memory(int size) {
  return tiled_x_tile_bytes(size) + kGemmTileK * b_tile_stride() * 4;
}

// K-split reduction (metal/marlin_reduce.h): outputs per threadgroup (one per
// planned thread).
MARLIN_CONSTEXPR int kReduceOutputs = 256;

// Standalone dequantize (metal/marlin_dequantize.h): threadgroup of
// kDequantColumns x kDequantRows threads, one packed word each.
MARLIN_CONSTEXPR int kDequantColumns = 32;
MARLIN_CONSTEXPR int kDequantRows = 4;

// Routed expert matmuls (metal/moe.metal): the per-pair GEMV is the decode
// GEMV on one row; the grouped GEMM is the fused GEMM on tiles of kMoeTileM
// expert-sorted rows; the routing's offsets and scatter kernels run
// kMoeRouteThreads threads per threadgroup; the combining epilogue
// kMoeCombineThreads.
MARLIN_CONSTEXPR int kMoeTileM = 32;
MARLIN_CONSTEXPR int kMoeRouteThreads = 256;
MARLIN_CONSTEXPR int kMoeCombineThreads = 256;

}  // namespace marlin
