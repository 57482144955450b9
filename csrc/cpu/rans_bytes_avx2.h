// The AVX2 builds' lookup in byte tables in registers (RansByteLayout of
// rans_kernel_args.h: at most 32 symbols, prob_bits 10-12), a piece of
// rans_kernels_impl.h (included there, inside its anonymous namespace): the
// tables, the lookup, the values by index and tcq's trellis as bytes.

#if MARLIN_KERNEL_AVX2
// A 16-entry byte table in both 128-bit halves (vpshufb's table).
inline __m256i byte_table16(const uint8_t* t) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)t));
}

// A 32-entry byte table as two 16-entry ones.
inline void byte_table_halves(const uint8_t* t, __m256i* out) {
  for (int h = 0; h < 2; ++h) out[h] = byte_table16(t + 16 * h);
}

template <int Lookup>
  requires(kByteLookup<Lookup>)
struct RansTable<Lookup> {
  int prob_bits;
  // Entries 0-15 and 16-31 of each table, in both 128-bit halves (vpshufb's tables);
  // by bucket: its first symbol's index, and the low slot bits minus 1 of the cums inside it
  // (ascending; 127, above every slot's, where it has fewer); by index: freq, cum (low, high
  // bytes), symbol. A split bucket's number s + 1 (others 0) by bucket, and by that number (16
  // entries) its cums from `boundaries` on (127 past them, and for 0), its run's start and length
  // (0 for 0).
  __m256i first[2], inside[kRansByteBoundaries][2], freq_lo[2], freq_hi[2], cum_lo[2], cum_hi[2], sym[2];
  __m256i split_number[2], split_inside[kRansSplitCompares], run_start, run_length;
  __m256i low_bits;  // the slot bits below the bucket's, per 16-bit word
  __m128i bucket_shift;
  int boundaries, split_compares;  // split_compares: the most of those cums in a split bucket
  bool has_split;

  explicit RansTable(const RansArgs& a) : prob_bits(a.prob_bits) {
    const RansRegisterTable& r = a.registers;
    const RansByteLayout& layout = a.bytes;
    bucket_shift = _mm_cvtsi32_si128(a.prob_bits - 5);
    low_bits = _mm256_set1_epi16(short((1 << (a.prob_bits - 5)) - 1));
    boundaries = layout.boundaries;
    split_compares = 0;
    has_split = layout.splits > 0;
    alignas(32) uint8_t bytes[7 + kRansByteBoundaries][kRansByteBuckets] = {};
    const bool parity = a.kind == kRansTcq;
    for (int i = 0; i < r.symbols; ++i) {
      // tcq: the symbol's parity in bit 7 of its freq's high byte (at most 0x10 there)
      bytes[0][i] = uint8_t(r.freq[i]), bytes[1][i] = uint8_t(r.freq[i] >> 8 | (parity && (r.sym[i] & 1)) << 7);
      bytes[2][i] = uint8_t(r.cum[i]), bytes[3][i] = uint8_t(r.cum[i] >> 8), bytes[4][i] = uint8_t(r.sym[i]);
    }
    for (int b = 0; b < kRansByteBuckets; ++b) {
      bytes[5][b] = uint8_t(layout.first[b]);
      for (int j = 0; j < kRansByteBoundaries; ++j) bytes[6 + j][b] = j < layout.count[b] ? layout.inside[b][j] : 127;
    }
    alignas(32) uint8_t numbers[kRansByteBuckets] = {}, split_cums[kRansSplitCompares][16];
    alignas(16) uint8_t starts[16] = {}, lengths[16] = {};
    memset(split_cums, 127, sizeof(split_cums));
    for (int s = 0; s < layout.splits; ++s) {
      const int b = layout.split_bucket[s];
      numbers[b] = uint8_t(s + 1);
      starts[s + 1] = layout.run_start[s], lengths[s + 1] = layout.run_length[s];
      const int compares = layout.count[b] - boundaries;  // (RansByteLayout keeps it within kRansSplitCompares)
      split_compares = compares > split_compares ? compares : split_compares;
      for (int j = 0; j < compares; ++j) split_cums[j][s + 1] = layout.inside[b][boundaries + j];
    }
    byte_table_halves(numbers, split_number);
    for (int j = 0; j < kRansSplitCompares; ++j) split_inside[j] = byte_table16(split_cums[j]);
    run_start = byte_table16(starts), run_length = byte_table16(lengths);
    byte_table_halves(bytes[0], freq_lo), byte_table_halves(bytes[1], freq_hi);
    byte_table_halves(bytes[2], cum_lo), byte_table_halves(bytes[3], cum_hi);
    byte_table_halves(bytes[4], sym), byte_table_halves(bytes[5], first);
    for (int j = 0; j < kRansByteBoundaries; ++j) byte_table_halves(bytes[6 + j], inside[j]);
  }

