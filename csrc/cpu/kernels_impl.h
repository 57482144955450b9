// CPU kernels for torch.ops.marlin.* on raw pointers, written once and
// compiled twice (kernels_avx2.cpp with AVX2+FMA, kernels_generic.cpp for
// any CPU); csrc/cpu/ops.cpp picks one at run time.
//
// Everything here is in an anonymous namespace and includes no C++ library
// headers, so the two ISA builds cannot leak into each other through
// shared inline functions (ODR). GCC/Clang vector extensions give 8-float
// vectors that map to one AVX2 register or two SSE/NEON registers.
//
// Usage: define MARLIN_KERNEL_NS, then include this file.
#include <stdint.h>
#include <string.h>

#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_KERNEL_NS {
namespace {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

constexpr int kGemvCols = int(kGemvBlockCols);  // 4 vectors of 8
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

// E2M1 code (0..15) -> fp32 by moving bits: magnitude index e:m lands in
// the fp32 exponent (rebased by 126) and top mantissa bit; codes 0 and 1
// (zero and the subnormal 0.5) are the two cases the shift cannot express.
inline v8f decode_fp4(v8i code) {
  const v8i mag = code & 7;
  v8i bits = (mag << 22) + (126 << 23);
  const v8i is_half = mag == 1;
  bits = (is_half & 0x3F000000) | (~is_half & bits);
  bits &= ~(mag == 0);
  bits |= (code & 8) << 28;
  return (v8f)bits;
}

// Integer formats decode to q itself; the zero point (8 for int4) is applied
// per group, where it costs one multiply instead of one per weight.
inline v8f decode(v8i code, int format) {
  return format == kFormatFp4 ? decode_fp4(code) : __builtin_convertvector(code, v8f);
}

// Copies `count` (<= width) words/values into a zero-padded local row so
// tails need no separate code path.
inline void copy_words(int32_t* dst, const int32_t* src, int64_t count, int width) {
  memcpy(dst, src, count * sizeof(int32_t));
  memset(dst + count, 0, (width - count) * sizeof(int32_t));
}
inline void copy_halves(float* dst, const uint16_t* src, int64_t count, int width) {
  for (int64_t i = 0; i < count; ++i) dst[i] = half_to_float(src[i]);
  for (int64_t i = count; i < width; ++i) dst[i] = 0.f;
}

inline float zero_point(const GemmArgs& a, int64_t g, int64_t col) {
  if (a.format == kFormatInt4) return 8.f;
  return a.format == kFormatUint4 ? half_to_float(a.zeros[g * a.n + col]) : 0.f;
}

// out[m, n0:n1] = x[m, :] @ B[:, n0:n1] for one row m, fused dequant.
// Per group: part = sum_k x_k * q_k; out += s * (part - zero * sum_k x_k).
void gemv_row(const GemmArgs& a, int64_t m, int64_t n0, int64_t n1) {
  const float* x = a.x + m * a.k;
  const int64_t words_per_group = a.group_rows / 8;
  for (int64_t nb = n0; nb < n1; nb += kGemvCols) {
    const int64_t cols = (n1 - nb < kGemvCols) ? n1 - nb : kGemvCols;
    v8f acc[4] = {};
    int32_t words[kGemvCols];
    float scale[kGemvCols], zero[kGemvCols];
    for (int64_t g = 0; g < a.groups; ++g) {
      v8f part[4] = {};
      float xsum = 0.f;
      for (int64_t r = g * words_per_group; r < (g + 1) * words_per_group; ++r) {
        copy_words(words, a.packed + r * a.n + nb, cols, kGemvCols);
        const v8i w[4] = {load8(words), load8(words + 8), load8(words + 16), load8(words + 24)};
        for (int j = 0; j < 8; ++j) {
          const float xs = x[r * 8 + j];
          xsum += xs;
          for (int q = 0; q < 4; ++q) part[q] += xs * decode((w[q] >> (4 * j)) & 0xF, a.format);
        }
      }
      copy_halves(scale, a.scales + g * a.n + nb, cols, kGemvCols);
      for (int c = 0; c < kGemvCols; ++c) zero[c] = c < cols ? zero_point(a, g, nb + c) * xsum : 0.f;
      for (int q = 0; q < 4; ++q) acc[q] += load8(scale + 8 * q) * (part[q] - load8(zero + 8 * q));
    }
    float out[kGemvCols];
    for (int q = 0; q < 4; ++q) store8(out + 8 * q, acc[q]);
    memcpy(a.out + m * a.n + nb, out, cols * sizeof(float));
  }
}

// Dequantizes rows [k0, k0 + rows) x columns [nb, nb + 64) of B into an
// fp32 tile with row stride 64 (columns past N are zero).
void dequant_tile(const GemmArgs& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  int32_t words[kTileCols];
  float scale[kTileCols], zero[kTileCols];
  int64_t group = -1;
  for (int64_t r = k0 / 8; r < (k0 + rows) / 8; ++r) {
    const int64_t g = r * 8 / a.group_rows;
    if (g != group) {  // groups span whole words: group_rows is a multiple of 8
      group = g;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      for (int c = 0; c < kTileCols; ++c) zero[c] = c < cols ? zero_point(a, g, nb + c) : 0.f;
    }
    copy_words(words, a.packed + r * a.n + nb, cols, kTileCols);
    for (int q = 0; q < kTileCols / 8; ++q) {
      const v8i w = load8(words + 8 * q);
      const v8f s = load8(scale + 8 * q), z = load8(zero + 8 * q);
      for (int j = 0; j < 8; ++j) {
        const v8f v = (decode((w >> (4 * j)) & 0xF, a.format) - z) * s;
        store8(tile + (r * 8 + j - k0) * kTileCols + 8 * q, v);
      }
    }
  }
}

// acc[m0:m0+MR, 16 columns at col] += x[m0:m0+MR, k0:k0+rows] @ tile[:, col:col+16].
template <int MR>
inline void micro_kernel(const GemmArgs& a, int64_t m0, int64_t k0, int64_t rows, const float* tile,
                         int col, float* acc) {
  v8f c[MR][2];
  for (int i = 0; i < MR; ++i) {
    c[i][0] = load8(acc + i * kTileCols + col);
    c[i][1] = load8(acc + i * kTileCols + col + 8);
  }
  const float* x = a.x + m0 * a.k + k0;
  for (int64_t k = 0; k < rows; ++k) {
    const v8f b0 = load8(tile + k * kTileCols + col), b1 = load8(tile + k * kTileCols + col + 8);
    for (int i = 0; i < MR; ++i) {
      const float xs = x[i * a.k + k];
      c[i][0] += xs * b0;
      c[i][1] += xs * b1;
    }
  }
  for (int i = 0; i < MR; ++i) {
    store8(acc + i * kTileCols + col, c[i][0]);
    store8(acc + i * kTileCols + col + 8, c[i][1]);
  }
}

}  // namespace

void gemv(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; ++m) gemv_row(a, m, n0, n1);
}

// out[m0:m1, nb:nb+64] = x @ B for one column tile; `scratch` holds
// kTileRows * 64 + (m1 - m0) * 64 floats.
void gemm_tile(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  float* tile = scratch;
  float* acc = scratch + kTileRows * kTileCols;
  memset(acc, 0, (m1 - m0) * kTileCols * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    dequant_tile(a, k0, rows, nb, tile);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4)
      for (int col = 0; col < kTileCols; col += 16)
        micro_kernel<4>(a, m, k0, rows, tile, col, acc + (m - m0) * kTileCols);
    for (; m < m1; ++m)
      for (int col = 0; col < kTileCols; col += 16)
        micro_kernel<1>(a, m, k0, rows, tile, col, acc + (m - m0) * kTileCols);
  }
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  for (int64_t m = m0; m < m1; ++m)
    memcpy(a.out + m * a.n + nb, acc + (m - m0) * kTileCols, cols * sizeof(float));
}

void dequantize_rows(const GemmArgs& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  dequant_tile(a, k0, k1 - k0, nb, tile);
}

}  // namespace MARLIN_KERNEL_NS
}  // namespace cpu
}  // namespace marlin
