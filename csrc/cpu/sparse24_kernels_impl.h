// CPU kernels of the 2:4 sparse layout (docs/FORMAT.md), part of one kernel
// build (see cpu/cpu_vec.h; cpu/kernels_impl.h puts its entry points into the
// build's table, CpuKernels). It reuses the value decode and the dense
// kernels' panels, register blocks and GEMM loops.
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/dense_gemm.h"
#include "cpu/dense_gemv.h"
#include "cpu/format_decode.h"
#include "cpu/kernel_args.h"
#include "cpu/sparse24_metadata.h"

// Layout recap: values word [r, n] holds the 8 kept codes of K rows
// 16r..16r+15: nibble j is kept weight j / 4 of block j % 4; metadata word
// [r / 2, n] holds 8 nibbles pos0 | pos1 << 2, half r % 2 of it (16 bits) the
// 4 blocks of values row r, so nibble j's position inside its block is bits
// 4 (j % 4) + 2 (j / 4) .. + 1 of that half.
//
// GEMV: the weight is never expanded. fp32 x: each slot's value is
// multiplied by the x it belongs to, gathered per lane (column) from the
// block's 4 x values: half the multiplies of the dense GEMV and a quarter less
// data. bf16 x on AVX512-BF16 (kSparseDot): a block's kept pair (v0, v1) is
// one bf16 pair and (x[pos0], x[pos1]) another, looked up by the metadata
// nibble in a 16-entry table of x pairs made once per block of x; one
// vdpbf16ps then does the block's two products.
// GEMM: cache-sized dense tiles (zeros at pruned positions), then the dense
// micro-kernels (fp32, or bf16 pairs for fp4/int4 with bf16 x). Every kernel
// checks each metadata word it decodes and returns nonzero if one holds an
// invalid pattern.

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

constexpr int kSparseChunkWords = 8;          // gemv: values rows per pass (128 K rows)
// The bf16 pair path (vpmultishiftqb, vpermw, vdpbf16ps): AVX512-BF16 builds only.
#define MARLIN_SPARSE24_DOT (MARLIN_KERNEL_AVX512 && MARLIN_KERNEL_BF16_DOT)
constexpr bool kSparseDot = MARLIN_SPARSE24_DOT;

// x gathered by position: lane l takes xb[idx_l & 3] of a block's 4 x values.
// x86: vpermilps on the 4 values broadcast to every 128-bit lane reads only
// index bits 0..1, so metadata shifted right by 2s is the index as it is.
// Portable build: two bit selects on masks made once per slot.
#if MARLIN_KERNEL_AVX512 || MARLIN_KERNEL_AVX2
struct SlotIndex {
  vi idx;
};
inline SlotIndex slot_index(vi shifted) { return {shifted}; }
typedef vf XBlock;
inline XBlock load_block(const float* x4) {
#if MARLIN_KERNEL_AVX512
  return _mm512_broadcast_f32x4(_mm_loadu_ps(x4));
#else
  typedef float v4f __attribute__((vector_size(16)));
  v4f q;
  memcpy(&q, x4, sizeof(q));
  return __builtin_shufflevector(q, q, 0, 1, 2, 3, 0, 1, 2, 3);
#endif
}
inline vf gather(const XBlock& xb, const SlotIndex& s) {
#if MARLIN_KERNEL_AVX512
  return _mm512_permutevar_ps(xb, (__m512i)s.idx);
#else
  return __builtin_ia32_vpermilvarps256(xb, s.idx);
#endif
}
#else
struct SlotIndex {
  vi odd, high;  // all-ones lanes where the position is odd / >= 2
};
inline SlotIndex slot_index(vi shifted) { return {(shifted << 31) >> 31, (shifted << 30) >> 31}; }
struct XBlock {
  vi x[4];
};
inline XBlock load_block(const float* x4) {
  return {{(vi)splat(x4[0]), (vi)splat(x4[1]), (vi)splat(x4[2]), (vi)splat(x4[3])}};
}
inline vf gather(const XBlock& xb, const SlotIndex& s) {
  const vi lo = (xb.x[1] & s.odd) | (xb.x[0] & ~s.odd), hi = (xb.x[3] & s.odd) | (xb.x[2] & ~s.odd);
  return (vf)((hi & s.high) | (lo & ~s.high));
}
#endif

