// Plain-pointer arguments of the entropy-coded layout's CPU kernels
// (csrc/cpu/rans_kernels_impl.h; the stream format in docs/FORMAT.md).
#pragma once
#include <stdint.h>

#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

constexpr int kRansBlockCols = 32;  // lanes of a column block: one output column each
// RansArgs::kind of weight_format "grid": value (s - 128) * step. Not a value format
// number: has_zeros and zeros_are_bias are false for it, as the grid has no zeros.
constexpr int kRansGrid = 100;
// RansArgs::kind of weight_format "tcq": the grid's symbols through the 4-state trellis
// (docs/FORMAT.md): value j * step, j = 2k or 2k - sign(k) by the lane's state, k = s - 128.
constexpr int kRansTcq = 101;
static_assert(!has_zeros(WeightFormat(kRansGrid)) && !zeros_are_bias(WeightFormat(kRansGrid)) &&
                  values_exact_in_bf16(WeightFormat(kRansGrid)),
              "the grid has no zeros and its values s - 128 are exact in bf16");
static_assert(!has_zeros(WeightFormat(kRansTcq)) && !zeros_are_bias(WeightFormat(kRansTcq)) &&
                  values_exact_in_bf16(WeightFormat(kRansTcq)),
              "tcq has no zeros and its levels j in [-256, 254] are exact in bf16");

// The per-call slot table (rans_ops.cpp builds it from freqs): for every slot
// of [0, 2^prob_bits), its symbol s, freq[s] and slot - cum[s]. Up to
// kRansPackedProbBits one uint32 per slot, s | (slot - cum) << 8 | (freq - 1) << 20;
// above, two arrays of 2^prob_bits uint32: freq | (slot - cum) << 16, then s.
constexpr int kRansPackedProbBits = 12;

// Column blocks per work item of the fused GEMV (the op splits N along these).
constexpr int64_t kRansGemvItemBlocks = 4;

// Writes the slot table of freqs [symbols] (summing to 2^prob_bits, checked by
// the caller) into table (2^prob_bits entries, twice that above kRansPackedProbBits).
inline void build_rans_slot_table(const uint16_t* freqs, int symbols, int prob_bits, uint32_t* table) {
  const uint32_t size = 1u << prob_bits;
  uint32_t cum = 0;
  for (int sym = 0; sym < symbols; ++sym) {
    for (uint32_t j = 0; j < freqs[sym]; ++j) {
      if (prob_bits <= kRansPackedProbBits) {
        table[cum + j] = uint32_t(sym) | j << 8 | (freqs[sym] - 1u) << 20;
      } else {
        table[cum + j] = freqs[sym] | j << 16;
        table[size + cum + j] = uint32_t(sym);
      }
    }
    cum += freqs[sym];
  }
}
inline int64_t rans_slot_table_size(int prob_bits) {
  return (int64_t(1) << prob_bits) * (prob_bits <= kRansPackedProbBits ? 1 : 2);
}

// The symbols of nonzero frequency in symbol (so cum) order, for the AVX-512
// builds' lookup in registers: from the first symbol of the slot's bucket
// (kRansBuckets buckets of equal width), a binary search of the slot among
// the next 2^levels cums, then entry = s | freq << 16. symbols 0 (the slot
// table serves): more than kRansRegisterSymbols of them, a search of more than
// kRansMaxLevels halvings, or prob_bits outside [kRansBucketBits,
// kRansPackedProbBits]. Unused entries have cum 2^16, above every slot.
constexpr int kRansRegisterSymbols = 32;
constexpr int kRansBucketBits = 6;
constexpr int kRansBuckets = 1 << kRansBucketBits;
constexpr int kRansMaxLevels = 2;
struct RansRegisterTable {
  int symbols, levels;
  uint32_t cum[kRansRegisterSymbols];
  uint32_t entry[kRansRegisterSymbols];
  uint16_t bucket_first[kRansBuckets];
};

