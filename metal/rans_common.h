// Facts of the entropy-coded ("rans") layout shared by the Metal kernels
// (metal/rans_*.h) and their planner (csrc/core/metal_plan_rans.cpp): the
// stream constants of the layout (docs/FORMAT.md, "Entropy-coded layout"; the
// planner checks them against csrc/core/rans_checks.h) and the kernels' tiles
// and threadgroup-memory sizes.
#pragma once

#include "marlin_common.h"

namespace marlin {
namespace rans {

// Stream: 32 interleaved 32-bit states per chunk (one per output column of a
// 32-column block), 16-bit words, state in [2^16, 2^32), prob_bits in [10, 15].
MARLIN_CONSTEXPR int kLanes = 32;
MARLIN_CONSTEXPR unsigned kStateLow = 1u << 16;
MARLIN_CONSTEXPR int kMinProbBits = 10;
MARLIN_CONSTEXPR int kMaxProbBits = 15;
MARLIN_CONSTEXPR int kLosslessSymbols = 16;  // a 4-bit format's codes
MARLIN_CONSTEXPR int kGridSymbols = 256;     // "grid" (value = symbol - 128) and "tcq"
MARLIN_CONSTEXPR int kGridOffset = 128;
static_assert(kLanes == kSimdWidth, "one simdgroup decodes the 32 lanes of a chunk in lockstep");

// Decode table in threadgroup memory: per symbol 8 bytes (freq, cum, the
// symbol's raw value as half, 0: metal/rans_decode.h RansEntry), then one symbol byte per bucket
// of 2^(prob_bits - kBucketBits) slots (the first symbol whose range meets
// the bucket; a lane walks on from it when its slot lies past that symbol's
// range, at most 2^(prob_bits - kBucketBits) - 1 steps). 2^12 buckets: no
// walk up to the default prob_bits 12, and 6 KiB for 256 symbols whatever
// prob_bits is (the GEMM's tiles fit beside it in 16 KiB).
MARLIN_CONSTEXPR int kBucketBits = 12;
inline constexpr int bucket_bits(int prob_bits) {
  return prob_bits < kBucketBits ? prob_bits : kBucketBits;
}
inline constexpr int table_bytes(int symbols) { return symbols * 8 + (1 << kBucketBits); }

// Decode kernel and fused decode GEMV: a threadgroup of up to
// kChunkSimdgroups simdgroups, one chunk per simdgroup (the table is built
// once per threadgroup). The GEMV serves M <= kGemvMaxRows.
MARLIN_CONSTEXPR int kChunkSimdgroups = 8;
MARLIN_CONSTEXPR int kGemvMaxRows = 8;

// GEMM: kGemmSimdgroups simdgroups own a kGemmTileM x
// (32 * kGemmSimdgroups) output tile; simdgroup s decodes column block s of
// the tile kGemmTileK K rows at a time into its raw-value tile
// Bt[32 columns][kBtStride] (half) and multiplies that block's columns.
MARLIN_CONSTEXPR int kGemmSimdgroups = 4;
MARLIN_CONSTEXPR int kGemmTileM = 32;
MARLIN_CONSTEXPR int kGemmTileN = kLanes * kGemmSimdgroups;
MARLIN_CONSTEXPR int kBtStride = kGemmTileK + kTilePadBytes / 2;  // halves
inline constexpr int bt_bytes() { return kGemmSimdgroups * kLanes * kBtStride * 2; }
// Threadgroup memory of the GEMM: table, Bt tiles, then the x tile [TM][x_tile_stride] of T.
inline constexpr int gemm_threadgroup_memory(int symbols, int size) {
  return table_bytes(symbols) + bt_bytes() + kGemmTileM * x_tile_stride(size) * size;
}

}  // namespace rans
}  // namespace marlin