#if MARLIN_SPARSE24_DOT
// The x-pair table of one block of bf16 x (4 values at x4): entry n (0..15)
// = x[n & 3] | x[n >> 2] << 16, so a metadata nibble pos0 | pos1 << 2 looks up
// (x[pos0], x[pos1]). One vpermw of the 4 values.
inline void make_pair_table(const uint16_t* x4, float* table) {
  int64_t bits;
  memcpy(&bits, x4, sizeof(bits));
  typedef short v32s __attribute__((vector_size(64)));
#define MARLIN_P(n) short((n) & 3), short((n) >> 2)
  const v32s index = {MARLIN_P(0),  MARLIN_P(1),  MARLIN_P(2),  MARLIN_P(3), MARLIN_P(4),  MARLIN_P(5),
                      MARLIN_P(6),  MARLIN_P(7),  MARLIN_P(8),  MARLIN_P(9), MARLIN_P(10), MARLIN_P(11),
                      MARLIN_P(12), MARLIN_P(13), MARLIN_P(14), MARLIN_P(15)};
#undef MARLIN_P
  store(table, (vf)_mm512_permutexvar_epi16((__m512i)index, _mm512_set1_epi64(bits)));
}

// Block b's kept pair of each values word as bf16 (v0 low, v1 high):
// nibbles b and b + 4, word bits 4b.. and 4b + 16...
template <int F>
inline vf decode_kept_pair(vi w, int b) {
  return decode_bf16_pairs<F>(w, 0x3030202010100000ll + 0x0404040404040404ll * b);
}

// Lane l: table[idx_l & 15].
inline vf lookup_pairs(vi idx, vf table) { return _mm512_permutexvar_ps((__m512i)idx, table); }
#endif

// The metadata code: how a values row finds the positions of its 8 slots.
// The layout's code (docs/FORMAT.md) is a nibble pos0 | pos1 << 2 per block,
// so half r % 2 of metadata word r / 2 is values row r's positions. (The GEMV takes the code as a template argument so that
// benchmarks/sparse_metadata_code.py can time a denser code in the same kernel.)
struct NibbleMetadata {
  static constexpr int kRowsPerWord = 2;  // values rows per metadata word
  static constexpr int32_t kFill = kFillMetadata;  // a valid word for padded columns
  // Positions of values row `part` (0..kRowsPerWord-1) of metadata word vector m,
  // block b at bits 4b..4b+3; `bad` collects invalid patterns (checked once per word, with part 0).
  static inline vi positions(vi m, int part, vu& bad) {
    if (part == 0) bad |= metadata_invalid(m);
    return (vi)((vu)m >> (16 * part));
  }
};

// ---------------------------------------------------------------------------
// GEMV

struct SparseGemvChunk {
  const float* x;        // fp32: the chunk's 16 * words K values of the block's first row;
                         // Dot: its x-pair tables, 4 * 16 floats per values row
  int64_t ldx;           // row stride of x
  const int32_t* w;      // values row r0, first column of the strip
  int64_t ldw;           // values row stride (N, or kStrip for a padded copy)
  const int32_t* meta;   // metadata row r0 / R, same column (R = values rows per metadata word)
  int64_t ldm;
  int phase;             // r0 % R: values row r of the chunk is part (phase + r) % R of metadata row (phase + r) / R
  int words;             // values rows in this chunk
  bool first, last;      // chunk starts / ends its group
  const float* scale;
  const float* zero;     // (uint4)
  float* part;           // [rows, kStrip]: group partial sums between chunks
  float* xpart;          // [rows, kStrip]: Dot uint4, partial sums of the kept x
  float* acc;            // [rows, kStrip]
};

// Values rows of x per x-pair table row: 4 tables of 16 floats.
constexpr int kPairTableFloats = 4 * 16;