inline RansRegisterTable build_rans_register_table(const uint16_t* freqs, int symbols, int prob_bits) {
  RansRegisterTable t{};
  if (prob_bits < kRansBucketBits || prob_bits > kRansPackedProbBits) return t;
  for (int i = 0; i < kRansRegisterSymbols; ++i) t.cum[i] = 1u << 16;
  uint32_t cum = 0;
  for (int sym = 0; sym < symbols; ++sym) {
    if (!freqs[sym]) continue;
    if (t.symbols == kRansRegisterSymbols) return RansRegisterTable{};
    t.cum[t.symbols] = cum;
    t.entry[t.symbols++] = uint32_t(sym) | uint32_t(freqs[sym]) << 16;
    cum += freqs[sym];
  }
  // The symbol index of each bucket's first and last slot: the search must span their difference.
  auto index_of = [&](uint32_t slot) {
    int i = 0;
    while (i + 1 < t.symbols && t.cum[i + 1] <= slot) ++i;
    return i;
  };
  const int width = 1 << (prob_bits - kRansBucketBits);
  int span = 1;
  for (int b = 0; b < kRansBuckets; ++b) {
    const int first = index_of(uint32_t(b * width)), last = index_of(uint32_t((b + 1) * width - 1));
    t.bucket_first[b] = uint16_t(first);
    if (last - first + 1 > span) span = last - first + 1;
  }
  while ((1 << t.levels) < span) ++t.levels;
  // Longer searches (symbols of small frequencies next to each other) were slower than the gather.
  if (t.levels > kRansMaxLevels) return RansRegisterTable{};
  // The search must not run past entry 31: starting lower is as good, the cums being sorted.
  for (uint16_t& first : t.bucket_first)
    if (first + (1 << t.levels) > kRansRegisterSymbols) first = uint16_t(kRansRegisterSymbols - (1 << t.levels));
  return t;
}

struct RansArgs {
  const uint16_t* words;        // [W]: the chunks' 16-bit words, one after another
  const int32_t* word_offsets;  // [chunks + 1]
  const uint32_t* states;       // [chunks, 32]: initial state of each lane
  const uint32_t* table;        // the slot table
  RansRegisterTable registers;  // its symbols, if few
  int prob_bits;
  int kind;                     // a WeightFormat (lossless), kRansGrid or kRansTcq
  int64_t k, n, chunk_k, kchunks, blocks;
  // x (fp32; or x_bf16 for gemm_tile in builds with bf16_x), xsum, scales, zeros,
  // out, m, groups, group_rows as for the dense kernels (packed unused).
  GemmArgs gemm;
};

// One build of the kernels (the same instruction sets as CpuKernels). Each
// returns nonzero if a chunk it decoded is not well formed (a read past its
// words, words left over, or a final state other than 2^16; the op then
// reports which chunk); the outputs of a bad chunk are garbage, never a read
// outside its words.
//   gemv(a, m0, m1, b0, b1, c0, c1, out, ldo)  out[0:m1-m0, 0:32 (b1-b0)] (row stride ldo) =
//       x[m0:m1] @ W[K chunks c0:c1, column blocks b0:b1]; the weight is decoded in
//       registers, never stored. Groups end with the range (c1 at a group end, or a
//       format without zeros).
//   gemm_tile(a, m0, m1, nb, scratch)    out[m0:m1, nb:nb+64] (a.gemm.out), every chunk of the
//       two column blocks decoded once into cache-sized tiles reused for all rows
//       (the dense gemm_tiles); scratch as gemm_scratch_floats(m1 - m0).
//   decode_chunk(a, c, out, ldo, cols)   symbols of chunk c into out[0:rows, 0:cols] (uint8, its
//       K rows from the chunk's first, row stride ldo).
struct RansKernels {
  const char* name;
  uint32_t (*gemv)(const RansArgs& a, int64_t m0, int64_t m1, int64_t b0, int64_t b1, int64_t c0, int64_t c1,
                   float* out, int64_t ldo);
  uint32_t (*gemm_tile)(const RansArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch);
  uint32_t (*decode_chunk)(const RansArgs& a, int64_t c, uint8_t* out, int64_t ldo, int64_t cols);
};

#define MARLIN_DECLARE_RANS_KERNELS(NS) \
  namespace NS {                        \
  extern const RansKernels rans_kernels; \
  }
MARLIN_DECLARE_RANS_KERNELS(avx512_bf16)
MARLIN_DECLARE_RANS_KERNELS(avx512)
MARLIN_DECLARE_RANS_KERNELS(avx2)
MARLIN_DECLARE_RANS_KERNELS(neon_bf16)
MARLIN_DECLARE_RANS_KERNELS(generic)
#undef MARLIN_DECLARE_RANS_KERNELS

}  // namespace cpu
}  // namespace marlin
