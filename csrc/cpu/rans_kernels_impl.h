// The entropy-coded layout's CPU kernels (docs/FORMAT.md; entry points in
// csrc/cpu/rans_kernel_args.h). Included by kernels_impl.h with
// MARLIN_KERNEL_RANS (csrc/cpu/rans_kernels_<isa>.cpp), inside its anonymous
// namespace, on its pieces: vectors, value formats (FormatDecode through
// table_nibble), group_dot / group_weight, gemm_tiles and gemm_tiles_dot.
//
// The 32 lanes of a chunk decode in lockstep. With few symbols (up to 64),
// AVX-512 builds keep the tables in registers and a chunk's states as two
// vectors of 16-bit words (RansPlanes: all 32 lanes in each instruction).
// Otherwise the lanes are kRansVectors vectors of kLanes 32-bit states
// (RansLanes): per step each lane looks its slot up (AVX2, with at most 32
// symbols: in byte tables in registers, 32 lanes per vpshufb, RansByteLayout;
// otherwise in the per-call slot table, a gather on AVX-512, one load per lane
// elsewhere), updates its state,
// and the lanes whose state fell below 2^16 take the next words of the
// chunk's shared stream in lane order (AVX-512: vpexpandd; AVX2: vpermd by a
// 256-entry table of the 8-lane prefix sums; elsewhere one lane after the
// other). Lane l of column block b is output column 32 b + l, so x[k]
// multiplies a whole vector of decoded weights as one broadcast. "tcq"
// symbols take their value through each lane's trellis state, kept next to
// its rANS state.

#include "cpu/rans_kernel_args.h"

constexpr int kRansVectors = kRansBlockCols / kLanes;
constexpr uint32_t kRansLow = 1u << 16;

// The step's pieces, always inlined: a call keeps the lanes' states in memory.
#define MARLIN_RANS_INLINE __attribute__((always_inline)) inline

// tcq: the trellis state sigma = 2 high + low of each lane (docs/FORMAT.md),
// as two vectors of which only bit 0 counts: the next state is
// (high, low) = (low ^ s, high), so the step is one xor and a renaming.
struct TcqTrellis {
  vu high, low;
};

// The decode state of one chunk's 32 lanes.
struct RansLanes {
  vu x[kRansVectors];
  TcqTrellis trellis[kRansVectors];  // tcq only (unused, so optimized away, for other kinds)
  const uint16_t* ptr;  // next word of the chunk
  const uint16_t* end;  // its end: never read at or past it
  uint32_t bad;         // a lane wanted a word past the end
};

inline vu load_u(const uint32_t* p) {
  vu v;
  memcpy(&v, p, sizeof(v));
  return v;
}

inline void rans_start(const RansArgs& a, int64_t chunk, RansLanes& d) {
  for (int v = 0; v < kRansVectors; ++v) {
    d.x[v] = load_u(a.states + chunk * kRansBlockCols + v * kLanes);
    d.trellis[v] = TcqTrellis{};  // every chunk starts at trellis state 0
  }
  d.ptr = a.words + a.word_offsets[chunk];
  d.end = a.words + a.word_offsets[chunk + 1];
  d.bad = 0;
}

// Nonzero unless the chunk ended well formed: all words used, every lane at 2^16.
inline uint32_t rans_finish(const RansLanes& d) {
  uint32_t bad = d.bad | (d.ptr != d.end);
  for (int v = 0; v < kRansVectors; ++v)
    for (int l = 0; l < kLanes; ++l) bad |= d.x[v][l] != kRansLow;
  return bad;
}

#if MARLIN_KERNEL_AVX2
// kExpand8[m]: for each of 8 lanes, the number of lanes below it set in m
// (its word's index among this step's refills), as bytes.
struct Expand8Table {
  uint64_t index[256];
  constexpr Expand8Table() : index() {
    for (int m = 0; m < 256; ++m) {
      uint64_t packed = 0;
      for (int l = 0, rank = 0; l < 8; ++l) {
        packed |= uint64_t(rank) << (8 * l);
        if (m >> l & 1) ++rank;
      }
      index[m] = packed;
    }
  }
};
constexpr Expand8Table kExpand8;
#endif

// Words for the lanes of `need` (lane order) into x = (x << 16) | word; at
// most kLanes words are read, all of them before d.end (Checked: the caller
// knows that kLanes words are left, so no branch).
template <bool Checked = true>
MARLIN_RANS_INLINE vu rans_refill(RansLanes& d, vu x) {
#if MARLIN_KERNEL_AVX512 || MARLIN_KERNEL_AVX2
  typedef uint16_t vw __attribute__((vector_size(2 * kLanes)));
#if MARLIN_KERNEL_AVX512
  const __mmask16 need = _mm512_cmplt_epu32_mask((__m512i)x, _mm512_set1_epi32(int(kRansLow)));
#else
  const unsigned need = __builtin_ia32_movmskps256((vf)((vi)(x >> 16) == 0));
#endif
  if (Checked && !need) return x;
  int64_t count = __builtin_popcount(need);
  const int64_t left = d.end - d.ptr;
  vw words;
  if (!Checked || left >= kLanes) {
    memcpy(&words, d.ptr, sizeof(words));
  } else {  // the chunk's last words: never read past them
    uint16_t tail[kLanes] = {};
    memcpy(tail, d.ptr, left * sizeof(uint16_t));
    memcpy(&words, tail, sizeof(words));
    if (count > left) {
      d.bad = 1;
      count = left;
    }
  }
  d.ptr += count;
#if MARLIN_KERNEL_AVX512
  const vu w = (vu)_mm512_cvtepu16_epi32((__m256i)words);  // GCC's convertvector took three instructions
  return (vu)_mm512_mask_or_epi32((__m512i)x, need, (__m512i)(x << 16), _mm512_maskz_expand_epi32(need, (__m512i)w));
#else  // vpmovzxwd / vpmovzxbd (GCC's convertvector and an 8-byte memcpy took five instructions)
  const __m256i w = _mm256_cvtepu16_epi32((__m128i)words);
  const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)&kExpand8.index[need]));
  const vu expanded = (vu)_mm256_permutevar8x32_epi32(w, index);
  return (vu)_mm256_blendv_epi8((__m256i)x, (__m256i)((x << 16) | expanded), (__m256i)((vi)(x >> 16) == 0));
#endif
#else
  for (int l = 0; l < kLanes; ++l) {
    if (x[l] >= kRansLow) continue;
    if (d.ptr == d.end) {
      d.bad = 1;
      x[l] <<= 16;
      continue;
    }
    x[l] = (x[l] << 16) | *d.ptr++;
  }
  return x;
#endif
}

// table[index[l]] for each lane: a gather on AVX-512, loads lane by lane elsewhere.
inline vu rans_gather(const uint32_t* table, vu index) {
#if MARLIN_KERNEL_AVX512
  return (vu)_mm512_i32gather_epi32((__m512i)index, table, 4);
#else  // AVX2 too: vpgatherdd is microcoded on AMD, and GCC's vpextrd, load, vpinsrd per lane
       // measured faster on Zen 5 (M = 32 8-12%); not measured on Intel
  vu e;
  for (int l = 0; l < kLanes; ++l) e[l] = table[index[l]];
  return e;
#endif
}

