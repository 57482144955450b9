// The dense layout's GEMV with int8 activations (few rows of x), part of one
// kernel build (see cpu/cpu_vec.h). ops.cpp quantizes x per block of 32 to int8
// with an fp32 scale (as llama.cpp's Q8_0); here every word of codes becomes
// bytes (Q8Decode) and meets x's bytes in integer dot products (dot4), so a
// word's 8 products are 2 instructions where the float GEMV has 8 FMAs and 8
// decodes. Per block b of 32 K rows and column n:
//   part += dx_b * sum_k xq_k * u_k
// and at the end of each group g (X_g = sum over its blocks of dx_b * sum_k xq_k):
//   out += scale / kDivisor * (part - c * X_g)   (c: kOffset, or uint4's zero)
//   out += scale * part + bias * X_g             (affine)
// The weights are read in memory order, one block of 4 word rows (4 streams)
// across the call's whole column range, with the per-column sums in memory. No
// software prefetch: the hardware's follows 4 streams, and fetching 2 KiB ahead
// in each was measured 3-6% slower (Zen 5, 8192 x 8192 int4 g32, one thread).
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/dense_gemm.h"  // with_rows
#include "cpu/format_decode.h"
#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

constexpr int kQ8WordRows = int(kQ8Block / 8);  // word rows per block of x

struct Q8Step {
  const int32_t* x;      // x of the block's first row: 8 int32 (4 word rows x (even, odd) quads)
  int64_t ldx;           // row stride of x, in int32 (K / 4)
  const float* dx;       // dx_b of the first row
  int64_t lddx;          // = K / 32
  const float* gsum;     // X_g of the first row
  int64_t ldgsum;        // = groups
  const float *scale, *zero;
  float *part, *acc;     // [rows][ld] per-column sums
  int64_t ld;
  bool first, last;      // the block starts / ends its group
};

// Columns [col, col + kLanes * NV) of the sums, from words w (word row stride ldw).
template <int F, int MR, int NV>
inline void q8_micro(const Q8Step& c, const int32_t* w, int64_t ldw, int64_t col) {
  using D = Q8Decode<F>;
  vi s[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) s[i][v] = vi{};
#pragma GCC unroll 4
  for (int r = 0; r < kQ8WordRows; ++r) {
    vi lo[NV], hi[NV];
    for (int v = 0; v < NV; ++v) q8_code_bytes<F>(load(w + r * ldw + kLanes * v), lo[v], hi[v]);
    for (int i = 0; i < MR; ++i) {
      const vi xe = splat_i(c.x[i * c.ldx + 2 * r]), xo = splat_i(c.x[i * c.ldx + 2 * r + 1]);
      for (int v = 0; v < NV; ++v) s[i][v] = dot4(dot4(s[i][v], lo[v], xe), hi[v], xo);
    }
  }
  for (int i = 0; i < MR; ++i) {
    const vf dx = splat(c.dx[i * c.lddx]);
    for (int v = 0; v < NV; ++v) {
      const int64_t o = i * c.ld + col + kLanes * v;
      const vf sum = __builtin_convertvector(s[i][v], vf);  // exact: below 2^24
      vf p = c.first ? sum * dx : fmadd(sum, dx, load(c.part + o));
      if (!c.last) {
        store(c.part + o, p);
        continue;
      }
      const vf x_sum = splat(c.gsum[i * c.ldgsum]), scale = load(c.scale + col + kLanes * v);
      const vf zero = kHasZeros<F> ? load(c.zero + col + kLanes * v) : splat(float(D::kOffset));
      if constexpr (kZerosAreBias<F>) {
        store(c.acc + o, fmadd(scale, p, fmadd(zero, x_sum, load(c.acc + o))));
        continue;
      }
      if (kHasZeros<F> || D::kOffset != 0) p -= zero * x_sum;
      if (D::kDivisor == 2) p *= 0.5f;  // exact
      store(c.acc + o, fmadd(scale, p, load(c.acc + o)));
    }
  }
}

// Register blocks: rows x vectors of int32 sums plus the decoded bytes.
constexpr int kQ8BlockRows = MARLIN_KERNEL_AVX512 ? 4 : 2;
template <int MR>
constexpr int kQ8BlockVectors = MARLIN_KERNEL_AVX512 ? (MR <= 2 ? 4 : 2) : MARLIN_KERNEL_AVX2 ? (MR <= 1 ? 4 : 2) : 1;

// out[m0:m1, n0:n1] (m1 - m0 <= kGemvMaxRows) from the int8 x of GemmArgs (q8_*).
template <int F, int MR>
void q8_rows(const GemmArgs& a, int64_t m0, int64_t n0, int64_t n1, float* buffers) {
  constexpr int NV = kQ8BlockVectors<MR>, kCols = kLanes * NV;
  const int64_t cols = n1 - n0, padded = (cols + kCols - 1) / kCols * kCols;
  const int64_t blocks = a.k / kQ8Block, group_blocks = a.group_rows / kQ8Block;
  float *part = buffers, *acc = part + MR * padded, *scale = acc + MR * padded, *zero = scale + padded;
  memset(acc, 0, MR * padded * sizeof(float));
  alignas(64) int32_t tail[kQ8WordRows * kCols];
  Q8Step c;
  c.ldx = a.k / 4;
  c.lddx = blocks;
  c.ldgsum = a.groups;
  c.scale = scale;
  c.zero = zero;
  c.part = part;
  c.acc = acc;
  c.ld = padded;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / group_blocks;
    c.first = b % group_blocks == 0;
    c.last = b % group_blocks == group_blocks - 1;
    c.x = a.q8_x + m0 * c.ldx + 8 * b;
    c.dx = a.q8_scale + m0 * blocks + b;
    c.gsum = a.q8_gsum + m0 * a.groups + g;
    if (c.last) {
      copy_halves(scale, a.scales + g * a.n + n0, cols, int(padded));
      if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + n0, cols, int(padded));
    }
    const int32_t* rows = a.packed + b * kQ8WordRows * a.n + n0;
    for (int64_t col = 0; col < padded; col += kCols) {
      if (col + kCols > cols) {  // the tail: zero-padded copies of the 4 word rows
        for (int r = 0; r < kQ8WordRows; ++r) copy_words(tail + r * kCols, rows + r * a.n + col, cols - col, kCols);
        q8_micro<F, MR, NV>(c, tail, kCols, col);
        continue;
      }
      q8_micro<F, MR, NV>(c, rows + col, a.n, col);
    }
  }
  for (int i = 0; i < MR; ++i) memcpy(a.out + (m0 + i) * a.n + n0, acc + i * padded, cols * sizeof(float));
}

template <int F>
void gemv_q8_format(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if constexpr (!Q8Decode<F>::kApplies) {
    return;  // ops.cpp never asks (gemv_q8_applies)
  } else {
    static_assert(2 * kQ8BlockRows + 2 <= kGemvScratchRows, "gemv_scratch_floats is too small");
    const int64_t padded = (n1 - n0 + 64) / 64 * 64;
    float* buffers = a.scratch ? a.scratch : new float[(2 * kQ8BlockRows + 2) * padded];
    for (int64_t m = m0; m < m1;) {
      const int64_t left = m1 - m, blocks = (left + kQ8BlockRows - 1) / kQ8BlockRows;
      const int mr = int((left + blocks - 1) / blocks);
      with_rows<kQ8BlockRows>(mr, [&]<int MR>() { q8_rows<F, MR>(a, m, n0, n1, buffers); });
      m += mr;
    }
    if (!a.scratch) delete[] buffers;
  }
}

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
