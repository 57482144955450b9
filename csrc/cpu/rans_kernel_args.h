// Plain-pointer arguments of the entropy-coded layout's CPU kernels
// (csrc/cpu/rans_kernels_impl.h; the stream format in docs/FORMAT.md).
#pragma once
#include <stdint.h>

#include <algorithm>
#include <bitset>

#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {

constexpr int kRansBlockCols = 32;  // lanes of a column block: one output column each
// Columns of one gemm_tile call: 4 column blocks, so that AVX-512's tile fill
// decodes 4 independent state chains in lockstep.
constexpr int64_t kRansGemmCols = 2 * kGemmBlockCols;
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

// The slot table (rans_ops.cpp builds it from freqs, once per distinct freqs): for every slot
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
// builds' lookup in registers: 16-bit lanes, the 32 lanes of a chunk at once
// (vpermi2w on tables of 64 words). The slot's top kRansBucketBits bits pick a
// bucket, whose word is the index of its first slot's symbol; or 64 for a
// split bucket (more symbols than a search of `levels` halvings covers), whose
// sub-buckets (its next split_bits bits) have their first symbol's index in
// split[(slot >> (prob_bits - 6 - split_bits)) & 63]: the split buckets must
// differ in their bucket number's low 6 - split_bits bits (then both lookups
// go in parallel). From there a binary search of the slot among the next
// 2^levels cums; unused entries have cum 0xFFFF, above every slot. symbols 0
// (the slot table serves): more than kRansRegisterSymbols of them, or no
// split_bits in [kRansMinSplitBits, 6] that covers every bucket with
// kRansMaxLevels halvings.
constexpr int kRansRegisterSymbols = 64;
constexpr int kRansBucketBits = 6;
constexpr int kRansBuckets = 1 << kRansBucketBits;
constexpr int kRansMinSplitBits = 4;
constexpr int kRansMaxLevels = 2;
struct RansRegisterTable {
  int symbols, levels, split_bits;
  bool has_split;  // some bucket is split (its word is kRansRegisterSymbols)
  uint16_t bucket[kRansBuckets];
  uint16_t split[kRansRegisterSymbols];
  uint16_t cum[kRansRegisterSymbols];
  uint16_t freq[kRansRegisterSymbols];
  uint16_t sym[kRansRegisterSymbols];
};

inline RansRegisterTable build_rans_register_table(const uint16_t* freqs, int symbols, int prob_bits) {
  RansRegisterTable t{};
  if (prob_bits < kRansBucketBits + kRansMinSplitBits || prob_bits > 15) return t;  // slots in 16 bits
  for (uint16_t& c : t.cum) c = 0xFFFF;
  int count = 0;
  uint32_t cum = 0;
  for (int sym = 0; sym < symbols; ++sym) {
    if (!freqs[sym]) continue;
    if (count == kRansRegisterSymbols) return RansRegisterTable{};
    t.cum[count] = uint16_t(cum);
    t.freq[count] = freqs[sym];
    t.sym[count++] = uint16_t(sym);
    cum += freqs[sym];
  }
  auto index_of = [&](uint32_t slot) {  // of the last cum at or below the slot (the cums ascend)
    // a binary search: the op built this table per call before it kept tables, and with 33-64 symbols (a real
    // layer's table at 3.6-4.1 bits) a linear walk took it 16-21 us, bisection 7-8
    return count > 1 ? int(std::upper_bound(t.cum + 1, t.cum + count, slot) - t.cum) - 1 : 0;
  };
  const int bucket_bits = prob_bits - kRansBucketBits;
  // The fewest levels (then split bits) whose search covers every bucket or, split, its sub-buckets.
  for (int levels = 0; levels <= kRansMaxLevels; ++levels) {
    const int reach = 1 << levels;
    // The search must not run past entry 63: starting lower is as good, the cums being sorted.
    auto start = [&](int first) {
      return uint16_t(first < kRansRegisterSymbols - reach ? first : kRansRegisterSymbols - reach);
    };
    for (int split_bits = kRansMinSplitBits; split_bits <= 6 && split_bits <= bucket_bits; ++split_bits) {
      const uint32_t width = 1u << bucket_bits, sub_width = width >> split_bits, subs = 1u << split_bits;
      const uint32_t places = kRansRegisterSymbols >> split_bits;  // split buckets at b % places
      std::bitset<kRansRegisterSymbols> taken;
      bool covered = true;
      for (uint32_t b = 0; b < kRansBuckets && covered; ++b) {
        const int first = index_of(b * width);
        if (index_of((b + 1) * width - 1) - first < reach) {
          t.bucket[b] = start(first);
          continue;
        }
        if (taken[b % places]) {
          covered = false;
          break;
        }
        taken[b % places] = true;
        t.bucket[b] = kRansRegisterSymbols;
        for (uint32_t j = 0; j < subs; ++j) {
          const uint32_t lo = b * width + j * sub_width;
          const int sub_first = index_of(lo);
          covered = covered && index_of(lo + sub_width - 1) - sub_first < reach;
          t.split[(b % places) * subs + j] = start(sub_first);
        }
      }
      if (covered) {
        t.symbols = count;
        t.levels = levels;
        t.split_bits = split_bits;
        t.has_split = taken.any();
        return t;
      }
    }
  }
  return RansRegisterTable{};
}