// Where a step looks its slots up: the packed slot table, its two arrays
// (prob_bits above kRansPackedProbBits), (AVX-512, few symbols) registers, or
// (AVX2, RansByteLayout) byte tables in registers, for at most 32 or 16 symbols.
enum RansLookup { kLookupTwoTables, kLookupPacked, kLookupRegisters, kLookupBytes, kLookupBytes16 };
template <int Lookup>
constexpr bool kByteLookup = Lookup == kLookupBytes || Lookup == kLookupBytes16;

template <int Lookup>
struct RansTable {
  const uint32_t* table;
  int prob_bits;
#if MARLIN_KERNEL_AVX512
  __m512i bucket[2], split[2], cum[2], freq[2], sym[2];  // each table's words 0-31, 32-63
  int bucket_shift, split_shift, levels;
  bool has_split;
#endif
#if MARLIN_KERNEL_AVX2
  // kByteLookup: entries 0-15 and 16-31 of each table, in both 128-bit halves (vpshufb's tables);
  // by bucket: its first symbol's index, and the low slot bits minus 1 of the cums inside it
  // (ascending; 127, above every slot's, where it has fewer); by index: freq, cum (low, high
  // bytes), symbol. A split bucket's number s + 1 (others 0) by bucket, and by that number (16
  // entries) its cums from `boundaries` on (127 past them, and for 0).
  __m256i first[2], inside[kRansByteBoundaries][2], freq_lo[2], freq_hi[2], cum_lo[2], cum_hi[2], sym[2];
  __m256i split_number[2], split_inside[kRansSplitBoundaries];
  int boundaries, bucket_shift, split_most;  // split_most: the most cums in a split bucket (0: none)
#endif

  explicit RansTable(const RansArgs& a) : table(a.table), prob_bits(a.prob_bits) {
#if MARLIN_KERNEL_AVX512
    if constexpr (Lookup == kLookupRegisters) {
      const RansRegisterTable& r = a.registers;
      for (int h = 0; h < 2; ++h) {
        bucket[h] = _mm512_loadu_si512(r.bucket + 32 * h);
        split[h] = _mm512_loadu_si512(r.split + 32 * h);
        cum[h] = _mm512_loadu_si512(r.cum + 32 * h);
        freq[h] = _mm512_loadu_si512(r.freq + 32 * h);
        sym[h] = _mm512_loadu_si512(r.sym + 32 * h);
      }
      bucket_shift = a.prob_bits - kRansBucketBits;
      split_shift = bucket_shift - r.split_bits;
      levels = r.levels;
      has_split = r.has_split;
    }
#endif
#if MARLIN_KERNEL_AVX2
    if constexpr (kByteLookup<Lookup>) {
      const RansRegisterTable& r = a.registers;
      const RansByteLayout layout(a.registers, a.prob_bits);
      bucket_shift = a.prob_bits - 5;
      boundaries = layout.boundaries;
      split_most = 0;
      alignas(32) uint8_t bytes[7 + kRansByteBoundaries][kRansByteBuckets] = {};
      auto halves = [&](const uint8_t* t, __m256i* out) {
        out[0] = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)t));
        out[1] = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)(t + 16)));
      };
      for (int i = 0; i < r.symbols; ++i) {
        bytes[0][i] = uint8_t(r.freq[i]), bytes[1][i] = uint8_t(r.freq[i] >> 8);
        bytes[2][i] = uint8_t(r.cum[i]), bytes[3][i] = uint8_t(r.cum[i] >> 8), bytes[4][i] = uint8_t(r.sym[i]);
      }
      for (int b = 0; b < kRansByteBuckets; ++b) {
        bytes[5][b] = uint8_t(layout.first[b]);
        for (int j = 0; j < kRansByteBoundaries; ++j) bytes[6 + j][b] = j < layout.count[b] ? layout.inside[b][j] : 127;
      }
      alignas(32) uint8_t numbers[kRansByteBuckets] = {}, split_cums[kRansSplitBoundaries][16];
      memset(split_cums, 127, sizeof(split_cums));
      for (int s = 0; s < layout.splits; ++s) {
        const int b = layout.split_bucket[s];
        numbers[b] = uint8_t(s + 1);
        split_most = layout.count[b] > split_most ? layout.count[b] : split_most;
        for (int j = boundaries; j < layout.count[b]; ++j) split_cums[j][s + 1] = layout.inside[b][j];
      }
      halves(numbers, split_number);
      for (int j = 0; j < kRansSplitBoundaries; ++j)
        split_inside[j] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)split_cums[j]));
      halves(bytes[0], freq_lo), halves(bytes[1], freq_hi), halves(bytes[2], cum_lo), halves(bytes[3], cum_hi);
      halves(bytes[4], sym), halves(bytes[5], first);
      for (int j = 0; j < kRansByteBoundaries; ++j) halves(bytes[6 + j], inside[j]);
    }
#endif
  }

