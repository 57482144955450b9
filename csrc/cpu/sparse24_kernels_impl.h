// CPU kernels of the 2:4 sparse layout (docs/FORMAT.md), written once and
// compiled into every per-ISA unit: kernels_<isa>.cpp includes this file
// right after cpu/kernels_impl.h, in the same (anonymous) namespace, so the
// vector types, value decoders and copies of the dense kernels are reused.
//
// Layout recap: values word [r, n] holds the 8 kept codes of K rows
// 16r..16r+15: nibble j is kept weight j / 4 of block j % 4; metadata word
// [r / 2, n] holds 8 nibbles pos0 | pos1 << 2, half r % 2 of it (16 bits) the
// 4 blocks of values row r, so nibble j's position inside its block is bits
// 4 (j % 4) + 2 (j / 4) .. + 1 of that half.
//
// GEMV: the weight is never expanded. Each slot's value is multiplied by the
// x it belongs to, gathered per lane (column) from the block's 4 x values:
// half the multiplies of the dense GEMV and a quarter less data.
// GEMM: cache-sized dense fp32 tiles (zeros at pruned positions), then the
// dense micro-kernel. Both check every metadata word they decode and return
// nonzero if one holds an invalid pattern.
#include "cpu/sparse24_kernel_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_KERNEL_NS {
namespace {

// Written for 8-lane vectors: the avx2 and generic builds (sparse24_ops.cpp
// runs these for every x86 build and for the others respectively).
static_assert(MARLIN_VECTOR_BYTES == 32, "the 2:4 kernels are compiled into the 32-byte-vector builds only");
typedef vf v8f;
typedef vi v8i;
typedef vu v8u;
inline v8f load8(const float* p) { return load(p); }
inline v8i load8(const int32_t* p) { return load(p); }
inline void store8(float* p, v8f v) { store(p, v); }

constexpr int kSparseChunkWords = 8;          // gemv: values rows per pass (128 K rows)
constexpr int32_t kFillMetadata = 0x44444444;  // (0, 1) in every block: pads tail columns

inline void copy_metadata(int32_t* dst, const int32_t* src, int64_t count, int width, int32_t fill) {
  memcpy(dst, src, count * sizeof(int32_t));
  for (int64_t i = count; i < width; ++i) dst[i] = fill;
}

// Nonzero lanes: a nibble of the metadata word is not pos0 < pos1.
inline v8u metadata_invalid(v8i m) {
  const v8u a = (v8u)m & 0x33333333u, b = ((v8u)m >> 2) & 0x33333333u;
  // Per nibble 4 + pos1 - pos0 - 1, in 0..6, so no borrows: bit 2 set iff pos1 > pos0.
  return ~((b | 0x44444444u) - a - 0x11111111u) & 0x44444444u;
}

inline uint32_t any_lane(v8u v) {
  uint32_t r = 0;
  for (int i = 0; i < 8; ++i) r |= v[i];
  return r;
}

// x gathered by position: lane l takes xb[idx_l & 3] of a block's 4 x values.
// AVX2: vpermilps on the 4 values broadcast to both 128-bit halves reads
// only index bits 0..1, so metadata shifted right by 2s is the index as it
// is. Portable build: two bit selects on masks made once per slot.
#if MARLIN_KERNEL_AVX2
typedef float v4f __attribute__((vector_size(16)));
struct SlotIndex {
  v8i idx;
};
inline SlotIndex slot_index(v8i shifted) { return {shifted}; }
typedef v8f XBlock;
inline XBlock load_block(const float* x4) {
  v4f q;
  memcpy(&q, x4, sizeof(q));
  return __builtin_shufflevector(q, q, 0, 1, 2, 3, 0, 1, 2, 3);
}
inline v8f gather(const XBlock& xb, const SlotIndex& s) { return __builtin_ia32_vpermilvarps256(xb, s.idx); }
#else
struct SlotIndex {
  v8i odd, high;  // all-ones lanes where the position is odd / >= 2
};
inline SlotIndex slot_index(v8i shifted) { return {(shifted << 31) >> 31, (shifted << 30) >> 31}; }
struct XBlock {
  v8i x[4];
};
inline XBlock load_block(const float* x4) {
  return {{(v8i)splat(x4[0]), (v8i)splat(x4[1]), (v8i)splat(x4[2]), (v8i)splat(x4[3])}};
}
inline v8f gather(const XBlock& xb, const SlotIndex& s) {
  const v8i lo = (xb.x[1] & s.odd) | (xb.x[0] & ~s.odd), hi = (xb.x[3] & s.odd) | (xb.x[2] & ~s.odd);
  return (v8f)((hi & s.high) | (lo & ~s.high));
}
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
  static inline v8i positions(v8i m, int part, v8u& bad) {
    if (part == 0) bad |= metadata_invalid(m);
    return (v8i)((v8u)m >> (16 * part));
  }
};