// Rows [0, MR) of the block, columns [col, col + kLanes * NV) of the strip.
template <class Meta, int F, int MR, int NV, bool Dot>
inline vu sparse_gemv_micro(const SparseGemvChunk& c, int col) {
  // Dot uint4 / affine: q - zero (q * scale + bias) is not exact in bf16, so the kept x are summed too
  // (a dot with the pair (1, 1)) and the zero (bias) term applied per group (group_dot).
  constexpr bool KeptXSum = Dot && kHasZeros<F>;
  vf p[MR][NV], xs[KeptXSum ? MR : 1][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      p[i][v] = c.first ? vf{} : load(c.part + i * kStrip + col + kLanes * v);
      if (KeptXSum) xs[i][v] = c.first ? vf{} : load(c.xpart + i * kStrip + col + kLanes * v);
    }
  vu bad = {};
  for (int r = 0; r < c.words; ++r) {
    const int h = c.phase + r;
    vi meta[NV];
    for (int v = 0; v < NV; ++v)
      meta[v] = Meta::positions(load(c.meta + (h / Meta::kRowsPerWord) * c.ldm + col + kLanes * v),
                                h % Meta::kRowsPerWord, bad);
#if MARLIN_SPARSE24_DOT
    if constexpr (Dot) {
      vi w[NV];
      for (int v = 0; v < NV; ++v) w[v] = load(c.w + r * c.ldw + col + kLanes * v);
      const vf ones = (vf)(vi{} + 0x3F803F80);  // the bf16 pair (1, 1)
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        vf pair[NV];
        vi idx[NV];
        for (int v = 0; v < NV; ++v) {
          pair[v] = decode_kept_pair<F>(w[v], b);
          idx[v] = (vi)((vu)meta[v] >> (4 * b));
        }
        for (int i = 0; i < MR; ++i) {
          const vf table = load(c.x + i * c.ldx + kPairTableFloats * r + 16 * b);
          for (int v = 0; v < NV; ++v) {
            const vf xp = lookup_pairs(idx[v], table);
            p[i][v] = dot_pairs(p[i][v], pair[v], xp);
            if (KeptXSum) xs[i][v] = dot_pairs(xs[i][v], ones, xp);
          }
        }
      }
      continue;
    }
#endif
    GemvWords w[NV];
    vf zero[NV], scale[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = gemv_prepare<F, false>(load(c.w + r * c.ldw + col + kLanes * v));
      zero[v] = kHasZeros<F> ? load(c.zero + col + kLanes * v) : vf{};
      scale[v] = kZerosAreBias<F> ? load(c.scale + col + kLanes * v) : vf{};
    }
    const float* x = c.x + kSparseValueRows * r;
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      vf b[NV];
      SlotIndex idx[NV];
      for (int v = 0; v < NV; ++v) {
        b[v] = gemv_value<F, false>(w[v], s);
        // q - zero, or the weight q * scale + bias: a pruned weight is 0, not -zero or bias
        if (kZerosAreBias<F>) b[v] = group_weight<F>(b[v], scale[v], zero[v]);
        else if (kHasZeros<F>) b[v] -= zero[v];
        idx[v] = slot_index((vi)((vu)meta[v] >> (4 * (s & 3) + 2 * (s >> 2))));
      }
      for (int i = 0; i < MR; ++i) {
        const XBlock xb = load_block(x + i * c.ldx + 4 * (s & 3));
        for (int v = 0; v < NV; ++v) p[i][v] = fmadd(gather(xb, idx[v]), b[v], p[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) {
      const int o = i * kStrip + col + kLanes * v;
      if (!c.last) {
        store(c.part + o, p[i][v]);
        if (KeptXSum) store(c.xpart + o, xs[i][v]);
        continue;
      }
      vf sum = p[i][v];
      if (FormatDecode<F>::kByteTable && !Dot) sum *= 0.5f;
      if (kZerosAreBias<F> && !Dot) {  // weights with their scale and bias already
        store(c.acc + o, load(c.acc + o) + sum);
        continue;
      }
      const vf xsum = KeptXSum ? xs[i][v] : vf{}, zero = KeptXSum ? load(c.zero + col + kLanes * v) : vf{};
      store(c.acc + o, group_dot<F>(load(c.acc + o), sum, xsum, load(c.scale + col + kLanes * v), zero));
    }
  }
  return bad;
}

// Register blocks: accumulators, values, indices and x of MR x NV fit the
// registers (16 on AVX2, 32 on AVX-512; the portable build has two per
// vector); enough independent accumulators per step cover the FMA latency.
constexpr int kSparseGemvBlockRows = MARLIN_KERNEL_AVX512 ? 8 : MARLIN_KERNEL_AVX2 ? 6 : 4;
template <int MR, bool KeptXSum>
constexpr int kSparseGemvVectors = MARLIN_KERNEL_AVX512 ? (MR * (KeptXSum ? 2 : 1) <= 2 ? 4 : MR * (KeptXSum ? 2 : 1) <= 4 ? 2 : 1)
                                   : MARLIN_KERNEL_AVX2 ? (MR <= 4 ? 2 : 1)
                                                        : (MR <= 2 ? 2 : 1);

template <class Meta, int F, int MR, bool Dot>
inline vu sparse_gemv_block(const SparseGemvChunk& c, int cols) {
  constexpr int NV = kSparseGemvVectors<MR, Dot && kHasZeros<F>>;
  vu bad = {};
  for (int col = 0; col < cols; col += kLanes * NV) bad |= sparse_gemv_micro<Meta, F, MR, NV, Dot>(c, col);
  return bad;
}

template <class Meta, int F, bool Dot>
vu sparse_gemv_rows(SparseGemvChunk c, int rows, int cols) {
  vu bad = {};
  for (int i = 0; i < rows;) {
    const int mr = even_rows(rows - i, kSparseGemvBlockRows);
    with_rows<kSparseGemvBlockRows>(mr, [&]<int MR>() { bad |= sparse_gemv_block<Meta, F, MR, Dot>(c, cols); });
    c.x += mr * c.ldx;
    c.part += mr * kStrip;
    c.xpart += mr * kStrip;
    c.acc += mr * kStrip;
    i += mr;
  }
  return bad;
}

// x of rows [m0, m0 + rows), values rows [r0, r0 + words) as the kernels read
// it: fp32 values, or (Dot) x-pair tables; row stride ldx.
template <bool Dot>
inline void load_sparse_x(const Sparse24Args& a, int64_t m0, int rows, int64_t r0, int words, float* dst,
                          int64_t ldx) {
  for (int i = 0; i < rows; ++i) {
#if MARLIN_SPARSE24_DOT
    if (Dot) {
      const uint16_t* x = a.x_bf16 + (m0 + i) * a.k + kSparseValueRows * r0;
      for (int b = 0; b < 4 * words; ++b) make_pair_table(x + 4 * b, dst + i * ldx + 16 * b);
      continue;
    }
#endif
    memcpy(dst + i * ldx, a.x + (m0 + i) * a.k + kSparseValueRows * r0, words * kSparseValueRows * sizeof(float));
  }
}

// out[m0:m1, n0:n1] for m1 - m0 <= kMaxRows, one panel of kPanelStrips
// strips at a time, as the dense gemv_impl: per chunk of K every strip of the
// panel, so each values row is read as a run of kPanelStrips * 256 bytes.
template <class Meta, int F, bool Dot>
vu sparse_gemv_impl(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  constexpr int R = Meta::kRowsPerWord;
  constexpr int kPanel = kPanelStrips * kStrip;
  constexpr int x_per_row = Dot ? kPairTableFloats : kSparseValueRows;  // floats of x per values row
  const int rows = int(m1 - m0);
  const int64_t group_words = a.group_rows / kSparseValueRows;  // values rows per group (g16: one)
  const int64_t value_rows = a.k / kSparseValueRows;
  // Per strip s: acc/part [s][kMaxRows][kStrip] (a strip's rows contiguous).
  alignas(64) float acc[kPanelStrips * kMaxRows * kStrip], part[kPanelStrips * kMaxRows * kStrip];
  alignas(64) float xpart[(Dot && kHasZeros<F> ? kPanelStrips * kMaxRows : 1) * kStrip];
  alignas(64) float scale[kPanel], zero[kPanel];
  const PanelBuffers panel{scale, zero, part, acc};
  // Padded copies for tail strips and re-read weights (as the dense gemv).
  alignas(64) int32_t padded[kSparseChunkWords * kStrip];
  alignas(64) int32_t padded_meta[(kSparseChunkWords / R + 2) * kStrip];
  alignas(64) float xbuf[kMaxRows * kSparseChunkWords * x_per_row];
  vu bad = {};
  for (int64_t pb = n0; pb < n1; pb += kPanel) {
    const int64_t panel_cols = n1 - pb < kPanel ? n1 - pb : kPanel;
    const int strips = int((panel_cols + kStrip - 1) / kStrip);
    memset(acc, 0, strips * kMaxRows * kStrip * sizeof(float));
    SparseGemvChunk c;
    c.x = xbuf;
    c.ldx = kSparseChunkWords * x_per_row;
    for (int64_t g = 0; g < a.groups; ++g) {
      load_panel_group<F>(a, g, pb, n1, strips, panel);
      for (int64_t w0 = 0; w0 < group_words; w0 += kSparseChunkWords) {
        const int64_t r0 = g * group_words + w0;
        c.words = int(group_words - w0 < kSparseChunkWords ? group_words - w0 : kSparseChunkWords);
        c.first = w0 == 0;
        c.last = w0 + c.words == group_words;
        c.phase = int(r0 % R);
        const int64_t meta0 = r0 / R, meta_rows = (r0 + c.words - 1) / R - meta0 + 1;
        load_sparse_x<Dot>(a, m0, rows, r0, c.words, xbuf, c.ldx);
        // Fetch the panel's next chunk early (each values row is its own stream).
        for (int64_t r = r0 + c.words; r < r0 + c.words + kSparseChunkWords && r < value_rows; ++r) {
          for (int64_t l = 0; l < panel_cols; l += 16) __builtin_prefetch(a.packed + r * a.n + pb + l);
          if (r % R == 0)
            for (int64_t l = 0; l < panel_cols; l += 16) __builtin_prefetch(a.metadata + (r / R) * a.n + pb + l);
        }
        for (int s = 0; s < strips; ++s) {
          const int64_t nb = pb + s * kStrip;
          const int cols = int(n1 - nb < kStrip ? n1 - nb : kStrip);
          use_strip(c, panel, s);
          c.xpart = xpart + (Dot && kHasZeros<F> ? s * kMaxRows * kStrip : 0);
          if (cols == kStrip && rows <= kSparseGemvBlockRows) {  // read once: stream from the weight
            c.w = a.packed + r0 * a.n + nb;
            c.ldw = a.n;
            c.meta = a.metadata + meta0 * a.n + nb;
            c.ldm = a.n;
          } else {
            for (int r = 0; r < c.words; ++r)
              copy_words(padded + r * kStrip, a.packed + (r0 + r) * a.n + nb, cols, kStrip);
            for (int64_t r = 0; r < meta_rows; ++r)
              copy_metadata(padded_meta + r * kStrip, a.metadata + (meta0 + r) * a.n + nb, cols, kStrip,
                            Meta::kFill);
            c.w = padded;
            c.ldw = kStrip;
            c.meta = padded_meta;
            c.ldm = kStrip;
          }
          bad |= sparse_gemv_rows<Meta, F, Dot>(c, rows, (cols + kLanes - 1) & ~(kLanes - 1));
        }
      }
    }
    store_panel(a, m0, rows, pb, n1, strips, acc);
  }
  return bad;
}

// out[m0, n0:n1] for one row of x, as the dense gemv_stream: each values row
// is read across all of n0:n1 (one sequential stream, the metadata a second
// one, each prefetched ahead) with the per-column group sums in memory; the
// strip-by-strip walk above reads 256 bytes per values row and then jumps N
// words. Same sums in the same order as sparse_gemv_impl.
template <class Meta, int F, bool Dot>
vu sparse_gemv_stream(const Sparse24Args& a, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = Meta::kRowsPerWord;
  const int64_t cols = n1 - n0, padded_cols = (cols + kStrip - 1) / kStrip * kStrip;
  const int64_t value_rows = a.k / kSparseValueRows, group_words = a.group_rows / kSparseValueRows;
  // Per column: group partial sums (of products, and Dot uint4 of the kept x),
  // output sums and (uint4) the group's zeros.
  float* sums = new float[4 * padded_cols];
  float *part = sums, *xpart = sums + padded_cols, *acc = sums + 2 * padded_cols, *zeros = sums + 3 * padded_cols;
  memset(acc, 0, padded_cols * sizeof(float));
  alignas(64) int32_t tail[kStrip], tail_meta[kStrip];
  alignas(64) float scale[kStrip];
  alignas(64) float x_row[Dot ? kPairTableFloats : 1];
  SparseGemvChunk c;
  c.ldx = kSparseValueRows;
  c.ldw = kStrip;
  c.ldm = kStrip;
  c.words = 1;
  c.scale = scale;
  // The prefetch cursor: the same walk over (values row, column), kStreamPrefetchWords ahead.
  int64_t ahead_row = kStreamPrefetchWords / cols, ahead_col = kStreamPrefetchWords % cols;
  vu bad = {};
  for (int64_t r = 0; r < value_rows; ++r) {
    const int64_t g = r / group_words;
    c.first = r % group_words == 0;
    c.last = r % group_words == group_words - 1;
    c.phase = int(r % R);
    if (Dot) {
      load_sparse_x<Dot>(a, m0, 1, r, 1, x_row, kPairTableFloats);
      c.x = x_row;
    } else {
      c.x = a.x + m0 * a.k + kSparseValueRows * r;
    }
    if (kHasZeros<F> && c.first)
      for (int64_t nb = 0; nb < cols; nb += kStrip)
        copy_halves(zeros + nb, a.zeros + g * a.n + n0 + nb, cols - nb < kStrip ? cols - nb : kStrip, kStrip);
    const int32_t* row = a.packed + r * a.n + n0;
    const int32_t* meta = a.metadata + (r / R) * a.n + n0;
    for (int64_t nb = 0; nb < cols; nb += kStrip) {
      const int64_t left = cols - nb < kStrip ? cols - nb : kStrip;
      if (ahead_row < value_rows) {
        const int64_t o = ahead_row * a.n + n0 + ahead_col;
        for (int l = 0; l < kStrip; l += 16) __builtin_prefetch(a.packed + o + l);
        if (ahead_row % R == 0)
          for (int l = 0; l < kStrip; l += 16)
            __builtin_prefetch(a.metadata + (ahead_row / R) * a.n + n0 + ahead_col + l);
        ahead_col += kStrip;
        if (ahead_col >= cols) {
          ahead_col -= cols;
          ++ahead_row;
        }
      }
      c.w = row + nb;
      c.meta = meta + nb;
      if (left < kStrip) {
        copy_words(tail, row + nb, left, kStrip);
        copy_metadata(tail_meta, meta + nb, left, kStrip, Meta::kFill);
        c.w = tail;
        c.meta = tail_meta;
      }
      // The scale buffer is one strip wide: affine decodes every word with it (group_weight),
      // the other formats apply it once per group.
      if (c.last || (kZerosAreBias<F> && !Dot)) copy_halves(scale, a.scales + g * a.n + n0 + nb, left, kStrip);
      c.zero = zeros + nb;
      c.part = part + nb;
      c.xpart = xpart + nb;
      c.acc = acc + nb;
      bad |= sparse_gemv_block<Meta, F, 1, Dot>(c, kStrip);
    }
  }
  memcpy(a.out + m0 * a.n + n0, acc, cols * sizeof(float));
  delete[] sums;
  return bad;
}

// ---------------------------------------------------------------------------
// Dense tiles for the GEMM and dequantize

// All-ones lanes where p == c (p in 0..3).
inline vi equals(vi p, int c) {
#if MARLIN_KERNEL_AVX2 || MARLIN_KERNEL_AVX512
  return (vi)(p == c);
#else
  return ((p ^ c) - 1) >> 31;  // compares become scalar code without AVX
#endif
}
inline vf keep_if(vf v, vi mask) { return (vf)((vi)v & mask); }

// Rows [k0, k0 + rows) (whole values rows) x columns [nb, nb + 64) of B into
// a tile with row stride 64, pruned weights +0. Scaled: fp32 B. Unscaled
// (Pairs): the codes' values as bf16 pairs of K rows (2q, 2q + 1) in tile row
// q - 64 fp32-sized pairs per row, the layout of the dense gemm_tile_dot.
template <int F, bool Pairs>
vu sparse_dequant_tile(const Sparse24Args& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(64) int32_t words[kTileCols], metas[kTileCols];
  alignas(64) float scale[kTileCols], zero[kTileCols];
  int64_t group = -1;
  vu bad = {};
  for (int64_t r = k0 / kSparseValueRows; r < (k0 + rows) / kSparseValueRows; ++r) {
    const int64_t g = r * kSparseValueRows / a.group_rows;
    if (!Pairs && g != group) {  // groups span whole values words
      group = g;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + nb, cols, kTileCols);
    }
    const int32_t* src = a.packed + r * a.n + nb;
    const int32_t* msrc = a.metadata + (r >> 1) * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      copy_metadata(metas, msrc, cols, kTileCols, kFillMetadata);
      src = words;
      msrc = metas;
    }
    const int64_t row0 = r * kSparseValueRows - k0;
    for (int q = 0; q < kTileCols / kLanes; ++q) {
      const vi w = prepare_words<F>(load(src + kLanes * q));
      vi m = load(msrc + kLanes * q);
      if (!(r & 1)) bad |= metadata_invalid(m);
      m = (vi)((vu)m >> (16 * (r & 1)));
      const vf s = Pairs ? vf{} : load(scale + kLanes * q);
      const vf z = kHasZeros<F> && !Pairs ? load(zero + kLanes * q) : vf{};
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        vf v0 = decode_nibble<F>(w, b), v1 = decode_nibble<F>(w, b + 4);
        if (!Pairs) {
          v0 = group_weight<F>(v0, s, z);
          v1 = group_weight<F>(v1, s, z);
        }
        const vi p0 = (m >> (4 * b)) & 3, p1 = (m >> (4 * b + 2)) & 3;
        // pos0 < pos1: row 0 can only be pos0, row 3 only pos1.
        const vf d0 = keep_if(v0, equals(p0, 0));
        const vf d1 = (vf)((vi)keep_if(v0, equals(p0, 1)) | (vi)keep_if(v1, equals(p1, 1)));
        const vf d2 = (vf)((vi)keep_if(v0, equals(p0, 2)) | (vi)keep_if(v1, equals(p1, 2)));
        const vf d3 = keep_if(v1, equals(p1, 3));
        if (Pairs) {  // code values are exact in bf16: their top halves
          float* d = tile + (row0 + 4 * b) / 2 * kTileCols + kLanes * q;
          store(d, (vf)(((vu)d0 >> 16) | ((vu)d1 & 0xFFFF0000u)));
          store(d + kTileCols, (vf)(((vu)d2 >> 16) | ((vu)d3 & 0xFFFF0000u)));
        } else {
          float* d = tile + (row0 + 4 * b) * kTileCols + kLanes * q;
          store(d, d0);
          store(d + kTileCols, d1);
          store(d + 2 * kTileCols, d2);
          store(d + 3 * kTileCols, d3);
        }
      }
    }
  }
  return bad;
}