#if MARLIN_KERNEL_AVX2
  // Entry i of a 32-entry byte table for each byte i (0-31) of `index`: i + 0x70 has bit 7 (vpshufb's
  // zero) set for i >= 16, i + 0xF0 (wrapping) for i < 16. Small: i < 16, one vpshufb.
  template <bool Small>
  struct ByteIndex {
    __m256i low, high;
    explicit ByteIndex(__m256i i)
        : low(Small ? i : _mm256_add_epi8(i, _mm256_set1_epi8(0x70))),
          high(Small ? i : _mm256_add_epi8(i, _mm256_set1_epi8(char(0xF0)))) {}
  };
  using SymbolIndex = ByteIndex<Lookup == kLookupBytes16>;
  template <bool Small>
  static MARLIN_RANS_INLINE __m256i by(const __m256i* t, const ByteIndex<Small>& i) {
    if constexpr (Small) return _mm256_shuffle_epi8(t[0], i.low);
    return _mm256_or_si256(_mm256_shuffle_epi8(t[0], i.low), _mm256_shuffle_epi8(t[1], i.high));
  }
  // Bytes lo, hi of the pack's order (below) as the 4 vectors of dwords it came from.
  static MARLIN_RANS_INLINE void unpack_words(__m256i lo, __m256i hi, vu* out) {
    const __m256i zero = _mm256_setzero_si256(), w01 = _mm256_unpacklo_epi8(lo, hi), w23 = _mm256_unpackhi_epi8(lo, hi);
    out[0] = (vu)_mm256_unpacklo_epi16(w01, zero), out[1] = (vu)_mm256_unpackhi_epi16(w01, zero);
    out[2] = (vu)_mm256_unpacklo_epi16(w23, zero), out[3] = (vu)_mm256_unpackhi_epi16(w23, zero);
  }

  // kByteLookup: the 32 lanes' slots packed to bytes (vpackusdw, vpackuswb: an order of lanes that
  // the unpacks undo), their bucket's first index plus their compares with the cums inside it.
  MARLIN_RANS_INLINE SymbolIndex lookup_bytes(const vu* slot, vu* freq_out, vu* bias_out) const {
    const __m256i w01 = _mm256_packus_epi32((__m256i)slot[0], (__m256i)slot[1]);
    const __m256i w23 = _mm256_packus_epi32((__m256i)slot[2], (__m256i)slot[3]);
    const __m128i shift = _mm_cvtsi32_si128(bucket_shift);
    const __m256i low_bits = _mm256_set1_epi16(short((1 << bucket_shift) - 1));
    const ByteIndex<false> bucket(_mm256_packus_epi16(_mm256_srl_epi16(w01, shift), _mm256_srl_epi16(w23, shift)));
    const __m256i low = _mm256_packus_epi16(_mm256_and_si256(w01, low_bits), _mm256_and_si256(w23, low_bits));
    __m256i index = by(first, bucket);
#pragma GCC unroll 4
    for (int j = 0; j < kRansByteBoundaries; ++j)  // (`boundaries` is the same all call long)
      if (j < boundaries) index = _mm256_sub_epi8(index, _mm256_cmpgt_epi8(low, by(inside[j], bucket)));
    if (split_most) {  // (a grid's tails) the split buckets' further cums, by their number
      const __m256i number = by(split_number, bucket);
      for (int j = boundaries; j < split_most; ++j)
        index = _mm256_sub_epi8(index, _mm256_cmpgt_epi8(low, _mm256_shuffle_epi8(split_inside[j], number)));
    }
    const SymbolIndex at(index);
    unpack_words(by(freq_lo, at), by(freq_hi, at), freq_out);
    // slot - cum as words, in the pack's order
    const __m256i cum_low = by(cum_lo, at), cum_high = by(cum_hi, at), zero = _mm256_setzero_si256();
    const __m256i b01 = _mm256_sub_epi16(w01, _mm256_unpacklo_epi8(cum_low, cum_high));
    const __m256i b23 = _mm256_sub_epi16(w23, _mm256_unpackhi_epi8(cum_low, cum_high));
    bias_out[0] = (vu)_mm256_unpacklo_epi16(b01, zero), bias_out[1] = (vu)_mm256_unpackhi_epi16(b01, zero);
    bias_out[2] = (vu)_mm256_unpacklo_epi16(b23, zero), bias_out[3] = (vu)_mm256_unpackhi_epi16(b23, zero);
    return at;
  }
#endif

#if MARLIN_KERNEL_AVX512
  // The table index of each word's slot s, with its freq and slot - cum: the
  // last cum at or below the slot, searched from its (sub-)bucket's first
  // symbol; the gathers this replaces were the decode's slowest part.
  MARLIN_RANS_INLINE __m512i lookup_words(__m512i s, __m512i* freq_out, __m512i* bias_out) const {
    __m512i index = _mm512_permutex2var_epi16(bucket[0], _mm512_srli_epi16(s, bucket_shift), bucket[1]);
    if (has_split) {  // (a branch taken the same way all call long)
      // (vpermi2w takes the low 6 bits of the index: rans_kernel_args.h's split[... & 63])
      const __m512i sub = _mm512_permutex2var_epi16(split[0], _mm512_srli_epi16(s, split_shift), split[1]);
      index = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(index, _mm512_set1_epi16(kRansRegisterSymbols)), index, sub);
    }
    auto level = [&](short half) {
      const __m512i try_index = _mm512_add_epi16(index, _mm512_set1_epi16(half));
      const __m512i c = _mm512_permutex2var_epi16(cum[0], try_index, cum[1]);
      index = _mm512_mask_mov_epi16(index, _mm512_cmpge_epu16_mask(s, c), try_index);
    };
    if (levels == 2) level(2);
    if (levels >= 1) level(1);
    *bias_out = _mm512_sub_epi16(s, _mm512_permutex2var_epi16(cum[0], index, cum[1]));
    *freq_out = _mm512_permutex2var_epi16(freq[0], index, freq[1]);
    return index;
  }
#endif

  // Symbol, freq and slot - cum of each lane's slot, for the kRansVectors vectors of a chunk.
  MARLIN_RANS_INLINE void lookup(const vu* slot, vu* sym_out, vu* freq_out, vu* bias_out) const {
#if MARLIN_KERNEL_AVX2
    if constexpr (kByteLookup<Lookup>) return unpack_words(by(sym, lookup_bytes(slot, freq_out, bias_out)),
                                                              _mm256_setzero_si256(), sym_out);
#endif
    for (int v = 0; v < kRansVectors; ++v) {
      const vu e = rans_gather(table, slot[v]);
      if constexpr (Lookup == kLookupTwoTables) {
        freq_out[v] = e & 0xFFFF;
        bias_out[v] = e >> 16;
        sym_out[v] = rans_gather(table + (size_t(1) << prob_bits), slot[v]);
      } else {
        sym_out[v] = e & 0xFF;
        bias_out[v] = (e >> 8) & 0xFFF;
        freq_out[v] = (e >> 20) + 1;
      }
    }
  }
};

// Every lane's state update and refill, from its slot's freq and slot - cum.
MARLIN_RANS_INLINE void rans_advance(RansLanes& d, int prob_bits, const vu* freq, const vu* bias) {
  if (d.end - d.ptr >= kRansVectors * kLanes) {  // (nearly always)
#pragma GCC unroll 8
    for (int v = 0; v < kRansVectors; ++v) d.x[v] = rans_refill<false>(d, freq[v] * (d.x[v] >> prob_bits) + bias[v]);
    return;
  }
#pragma GCC unroll 8  // (the refill's branches kept GCC from it): d stays in registers
  for (int v = 0; v < kRansVectors; ++v) d.x[v] = rans_refill(d, freq[v] * (d.x[v] >> prob_bits) + bias[v]);
}

// One step of every lane: sym[v] = the symbols of lanes v * kLanes ...
template <int Lookup>
MARLIN_RANS_INLINE void rans_step(RansLanes& d, const RansTable<Lookup>& t, vu* sym) {
  const uint32_t mask = (1u << t.prob_bits) - 1;
  vu slot[kRansVectors], freq[kRansVectors], bias[kRansVectors];
  for (int v = 0; v < kRansVectors; ++v) slot[v] = d.x[v] & mask;
  t.lookup(slot, sym, freq, bias);
  rans_advance(d, t.prob_bits, freq, bias);
}

#if MARLIN_KERNEL_AVX512
// AVX-512's register lookup keeps a chunk's 32 states as two vectors of 16-bit
// words, word l = lane l: their high and low halves. The slot is then one
// and; a refill one vpexpandw (VBMI2) of the next words into the low halves
// and a masked move of the low halves into the high ones, for all 32 lanes at
// once; the update three 16-bit multiplies. Against two vectors of 32-bit
// states this took the tile fill from 4.7-4.8 to 3.2-3.4 ms (docs/CPU.md).
struct RansPlanes {
  __m512i hi, lo;
  __m512i trellis_high, trellis_low;  // tcq only (bit 0 of each word; optimized away for other kinds)
  const uint16_t* ptr;  // next word of the chunk
  const uint16_t* end;  // its end: never read at or past it
  uint32_t bad;         // a lane wanted a word past the end
};