// ---------------------------------------------------------------------------
// GEMV

struct SparseGemvChunk {
  const float* x;        // the chunk's 16 * words K values of the block's first row
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
  float* acc;            // [rows, kStrip]
};

// Rows [0, MR) of the block, columns [col, col + 8 * NV) of the strip.
template <class Meta, int F, int MR, int NV>
inline v8u sparse_gemv_micro(const SparseGemvChunk& c, int col) {
  v8f p[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) p[i][v] = c.first ? v8f{} : load8(c.part + i * kStrip + col + 8 * v);
  v8u bad = {};
  for (int r = 0; r < c.words; ++r) {
    const int h = c.phase + r;
    GemvWords w[NV];
    v8i meta[NV];
    v8f zero[NV];
    for (int v = 0; v < NV; ++v) {
      w[v] = gemv_prepare<F, false>(load8(c.w + r * c.ldw + col + 8 * v));
      const v8i m = load8(c.meta + (h / Meta::kRowsPerWord) * c.ldm + col + 8 * v);
      meta[v] = Meta::positions(m, h % Meta::kRowsPerWord, bad);
      zero[v] = F == kFormatUint4 ? load8(c.zero + col + 8 * v) : v8f{};
    }
    const float* x = c.x + kSparseValueRows * r;
#pragma GCC unroll 8
    for (int s = 0; s < 8; ++s) {
      v8f b[NV];
      SlotIndex idx[NV];
      for (int v = 0; v < NV; ++v) {
        b[v] = gemv_value<F, false>(w[v], s);
        if (F == kFormatUint4) b[v] -= zero[v];  // q - zero: a pruned weight is 0, not -zero
        idx[v] = slot_index((v8i)((v8u)meta[v] >> (4 * (s & 3) + 2 * (s >> 2))));
      }
      for (int i = 0; i < MR; ++i) {
        const XBlock xb = load_block(x + i * c.ldx + 4 * (s & 3));
        for (int v = 0; v < NV; ++v) p[i][v] = fmadd(gather(xb, idx[v]), b[v], p[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) {
      const int o = i * kStrip + col + 8 * v;
      if (!c.last) {
        store8(c.part + o, p[i][v]);
        continue;
      }
      v8f sum = p[i][v];
      if (F == kFormatFp4 && kGemvByteTable) sum *= 0.5f;
      store8(c.acc + o, fmadd(load8(c.scale + col + 8 * v), sum, load8(c.acc + o)));
    }
  }
  return bad;
}

// Register blocks: accumulators, values, indices and x of MR x NV fit the
// 16 AVX2 registers; at least 4 independent accumulators per slot cover the
// FMA latency (the portable build has two registers per vector).
constexpr int kSparseGemvBlockRows = MARLIN_KERNEL_AVX2 ? 6 : 4;
template <int MR>
constexpr int kSparseGemvVectors = MARLIN_KERNEL_AVX2 ? (MR <= 4 ? 2 : 1) : (MR <= 2 ? 2 : 1);

template <class Meta, int F, int MR>
inline v8u sparse_gemv_block(const SparseGemvChunk& c, int cols) {
  constexpr int NV = kSparseGemvVectors<MR>;
  v8u bad = {};
  for (int col = 0; col < cols; col += 8 * NV) bad |= sparse_gemv_micro<Meta, F, MR, NV>(c, col);
  return bad;
}

template <class Meta, int F>
v8u sparse_gemv_rows(SparseGemvChunk c, int rows, int cols) {
  v8u bad = {};
  for (int i = 0; i < rows;) {
    const int left = rows - i, blocks = (left + kSparseGemvBlockRows - 1) / kSparseGemvBlockRows;
    const int mr = (left + blocks - 1) / blocks;  // balanced blocks
    switch (mr) {
      case 1: bad |= sparse_gemv_block<Meta, F, 1>(c, cols); break;
      case 2: bad |= sparse_gemv_block<Meta, F, 2>(c, cols); break;
      case 3: bad |= sparse_gemv_block<Meta, F, 3>(c, cols); break;
      case 4: bad |= sparse_gemv_block<Meta, F, 4>(c, cols); break;
      case 5: bad |= sparse_gemv_block<Meta, F, 5>(c, cols); break;
      default: bad |= sparse_gemv_block<Meta, F, 6>(c, cols); break;
    }
    c.x += mr * c.ldx;
    c.part += mr * kStrip;
    c.acc += mr * kStrip;
    i += mr;
  }
  return bad;
}

// out[m0:m1, n0:n1] for m1 - m0 <= kMaxRows, one panel of kPanelStrips
// strips at a time, as the dense gemv_impl: per chunk of K every strip of the
// panel, so each values row is read as a run of kPanelStrips * 256 bytes.
template <class Meta, int F>
v8u sparse_gemv_impl(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  constexpr int R = Meta::kRowsPerWord;
  constexpr int kPanel = kPanelStrips * kStrip;
  const int rows = int(m1 - m0);
  const int64_t group_words = a.group_rows / kSparseValueRows;  // values rows per group (g16: one)
  const int64_t value_rows = a.k / kSparseValueRows;
  // Per strip s: acc/part [s][kMaxRows][kStrip] (a strip's rows contiguous).
  alignas(64) float acc[kPanelStrips * kMaxRows * kStrip], part[kPanelStrips * kMaxRows * kStrip];
  alignas(64) float scale[kPanel], zero[kPanel];
  const PanelBuffers panel{scale, zero, part, acc};
  // Padded copies for tail strips and re-read weights (as the dense gemv).
  alignas(64) int32_t padded[kSparseChunkWords * kStrip];
  alignas(64) int32_t padded_meta[(kSparseChunkWords / R + 2) * kStrip];
  alignas(64) float xbuf[kMaxRows * kSparseChunkWords * kSparseValueRows];
  v8u bad = {};
  for (int64_t pb = n0; pb < n1; pb += kPanel) {
    const int64_t panel_cols = n1 - pb < kPanel ? n1 - pb : kPanel;
    const int strips = int((panel_cols + kStrip - 1) / kStrip);
    memset(acc, 0, strips * kMaxRows * kStrip * sizeof(float));
    SparseGemvChunk c;
    c.x = xbuf;
    c.ldx = kSparseChunkWords * kSparseValueRows;
    for (int64_t g = 0; g < a.groups; ++g) {
      load_panel_group<F>(a, g, pb, n1, strips, panel);
      for (int64_t w0 = 0; w0 < group_words; w0 += kSparseChunkWords) {
        const int64_t r0 = g * group_words + w0;
        c.words = int(group_words - w0 < kSparseChunkWords ? group_words - w0 : kSparseChunkWords);
        c.first = w0 == 0;
        c.last = w0 + c.words == group_words;
        c.phase = int(r0 % R);
        const int64_t meta0 = r0 / R, meta_rows = (r0 + c.words - 1) / R - meta0 + 1;
        for (int i = 0; i < rows; ++i)
          memcpy(xbuf + i * c.ldx, a.x + (m0 + i) * a.k + kSparseValueRows * r0,
                 c.words * kSparseValueRows * sizeof(float));
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
          bad |= sparse_gemv_rows<Meta, F>(c, rows, (cols + 7) & ~7);
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
template <class Meta, int F>
v8u sparse_gemv_stream(const Sparse24Args& a, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int R = Meta::kRowsPerWord;
  const int64_t cols = n1 - n0, padded_cols = (cols + kStrip - 1) / kStrip * kStrip;
  const int64_t value_rows = a.k / kSparseValueRows, group_words = a.group_rows / kSparseValueRows;
  // Per column: group partial sums, output sums and (uint4) the group's zeros,
  // which every values row subtracts (a pruned weight is 0, not -zero).
  float* sums = new float[3 * padded_cols];
  float *part = sums, *acc = sums + padded_cols, *zeros = sums + 2 * padded_cols;
  memset(acc, 0, padded_cols * sizeof(float));
  alignas(64) int32_t tail[kStrip], tail_meta[kStrip];
  alignas(32) float scale[kStrip];
  SparseGemvChunk c;
  c.ldx = kSparseValueRows;
  c.ldw = kStrip;
  c.ldm = kStrip;
  c.words = 1;
  c.scale = scale;
  // The prefetch cursor: the same walk over (values row, column), kStreamPrefetchWords ahead.
  int64_t ahead_row = kStreamPrefetchWords / cols, ahead_col = kStreamPrefetchWords % cols;
  v8u bad = {};
  for (int64_t r = 0; r < value_rows; ++r) {
    const int64_t g = r / group_words;
    c.first = r % group_words == 0;
    c.last = r % group_words == group_words - 1;
    c.phase = int(r % R);
    c.x = a.x + m0 * a.k + kSparseValueRows * r;
    if (F == kFormatUint4 && c.first)
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
      if (c.last) copy_halves(scale, a.scales + g * a.n + n0 + nb, left, kStrip);
      c.zero = zeros + nb;
      c.part = part + nb;
      c.acc = acc + nb;
      bad |= sparse_gemv_block<Meta, F, 1>(c, kStrip);
    }
  }
  memcpy(a.out + m0 * a.n + n0, acc, cols * sizeof(float));
  delete[] sums;
  return bad;
}

// ---------------------------------------------------------------------------
// Dense tiles for the GEMM and dequantize

// All-ones lanes where p == c (p in 0..3).
inline v8i equals(v8i p, int c) {
#if MARLIN_KERNEL_AVX2
  return (v8i)(p == c);
#else
  return ((p ^ c) - 1) >> 31;  // compares become scalar code without AVX
#endif
}
inline v8f keep_if(v8f v, v8i mask) { return (v8f)((v8i)v & mask); }

// Rows [k0, k0 + rows) (whole metadata words) x columns [nb, nb + 64) of B
// into an fp32 tile with row stride 64; pruned weights are +0.
template <int F>
v8u sparse_dequant_tile(const Sparse24Args& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(32) int32_t words[kTileCols], metas[kTileCols];
  alignas(32) float scale[kTileCols], zero[kTileCols];
  int64_t group = -1;
  v8u bad = {};
  for (int64_t r = k0 / kSparseValueRows; r < (k0 + rows) / kSparseValueRows; ++r) {
    const int64_t g = r * kSparseValueRows / a.group_rows;
    if (g != group) {  // groups span whole values words
      group = g;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      if (F == kFormatUint4) copy_halves(zero, a.zeros + g * a.n + nb, cols, kTileCols);
    }
    const int32_t* src = a.packed + r * a.n + nb;
    const int32_t* msrc = a.metadata + (r >> 1) * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      copy_metadata(metas, msrc, cols, kTileCols, kFillMetadata);
      src = words;
      msrc = metas;
    }
    float* dst = tile + (r * kSparseValueRows - k0) * kTileCols;
    for (int q = 0; q < kTileCols / 8; ++q) {
      const v8i w = prepare_words<F>(load8(src + 8 * q));
      v8i m = load8(msrc + 8 * q);
      if (!(r & 1)) bad |= metadata_invalid(m);
      m = (v8i)((v8u)m >> (16 * (r & 1)));
      const v8f s = load8(scale + 8 * q);
      const v8f z = F == kFormatUint4 ? load8(zero + 8 * q) : v8f{};
#pragma GCC unroll 4
      for (int b = 0; b < 4; ++b) {
        v8f v0 = decode_nibble<F>(w, b), v1 = decode_nibble<F>(w, b + 4);
        v0 = F == kFormatUint4 ? (v0 - z) * s : v0 * s;
        v1 = F == kFormatUint4 ? (v1 - z) * s : v1 * s;
        const v8i p0 = (m >> (4 * b)) & 3, p1 = (m >> (4 * b + 2)) & 3;
        float* d = dst + 4 * b * kTileCols + 8 * q;
        // pos0 < pos1: row 0 can only be pos0, row 3 only pos1.
        store8(d, keep_if(v0, equals(p0, 0)));
        store8(d + kTileCols, (v8f)((v8i)keep_if(v0, equals(p0, 1)) | (v8i)keep_if(v1, equals(p1, 1))));
        store8(d + 2 * kTileCols, (v8f)((v8i)keep_if(v0, equals(p0, 2)) | (v8i)keep_if(v1, equals(p1, 2))));
        store8(d + 3 * kTileCols, keep_if(v1, equals(p1, 3)));
      }
    }
  }
  return bad;
}

template <int F>
v8u sparse_gemm_tile_impl(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  float* tile = scratch;
  float* acc = scratch + kTileRows * kTileCols;
  v8u bad = {};
  memset(acc, 0, (m1 - m0) * kTileCols * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    bad |= sparse_dequant_tile<F>(a, k0, rows, nb, tile);
    for (int col = 0; col < kTileCols; col += 16) {
      int64_t m = m0;
      for (; m + 6 <= m1; m += 6)
        micro_kernel<6>(a.x + m * a.k + k0, a.k, rows, tile, col, acc + (m - m0) * kTileCols);
      const float* x = a.x + m * a.k + k0;
      float* c = acc + (m - m0) * kTileCols;
      switch (m1 - m) {
        case 5: micro_kernel<5>(x, a.k, rows, tile, col, c); break;
        case 4: micro_kernel<4>(x, a.k, rows, tile, col, c); break;
        case 3: micro_kernel<3>(x, a.k, rows, tile, col, c); break;
        case 2: micro_kernel<2>(x, a.k, rows, tile, col, c); break;
        case 1: micro_kernel<1>(x, a.k, rows, tile, col, c); break;
        default: break;
      }
    }
  }
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  for (int64_t m = m0; m < m1; ++m)
    memcpy(a.out + m * a.n + nb, acc + (m - m0) * kTileCols, cols * sizeof(float));
  return bad;
}

}  // namespace

uint32_t sparse24_gemv(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  v8u bad = {};
  for (int64_t m = m0; m < m1; m += kMaxRows) {
    const int64_t e = m1 - m < kMaxRows ? m1 : m + kMaxRows;
    const bool stream = kGemvStream && e - m == 1 && n1 - n0 >= kStreamMinCols;
    switch (a.format) {
      case kFormatFp4:
        bad |= stream ? sparse_gemv_stream<NibbleMetadata, kFormatFp4>(a, m, n0, n1)
                      : sparse_gemv_impl<NibbleMetadata, kFormatFp4>(a, m, e, n0, n1);
        break;
      case kFormatInt4:
        bad |= stream ? sparse_gemv_stream<NibbleMetadata, kFormatInt4>(a, m, n0, n1)
                      : sparse_gemv_impl<NibbleMetadata, kFormatInt4>(a, m, e, n0, n1);
        break;
      default:
        bad |= stream ? sparse_gemv_stream<NibbleMetadata, kFormatUint4>(a, m, n0, n1)
                      : sparse_gemv_impl<NibbleMetadata, kFormatUint4>(a, m, e, n0, n1);
        break;
    }
  }
  return any_lane(bad);
}

uint32_t sparse24_gemm_tile(const Sparse24Args& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  switch (a.format) {
    case kFormatFp4: return any_lane(sparse_gemm_tile_impl<kFormatFp4>(a, m0, m1, nb, scratch));
    case kFormatInt4: return any_lane(sparse_gemm_tile_impl<kFormatInt4>(a, m0, m1, nb, scratch));
    default: return any_lane(sparse_gemm_tile_impl<kFormatUint4>(a, m0, m1, nb, scratch));
  }
}

uint32_t sparse24_dequantize_rows(const Sparse24Args& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  switch (a.format) {
    case kFormatFp4: return any_lane(sparse_dequant_tile<kFormatFp4>(a, k0, k1 - k0, nb, tile));
    case kFormatInt4: return any_lane(sparse_dequant_tile<kFormatInt4>(a, k0, k1 - k0, nb, tile));
    default: return any_lane(sparse_dequant_tile<kFormatUint4>(a, k0, k1 - k0, nb, tile));
  }
}

}  // namespace MARLIN_KERNEL_NS
}  // namespace cpu
}  // namespace marlin