  // Entry i of a 32-entry byte table for each byte i (0-31) of `index`: i + 0x70 has bit 7 (vpshufb's
  // zero) set for i >= 16, i + 0xF0 (wrapping) for i < 16. Small: i < 16, one vpshufb.
  template <bool Small>
  struct ByteIndex {
    __m256i low, high;
    ByteIndex() = default;
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

  // The 32 lanes' slots packed to bytes (vpackusdw, vpackuswb: an order of lanes that
  // the unpacks undo), their bucket's first index plus their compares with the cums inside it.
  // Parity: the table may be tcq's, whose freq_hi bytes carry the symbol's parity in bit 7:
  // masked off the freq and kept in *parity (other tables have that bit clear).
  template <bool Parity>
  MARLIN_RANS_INLINE SymbolIndex lookup_bytes(const vu* slot, vu* freq_out, vu* bias_out, __m256i* parity) const {
    const __m256i w01 = _mm256_packus_epi32((__m256i)slot[0], (__m256i)slot[1]);
    const __m256i w23 = _mm256_packus_epi32((__m256i)slot[2], (__m256i)slot[3]);
    const ByteIndex<false> bucket(
        _mm256_packus_epi16(_mm256_srl_epi16(w01, bucket_shift), _mm256_srl_epi16(w23, bucket_shift)));
    const __m256i low = _mm256_packus_epi16(_mm256_and_si256(w01, low_bits), _mm256_and_si256(w23, low_bits));
    __m256i index = by(first, bucket);
#pragma GCC unroll 4
    for (int j = 0; j < kRansByteBoundaries; ++j)  // (`boundaries` is the same all call long)
      if (j < boundaries) index = _mm256_sub_epi8(index, _mm256_cmpgt_epi8(low, by(inside[j], bucket)));
    if (has_split) {  // (a grid's tails) the split buckets' further cums and run, by their number
      const __m256i number = by(split_number, bucket);
#pragma GCC unroll 4
      for (int j = 0; j < kRansSplitCompares; ++j)  // (constant indices: no address arithmetic)
        if (j < split_compares)
          index = _mm256_sub_epi8(index, _mm256_cmpgt_epi8(low, _mm256_shuffle_epi8(split_inside[j], number)));
      const __m256i past = _mm256_subs_epu8(low, _mm256_shuffle_epi8(run_start, number));  // max(low - start, 0)
      index = _mm256_add_epi8(index, _mm256_min_epu8(past, _mm256_shuffle_epi8(run_length, number)));
    }
    const SymbolIndex at(index);
    __m256i high = by(freq_hi, at);
    if constexpr (Parity) *parity = high, high = _mm256_and_si256(high, _mm256_set1_epi8(0x7F));
    unpack_words(by(freq_lo, at), high, freq_out);
    // slot - cum as words, in the pack's order
    const __m256i cum_low = by(cum_lo, at), cum_high = by(cum_hi, at), zero = _mm256_setzero_si256();
    const __m256i b01 = _mm256_sub_epi16(w01, _mm256_unpacklo_epi8(cum_low, cum_high));
    const __m256i b23 = _mm256_sub_epi16(w23, _mm256_unpackhi_epi8(cum_low, cum_high));
    bias_out[0] = (vu)_mm256_unpacklo_epi16(b01, zero), bias_out[1] = (vu)_mm256_unpackhi_epi16(b01, zero);
    bias_out[2] = (vu)_mm256_unpacklo_epi16(b23, zero), bias_out[3] = (vu)_mm256_unpackhi_epi16(b23, zero);
    return at;
  }

  // Symbol, freq and slot - cum of each lane's slot (rans_step's interface; decode_chunk).
  MARLIN_RANS_INLINE void lookup(const vu* slot, vu* sym_out, vu* freq_out, vu* bias_out) const {
    __m256i parity;  // (unused; the mask makes any table's freq right, tcq's too)
    unpack_words(by(sym, lookup_bytes<true>(slot, freq_out, bias_out, &parity)), _mm256_setzero_si256(), sym_out);
  }
};

// The byte tables' values (kByteLookup): bytes 0-3 of each index's fp32
// value (tcq: its level in the trellis' even states), in vpshufb's two
// tables each; values exact in bf16 (all but nf4's) skip bytes 0 and 1.
// tcq: bytes 2-3 of its level in the odd states (its symbol's parity comes
// with the freq: RansTable's freq_hi).
template <int Kind>
struct RansByteValues {
  __m256i bytes[4][2], odd[2][2];
  bool exact;