struct WordIndex {  // vpermt2w / vpermw indices
  uint16_t iota[32], even[32], odd[32], pair_lo[32], pair_hi[32];
  constexpr WordIndex() : iota(), even(), odd(), pair_lo(), pair_hi() {
    for (int i = 0; i < 32; ++i) {
      iota[i] = uint16_t(i), even[i] = uint16_t(2 * i), odd[i] = uint16_t(2 * i + 1);
      // dword l of pair_words' two vectors: words l (16 + l) of a, then of b
      pair_lo[i] = uint16_t(i % 2 ? 32 + i / 2 : i / 2), pair_hi[i] = uint16_t(16 + pair_lo[i]);
    }
  }
};
alignas(64) constexpr WordIndex kWordIndex;

inline __m512i word_index(const uint16_t* p) { return _mm512_load_si512(p); }

// Dwords a[l] | b[l] << 16: lanes 0-15 into out[0], 16-31 into out[1].
MARLIN_RANS_INLINE void pair_words(__m512i a, __m512i b, vf* out) {
  out[0] = (vf)_mm512_permutex2var_epi16(a, word_index(kWordIndex.pair_lo), b);
  out[1] = (vf)_mm512_permutex2var_epi16(a, word_index(kWordIndex.pair_hi), b);
}

inline void rans_start(const RansArgs& a, int64_t chunk, RansPlanes& d) {
  const uint32_t* s = a.states + chunk * kRansBlockCols;
  const __m512i s0 = _mm512_loadu_si512(s), s1 = _mm512_loadu_si512(s + kLanes);
  d.lo = _mm512_permutex2var_epi16(s0, word_index(kWordIndex.even), s1);
  d.hi = _mm512_permutex2var_epi16(s0, word_index(kWordIndex.odd), s1);
  d.trellis_high = d.trellis_low = _mm512_setzero_si512();  // every chunk starts at trellis state 0
  d.ptr = a.words + a.word_offsets[chunk];
  d.end = a.words + a.word_offsets[chunk + 1];
  d.bad = 0;
}

inline uint32_t rans_finish(const RansPlanes& d) {
  const __mmask32 off = _mm512_cmpneq_epi16_mask(d.hi, _mm512_set1_epi16(1)) | _mm512_test_epi16_mask(d.lo, d.lo);
  return d.bad | (d.ptr != d.end) | (off != 0);
}

// One step of the 32 lanes: each lane's index into the register tables.
MARLIN_RANS_INLINE __m512i rans_step_index(RansPlanes& d, const RansTable<kLookupRegisters>& t) {
  const int p = t.prob_bits;
  __m512i freq, bias;
  const __m512i index = t.lookup_words(_mm512_and_si512(d.lo, _mm512_set1_epi16(short((1u << p) - 1))), &freq, &bias);
  // q = x >> p = qh 2^16 + ql; freq q = freq ql + (freq qh) 2^16 with freq qh < 2^16 (freq q < 2^32)
#if MARLIN_KERNEL_VBMI2
  const __m512i ql = _mm512_shrdv_epi16(d.lo, d.hi, _mm512_set1_epi16(short(p)));
#else
  const __m512i ql = _mm512_or_si512(_mm512_srl_epi16(d.lo, _mm_cvtsi32_si128(p)),
                                     _mm512_sll_epi16(d.hi, _mm_cvtsi32_si128(16 - p)));
#endif
  const __m512i qh = _mm512_srl_epi16(d.hi, _mm_cvtsi32_si128(p));
  const __m512i product_lo = _mm512_mullo_epi16(freq, ql);
  const __m512i lo = _mm512_add_epi16(product_lo, bias);
  // The carry of that add: the top bit of majority(product_lo, bias, ~lo).
  const __m512i carry = _mm512_srli_epi16(_mm512_ternarylogic_epi32(product_lo, bias, lo, 0xD4), 15);
  const __m512i hi =
      _mm512_add_epi16(_mm512_add_epi16(_mm512_mulhi_epu16(freq, ql), _mm512_mullo_epi16(freq, qh)), carry);
  // Refills in lane order: x = x << 16 | word where the high half is 0.
  const __mmask32 need = _mm512_testn_epi16_mask(hi, hi);
  const int64_t left = d.end - d.ptr;
  int64_t count = __builtin_popcount(need);
  __m512i words;
  if (left >= kRansBlockCols) {  // (nearly always)
    words = _mm512_loadu_si512(d.ptr);
  } else {  // the chunk's last words: a masked load never reads past them
    words = _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << (left > 0 ? left : 0)) - 1), d.ptr);
    if (count > left) {
      d.bad = 1;
      count = left;
    }
  }
  d.ptr += count;
  d.hi = _mm512_mask_mov_epi16(hi, need, lo);
#if MARLIN_KERNEL_VBMI2
  d.lo = _mm512_mask_expand_epi16(lo, need, words);
#else  // lanes 0-15, then 16-31 from the word after theirs, as dwords
  const __mmask16 need_lo = __mmask16(need), need_hi = __mmask16(need >> 16);
  const __m512i first = _mm512_maskz_expand_epi32(need_lo, _mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)));
  const __m512i from =
      _mm512_add_epi16(word_index(kWordIndex.iota), _mm512_set1_epi16(short(__builtin_popcount(need_lo))));
  const __m512i rest = _mm512_permutexvar_epi16(from, words);
  const __m512i second = _mm512_maskz_expand_epi32(need_hi, _mm512_cvtepu16_epi32(_mm512_castsi512_si256(rest)));
  d.lo = _mm512_mask_mov_epi16(lo, need, _mm512_permutex2var_epi16(first, word_index(kWordIndex.even), second));
#endif
  return index;
}

// The register tables' values: per index, the high and the low 16 bits of
// its fp32 value (tcq: its level in the trellis' even states, and in the odd
// ones), as words 0-31 and 32-63 of two vectors each.
template <int Kind>
struct RansWordValues {
  __m512i high[2], low[2], odd_high[2];
  bool exact;  // every value exact in bf16: no low halves

  explicit RansWordValues(const RansArgs& a) {
    alignas(64) uint16_t bits[3][kRansRegisterSymbols];
    exact = true;
    for (int i = 0; i < kRansRegisterSymbols; ++i) {
      const int sym = a.registers.sym[i], k = sym - 128;
      float value, odd = 0;  // rans_value's (table_nibble reads the code's low 4 bits)
      if constexpr (Kind == kRansGrid) value = float(k);
      else if constexpr (Kind == kRansTcq) value = float(2 * k), odd = float(2 * k - (k > 0) + (k < 0));
      else value = code_value<Kind>(sym & 15);
      const uint32_t u = __builtin_bit_cast(uint32_t, value);
      bits[0][i] = uint16_t(u >> 16), bits[1][i] = uint16_t(u), bits[2][i] = uint16_t(__builtin_bit_cast(uint32_t, odd) >> 16);
      exact &= (u & 0xFFFF) == 0;
    }
    for (int h = 0; h < 2; ++h) {
      high[h] = _mm512_load_si512(bits[0] + 32 * h);
      low[h] = _mm512_load_si512(bits[1] + 32 * h);
      odd_high[h] = _mm512_load_si512(bits[2] + 32 * h);
    }
  }
};