// The AVX2 builds' lookup in byte tables (vpshufb takes 16-entry tables, two
// of them 32 entries): at most 32 symbols, 32 buckets of the slot's top 5
// bits. A lane's index is its bucket's first symbol's plus the number of cums
// inside the bucket at or below its slot, compared on the slot's low bits (at
// most 7: prob_bits at most 12) as bytes, 32 lanes per instruction: by table
// (the first `boundaries` cums of every bucket, at most kRansByteBoundaries).
// A bucket with more (a grid's tails: rare symbols next to each other; up to
// kRansByteSplits such buckets of up to kRansSplitBoundaries cums) is split:
// its longest run of consecutive cums (symbols of frequency 1) counts as
// min(max(low - run_start, 0), run_length), its other cums past the table's
// are compared by a table of the split bucket's number. fits: these tables
// serve the symbols, and pay: a split bucket takes at most kRansSplitCompares
// compares beyond the table's (without the runs, bench_rans.py's Gaussian
// grid needed 9 and showed no gain over the slot table: docs/CPU.md). Built
// from the register table, so prob_bits 10 to 12.
constexpr int kRansByteBuckets = 32;
constexpr int kRansByteBoundaries = 3;
constexpr int kRansByteSplits = 15;
constexpr int kRansSplitBoundaries = 16;
constexpr int kRansSplitCompares = 4;
struct RansByteLayout {
  bool fits = false;
  int boundaries = 0;  // the most cums compared by table in a bucket that is not split
  int splits = 0;
  int split_bucket[kRansByteSplits] = {};
  uint8_t run_start[kRansByteSplits] = {};   // split bucket s's run: its first cum's slot - bucket start - 1
  uint8_t run_length[kRansByteSplits] = {};  // and its cums (0: none)
  int first[kRansByteBuckets] = {};  // index of the symbol of the bucket's first slot
  int count[kRansByteBuckets] = {};  // cums inside the bucket compared one by one (a split bucket's: but its run)
  uint8_t inside[kRansByteBuckets][kRansSplitBoundaries] = {};  // their slot - bucket start - 1, ascending

  RansByteLayout() = default;
  RansByteLayout(const RansRegisterTable& r, int prob_bits) {
    if (r.symbols == 0 || r.symbols > kRansByteBuckets || prob_bits < 5 || prob_bits > 12) return;
    const uint32_t width = 1u << (prob_bits - 5);
    for (int i = 1; i < r.symbols; ++i) {
      const uint32_t b = r.cum[i] / width, at = r.cum[i] % width;
      for (uint32_t later = b + (at != 0); later < kRansByteBuckets; ++later) first[later] = i;
      if (at == 0) continue;  // a bucket's start: its first symbol
      if (count[b] == kRansSplitBoundaries) return;
      inside[b][count[b]++] = uint8_t(at - 1);
    }
    for (int b = 0; b < kRansByteBuckets; ++b) {
      if (count[b] <= kRansByteBoundaries) {
        boundaries = count[b] > boundaries ? count[b] : boundaries;
        continue;
      }
      if (splits == kRansByteSplits) return;
      const int s = splits++;
      split_bucket[s] = b;
      int best = 0, length = 1;  // the longest run of consecutive cums, out of the compares
      for (int j = 1, start = 0; j <= count[b]; ++j) {
        if (j < count[b] && inside[b][j] == inside[b][j - 1] + 1) continue;
        if (j - start > length) best = start, length = j - start;
        start = j;
      }
      if (length < 2) continue;
      run_start[s] = inside[b][best], run_length[s] = uint8_t(length);
      for (int j = best; j + length < count[b]; ++j) inside[b][j] = inside[b][j + length];
      count[b] -= length;
    }
    for (int s = 0; s < splits; ++s)
      if (count[split_bucket[s]] - boundaries > kRansSplitCompares) return;
    fits = true;
  }
};

struct RansArgs {
  const uint16_t* words;        // [W]: the chunks' 16-bit words, one after another
  const int32_t* word_offsets;  // [chunks + 1]
  const uint32_t* states;       // [chunks, 32]: initial state of each lane
  const uint32_t* table;        // the slot table
  RansRegisterTable registers;  // its symbols, if few
  RansByteLayout bytes;         // the byte tables of `registers`, if they fit (AVX2 builds)
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
//   gemm_tile(a, m0, m1, nb, scratch)    out[m0:m1, nb:nb+128] (a.gemm.out; nb a multiple of
//       kRansGemmCols), every chunk of the four column blocks decoded once into cache-sized
//       tiles reused for all rows (the dense gemm_tiles); scratch as
//       2 * gemm_scratch_floats(m1 - m0).
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