  explicit RansByteValues(const RansArgs& a) {
    alignas(16) uint8_t b[6][kRansByteBuckets] = {};
    exact = true;
    for (int i = 0; i < a.registers.symbols && i < kRansByteBuckets; ++i) {
      const int sym = a.registers.sym[i], k = sym - 128;
      float value, odd_value = 0;  // rans_value's (table_nibble reads the code's low 4 bits)
      if constexpr (Kind == kRansGrid) value = float(k);
      else if constexpr (Kind == kRansTcq) value = float(2 * k), odd_value = float(2 * k - (k > 0) + (k < 0));
      else value = code_value<Kind>(sym & 15);
      const uint32_t u = __builtin_bit_cast(uint32_t, value), o = __builtin_bit_cast(uint32_t, odd_value);
      for (int j = 0; j < 4; ++j) b[j][i] = uint8_t(u >> (8 * j));
      b[4][i] = uint8_t(o >> 16), b[5][i] = uint8_t(o >> 24);
      exact &= (u & 0xFFFF) == 0;
    }
    for (int j = 0; j < 4; ++j) byte_table_halves(b[j], bytes[j]);
    byte_table_halves(b[4], odd[0]), byte_table_halves(b[5], odd[1]);
  }
};

// tcq's lanes on the byte tables: the trellis (bit 0 of high and low) as
// bit 7 of bytes (vpblendvb's), in the tables' order of lanes.
struct RansByteLanes : RansLanes {
  __m256i trellis_high, trellis_low;
};

inline void rans_start(const RansArgs& a, int64_t chunk, RansByteLanes& d) {
  rans_start(a, chunk, static_cast<RansLanes&>(d));
  d.trellis_high = d.trellis_low = _mm256_setzero_si256();  // every chunk starts at trellis state 0
}

// rans_values (below) on the byte tables, values by index. Every block's lookup, then
// every block's values, then their updates, then their refills: in this program order the
// out-of-order window holds both blocks' chains at once (a step of one block is about as
// long as the window; block after block, the fill took about 5% longer on Zen 3).
template <int Kind, bool Pair, int Blocks, int Lookup, class Lanes>
  requires(kByteLookup<Lookup>)
MARLIN_RANS_INLINE void rans_values(Lanes* d, int blocks, const RansTable<Lookup>& t,
                                    const RansByteValues<Kind>& w, vf* out) {
  static_assert(!Pair, "AVX2 builds take fp32 x");
  vu freq[Blocks][kRansVectors], bias[Blocks][kRansVectors];
  typename RansTable<Lookup>::SymbolIndex at[Blocks];
  __m256i parity[Blocks];  // tcq: bit 7 of each lane's byte
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) {  // (blocks past `blocks`: zero states, unused)
    vu slot[kRansVectors];
    rans_slots(d[j], t.prob_bits, slot);
    at[j] = t.template lookup_bytes<Kind == kRansTcq>(slot, freq[j], bias[j], &parity[j]);
  }
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) {
    if (j >= blocks) {
      for (int v = 0; v < kRansVectors; ++v) out[j * kRansVectors + v] = vf{};
      continue;
    }
    __m256i b2 = t.by(w.bytes[2], at[j]), b3 = t.by(w.bytes[3], at[j]);
    if constexpr (Kind == kRansTcq) {  // (high, low) = (low ^ s, high); k & 1 == s & 1
      b2 = _mm256_blendv_epi8(b2, t.by(w.odd[0], at[j]), d[j].trellis_high);
      b3 = _mm256_blendv_epi8(b3, t.by(w.odd[1], at[j]), d[j].trellis_high);
      const __m256i next = _mm256_xor_si256(d[j].trellis_low, parity[j]);  // (only bit 7 counts)
      d[j].trellis_low = d[j].trellis_high, d[j].trellis_high = next;
    }
    const __m256i h01 = _mm256_unpacklo_epi8(b2, b3), h23 = _mm256_unpackhi_epi8(b2, b3);
    __m256i l01 = _mm256_setzero_si256(), l23 = l01;
    if (!w.exact) {
      const __m256i b0 = t.by(w.bytes[0], at[j]), b1 = t.by(w.bytes[1], at[j]);
      l01 = _mm256_unpacklo_epi8(b0, b1), l23 = _mm256_unpackhi_epi8(b0, b1);
    }
    vf* o = out + j * kRansVectors;
    o[0] = (vf)_mm256_unpacklo_epi16(l01, h01), o[1] = (vf)_mm256_unpackhi_epi16(l01, h01);
    o[2] = (vf)_mm256_unpacklo_epi16(l23, h23), o[3] = (vf)_mm256_unpackhi_epi16(l23, h23);
  }
  vu x[Blocks][kRansVectors];
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j) rans_update(d[j], t.prob_bits, freq[j], bias[j], x[j]);
  _Pragma("GCC unroll 4") for (int j = 0; j < Blocks; ++j)
    if (j < blocks) rans_refills(d[j], x[j]);
}

template <int Kind, int Lookup>
  requires(kByteLookup<Lookup>)
struct RansLookupTypes<Kind, Lookup> {
  using Lanes = std::conditional_t<Kind == kRansTcq, RansByteLanes, RansLanes>;
  using Values = RansByteValues<Kind>;
};
#endif  // MARLIN_KERNEL_AVX2