// One step of a chunk's lanes: the high halves of their values' fp32 (the
// bf16 bits), and their low halves into *low if low is given.
template <int Kind>
MARLIN_RANS_INLINE __m512i rans_words(RansPlanes& d, const RansTable<kLookupRegisters>& t,
                                      const RansWordValues<Kind>& w, __m512i* low) {
  const __m512i index = rans_step_index(d, t);
  __m512i high = _mm512_permutex2var_epi16(w.high[0], index, w.high[1]);
  if constexpr (Kind == kRansTcq) {  // (high, low) = (low ^ s, high); k & 1 == s & 1
    const __mmask32 odd = _mm512_test_epi16_mask(d.trellis_high, _mm512_set1_epi16(1));
    high = _mm512_mask_blend_epi16(odd, high, _mm512_permutex2var_epi16(w.odd_high[0], index, w.odd_high[1]));
    const __m512i next = _mm512_xor_si512(d.trellis_low, _mm512_permutex2var_epi16(t.sym[0], index, t.sym[1]));
    d.trellis_low = d.trellis_high, d.trellis_high = next;
  }
  if (low) *low = w.exact ? _mm512_setzero_si512() : _mm512_permutex2var_epi16(w.low[0], index, w.low[1]);
  return high;
}

// rans_values (below) on the register lookup.
template <int Kind, bool Pair, int Blocks>
MARLIN_RANS_INLINE void rans_values(RansPlanes* d, int blocks, const RansTable<kLookupRegisters>& t,
                                    const RansWordValues<Kind>& w, vf* out) {
  __m512i first[Blocks], low[Blocks];
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) {
    low[j] = _mm512_setzero_si512();
    first[j] = j < blocks ? rans_words<Kind>(d[j], t, w, Pair ? nullptr : &low[j]) : _mm512_setzero_si512();
  }
  if constexpr (Pair) {  // all blocks' first steps, then their second: 4.0 -> 3.2 ms against block by block
    __m512i second[Blocks];
    _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j)
      second[j] = j < blocks ? rans_words<Kind>(d[j], t, w, nullptr) : _mm512_setzero_si512();
    for (int j = 0; j < Blocks; ++j) pair_words(first[j], second[j], out + j * kRansVectors);
  } else {
    for (int j = 0; j < Blocks; ++j) pair_words(low[j], first[j], out + j * kRansVectors);
  }
}
#endif

#if MARLIN_KERNEL_AVX2
// The byte tables' values (kByteLookup): bytes 0-3 of each index's fp32
// value (tcq: its level in the trellis' even states), in vpshufb's two
// tables each; values exact in bf16 (all but nf4's) skip bytes 0 and 1.
// tcq: bytes 2-3 of its level in the odd states, and 0xFF for odd symbols.
template <int Kind>
struct RansByteValues {
  __m256i bytes[4][2], odd[2][2], parity[2];
  bool exact;

  explicit RansByteValues(const RansArgs& a) {
    alignas(16) uint8_t b[7][kRansByteBuckets] = {};
    exact = true;
    for (int i = 0; i < a.registers.symbols && i < kRansByteBuckets; ++i) {
      const int sym = a.registers.sym[i], k = sym - 128;
      float value, odd_value = 0;  // rans_value's (table_nibble reads the code's low 4 bits)
      if constexpr (Kind == kRansGrid) value = float(k);
      else if constexpr (Kind == kRansTcq) value = float(2 * k), odd_value = float(2 * k - (k > 0) + (k < 0));
      else value = code_value<Kind>(sym & 15);
      const uint32_t u = __builtin_bit_cast(uint32_t, value), o = __builtin_bit_cast(uint32_t, odd_value);
      for (int j = 0; j < 4; ++j) b[j][i] = uint8_t(u >> (8 * j));
      b[4][i] = uint8_t(o >> 16), b[5][i] = uint8_t(o >> 24), b[6][i] = sym & 1 ? 0xFF : 0;
      exact &= (u & 0xFFFF) == 0;
    }
    auto halves = [](const uint8_t* t, __m256i* out) {
      for (int h = 0; h < 2; ++h) out[h] = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)(t + 16 * h)));
    };
    for (int j = 0; j < 4; ++j) halves(b[j], bytes[j]);
    halves(b[4], odd[0]), halves(b[5], odd[1]), halves(b[6], parity);
  }
};

// tcq's lanes on the byte tables: the trellis (bit 0 of high and low) as
// bytes 0 or 0xFF, in the tables' order of lanes.
struct RansByteLanes : RansLanes {
  __m256i trellis_high, trellis_low;
};

inline void rans_start(const RansArgs& a, int64_t chunk, RansByteLanes& d) {
  rans_start(a, chunk, static_cast<RansLanes&>(d));
  d.trellis_high = d.trellis_low = _mm256_setzero_si256();  // every chunk starts at trellis state 0
}

// rans_values (below) on the byte tables, values by index.
template <int Kind, bool Pair, int Blocks, int Lookup, class Lanes>
  requires(kByteLookup<Lookup>)
MARLIN_RANS_INLINE void rans_values(Lanes* d, int blocks, const RansTable<Lookup>& t,
                                    const RansByteValues<Kind>& w, vf* out) {
  static_assert(!Pair, "AVX2 builds take fp32 x");
  const uint32_t mask = (1u << t.prob_bits) - 1;
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) {
    if (j >= blocks) {
      for (int v = 0; v < kRansVectors; ++v) out[j * kRansVectors + v] = vf{};
      continue;
    }
    vu slot[kRansVectors], freq[kRansVectors], bias[kRansVectors];
    for (int v = 0; v < kRansVectors; ++v) slot[v] = d[j].x[v] & mask;
    const auto at = t.lookup_bytes(slot, freq, bias);
    __m256i b2 = t.by(w.bytes[2], at), b3 = t.by(w.bytes[3], at);
    if constexpr (Kind == kRansTcq) {  // (high, low) = (low ^ s, high); k & 1 == s & 1
      b2 = _mm256_blendv_epi8(b2, t.by(w.odd[0], at), d[j].trellis_high);
      b3 = _mm256_blendv_epi8(b3, t.by(w.odd[1], at), d[j].trellis_high);
      const __m256i next = _mm256_xor_si256(d[j].trellis_low, t.by(w.parity, at));
      d[j].trellis_low = d[j].trellis_high, d[j].trellis_high = next;
    }
    const __m256i h01 = _mm256_unpacklo_epi8(b2, b3), h23 = _mm256_unpackhi_epi8(b2, b3);
    __m256i l01 = _mm256_setzero_si256(), l23 = l01;
    if (!w.exact) {
      const __m256i b0 = t.by(w.bytes[0], at), b1 = t.by(w.bytes[1], at);
      l01 = _mm256_unpacklo_epi8(b0, b1), l23 = _mm256_unpackhi_epi8(b0, b1);
    }
    vf* o = out + j * kRansVectors;
    o[0] = (vf)_mm256_unpacklo_epi16(l01, h01), o[1] = (vf)_mm256_unpackhi_epi16(l01, h01);
    o[2] = (vf)_mm256_unpacklo_epi16(l23, h23), o[3] = (vf)_mm256_unpackhi_epi16(l23, h23);
    rans_advance(d[j], t.prob_bits, freq, bias);
  }
}
#endif

