// The entropy-coded layout's CPU kernels (docs/FORMAT.md; entry points in
// csrc/cpu/rans_kernel_args.h). Included by kernels_impl.h with
// MARLIN_KERNEL_RANS (csrc/cpu/rans_kernels_<isa>.cpp), inside its anonymous
// namespace, on its pieces: vectors, value formats (FormatDecode through
// table_nibble), group_dot / group_weight, gemm_tiles and gemm_tiles_dot.
//
// The 32 lanes of a chunk decode in lockstep. With few symbols (up to 64),
// AVX-512 builds keep the tables in registers and a chunk's states as two
// vectors of 16-bit words (RansPlanes, rans_registers_avx512.h: all 32 lanes
// in each instruction).
// Otherwise the lanes are kRansVectors vectors of kLanes 32-bit states
// (RansLanes): per step each lane looks its slot up (AVX2, with at most 32
// symbols: in byte tables in registers, 32 lanes per vpshufb, RansByteLayout,
// rans_bytes_avx2.h; otherwise in the per-call slot table, a gather on
// AVX-512, one load per lane elsewhere), updates its state,
// and the lanes whose state fell below 2^16 take the next words of the
// chunk's shared stream in lane order (AVX-512: vpexpandd; AVX2: one vpshufb
// by a 256-entry table of the 8-lane prefix sums; elsewhere by each lane's rank
// among them, without a branch). Lane l of column block b is output column
// 32 b + l, so x[k] multiplies a whole vector of decoded weights as one
// broadcast. "tcq"
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
// kExpand8.index[m]: vpshufb's index that moves, for each of 8 lanes set in m,
// the word whose position is the number of lanes below it set in m (its word
// among this step's refills) into the lane's dword, zero-extended; lanes not in
// m get 0. The 8 words are in both 128-bit halves (lanes 0-3 and 4-7), so one
// in-lane vpshufb does it: against vpmovzxwd, vpmovzxbd and vpermd, two
// shuffle uops fewer per 8 lanes and a shorter chain to the next step.
struct Expand8Table {
  alignas(32) uint8_t index[256][32];
  constexpr Expand8Table() : index() {
    for (int m = 0; m < 256; ++m)
      for (int l = 0, rank = 0; l < 8; ++l) {
        uint8_t* lane = index[m] + 4 * l;  // lane l: half l / 4, dword l % 4
        const bool need = m >> l & 1;
        lane[0] = need ? uint8_t(2 * rank) : 0x80, lane[1] = need ? uint8_t(2 * rank + 1) : 0x80;
        lane[2] = lane[3] = 0x80;
        rank += need;
      }
  }
};
constexpr Expand8Table kExpand8;
#endif

