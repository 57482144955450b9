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
enum WeightFormat : int { kFp4 = 0, kUint4 = 1, kInt4 = 2 };

// X(name, enumerator, ...): every value format once. Kernel instantiations
// (metal/*.metal) and the names the host builds kernel names from
// (csrc/core/formats.cpp) both come from this list.
#define MARLIN_FOR_EACH_FORMAT(X, ...) \
  X(fp4, kFp4, __VA_ARGS__)            \
  X(uint4, kUint4, __VA_ARGS__)        \
  X(int4, kInt4, __VA_ARGS__)

MARLIN_CONSTEXPR int kNumWeightFormats = 3;

// Formats with a zero point per group (`zeros`) besides the scale.
inline constexpr bool has_zeros(WeightFormat f) { return f == kUint4; }

MARLIN_CONSTEXPR int kPackFactor = 8;  // 4-bit codes per int32 word, along K
MARLIN_CONSTEXPR int kInt4Offset = 8;  // int4 is offset-binary: q - 8 is the value

// 2:4 sparse layout (docs/FORMAT.md): a values word holds the 8 kept codes of
// 16 K rows (4 blocks), a metadata word the 8 position nibbles of 32 K rows.
MARLIN_CONSTEXPR int kSparseValueRows = 16;
MARLIN_CONSTEXPR int kSparseMetadataRows = 32;

// Allowed group sizes along K; -1 is one group over all of K (per channel).
MARLIN_CONSTEXPR int kNumGroupSizes = 6;
MARLIN_CONSTEXPR int kGroupSizes[kNumGroupSizes] = {16, 32, 64, 128, 256, -1};

// Activation / output dtypes of the Metal kernels: X(name, Metal type,
// at::ScalarType enumerator, ...). bfloat needs Metal 3.1.
#if defined(__METAL_VERSION__) && __METAL_VERSION__ < 310
#define MARLIN_FOR_EACH_DTYPE(X, ...) \
  X(f16, half, Half, __VA_ARGS__)     \
  X(f32, float, Float, __VA_ARGS__)
#else
#define MARLIN_FOR_EACH_DTYPE(X, ...)     \
  X(f16, half, Half, __VA_ARGS__)         \
  X(bf16, bfloat, BFloat16, __VA_ARGS__) \
  X(f32, float, Float, __VA_ARGS__)
#endif

// --- Metal tiles: what the planner launches and the kernels assume --------------

MARLIN_CONSTEXPR int kMaxThreadgroupMemory = 32 * 1024;  // bytes, every Apple GPU
// Lanes per simdgroup on Apple GPUs; every kernel's lane arithmetic assumes it
// (the MPS bridge checks each pipeline's threadExecutionWidth).
MARLIN_CONSTEXPR int kSimdWidth = 32;

// Decode GEMV (metal/gemv.metal): a threadgroup of kGemvSimdgroups simdgroups
// owns kGemvColumns output columns and all of K, for up to kGemvMaxRows rows.
MARLIN_CONSTEXPR int kGemvColumns = 32;
MARLIN_CONSTEXPR int kGemvSimdgroups = 8;
MARLIN_CONSTEXPR int kGemvMaxRows = 8;

// GEMMs (metal/gemm_fused.metal, metal/gemm_tiled.metal): kGemmThreads threads
// (4 simdgroups) own a TM x kGemmTileN output tile and step through K in
// stages of kGemmTileK. The fused GEMM has TM = 32 or 64 (template), the
// tiled GEMM kTiledTileM.
MARLIN_CONSTEXPR int kGemmThreads = 128;
MARLIN_CONSTEXPR int kGemmTileN = 64;
MARLIN_CONSTEXPR int kGemmTileK = 32;
MARLIN_CONSTEXPR int kFusedMaxRows = 64;  // M above this: the tiled GEMM
MARLIN_CONSTEXPR int kTiledTileM = 64;

// Standalone dequantize (metal/dequant.metal): threadgroup of
// kDequantColumns x kDequantRows threads, one packed word each.
MARLIN_CONSTEXPR int kDequantColumns = 32;
MARLIN_CONSTEXPR int kDequantRows = 4;

}  // namespace marlin