// A chunk's lanes and (register lookup) the values of its table indices, by lookup.
struct NoWordValues {
  explicit NoWordValues(const RansArgs&) {}
};
template <int Kind, int Lookup>
struct RansLookupTypes {
  using Lanes = RansLanes;
  using Values = NoWordValues;
};
#if MARLIN_KERNEL_AVX512
template <int Kind>
struct RansLookupTypes<Kind, kLookupRegisters> {
  using Lanes = RansPlanes;
  using Values = RansWordValues<Kind>;
};
#endif
#if MARLIN_KERNEL_AVX2
template <int Kind, int Lookup>
  requires(kByteLookup<Lookup>)
struct RansLookupTypes<Kind, Lookup> {
  using Lanes = std::conditional_t<Kind == kRansTcq, RansByteLanes, RansLanes>;
  using Values = RansByteValues<Kind>;
};
#endif

// tcq's level j = 2k - high sign(k) (high: bit 0 of the state's high vector).
inline vi tcq_level(vi k, vu high) {
#if MARLIN_KERNEL_AVX512  // the odd states' -1 / +1 as masked subtract / add
  const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512(), two_k = (__m512i)(k + k);
  const __mmask16 odd = _mm512_test_epi32_mask((__m512i)high, one);
  const __m512i j = _mm512_mask_sub_epi32(two_k, _mm512_mask_cmpgt_epi32_mask(odd, (__m512i)k, zero), two_k, one);
  return (vi)_mm512_mask_add_epi32(j, _mm512_mask_cmplt_epi32_mask(odd, (__m512i)k, zero), j, one);
#elif MARLIN_KERNEL_AVX2  // vpsignd: (high & 1) sign(k)
  return k + k - (vi)_mm256_sign_epi32((__m256i)(high & 1), (__m256i)k);
#else  // -sign(k) as (k > 0) - (k < 0) of the all-ones compares, in the odd states only
  return k + k + (((k > 0) - (k < 0)) & (vi)((high & 1) != 0));
#endif
}

// The value of symbols before the scale: a lossless format's code value
// (FormatDecode, the 16-entry table of every build), the grid's s - 128, or
// tcq's trellis level of k = s - 128 by the lanes' states, which it advances.
template <int Kind>
inline vf rans_value(vu sym, TcqTrellis& trellis) {
  if constexpr (Kind == kRansGrid) {
    return __builtin_convertvector((vi)sym - 128, vf);
  } else if constexpr (Kind == kRansTcq) {
    const vi j = tcq_level((vi)sym - 128, trellis.high);
    trellis = TcqTrellis{trellis.low ^ sym, trellis.high};  // k & 1 == s & 1: 128 is even
    return __builtin_convertvector(j, vf);
  } else {
    return table_nibble<FormatDecode<Kind>>((vi)sym, 0);
  }
}

// The values of one step of Blocks chunks' lanes (those past `blocks` zero),
// kRansVectors vectors per chunk: fp32; Pair: two steps' (K rows k and k + 1)
// as bf16 pairs, k's in the low half (the values are exact in bf16 where bf16 x
// takes them). Here the lanes of the gather lookups.
template <int Kind, bool Pair, int Blocks, int Lookup>
MARLIN_RANS_INLINE void rans_values(RansLanes* d, int blocks, const RansTable<Lookup>& t, const NoWordValues&, vf* out) {
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) {  // constant indices: d stays in registers
    vu sym[kRansVectors];
    if (j < blocks) rans_step(d[j], t, sym);
    for (int v = 0; v < kRansVectors; ++v)
      out[j * kRansVectors + v] = j < blocks ? rans_value<Kind>(sym[v], d[j].trellis[v]) : vf{};
  }
  if constexpr (Pair) {
    _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) {
      vu sym[kRansVectors];
      if (j < blocks) rans_step(d[j], t, sym);
      for (int v = 0; v < kRansVectors; ++v) {
        const vf second = j < blocks ? rans_value<Kind>(sym[v], d[j].trellis[v]) : vf{};
        vf& first = out[j * kRansVectors + v];
        first = (vf)(((vu)first >> 16) | ((vu)second & 0xFFFF0000u));
      }
    }
  }
}

// Scales (and zeros) of group g for `cols` columns from n0, zero-padded to `width`.
template <int F>
inline void load_group(const GemmArgs& g, int64_t group, int64_t n0, int64_t cols, int width, float* scale,
                       float* zero) {
  copy_halves(scale, g.scales + group * g.n + n0, cols, width);
  if (kHasZeros<F>) copy_halves(zero, g.zeros + group * g.n + n0, cols, width);
}

// ---------------------------------------------------------------------------
// Fused GEMV: kRansGemvBlocks<Kind, Lookup> column blocks decode in lockstep
// (independent state chains, so that one chain's lookup and multiply latency
// hides behind the others': on avx512 at M = 1, 4 blocks were 1.15-1.2x
// faster than 2, except for tcq on 32-bit lanes, whose trellis states need
// the registers; on avx2, with 16 registers, 4 were no faster);
// each symbol is decoded once in registers and multiplied into
// MR rows. Per group the sums take the dense GEMV's order (x[k] * value in K
// order, then group_dot), so the lossless results equal the dense op's bit for
// bit. Dot: bf16 x as pairs, as the dense bf16 GEMV.

template <int Kind, int Lookup>
constexpr int kRansGemvBlocks = MARLIN_KERNEL_AVX512 && (Kind != kRansTcq || Lookup == kLookupRegisters) ? 4 : 2;

