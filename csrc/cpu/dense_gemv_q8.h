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
// across the call's whole column range, with the per-column sums in memory; the
// group's fp16 scales (and zeros) are read in the same pass, as a fifth stream
// (converting a group's row into a float buffer first was a second pass that cost
// a fifth of the speed from DRAM). Software prefetch only where the streams are
// short (see kPrefetchNextBlockCols); fetching 2 KiB ahead within long streams
// was measured 3-6% slower (Zen 5, 8192 x 8192 int4 g32, one thread).
// The 2:4 layout's int8 GEMV (cpu/sparse24_gemv_q8.h) is the same loop on
// another layout (Q8Layout: how a block's int32 sums come about).
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/dense_gemm.h"  // with_rows
#include "cpu/format_decode.h"
#include "cpu/kernel_args.h"
#include "cpu/sparse24_metadata.h"  // kFillMetadata, copy_metadata

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

struct Q8Step {
  const int32_t* x;      // x of the block's first row (32 bytes, in the layout's Q8Order)
  int64_t ldx;           // row stride of x, in int32 (K / 4)
  const float* dx;       // dx_b of the first row
  int64_t lddx;          // = K / 32
  const float* gsum;     // X_g of the first row
  int64_t ldgsum;        // = groups
  float *part, *xpart, *acc;  // [rows][ld] per-column sums (xpart: KeptSums layouts with zeros)
  int64_t ld;
  bool first, last;      // the block starts / ends its group
};

// A layout of the int8-x GEMV (Q8Layout):
//   kWordRows             weight word rows per block of x (kQ8Block K rows)
//   kKeptSums             per-column sums of x (t) meet the zeros (biases), not X_g, and
//                         dots takes the offsets off s itself
//   kBlockRows, kVectors<MR>  register blocks: rows x vectors
//   Args, metadata(a)     its kernel arguments; metadata words per column, one row per block (or null)
//   dots<F, MR, NV>(c, w, ldw, meta, s, t)  adds a block's sums of x times code bytes to s, of x to t;
//                         returns nonzero lanes where a metadata word is invalid
// The dense layout: 4 word rows of 8 codes per block.
struct DenseQ8 {
  static constexpr int kWordRows = int(kQ8Block / 8);
  static constexpr bool kKeptSums = false;
  static constexpr int kBlockRows = MARLIN_KERNEL_AVX512 ? 4 : 2;
  template <int MR>
  static constexpr int kVectors = MARLIN_KERNEL_AVX512 ? (MR <= 2 ? 4 : 2) : MARLIN_KERNEL_AVX2 ? (MR <= 1 ? 4 : 2) : 1;
  typedef GemmArgs Args;
  static const int32_t* metadata(const Args&) { return nullptr; }

  // vpmaddubsw sums the int16 pair sums of kRows word rows before one vpmaddwd
  // (int4 / uint4 / affine: the block's 4 rows; fp4: 2). Bounded for any int8 x
  // (|x| <= 128; the quantizer's are within 127) times code bytes up to kMaxByte.
  template <int F>
  static constexpr int kRows = kDotInt16 ? int16_rows(kWordRows, Q8Decode<F>::kMaxByte, 128) : kWordRows;

  template <int F, int MR, int NV>
  static inline vu dots(const Q8Step& c, const int32_t* w, int64_t ldw, const int32_t*, vi (&s)[MR][NV],
                        vi (&)[MR][NV]) {
    constexpr bool kInt16 = kDotInt16 && kRows<F> > 0;
    constexpr int kChunk = kInt16 ? kRows<F> : kWordRows;
    static_assert(!kInt16 || 4 * kChunk * Q8Decode<F>::kMaxByte * 128 <= 32767, "int16 sums may overflow");
#pragma GCC unroll 4
    for (int r0 = 0; r0 < kWordRows; r0 += kChunk) {
      vi sum[MR][NV] = {};
#pragma GCC unroll 4
      for (int r = r0; r < r0 + kChunk; ++r) {
        vi lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) q8_code_bytes<F>(load(w + r * ldw + kLanes * v), lo[v], hi[v]);
        for (int i = 0; i < MR; ++i) {
          const vi xe = splat_i(c.x[i * c.ldx + 2 * r]), xo = splat_i(c.x[i * c.ldx + 2 * r + 1]);
          for (int v = 0; v < NV; ++v) sum[i][v] = dot_add<kInt16>(dot_add<kInt16>(sum[i][v], lo[v], xe), hi[v], xo);
        }
      }
      for (int i = 0; i < MR; ++i)
        for (int v = 0; v < NV; ++v) s[i][v] += dot_total<kInt16>(sum[i][v]);
    }
    return vu{};
  }
};

