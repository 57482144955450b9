// CPU kernels for torch.ops.marlin.* on raw pointers, written once and
// compiled twice (kernels_avx2.cpp with AVX2+FMA+F16C, kernels_generic.cpp
// for any CPU); csrc/cpu/ops.cpp picks one at run time.
//
// Everything here is in an anonymous namespace and includes no C++ library
// headers, so the two ISA builds cannot leak into each other through
// shared inline functions (ODR). GCC/Clang vector extensions give 8-float
// vectors that map to one AVX2 register or two SSE/NEON registers; the
// AVX2 build additionally uses a few x86 builtins (MARLIN_KERNEL_AVX2).
//
// Usage: define MARLIN_KERNEL_NS (and MARLIN_KERNEL_AVX2 for the x86 build),
// then include this file.
#include <stdint.h>
#include <string.h>

#include "cpu/kernel_args.h"

#ifndef MARLIN_KERNEL_AVX2
#define MARLIN_KERNEL_AVX2 0
#endif

namespace marlin {
namespace cpu {
namespace MARLIN_KERNEL_NS {
namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef short v8h __attribute__((vector_size(16)));

constexpr int kStrip = int(kGemvBlockCols);  // gemv: columns whose accumulators stay in L1
constexpr int kChunkWords = 16;              // gemv: word rows decoded per pass (128 K values)
constexpr int kMaxRows = int(kGemvMaxRows);
constexpr int kTileCols = int(kGemmBlockCols);
constexpr int kTileRows = int(kGemmBlockRows);  // a 64 KiB fp32 tile: stays in L2

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // fp16 subnormal: normalize into an fp32 normal
    int shift = 0;
    while (!(mant & 0x400)) {
      mant <<= 1;
      ++shift;
    }
    bits = sign | (uint32_t(113 - shift) << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

inline v8f load8(const float* p) {
  v8f v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline v8i load8(const int32_t* p) {
  v8i v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof(v)); }
inline v8f splat(float f) { return v8f{f, f, f, f, f, f, f, f}; }  // one vbroadcastss

// a * b + c; -std=c++20 turns off FP contraction, so ask for the FMA.
inline v8f fmadd(v8f a, v8f b, v8f c) {
#if MARLIN_KERNEL_AVX2
  return __builtin_ia32_vfmaddps256(a, b, c);
#else
  return a * b + c;
#endif
}

// E2M1 code (0..15) -> fp32 with neither tables nor compares (GCC turns
// vector compares into scalar code without AVX). The magnitude bits e:m,
// placed in the fp32 exponent (rebased by 126) and top mantissa bit, give
// t = 0.5, 0.75, 1, 1.5, ..., 6: right except for codes 0 and 1 (0, 0.5).
// min(t, 2t - 1) fixes exactly those, written as t - relu(1 - t), with
// relu(y) = (y + |y|) / 2; every step is exact. The sign bit is ORed in.
inline v8f decode_fp4(v8i code) {
  const v8f t = (v8f)(((code & 7) << 22) + (126 << 23));
  const v8f y = 1.f - t;
  const v8f magnitude = t - (y + (v8f)((v8i)y & 0x7FFFFFFF)) * 0.5f;
  return (v8f)((v8i)magnitude | ((code & 8) << 28));
}

// Prepares a loaded word vector for decode_nibble: int4 flips each nibble's
// top bit, so that nibble read as a signed 4-bit number is q - 8.
template <int F>
inline v8i prepare_words(v8i w) {
  return F == kFormatInt4 ? w ^ int32_t(0x88888888u) : w;
}

// Value of nibble j (K row 8r + j) of prepared words: fp4 -> e2m1 value,
// int4 -> q - 8 (exact, no zero point needed), uint4 -> q (zero applied later).
template <int F>
inline v8f decode_nibble(v8i w, int j) {
  if (F == kFormatFp4) {
#if MARLIN_KERNEL_AVX2
    // vpermps reads only the low 3 bits of each index: a magnitude table
    // lookup without masking; the sign bit is moved to bit 31.
    const v8f magnitudes = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    const v8f mag = __builtin_ia32_permvarsf256(magnitudes, (v8i)((v8u)w >> (4 * j)));
    return (v8f)((v8i)mag ^ ((w << (28 - 4 * j)) & int32_t(0x80000000u)));
#else
    return decode_fp4((v8i)((v8u)w >> (4 * j)) & 15);
#endif
  } else if (F == kFormatInt4) {
    return __builtin_convertvector((w << (28 - 4 * j)) >> 28, v8f);
  } else {
    return __builtin_convertvector((v8i)((v8u)w >> (4 * j)) & 15, v8f);
  }
}

// Copies `count` (<= width) words/values into a zero-padded local row so
// tails need no separate code path.
inline void copy_words(int32_t* dst, const int32_t* src, int64_t count, int width) {
  memcpy(dst, src, count * sizeof(int32_t));
  memset(dst + count, 0, (width - count) * sizeof(int32_t));
}
inline void copy_halves(float* dst, const uint16_t* src, int64_t count, int width) {
#if MARLIN_KERNEL_AVX2
  if (count == width) {  // F16C: 8 at a time
    for (int i = 0; i < width; i += 8) {
      v8h h;
      memcpy(&h, src + i, sizeof(h));
      store8(dst + i, __builtin_ia32_vcvtph2ps256(h));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) dst[i] = half_to_float(src[i]);
  for (int64_t i = count; i < width; ++i) dst[i] = 0.f;
}

// ---------------------------------------------------------------------------
// GEMV (few rows): every weight word is decoded once in registers and
// multiplied into MR rows at once; nothing is dequantized to memory.
// Per group: part = sum_k x_k * v_k; acc += s * part (uint4: s * (part - z * sum_k x_k)).

struct GemvChunk {
  const float* x;    // x[m, 8 * r0 ...]: the chunk's K range of the block's first row
  int64_t ldx;       // row stride of x
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
// vpshufb, a 16-entry byte table per 128-bit lane: a = even nibbles, b = odd
// nibbles, each byte 2 * e2m1(code) as int8 (exact; -0 becomes +0, which a
// sum cannot tell apart). The other paths keep the word for decode_nibble.
struct GemvWords {
  v8i a, b;
};
constexpr bool kGemvByteTable = MARLIN_KERNEL_AVX2;

template <int F>
inline GemvWords gemv_prepare(v8i w) {
#if MARLIN_KERNEL_AVX2
  if (F == kFormatFp4) {
    typedef char v32c __attribute__((vector_size(32)));
    const v32c twice_e2m1 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,
                             0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const v8i low = w & 0x0F0F0F0F, high = (v8i)((v8u)w >> 4) & 0x0F0F0F0F;
    return {(v8i)__builtin_ia32_pshufb256(twice_e2m1, (v32c)low),
            (v8i)__builtin_ia32_pshufb256(twice_e2m1, (v32c)high)};
  }
#endif
  return {prepare_words<F>(w), v8i{}};
}

// Nibble j's value; for the byte table path it is twice the weight, and
// gemv_micro halves the group sum once instead.
template <int F>
inline v8f gemv_value(const GemvWords& p, int j) {
  if (F == kFormatFp4 && kGemvByteTable) {
    const v8i bytes = (j & 1) ? p.b : p.a;
    return __builtin_convertvector((bytes << (24 - 8 * (j >> 1))) >> 24, v8f);
  }
  return decode_nibble<F>(p.a, j);
}

// Rows [0, MR) of the block, columns [col, col + 8 * NV) of the strip.
template <int F, int MR, int NV>
inline void gemv_micro(const GemvChunk& c, int col) {
  v8f p[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) p[i][v] = c.first ? v8f{} : load8(c.part + i * kStrip + col + 8 * v);
  for (int r = 0; r < c.words; ++r) {
    GemvWords w[NV];
    for (int v = 0; v < NV; ++v) w[v] = gemv_prepare<F>(load8(c.w + r * c.ldw + col + 8 * v));
    const float* x = c.x + 8 * r;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      v8f b[NV];
      for (int v = 0; v < NV; ++v) b[v] = gemv_value<F>(w[v], j);
      for (int i = 0; i < MR; ++i) {
        const v8f xs = splat(x[i * c.ldx + j]);
        for (int v = 0; v < NV; ++v) p[i][v] = fmadd(xs, b[v], p[i][v]);
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
      if (F == kFormatUint4) sum -= load8(c.zero + col + 8 * v) * c.xsum[i * c.ldxsum];
      store8(c.acc + o, fmadd(load8(c.scale + col + 8 * v), sum, load8(c.acc + o)));
    }
  }
}

// All `cols` (padded to vectors) of the strip for MR rows; few rows take
// wider column blocks so enough independent FMA chains are in flight. The
// generic build has half the vector width (two registers per v8f): half the blocks.
template <int F, int MR>
inline void gemv_block(const GemvChunk& c, int cols) {
  constexpr int NV = (MR <= 2 ? 4 : 2) / (MARLIN_KERNEL_AVX2 ? 1 : 2);
  for (int col = 0; col < cols; col += 8 * NV) gemv_micro<F, MR, NV>(c, col);
}

// Rows per register block: 6 x 16 columns fills 12 of AVX2's 16 registers.
template <int F>
constexpr int kGemvBlockRows = MARLIN_KERNEL_AVX2 ? 6 : 4;

template <int F>
void gemv_rows(GemvChunk c, int rows, int cols) {
  for (int i = 0; i < rows;) {
    // Balanced blocks (8 rows = 4 + 4, not 6 + 2): a thin block wastes decodes.
    const int left = rows - i, blocks = (left + kGemvBlockRows<F> - 1) / kGemvBlockRows<F>;
    const int mr = (left + blocks - 1) / blocks;
    switch (mr) {
      case 1: gemv_block<F, 1>(c, cols); break;
      case 2: gemv_block<F, 2>(c, cols); break;
      case 3: gemv_block<F, 3>(c, cols); break;
      case 4: gemv_block<F, 4>(c, cols); break;
      case 5: gemv_block<F, 5>(c, cols); break;
      default: gemv_block<F, 6>(c, cols); break;
    }
    c.x += mr * c.ldx;
    c.xsum += mr * c.ldxsum;
    c.part += mr * kStrip;
    c.acc += mr * kStrip;
    i += mr;
  }
}

// out[m0:m1, n0:n1] for m1 - m0 <= kMaxRows, one strip of kStrip columns at a time.
template <int F>
void gemv_impl(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int rows = int(m1 - m0);
  const int64_t group_words = a.group_rows / 8;  // groups span whole words
  alignas(32) float acc[kMaxRows * kStrip], part[kMaxRows * kStrip];
  alignas(32) float scale[kStrip], zero[kStrip];
  // x and the weights are copied into these when re-read: rows of x (stride K)
  // and word rows (stride N) a power of two apart would share L1 sets.
  alignas(64) int32_t padded[kChunkWords * kStrip];
  alignas(64) float xbuf[kMaxRows * kChunkWords * 8];
  for (int64_t nb = n0; nb < n1; nb += kStrip) {
    const int cols = int(n1 - nb < kStrip ? n1 - nb : kStrip);
    const int vcols = (cols + 7) & ~7;
    memset(acc, 0, sizeof(acc));
    GemvChunk c;
    c.x = xbuf;
    c.ldx = kChunkWords * 8;
    c.ldxsum = a.groups;
    c.scale = scale;
    c.zero = zero;
    c.part = part;
    c.acc = acc;
    for (int64_t g = 0; g < a.groups; ++g) {
      copy_halves(scale, a.scales + g * a.n + nb, cols, kStrip);
      if (F == kFormatUint4) copy_halves(zero, a.zeros + g * a.n + nb, cols, kStrip);
      for (int64_t w0 = 0; w0 < group_words; w0 += kChunkWords) {
        const int64_t r0 = g * group_words + w0;
        c.words = int(group_words - w0 < kChunkWords ? group_words - w0 : kChunkWords);
        c.first = w0 == 0;
        c.last = w0 + c.words == group_words;
        for (int i = 0; i < rows; ++i)
          memcpy(xbuf + i * c.ldx, a.x + (m0 + i) * a.k + 8 * r0, c.words * 8 * sizeof(float));
        c.xsum = a.xsum ? a.xsum + m0 * a.groups + g : nullptr;
        if (cols == kStrip && rows <= kGemvBlockRows<F>) {  // read once: stream from the weight
          c.w = a.packed + r0 * a.n + nb;
          c.ldw = a.n;
          // Each word row is on its own page: fetch the next chunk early.
          const int64_t next = r0 + c.words;
          for (int64_t r = next; r < next + kChunkWords && r < a.k / 8; ++r)
            for (int l = 0; l < kStrip; l += 16) __builtin_prefetch(a.packed + r * a.n + nb + l);
        } else {
          for (int r = 0; r < c.words; ++r)
            copy_words(padded + r * kStrip, a.packed + (r0 + r) * a.n + nb, cols, kStrip);
          c.w = padded;
          c.ldw = kStrip;
        }
        gemv_rows<F>(c, rows, vcols);
      }
    }
    for (int i = 0; i < rows; ++i)
      memcpy(a.out + (m0 + i) * a.n + nb, acc + i * kStrip, cols * sizeof(float));
  }
}

// ---------------------------------------------------------------------------
// Tiled GEMM (more rows): dequantize a cache-sized tile once, then a
// register-blocked fp32 micro-kernel reuses it for every row.

// Dequantizes rows [k0, k0 + rows) x columns [nb, nb + 64) of B into an
// fp32 tile with row stride 64 (columns past N are zero).
template <int F>
void dequant_tile(const GemmArgs& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(32) int32_t words[kTileCols];
  alignas(32) float scale[kTileCols], zero[kTileCols];
  int64_t group = -1;
  for (int64_t r = k0 / 8; r < (k0 + rows) / 8; ++r) {
    const int64_t g = r * 8 / a.group_rows;
    if (g != group) {  // groups span whole words: group_rows is a multiple of 8
      group = g;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      if (F == kFormatUint4) copy_halves(zero, a.zeros + g * a.n + nb, cols, kTileCols);
    }
    const int32_t* src = a.packed + r * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      src = words;
    }
    float* dst = tile + (r * 8 - k0) * kTileCols;
    for (int q = 0; q < kTileCols / 8; ++q) {
      const v8i w = prepare_words<F>(load8(src + 8 * q));
      const v8f s = load8(scale + 8 * q);
      const v8f z = F == kFormatUint4 ? load8(zero + 8 * q) : v8f{};
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const v8f v = decode_nibble<F>(w, j);
        store8(dst + j * kTileCols + 8 * q, F == kFormatUint4 ? (v - z) * s : v * s);
      }
    }
  }
}

// acc[0:MR, col:col+16] += x[0:MR, k0:k0+rows] @ tile[:, col:col+16]
// (acc row stride kTileCols, x row stride K).
template <int MR>
inline void micro_kernel(const float* x, int64_t ldx, int64_t rows, const float* tile, int col, float* acc) {
  v8f c[MR][2];
  for (int i = 0; i < MR; ++i) {
    c[i][0] = load8(acc + i * kTileCols + col);
    c[i][1] = load8(acc + i * kTileCols + col + 8);
  }
  for (int64_t k = 0; k < rows; ++k) {
    const v8f b0 = load8(tile + k * kTileCols + col), b1 = load8(tile + k * kTileCols + col + 8);
    for (int i = 0; i < MR; ++i) {
      const v8f xs = splat(x[i * ldx + k]);
      c[i][0] = fmadd(xs, b0, c[i][0]);
      c[i][1] = fmadd(xs, b1, c[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    store8(acc + i * kTileCols + col, c[i][0]);
    store8(acc + i * kTileCols + col + 8, c[i][1]);
  }
}

template <int F>
void gemm_tile_impl(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  float* tile = scratch;
  float* acc = scratch + kTileRows * kTileCols;
  memset(acc, 0, (m1 - m0) * kTileCols * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    dequant_tile<F>(a, k0, rows, nb, tile);
    // Column slices outer: one 16-column slice of the tile (16 KiB) stays in
    // L1 while every row block streams past it. 6x16 uses 12 of 16 registers.
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
}

}  // namespace

// The format is dispatched once here so the inner loops are branch-free.
void gemv(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; m += kMaxRows) {
    const int64_t e = m1 - m < kMaxRows ? m1 : m + kMaxRows;
    switch (a.format) {
      case kFormatFp4: gemv_impl<kFormatFp4>(a, m, e, n0, n1); break;
      case kFormatInt4: gemv_impl<kFormatInt4>(a, m, e, n0, n1); break;
      default: gemv_impl<kFormatUint4>(a, m, e, n0, n1); break;
    }
  }
}

// out[m0:m1, nb:nb+64] = x @ B for one column tile; `scratch` holds
// kTileRows * 64 + (m1 - m0) * 64 floats.
void gemm_tile(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  switch (a.format) {
    case kFormatFp4: gemm_tile_impl<kFormatFp4>(a, m0, m1, nb, scratch); break;
    case kFormatInt4: gemm_tile_impl<kFormatInt4>(a, m0, m1, nb, scratch); break;
    default: gemm_tile_impl<kFormatUint4>(a, m0, m1, nb, scratch); break;
  }
}

void dequantize_rows(const GemmArgs& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  switch (a.format) {
    case kFormatFp4: dequant_tile<kFormatFp4>(a, k0, k1 - k0, nb, tile); break;
    case kFormatInt4: dequant_tile<kFormatInt4>(a, k0, k1 - k0, nb, tile); break;
    default: dequant_tile<kFormatUint4>(a, k0, k1 - k0, nb, tile); break;
  }
}

}  // namespace MARLIN_KERNEL_NS
}  // namespace cpu
}  // namespace marlin
