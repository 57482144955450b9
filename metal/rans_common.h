// Facts of the entropy-coded ("rans") layout shared by the Metal kernels
// (metal/rans_*.h) and their planner (csrc/core/metal_plan_rans.cpp): the
// stream constants of the layout (docs/FORMAT.md, "Entropy-coded layout") and
// the kernels' tiles and threadgroup-memory sizes.
#pragma once

#include "marlin_common.h"

namespace marlin {

// Stream: 32 interleaved 32-bit states per chunk (one per output column of a
// 32-column block), 16-bit words, state in [2^16, 2^32), prob_bits in [10, 15].
MARLIN_CONSTEXPR int kRansLanes = 32;
MARLIN_CONSTEXPR unsigned kRansStateLow = 1u << 16;
MARLIN_CONSTEXPR int kRansMinProbBits = 10;
MARLIN_CONSTEXPR int kRansMaxProbBits = 15;
MARLIN_CONSTEXPR int kRansLosslessSymbols = 16;  // a 4-bit format's codes
MARLIN_CONSTEXPR int kRansGridSymbols = 256;     // "grid": value = symbol - 128
MARLIN_CONSTEXPR int kRansGridOffset = 128;
static_assert(kRansLanes == kSimdWidth, "one simdgroup decodes the 32 lanes of a chunk in lockstep");

// Decode table in threadgroup memory: per symbol a uint2 (freq | cum << 16,
// the float bits of the symbol's raw value), then one symbol byte per bucket
// of 2^(prob_bits - kRansBucketBits) slots (the first symbol whose range meets
// the bucket; a lane walks on from it when its slot lies past that symbol's
// range, at most 2^(prob_bits - kRansBucketBits) - 1 steps). 2^11 buckets
// keep the table at 4 KiB for 256 symbols whatever prob_bits is.
MARLIN_CONSTEXPR int kRansBucketBits = 11;
inline constexpr int rans_bucket_bits(int prob_bits) {
  return prob_bits < kRansBucketBits ? prob_bits : kRansBucketBits;
}
inline constexpr int rans_table_bytes(int symbols) { return symbols * 8 + (1 << kRansBucketBits); }

// Decode kernel and fused decode GEMV: a threadgroup of up to
// kRansChunkSimdgroups simdgroups, one chunk per simdgroup (the table is built
// once per threadgroup). The GEMV serves M <= kRansGemvMaxRows.
MARLIN_CONSTEXPR int kRansChunkSimdgroups = 8;
MARLIN_CONSTEXPR int kRansGemvMaxRows = 8;

// GEMM: kRansGemmSimdgroups simdgroups own a kRansGemmTileM x
// (32 * kRansGemmSimdgroups) output tile; simdgroup s decodes column block s of
// the tile kGemmTileK K rows at a time into its raw-value tile
// Bt[32 columns][kRansBtStride] (half) and multiplies that block's columns.
MARLIN_CONSTEXPR int kRansGemmSimdgroups = 4;
MARLIN_CONSTEXPR int kRansGemmTileM = 32;
MARLIN_CONSTEXPR int kRansGemmTileN = kRansLanes * kRansGemmSimdgroups;
MARLIN_CONSTEXPR int kRansBtStride = kGemmTileK + kTilePadBytes / 2;  // halves
inline constexpr int rans_bt_bytes() { return kRansGemmSimdgroups * kRansLanes * kRansBtStride * 2; }
// Threadgroup memory of the GEMM: table, Bt tiles, then the x tile [TM][x_tile_stride] of T.
inline constexpr int rans_gemm_threadgroup_memory(int symbols, int size) {
  return rans_table_bytes(symbols) + rans_bt_bytes() + kRansGemmTileM * x_tile_stride(size) * size;
}

}  // namespace marlin