// Words for the lanes whose state fell below 2^16 (lane order) into
// x = (x << 16) | word; at most kLanes words are read, all of them before
// d.end (Checked: the caller knows that kLanes words are left, so no branch).
template <bool Checked = true>
MARLIN_RANS_INLINE vu rans_refill(RansLanes& d, vu x) {
  typedef uint16_t vw __attribute__((vector_size(2 * kLanes)));
#if MARLIN_KERNEL_AVX512
  const __mmask16 need = _mm512_cmplt_epu32_mask((__m512i)x, _mm512_set1_epi32(int(kRansLow)));
#elif MARLIN_KERNEL_AVX2
  const unsigned need = __builtin_ia32_movmskps256((vf)((vi)(x >> 16) == 0));
#else
  unsigned need = 0;  // bit l: lane l
  for (int l = 0; l < kLanes; ++l) need |= unsigned(x[l] < kRansLow) << l;
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
#elif MARLIN_KERNEL_AVX2  // the words in both halves (vbroadcasti128), into their lanes by kExpand8
  const __m256i w = _mm256_broadcastsi128_si256((__m128i)words);
  const vu expanded = (vu)_mm256_shuffle_epi8(w, _mm256_load_si256((const __m256i*)kExpand8.index[need]));
  return (vu)_mm256_blendv_epi8((__m256i)x, (__m256i)((x << 16) | expanded), (__m256i)((vi)(x >> 16) == 0));
#else  // lane l takes the word after those of the needing lanes below it: no branch per lane (a
       // lane's need is a coin toss), and a step's code small enough for GCC to compile in
       // reasonable time (with a branch per lane rans_kernels_neon_bf16.cpp took 724 s of CPU, now 414)
  uint16_t word[kLanes];
  memcpy(word, &words, sizeof(word));
  vu expanded;
  for (int l = 0, rank = 0; l < kLanes; ++l) {
    expanded[l] = word[rank];
    rank += need >> l & 1;
  }
  const vu take = (vu)(x < kRansLow);
  return (((x << 16) | expanded) & take) | (x & ~take);
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

// The slot table of rans_kernel_args.h, one load per lane (AVX-512: a gather).
// Specialised for the register lookup (rans_registers_avx512.h) and the byte
// tables (rans_bytes_avx2.h).
template <int Lookup>
struct RansTable {
  const uint32_t* table;
  int prob_bits;

  explicit RansTable(const RansArgs& a) : table(a.table), prob_bits(a.prob_bits) {}

  // Symbol, freq and slot - cum of each lane's slot, for the kRansVectors vectors of a chunk.
  MARLIN_RANS_INLINE void lookup(const vu* slot, vu* sym_out, vu* freq_out, vu* bias_out) const {
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

// Every lane's state update from its slot's freq and slot - cum, before its refill.
MARLIN_RANS_INLINE void rans_update(const RansLanes& d, int prob_bits, const vu* freq, const vu* bias, vu* x) {
  for (int v = 0; v < kRansVectors; ++v) x[v] = freq[v] * (d.x[v] >> prob_bits) + bias[v];
}

// The refills of every lane after its update x.
MARLIN_RANS_INLINE void rans_refills(RansLanes& d, const vu* x) {
  if (d.end - d.ptr >= kRansVectors * kLanes) {  // (nearly always)
#pragma GCC unroll 8
    for (int v = 0; v < kRansVectors; ++v) d.x[v] = rans_refill<false>(d, x[v]);
    return;
  }
#pragma GCC unroll 8  // (the refill's branches kept GCC from it): d stays in registers
  for (int v = 0; v < kRansVectors; ++v) d.x[v] = rans_refill(d, x[v]);
}

// Every lane's state update and refill, from its slot's freq and slot - cum.
MARLIN_RANS_INLINE void rans_advance(RansLanes& d, int prob_bits, const vu* freq, const vu* bias) {
  vu x[kRansVectors];
  rans_update(d, prob_bits, freq, bias, x);
  rans_refills(d, x);
}

// Each lane's slot: the low prob_bits bits of its state.
MARLIN_RANS_INLINE void rans_slots(const RansLanes& d, int prob_bits, vu* slot) {
  const uint32_t mask = (1u << prob_bits) - 1;
  for (int v = 0; v < kRansVectors; ++v) slot[v] = d.x[v] & mask;
}

// One step of every lane: sym[v] = the symbols of lanes v * kLanes ...
template <int Lookup>
MARLIN_RANS_INLINE void rans_step(RansLanes& d, const RansTable<Lookup>& t, vu* sym) {
  vu slot[kRansVectors], freq[kRansVectors], bias[kRansVectors];
  rans_slots(d, t.prob_bits, slot);
  t.lookup(slot, sym, freq, bias);
  rans_advance(d, t.prob_bits, freq, bias);
}

// A chunk's lanes and (register lookup) the values of its table indices, by lookup.
struct NoWordValues {
  explicit NoWordValues(const RansArgs&) {}
};
template <int Kind, int Lookup>
struct RansLookupTypes {
  using Lanes = RansLanes;
  using Values = NoWordValues;
};

#include "cpu/rans_registers_avx512.h"
#include "cpu/rans_bytes_avx2.h"

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
// 4.7-4.9 ms against 3.3, tcq 5.8 against 4.7); and for tcq on AVX2's byte
// tables, whose trellis makes the chain longer (Zen 3, in one process: the tcq
// fill 0.91-0.93x of one tile's; the grid's 1.02-1.04x, fp4's 1.01x).

template <int Kind, int Lookup>
constexpr int kRansFillTiles =
    (MARLIN_KERNEL_AVX512 && Lookup == kLookupRegisters) || (kByteLookup<Lookup> && Kind == kRansTcq) ? 2 : 1;

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
  int64_t group = -1, group_end = 0;  // (a division per row cost the grid's fill 2%)
  // The grid and tcq with one scale per column: the tiles hold the values unscaled and the
  // scale multiplies the sums (gemm_tiles' column_scale), as the GEMV's group_dot does.
  const bool scale_sums;
  uint32_t bad = 0;
  alignas(64) float scale[kCols], zero[kCols];

  RansTileFill(const RansArgs& args, int64_t nb_)
      : a(args), table(args), words(args), nb(nb_),
        scale_sums(!Dot && (Kind == kRansGrid || Kind == kRansTcq) && args.gemm.groups == 1) {
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
      if (k >= group_end) {
        group = k / g.group_rows, group_end = (group + 1) * g.group_rows;
        load_group<F>(g, group, nb, cols, kCols, scale, zero);
      }
      if (scale_sums) {
        for (int q = 0; q < kCols / kLanes; ++q) store(at(tile, q * kLanes) + r * kTileCols, values[q]);
        continue;
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
  constexpr int Tiles = kRansFillTiles<Kind, Lookup>;
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
    gemm_tiles<Tiles>(a.gemm, m0, m1, n0, scratch, f, fill.scale_sums ? fill.scale : nullptr);
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
  if (a.bytes.fits)
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
