// The dense layout's GEMV kernels (few rows of x), part of one kernel build
// (see cpu/cpu_vec.h); the 2:4 GEMV reuses its panels and value decode.
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/format_decode.h"
#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

constexpr int kStrip = int(kGemvBlockCols);  // gemv: columns whose accumulators stay in L1
constexpr int kChunkWords = 16;              // gemv: word rows decoded per pass (128 K values)
constexpr int kPanelStrips = 8;              // gemv: strips per panel (see gemv_impl)
constexpr int kMaxRows = int(kGemvMaxRows);

// GEMV (few rows): every weight word is decoded once in registers and
// multiplied into MR rows at once; nothing is dequantized to memory.
// Per group: part = sum_k x_k * v_k; acc += s * part (uint4: s * (part - z * sum_k x_k)).
// Dot = true: bf16 x and pair dot products, 4 steps per word instead of 8.

struct GemvChunk {
  const float* x;    // x[m, ...]: the chunk's K range of the block's first row
                     // (fp32, or bf16 pairs read as 32-bit units when Dot)
  int64_t ldx;       // row stride of x, in 32-bit units
  const int32_t* w;  // word row r0, first column of the strip
  int64_t ldw;       // word row stride (N, or kStrip for a padded copy)
  int words;         // word rows in this chunk
  bool first, last;  // chunk starts / ends its group
  const float* xsum; // xsum[m, g] (uint4)
  int64_t ldxsum;    // = groups
  const float* scale;
  const float* zero;
  float* part;       // [rows, kStrip]: group partial sums between chunks
  float* acc;        // [rows, kStrip]
};

// A loaded word vector, split into what its 8 nibbles share. AVX2 fp4 uses
// vpshufb, a 16-entry byte table per 128-bit lane (FormatDecode<F>::kByteTable,
// for formats whose doubled values are small integers): a = even nibbles, b =
// odd nibbles, each byte 2 * value(code) as int8 (exact; -0 becomes +0, which
// a sum cannot tell apart). The other paths keep the word for decode_nibble.
struct GemvWords {
  vi a, b;
};

template <int F, bool Dot>
inline GemvWords gemv_prepare(vi w) {
#if MARLIN_KERNEL_AVX2
  if constexpr (FormatDecode<F>::kByteTable) {
    typedef char v32c __attribute__((vector_size(32)));
#define MARLIN_B(i) char(2 * code_value<F>(i))
    const v32c twice_values = {MARLIN_CODES(MARLIN_B), MARLIN_CODES(MARLIN_B)};
#undef MARLIN_B
    const vi low = w & 0x0F0F0F0F, high = (vi)((vu)w >> 4) & 0x0F0F0F0F;
    return {(vi)__builtin_ia32_pshufb256(twice_values, (v32c)low),
            (vi)__builtin_ia32_pshufb256(twice_values, (v32c)high)};
  }
#endif
  return {prepare_words<F>(w), vi{}};
}

// Step j's weight vector: nibble j's value (for the byte table path twice
// the weight, and gemv_micro halves the group sum once instead), or pair j.
template <int F, bool Dot>
inline vf gemv_value(const GemvWords& p, int j) {
#if MARLIN_KERNEL_BF16_DOT
  if (Dot) return decode_pair<F>(p.a, j);
#endif
  if (FormatDecode<F>::kByteTable) {
    const vi bytes = (j & 1) ? p.b : p.a;
    return __builtin_convertvector((bytes << (24 - 8 * (j >> 1))) >> 24, vf);
  }
  return decode_nibble<F>(p.a, j);
}

template <bool Dot>
inline vf gemv_madd(vf xs, vf b, vf p) {
#if MARLIN_KERNEL_BF16_DOT
  if (Dot) return dot_pairs(p, b, xs);
#endif
  return fmadd(xs, b, p);
}

