// The AVX-512 builds' lookup in registers (RansRegisterTable of
// rans_kernel_args.h: at most 64 symbols), a piece of rans_kernels_impl.h
// (included there, inside its anonymous namespace): the tables, a chunk's
// states as 16-bit planes, the values by index.

#if MARLIN_KERNEL_AVX512
template <>
struct RansTable<kLookupRegisters> {
  int prob_bits;
  __m512i bucket[2], split[2], cum[2], freq[2], sym[2];  // each table's words 0-31, 32-63
  int bucket_shift, split_shift, levels;
  bool has_split;

  explicit RansTable(const RansArgs& a) : prob_bits(a.prob_bits) {
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
};

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

template <int Kind>
struct RansLookupTypes<Kind, kLookupRegisters> {
  using Lanes = RansPlanes;
  using Values = RansWordValues<Kind>;
};
#endif  // MARLIN_KERNEL_AVX512