// A block row of at most this many columns is a short stream for the hardware
// prefetcher (16 KiB of words), which would start each of the next block's rows
// cold: q8_rows fetches them into L2 while it reads the block. Zen 5, int4 g32
// from DRAM, one thread: 2048 x 8192 (N x K) 17.2-17.8 -> 19.7-20.1 GB/s, 512 x 2048
// 9.9 -> 15.5-15.7, 4096 x 4096 17.3-18.2 -> 19.2-19.4; 8192 x 2048 19.2-19.4 -> 18.7-18.9
// (long rows: no gain, so none there).
constexpr int64_t kPrefetchNextBlockCols = 4096;

// Columns [col, col + kLanes * NV) of the sums, from words w (word row stride ldw),
// metadata meta (the layout's) and the group's fp16 scale and zero at that column.
template <int F, int MR, int NV, class L>
inline vu q8_micro(const Q8Step& c, const int32_t* w, int64_t ldw, const int32_t* meta, const uint16_t* scale_h,
                   const uint16_t* zero_h, int64_t col) {
  using D = Q8Decode<F>;
  constexpr bool kKeptXSum = L::kKeptSums && kHasZeros<F>;  // float sums of the kept x between blocks
  vi s[MR][NV], t[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) s[i][v] = t[i][v] = vi{};
  const vu bad = L::template dots<F, MR, NV>(c, w, ldw, meta, s, t);
  for (int i = 0; i < MR; ++i) {
    const vf dx = splat(c.dx[i * c.lddx]);
    for (int v = 0; v < NV; ++v) {
      const int64_t o = i * c.ld + col + kLanes * v;
      const vf sum = __builtin_convertvector(s[i][v], vf);  // exact: below 2^24
      vf p = c.first ? sum * dx : fmadd(sum, dx, load(c.part + o)), xp = vf{};
      if (kKeptXSum) {
        const vf kept = __builtin_convertvector(t[i][v], vf);
        xp = c.first ? kept * dx : fmadd(kept, dx, load(c.xpart + o));
      }
      if (!c.last) {
        store(c.part + o, p);
        if (kKeptXSum) store(c.xpart + o, xp);
        continue;
      }
      const vf x_sum = kKeptXSum ? xp : splat(c.gsum[i * c.ldgsum]), scale = load_halves(scale_h + kLanes * v);
      constexpr int offset = L::kKeptSums ? 0 : D::kOffset;
      const vf zero = kHasZeros<F> ? load_halves(zero_h + kLanes * v) : splat(float(offset));
      if constexpr (kZerosAreBias<F>) {
        store(c.acc + o, fmadd(scale, p, fmadd(zero, x_sum, load(c.acc + o))));
        continue;
      }
      if (kHasZeros<F> || offset != 0) p -= zero * x_sum;
      if (D::kDivisor == 2) p *= 0.5f;  // exact
      store(c.acc + o, fmadd(scale, p, load(c.acc + o)));
    }
  }
  return bad;
}