// The dense GEMM loops (gemm_tiles / gemm_tiles_dot) on 2:4 tiles. bf16 x
// takes the pair path for fp4 and int4; uint4's zero point needs the kept
// x's sums per column, so it takes the fp32 path (the op passes x in both).
template <int F>
vu sparse_gemm_tile_impl(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  vu bad = {};
#if MARLIN_SPARSE24_DOT
  if (!kHasZeros<F> && a.x_bf16) {
    gemm_tiles_dot<F>(a, m0, m1, nb, scratch, [&](int64_t k0, int64_t rows, float* tile) {
      bad |= sparse_dequant_tile<F, true>(a, k0, rows, nb, tile);
    });
    return bad;
  }
#endif
  gemm_tiles(a, m0, m1, nb, scratch, [&](int64_t k0, int64_t rows, float* tile) {
    bad |= sparse_dequant_tile<F, false>(a, k0, rows, nb, tile);
  });
  return bad;
}

template <int F>
vu sparse_gemv_format(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  vu bad = {};
  for (int64_t m = m0; m < m1; m += kMaxRows) {
    const int64_t e = m1 - m < kMaxRows ? m1 : m + kMaxRows;
    const bool stream = kGemvStream && e - m == 1 && n1 - n0 >= kStreamMinCols;
    if constexpr (kSparseDot) {  // the Dot variants exist only in the builds that run them
      if (a.x_bf16) {
        bad |= stream ? sparse_gemv_stream<NibbleMetadata, F, true>(a, m, n0, n1)
                      : sparse_gemv_impl<NibbleMetadata, F, true>(a, m, e, n0, n1);
        continue;
      }
    }
    bad |= stream ? sparse_gemv_stream<NibbleMetadata, F, false>(a, m, n0, n1)
                  : sparse_gemv_impl<NibbleMetadata, F, false>(a, m, e, n0, n1);
  }
  return bad;
}

uint32_t sparse24_gemv(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  return with_format(a.format, [&]<int F>() { return any_lane(sparse_gemv_format<F>(a, m0, m1, n0, n1)); });
}

uint32_t sparse24_gemm_tile(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  return with_format(a.format, [&]<int F>() { return any_lane(sparse_gemm_tile_impl<F>(a, m0, m1, nb, scratch)); });
}

uint32_t sparse24_dequantize_rows(const Sparse24Args& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  return with_format(a.format,
                     [&]<int F>() { return any_lane(sparse_dequant_tile<F, false>(a, k0, k1 - k0, nb, tile)); });
}

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