template <int Kind, int Lookup, bool Dot, int MR>
uint32_t rans_gemv_rows(const RansArgs& a, int64_t m0, int rows, int64_t b0, int blocks, int64_t c0, int64_t c1,
                        float* out, int64_t ldo) {
  constexpr int F = Kind;  // has_zeros / zeros_are_bias: false for the grid
  constexpr int kBlocks = kRansGemvBlocks<Kind, Lookup>, kVectors = kBlocks * kRansVectors;
  constexpr int kCols = kBlocks * kRansBlockCols;
  const GemmArgs& g = a.gemm;
  const int64_t n0 = b0 * kRansBlockCols, cols = a.n - n0 < kCols ? a.n - n0 : kCols;
  // Rows past `rows` (up to MR) repeat the last one and are not stored.
  int64_t row[MR];
  for (int i = 0; i < MR; ++i) row[i] = m0 + (i < rows ? i : rows - 1);
  alignas(64) float scale[kCols], zero[kCols];
  vf acc[MR][kVectors], part[MR][kVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kVectors; ++v) acc[i][v] = part[i][v] = vf{};
  const RansTable<Lookup> table(a);
  const typename RansLookupTypes<Kind, Lookup>::Values words(a);
  uint32_t bad = 0;
  int64_t loaded = -1;
  for (int64_t c = c0; c < c1; ++c) {
    typename RansLookupTypes<Kind, Lookup>::Lanes d[kBlocks] = {};  // zeroed: GCC cannot tell that those past `blocks` go unused
    _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j)  // constant indices (here and below): d stays in registers
      if (j < blocks) rans_start(a, (b0 + j) * a.kchunks + c, d[j]);
    const int64_t k_end = (c + 1) * a.chunk_k < a.k ? (c + 1) * a.chunk_k : a.k;
    for (int64_t k = c * a.chunk_k; k < k_end;) {
      const int64_t group = k / g.group_rows, group_end = (group + 1) * g.group_rows;
      const int64_t seg_end = group_end < k_end ? group_end : k_end;
      if (group != loaded) {
        load_group<F>(g, group, n0, cols, kCols, scale, zero);
        loaded = group;
      }
      for (; k < seg_end; k += Dot ? 2 : 1) {
        vf value[kVectors];  // Dot: bf16 pairs of K rows k, k + 1
        rans_values<Kind, Dot, kBlocks>(d, blocks, table, words, value);
#if MARLIN_KERNEL_BF16_DOT
        if constexpr (Dot) {
          for (int i = 0; i < MR; ++i) {
            const vf xs = splat_bits(g.x_bf16 + row[i] * a.k + k);
            for (int v = 0; v < kVectors; ++v) part[i][v] = dot_pairs(part[i][v], value[v], xs);
          }
          continue;
        }
#endif
        for (int i = 0; i < MR; ++i) {
          const vf xs = splat(g.x[row[i] * a.k + k]);
          for (int v = 0; v < kVectors; ++v) part[i][v] = fmadd(xs, value[v], part[i][v]);
        }
      }
      if (seg_end == group_end || seg_end == a.k || c == c1 - 1) {  // the group (or this range's share) ends
        for (int i = 0; i < MR; ++i) {
          const vf xsum = kHasZeros<F> ? splat(g.xsum[row[i] * g.groups + group]) : vf{};
          for (int v = 0; v < kVectors; ++v) {
            const vf z = kHasZeros<F> ? load(zero + v * kLanes) : vf{};
            acc[i][v] = group_dot<F>(acc[i][v], part[i][v], xsum, load(scale + v * kLanes), z);
            part[i][v] = vf{};
          }
        }
      }
    }
    for (int j = 0; j < kBlocks; ++j)
      if (j < blocks) bad |= rans_finish(d[j]);
  }
  for (int i = 0; i < rows; ++i)
    for (int v = 0; v < blocks * kRansVectors; ++v) store(out + i * ldo + v * kLanes, acc[i][v]);
  return bad;
}

// Up to 8 rows (kGemvMaxRows) share each decoded symbol: register blocks of
// 1, 2, 4 or 8 rows (a block's spare rows repeat its last row).
template <int Kind, int Lookup, bool Dot>
uint32_t rans_gemv_kind(const RansArgs& a, int64_t m0, int64_t m1, int64_t b0, int64_t b1, int64_t c0, int64_t c1,
                        float* out, int64_t ldo) {
  uint32_t bad = 0;
  constexpr int kBlocks = kRansGemvBlocks<Kind, Lookup>;
  for (int64_t b = b0; b < b1; b += kBlocks) {
    const int blocks = int(b1 - b < kBlocks ? b1 - b : kBlocks);
    for (int64_t m = m0; m < m1; m += kMaxRows) {
      const int rows = int(m1 - m < kMaxRows ? m1 - m : kMaxRows);
      float* o = out + (m - m0) * ldo + (b - b0) * kRansBlockCols;
      if (rows == 1)
        bad |= rans_gemv_rows<Kind, Lookup, Dot, 1>(a, m, rows, b, blocks, c0, c1, o, ldo);
      else if (rows == 2)
        bad |= rans_gemv_rows<Kind, Lookup, Dot, 2>(a, m, rows, b, blocks, c0, c1, o, ldo);
      else if (rows <= 4)
        bad |= rans_gemv_rows<Kind, Lookup, Dot, 4>(a, m, rows, b, blocks, c0, c1, o, ldo);
      else
        bad |= rans_gemv_rows<Kind, Lookup, Dot, 8>(a, m, rows, b, blocks, c0, c1, o, ldo);
    }
  }
  return bad;
}

// ---------------------------------------------------------------------------
// Tiled GEMM: the dense gemm_tiles (or gemm_tiles_dot) on Tiles tiles side by
// side that this fill decodes from the chunks of column blocks nb / 32 ...
// nb / 32 + 2 Tiles - 1 in lockstep, one tile row after the other (the lanes'
// states carry over between tiles). Tiles = 2 on AVX-512's register lookup:
// 4 independent state chains, as the GEMV's 4 blocks (with 2 the fill took
// 4.7-4.9 ms against 3.3, tcq 5.8 against 4.7).

template <int Lookup>
constexpr int kRansFillTiles = MARLIN_KERNEL_AVX512 && Lookup == kLookupRegisters ? 2 : 1;

template <int Kind, int Lookup, bool Dot, int Tiles>
struct RansTileFill {
  static constexpr int F = Kind;
  static constexpr int kCols = Tiles * kTileCols;
  static constexpr int kBlocks = kCols / kRansBlockCols;
  using Lanes = typename RansLookupTypes<Kind, Lookup>::Lanes;
  const RansArgs& a;
  const RansTable<Lookup> table;
  const typename RansLookupTypes<Kind, Lookup>::Values words;
  int64_t nb;
  int blocks;             // column blocks of the tiles inside N (1 ... kBlocks)
  Lanes d[kBlocks] = {};
  int64_t chunk_end = 0;  // K row where the current chunk ends
  int64_t group = -1;
  uint32_t bad = 0;
  alignas(64) float scale[kCols], zero[kCols];

  RansTileFill(const RansArgs& args, int64_t nb_) : a(args), table(args), words(args), nb(nb_) {
    const int64_t b0 = nb / kRansBlockCols;
    blocks = int(a.blocks - b0 < kBlocks ? a.blocks - b0 : kBlocks);
  }

  // Chunk boundaries before K row k.
  MARLIN_RANS_INLINE void start_row(Lanes* lanes, int64_t k) {
    if (k != chunk_end) return;
    const int64_t c = k / a.chunk_k;
    _Pragma("GCC unroll 4") for (int j = 0; j < kBlocks; ++j) {
      if (j >= blocks) continue;
      if (c > 0) bad |= rans_finish(lanes[j]);
      rans_start(a, (nb / kRansBlockCols + j) * a.kchunks + c, lanes[j]);
    }
    chunk_end = (c + 1) * a.chunk_k < a.k ? (c + 1) * a.chunk_k : a.k;
  }

  // Column col's place in the tiles (row 0).
  static float* at(float* tile, int col) { return tile + col / kTileCols * (kTileRows * kTileCols) + col % kTileCols; }