// out[m0:m0+MR, n0:n1] from the int8 x of the arguments (q8_*).
template <int F, int MR, class L>
vu q8_rows(const typename L::Args& a, int64_t m0, int64_t n0, int64_t n1, float* buffers) {
  constexpr int NV = L::template kVectors<MR>, kCols = kLanes * NV;
  const int64_t cols = n1 - n0, padded = (cols + kCols - 1) / kCols * kCols;
  const int64_t blocks = a.k / kQ8Block, group_blocks = a.group_rows / kQ8Block;
  const bool direct = MR == 1 && padded == cols;  // one row without a tail: its sums go straight into out
  float *part = buffers, *xpart = part + MR * padded, *acc = direct ? a.out + m0 * a.n + n0 : xpart + MR * padded;
  memset(acc, 0, MR * padded * sizeof(float));
  alignas(64) int32_t tail[L::kWordRows * kCols], tail_meta[kCols];
  alignas(64) uint16_t tail_scale[kCols] = {}, tail_zero[kCols] = {};
  const bool prefetch_next_block = cols <= kPrefetchNextBlockCols;
  const int32_t* metadata = L::metadata(a);
  Q8Step c;
  c.ldx = a.k / 4;
  c.lddx = blocks;
  c.ldgsum = a.groups;
  c.part = part;
  c.xpart = xpart;
  c.acc = acc;
  c.ld = padded;
  vu bad = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b / group_blocks;
    c.first = b % group_blocks == 0;
    c.last = b % group_blocks == group_blocks - 1;
    c.x = a.q8_x + m0 * c.ldx + 8 * b;
    c.dx = a.q8_scale + m0 * blocks + b;
    c.gsum = L::kKeptSums ? nullptr : a.q8_gsum + m0 * a.groups + g;
    const uint16_t* scales = a.scales + g * a.n + n0;  // read on the group's last block
    const uint16_t* zeros = kHasZeros<F> ? a.zeros + g * a.n + n0 : nullptr;
    const int32_t* rows = a.packed + b * L::kWordRows * a.n + n0;
    const int32_t* meta = metadata ? metadata + b * a.n + n0 : nullptr;
    for (int64_t col = 0; col < padded; col += kCols) {
      if (col + kCols > cols) {  // the tail: zero-padded copies of the word rows, valid metadata
        for (int r = 0; r < L::kWordRows; ++r) copy_words(tail + r * kCols, rows + r * a.n + col, cols - col, kCols);
        if (meta) copy_metadata(tail_meta, meta + col, cols - col, kCols, kFillMetadata);
        if (c.last) {
          memcpy(tail_scale, scales + col, (cols - col) * sizeof(uint16_t));
          if (kHasZeros<F>) memcpy(tail_zero, zeros + col, (cols - col) * sizeof(uint16_t));
        }
        bad |= q8_micro<F, MR, NV, L>(c, tail, kCols, tail_meta, tail_scale, tail_zero, col);
        continue;
      }
      if (prefetch_next_block && b + 1 < blocks)  // the same columns of the next block's word rows
        for (int r = L::kWordRows; r < 2 * L::kWordRows; ++r)
          for (int w = 0; w < kCols; w += 64 / sizeof(int32_t)) __builtin_prefetch(rows + r * a.n + col + w, 0, 2);
      bad |= q8_micro<F, MR, NV, L>(c, rows + col, a.n, meta ? meta + col : nullptr, scales + col,
                                    kHasZeros<F> ? zeros + col : nullptr, col);
    }
  }
  if (!direct)
    for (int i = 0; i < MR; ++i) memcpy(a.out + (m0 + i) * a.n + n0, acc + i * padded, cols * sizeof(float));
  return bad;
}

template <int F, class L>
vu q8_gemv(const typename L::Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  if constexpr (!Q8Decode<F>::kApplies) {
    return vu{};  // ops.cpp never asks (gemv_q8_applies)
  } else {
    static_assert(3 * L::kBlockRows <= kGemvScratchRows, "gemv_scratch_floats is too small");
    const int64_t padded = (n1 - n0 + 64) / 64 * 64;
    float* scratch = nullptr;
    if constexpr (requires { a.scratch; }) scratch = a.scratch;  // the decode engine's, allocated once
    float* buffers = scratch ? scratch : new float[3 * L::kBlockRows * padded];
    vu bad = {};
    for (int64_t m = m0; m < m1;) {
      const int mr = even_rows(m1 - m, L::kBlockRows);
      with_rows<L::kBlockRows>(mr, [&]<int MR>() { bad |= q8_rows<F, MR, L>(a, m, n0, n1, buffers); });
      m += mr;
    }
    if (!scratch) delete[] buffers;
    return bad;
  }
}

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