// Rows [0, MR) of the block, columns [col, col + kLanes * NV) of the strip.
template <int F, int MR, int NV, bool Dot>
inline void gemv_micro(const GemvChunk& c, int col) {
  constexpr int steps = Dot ? 4 : 8;  // products per word per row
  vf p[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) p[i][v] = c.first ? vf{} : load(c.part + i * kStrip + col + kLanes * v);
  for (int r = 0; r < c.words; ++r) {
    GemvWords w[NV];
    for (int v = 0; v < NV; ++v) w[v] = gemv_prepare<F, Dot>(load(c.w + r * c.ldw + col + kLanes * v));
    const float* x = c.x + steps * r;
#pragma GCC unroll 8
    for (int j = 0; j < steps; ++j) {
      vf b[NV];
      for (int v = 0; v < NV; ++v) b[v] = gemv_value<F, Dot>(w[v], j);
      for (int i = 0; i < MR; ++i) {
        const vf xs = splat(x[i * c.ldx + j]);
        for (int v = 0; v < NV; ++v) p[i][v] = gemv_madd<Dot>(xs, b[v], p[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) {
      const int o = i * kStrip + col + kLanes * v;
      if (!c.last) {
        store(c.part + o, p[i][v]);
        continue;
      }
      vf sum = p[i][v];
      if (FormatDecode<F>::kByteTable && !Dot) sum *= 0.5f;
      const vf xsum = kHasZeros<F> ? splat(c.xsum[i * c.ldxsum]) : vf{};
      const vf zero = kHasZeros<F> ? load(c.zero + col + kLanes * v) : vf{};
      store(c.acc + o, group_dot<F>(load(c.acc + o), sum, xsum, load(c.scale + col + kLanes * v), zero));
    }
  }
}

// Register blocks: few rows take wider column blocks so enough independent
// chains are in flight. AVX2: 6 rows x 16 columns fill 12 of 16 registers.
// The generic build has half the vector width (two registers per vf): half
// the blocks. AVX-512 has 32 registers of 16 lanes.
template <bool Dot>
constexpr int kGemvBlockRows = MARLIN_KERNEL_AVX512 ? 8 : MARLIN_KERNEL_AVX2 ? 6 : 4;
template <int MR, bool Dot>
constexpr int kGemvBlockVectors = MARLIN_KERNEL_AVX512 ? (MR <= 3 ? 4 : 2)
                                  : MARLIN_KERNEL_AVX2 ? (MR <= 2 ? 4 : 2)
                                                       : (MR <= 2 ? 2 : 1);

// All `cols` (padded to vectors) of the strip for MR rows.
template <int F, int MR, bool Dot>
inline void gemv_block(const GemvChunk& c, int cols) {
  constexpr int NV = kGemvBlockVectors<MR, Dot>;
  for (int col = 0; col < cols; col += kLanes * NV) gemv_micro<F, MR, NV, Dot>(c, col);
}

template <int F, bool Dot>
void gemv_rows(GemvChunk c, int rows, int cols) {
  constexpr int block_rows = kGemvBlockRows<Dot>;
  for (int i = 0; i < rows;) {
    const int mr = even_rows(rows - i, block_rows);  // (8 rows = 4 + 4, not 6 + 2)
    switch (mr) {
      case 1: gemv_block<F, 1, Dot>(c, cols); break;
      case 2: gemv_block<F, 2, Dot>(c, cols); break;
      case 3: gemv_block<F, 3, Dot>(c, cols); break;
      case 4: gemv_block<F, 4, Dot>(c, cols); break;
      case 5: gemv_block<F, 5, Dot>(c, cols); break;
#if MARLIN_KERNEL_AVX512
      case 6: gemv_block<F, 6, Dot>(c, cols); break;
      case 7: gemv_block<F, 7, Dot>(c, cols); break;
      default: gemv_block<F, 8, Dot>(c, cols); break;
#else
      default: gemv_block<F, 6, Dot>(c, cols); break;
#endif
    }
    c.x += mr * c.ldx;
    c.xsum += mr * c.ldxsum;
    c.part += mr * kStrip;
    c.acc += mr * kStrip;
    i += mr;
  }
}

// Column panels of the GEMVs (dense gemv_impl and the 2:4 one): per strip s
// of a panel, its scales/zeros at s * kStrip and its rows' sums at
// s * kMaxRows * kStrip of the panel's buffers.
struct PanelBuffers {
  float *scale, *zero, *part, *acc;
};
template <class Chunk>
inline void use_strip(Chunk& c, const PanelBuffers& p, int s) {
  c.scale = p.scale + s * kStrip;
  c.zero = p.zero + s * kStrip;
  c.part = p.part + s * kMaxRows * kStrip;
  c.acc = p.acc + s * kMaxRows * kStrip;
}
// Scales (and uint4 zeros) of group g for the strips of panel [pb, n1).
template <int F>
inline void load_panel_group(const GemmArgs& a, int64_t g, int64_t pb, int64_t n1, int strips, const PanelBuffers& p) {
  for (int s = 0; s < strips; ++s) {
    const int64_t nb = pb + s * kStrip, cols = n1 - nb < kStrip ? n1 - nb : kStrip;
    copy_halves(p.scale + s * kStrip, a.scales + g * a.n + nb, cols, kStrip);
    if (kHasZeros<F>) copy_halves(p.zero + s * kStrip, a.zeros + g * a.n + nb, cols, kStrip);
  }
}
// The panel's sums of rows m0 .. m0 + rows into out.
inline void store_panel(const GemmArgs& a, int64_t m0, int rows, int64_t pb, int64_t n1, int strips, const float* acc) {
  for (int s = 0; s < strips; ++s) {
    const int64_t nb = pb + s * kStrip, cols = n1 - nb < kStrip ? n1 - nb : kStrip;
    for (int i = 0; i < rows; ++i)
      memcpy(a.out + (m0 + i) * a.n + nb, acc + (s * kMaxRows + i) * kStrip, cols * sizeof(float));
  }
}

// out[m0:m1, n0:n1] for m1 - m0 <= kMaxRows, one panel of kPanelStrips
// strips at a time: per chunk of K, every strip of the panel, so that each
// word row is read as kPanelStrips * 256 contiguous bytes (one TLB entry and
// a prefetchable stream instead of 256 bytes per page when N is large).
template <int F, bool Dot>
void gemv_impl(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  constexpr int x_per_word = Dot ? 4 : 8;  // 32-bit units of x per word row
  constexpr int kPanel = kPanelStrips * kStrip;
  const int rows = int(m1 - m0);
  const int64_t group_words = a.group_rows / 8;  // groups span whole words
  // Per strip s: acc/part [s][kMaxRows][kStrip] (a strip's rows contiguous).
  alignas(64) float acc[kPanelStrips * kMaxRows * kStrip], part[kPanelStrips * kMaxRows * kStrip];
  alignas(64) float scale[kPanel], zero[kPanel];
  const PanelBuffers panel{scale, zero, part, acc};
  // x and the weights are copied into these when re-read: rows of x (stride K)
  // and word rows (stride N) a power of two apart would share L1 sets.
  alignas(64) int32_t padded[kChunkWords * kStrip];
  alignas(64) float xbuf[kMaxRows * kChunkWords * x_per_word];
  for (int64_t pb = n0; pb < n1; pb += kPanel) {
    const int64_t panel_cols = n1 - pb < kPanel ? n1 - pb : kPanel;
    const int strips = int((panel_cols + kStrip - 1) / kStrip);
    memset(acc, 0, strips * kMaxRows * kStrip * sizeof(float));
    GemvChunk c;
    c.x = xbuf;
    c.ldx = kChunkWords * x_per_word;
    c.ldxsum = a.groups;
    for (int64_t g = 0; g < a.groups; ++g) {
      load_panel_group<F>(a, g, pb, n1, strips, panel);
      for (int64_t w0 = 0; w0 < group_words; w0 += kChunkWords) {
        const int64_t r0 = g * group_words + w0;
        c.words = int(group_words - w0 < kChunkWords ? group_words - w0 : kChunkWords);
        c.first = w0 == 0;
        c.last = w0 + c.words == group_words;
        for (int i = 0; i < rows; ++i) {
          if (Dot)
            memcpy(xbuf + i * c.ldx, a.x_bf16 + (m0 + i) * a.k + 8 * r0, c.words * 8 * sizeof(uint16_t));
          else
            memcpy(xbuf + i * c.ldx, a.x + (m0 + i) * a.k + 8 * r0, c.words * 8 * sizeof(float));
        }
        c.xsum = a.xsum ? a.xsum + m0 * a.groups + g : nullptr;
        // Fetch the panel's next chunk early (each word row is its own stream).
        const int64_t next = r0 + c.words;
        for (int64_t r = next; r < next + kChunkWords && r < a.k / 8; ++r)
          for (int64_t l = 0; l < panel_cols; l += 16) __builtin_prefetch(a.packed + r * a.n + pb + l);
        for (int s = 0; s < strips; ++s) {
          const int64_t nb = pb + s * kStrip;
          const int cols = int(n1 - nb < kStrip ? n1 - nb : kStrip);
          use_strip(c, panel, s);
          if (cols == kStrip && rows <= kGemvBlockRows<Dot>) {  // read once: stream from the weight
            c.w = a.packed + r0 * a.n + nb;
            c.ldw = a.n;
          } else {
            for (int r = 0; r < c.words; ++r)
              copy_words(padded + r * kStrip, a.packed + (r0 + r) * a.n + nb, cols, kStrip);
            c.w = padded;
            c.ldw = kStrip;
          }
          gemv_rows<F, Dot>(c, rows, (cols + kLanes - 1) & ~(kLanes - 1));
        }
      }
    }
    store_panel(a, m0, rows, pb, n1, strips, acc);
  }
}

// How far ahead of the read position gemv_stream fetches weights: 16 KiB
// measured best on Zen 5 (8 KiB: up to 9% slower; none: 1.2-1.7x slower from DRAM).
constexpr int kStreamPrefetchWords = 4096;
// Builds that take gemv_stream for one row: measured faster with AVX-512
// and AVX2; the generic build is compute-bound and ran 2-3.4x slower with it
// (part sums through memory), and Arm is unmeasured.
constexpr bool kGemvStream = MARLIN_KERNEL_AVX512 || MARLIN_KERNEL_AVX2;
// ... and only for a range of at least a panel: narrow ranges (moe_gemm's
// 64-column items) gain no long stream and keep the sums in registers.
constexpr int64_t kStreamMinCols = kPanelStrips * kStrip;

// out[m0, n0:n1] for one row of x: the weights are read in memory order,
// each word row across all of n0:n1, so that one thread reads one sequential
// stream (prefetched 16 KiB ahead). From DRAM this ran 1.7-2.2x faster
// than column panels with word rows 4*N bytes apart, whose runs restart
// every few KiB. The per-column group sums live in memory (part, acc), so
// each word is read once and decoded once; sums are taken in the same order
// as gemv_impl (same results, bit for bit).
template <int F, bool Dot>
void gemv_stream(const GemmArgs& a, int64_t m0, int64_t n0, int64_t n1) {
  constexpr int x_per_word = Dot ? 4 : 8;  // 32-bit units of x per word row
  const int64_t cols = n1 - n0, padded_cols = (cols + kStrip - 1) / kStrip * kStrip;
  const int64_t word_rows = a.k / 8, group_words = a.group_rows / 8;
  float* sums = a.scratch ? a.scratch : new float[2 * padded_cols];
  float *part = sums, *acc = sums + padded_cols;
  memset(acc, 0, padded_cols * sizeof(float));
  alignas(64) int32_t tail[kStrip];
  alignas(64) float scale[kStrip], zero[kStrip];
  const float* x = Dot ? (const float*)(a.x_bf16 + m0 * a.k) : a.x + m0 * a.k;
  GemvChunk c;
  c.ldx = x_per_word;
  c.ldxsum = a.groups;
  c.words = 1;
  c.ldw = kStrip;
  c.scale = scale;
  c.zero = zero;
  // The prefetch cursor: the same walk over (word row, column), prefetch_words ahead.
  int64_t ahead_row = kStreamPrefetchWords / cols, ahead_col = kStreamPrefetchWords % cols;
  for (int64_t r = 0; r < word_rows; ++r) {
    const int64_t g = r / group_words;
    c.first = r % group_words == 0;
    c.last = r % group_words == group_words - 1;
    c.x = x + x_per_word * r;
    c.xsum = a.xsum ? a.xsum + m0 * a.groups + g : nullptr;
    const int32_t* row = a.packed + r * a.n + n0;
    for (int64_t nb = 0; nb < cols; nb += kStrip) {
      const int64_t left = cols - nb < kStrip ? cols - nb : kStrip;
      if (ahead_row < word_rows) {
        const char* p = (const char*)(a.packed + ahead_row * a.n + n0 + ahead_col);
        for (int l = 0; l < kStrip * 4; l += 64) __builtin_prefetch(p + l);
        ahead_col += kStrip;
        if (ahead_col >= cols) {
          ahead_col -= cols;
          ++ahead_row;
        }
      }
      c.w = row + nb;
      if (left < kStrip) {
        copy_words(tail, row + nb, left, kStrip);
        c.w = tail;
      }
      if (c.last) {
        copy_halves(scale, a.scales + g * a.n + n0 + nb, left, kStrip);
        if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + n0 + nb, left, kStrip);
      }
      c.part = part + nb;
      c.acc = acc + nb;
      gemv_block<F, 1, Dot>(c, kStrip);
    }
  }
  memcpy(a.out + m0 * a.n + n0, acc, cols * sizeof(float));
  if (!a.scratch) delete[] sums;
}

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