  // Tile rows k0 ... k0 + rows - 1 (Dot: pair rows, as gemm_tiles_dot takes them; the scale is
  // applied per group there). The lanes are a local copy of d, indexed by constants only (every
  // loop over blocks unrolls), so that they live in registers.
  void operator()(int64_t k0, int64_t rows, float* tile) {
    const GemmArgs& g = a.gemm;
    const int64_t cols = a.n - nb < kCols ? a.n - nb : kCols;
    Lanes lanes[kBlocks];
    for (int j = 0; j < kBlocks; ++j) lanes[j] = d[j];
    for (int64_t r = 0; r < rows; r += Dot ? 2 : 1) {
      const int64_t k = k0 + r;
      start_row(lanes, k);  // (chunk_k is a multiple of 32: k + 1 starts none)
      vf values[kCols / kLanes];
      rans_values<Kind, Dot, kBlocks>(lanes, blocks, table, words, values);
      if constexpr (Dot) {
        for (int q = 0; q < kCols / kLanes; ++q) store(at(tile, q * kLanes) + r / 2 * kTileCols, values[q]);
        continue;
      }
      if (k / g.group_rows != group) {
        group = k / g.group_rows;
        load_group<F>(g, group, nb, cols, kCols, scale, zero);
      }
      for (int q = 0; q < kCols / kLanes; ++q) {
        const vf z = kHasZeros<F> ? load(zero + q * kLanes) : vf{};
        store(at(tile, q * kLanes) + r * kTileCols, group_weight<F>(values[q], load(scale + q * kLanes), z));
      }
    }
    for (int j = 0; j < kBlocks; ++j) d[j] = lanes[j];
    if (k0 + rows == a.k)
      for (int j = 0; j < blocks; ++j) bad |= rans_finish(d[j]);
  }
};

// Columns [nb, nb + kRansGemmCols): one fill of kRansFillTiles tiles after the other.
template <int Kind, int Lookup, bool Dot>
uint32_t rans_gemm_tile_kind(const RansArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  constexpr int Tiles = kRansFillTiles<Lookup>;
  uint32_t bad = 0;
  for (int64_t n0 = nb; n0 < nb + kRansGemmCols && n0 < a.n; n0 += Tiles * kTileCols) {
    RansTileFill<Kind, Lookup, Dot, Tiles> fill(a, n0);
    auto f = [&](int64_t k0, int64_t rows, float* tile) { fill(k0, rows, tile); };
#if MARLIN_KERNEL_BF16_DOT
    if constexpr (Dot) {
      gemm_tiles_dot<Kind, Tiles>(a.gemm, m0, m1, n0, scratch, f);
      bad |= fill.bad;
      continue;
    }
#endif
    gemm_tiles<Tiles>(a.gemm, m0, m1, n0, scratch, f);
    bad |= fill.bad;
  }
  return bad;
}

// ---------------------------------------------------------------------------
// Entry points: the kind (and lookup, and x's type) dispatched once.

// The lookup of rans_kernel_args.h's tables this build and these symbols take.
inline int rans_lookup(const RansArgs& a) {
  if (MARLIN_KERNEL_AVX512 && a.registers.symbols) return kLookupRegisters;
#if MARLIN_KERNEL_AVX2
  if (RansByteLayout(a.registers, a.prob_bits).fits)
    return a.registers.symbols <= 16 ? kLookupBytes16 : kLookupBytes;
#endif
  return a.prob_bits <= kRansPackedProbBits ? kLookupPacked : kLookupTwoTables;
}

template <class Body>
inline uint32_t with_rans_lookup(const RansArgs& a, Body&& body) {
  switch (rans_lookup(a)) {
#if MARLIN_KERNEL_AVX512
    case kLookupRegisters: return body.template operator()<kLookupRegisters>();
#endif
#if MARLIN_KERNEL_AVX2
    case kLookupBytes: return body.template operator()<kLookupBytes>();
    case kLookupBytes16: return body.template operator()<kLookupBytes16>();
#endif
    case kLookupPacked: return body.template operator()<kLookupPacked>();
    default: return body.template operator()<kLookupTwoTables>();
  }
}

template <class Body>
inline uint32_t with_rans_kind(const RansArgs& a, bool dot, Body&& body) {
  auto on_kind = [&]<int Kind>() -> uint32_t {
    return with_rans_lookup(a, [&]<int Lookup>() -> uint32_t {
#if MARLIN_KERNEL_BF16_DOT
      if (dot) return body.template operator()<Kind, Lookup, true>();
#endif
      return body.template operator()<Kind, Lookup, false>();
    });
  };
  if (a.kind == kRansGrid) return on_kind.template operator()<kRansGrid>();
  if (a.kind == kRansTcq) return on_kind.template operator()<kRansTcq>();
  return with_format(a.kind, on_kind);  // traps on any other number (the op's checks let none through)
}

uint32_t rans_gemv(const RansArgs& a, int64_t m0, int64_t m1, int64_t b0, int64_t b1, int64_t c0, int64_t c1,
                   float* out, int64_t ldo) {
  return with_rans_kind(a, a.gemm.x_bf16 != nullptr, [&]<int Kind, int Lookup, bool Dot>() {
    return rans_gemv_kind<Kind, Lookup, Dot>(a, m0, m1, b0, b1, c0, c1, out, ldo);
  });
}

uint32_t rans_gemm_tile(const RansArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  return with_rans_kind(a, a.gemm.x_bf16 != nullptr, [&]<int Kind, int Lookup, bool Dot>() {
    return rans_gemm_tile_kind<Kind, Lookup, Dot>(a, m0, m1, nb, scratch);
  });
}

template <int Lookup>
uint32_t rans_decode_chunk_impl(const RansArgs& a, int64_t c, uint8_t* out, int64_t ldo, int64_t cols) {
  const RansTable<Lookup> table(a);
  typename RansLookupTypes<kRansGrid, Lookup>::Lanes d;
  rans_start(a, c, d);
  const int64_t k0 = (c % a.kchunks) * a.chunk_k, k1 = k0 + a.chunk_k < a.k ? k0 + a.chunk_k : a.k;
  alignas(64) uint8_t row[kRansBlockCols];
  for (int64_t k = k0; k < k1; ++k) {
#if MARLIN_KERNEL_AVX512
    if constexpr (Lookup == kLookupRegisters) {
      const __m512i sym = _mm512_permutex2var_epi16(table.sym[0], rans_step_index(d, table), table.sym[1]);
      _mm256_store_si256((__m256i*)row, _mm512_cvtepi16_epi8(sym));
    } else
#endif
    {
      vu sym[kRansVectors];
      rans_step(d, table, sym);
      for (int v = 0; v < kRansVectors; ++v)
        for (int l = 0; l < kLanes; ++l) row[v * kLanes + l] = uint8_t(sym[v][l]);
    }
    memcpy(out + (k - k0) * ldo, row, cols);
  }
  return rans_finish(d);
}

uint32_t rans_decode_chunk(const RansArgs& a, int64_t c, uint8_t* out, int64_t ldo, int64_t cols) {
  return with_rans_lookup(a, [&]<int Lookup>() { return rans_decode_chunk_impl<Lookup>(a, c, out, ldo, cols); });
}

#undef MARLIN_RANS_INLINE
