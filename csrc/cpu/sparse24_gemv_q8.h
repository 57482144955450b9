// The 2:4 layout's GEMV with int8 activations (docs/FORMAT.md; few rows of x),
// part of one kernel build: the dense int8 GEMV's loop (cpu/dense_gemv_q8.h)
// on this layout. x comes as int8 bytes in K order (Q8Order::kNatural), one
// block of 32 = 2 values rows = 1 metadata row. Per values row (16 K rows)
// the 16 bytes of x sit in every 128-bit lane, and one byte shuffle per 4 kept
// codes (lookup_bytes: vpshufb, tbl) gathers, lane by lane, the x bytes that
// the metadata pairs with each column's codes; then the dense dot products
// (dot4). The code bytes carry an offset (fp4: 2 x value + 12, int4: q + 8)
// and uint4 / affine a zero point or bias per group: these meet the sum of
// the kept x, which differs per column. fp4 / int4 take the signed values
// instead (dots below); uint4 / affine also sum the gathered x (dot4 with
// bytes of 1): per block and column s = sum of xq * q and t = sum of xq over
// the kept positions, and per group the sums of dx * s and dx * t.
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/dense_gemv_q8.h"
#include "cpu/format_decode.h"
#include "cpu/kernel_args.h"
#include "cpu/sparse24_metadata.h"

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

struct Sparse24Q8 {
  static constexpr int kWordRows = 2;
  static constexpr bool kKeptSums = true;
  static constexpr int kBlockRows = MARLIN_KERNEL_AVX512 ? 4 : 2;
  template <int MR>
  static constexpr int kVectors = MARLIN_KERNEL_AVX512 ? (MR <= 1 ? 4 : MR <= 2 ? 2 : 1)
                                  : MARLIN_KERNEL_AVX2 ? (MR <= 1 ? 2 : 1)
                                                       : 1;
  typedef Sparse24Args Args;
  static const int32_t* metadata(const Args& a) { return a.metadata; }

  // Lane by lane, the byte indices (into a values row's 16 x bytes) that meet
  // the code bytes of q8_code_bytes: lo holds nibbles 0, 2, 4, 6 = slot 0 of
  // blocks 0 and 2, slot 1 of blocks 0 and 2; hi nibbles 1, 3, 5, 7 = the same
  // of blocks 1 and 3. Block b's positions are bits 4b (pos0) and 4b + 2 (pos1)
  // of h; its x bytes start at 4b.
  static inline vi lo_index(vi h) { return (h & 0x0303) | ((h << 14) & 0x03030000) | 0x08000800; }
  static inline vi hi_index(vi h) { return ((h >> 4) & 0x0303) | ((h << 10) & 0x03030000) | 0x0C040C04; }

  // fp4 / int4 (no zeros): the signed code values (u - offset) meet x + 128
  // (unsigned; x's bytes with the top bit flipped), and 128 times the column's
  // kept values comes off per block: no sums of the kept x. sdot takes x as it is.
  template <int F, int MR, int NV>
  static inline vu dots(const Q8Step& c, const int32_t* w, int64_t ldw, const int32_t* meta, vi (&s)[MR][NV],
                        vi (&t)[MR][NV]) {
    using D = Q8Decode<F>;
    constexpr bool kSigned = !kHasZeros<F>, kBiased = kSigned && !kDot4Symmetric;
    // vpmaddubsw: the block's int16 pair sums add up before one vpmaddwd (DenseQ8::kRows), bounded
    // for x + 128 (up to 255) times signed values (|u - offset|), or code bytes times any int8 x.
    constexpr int kMaxValue = D::kOffset > D::kMaxByte - D::kOffset ? D::kOffset : D::kMaxByte - D::kOffset;
    constexpr bool kInt16 = kDotInt16 && int16_rows(kWordRows, kSigned ? 255 : D::kMaxByte,
                                                    kSigned ? kMaxValue : 128) == kWordRows;
    const vi ones = splat_i(0x01010101), offset = splat_i(D::kOffset * 0x01010101);
    vi m[NV], value_sums[NV], ss[MR][NV] = {}, ts[MR][NV] = {};
    vu bad = {};
    for (int v = 0; v < NV; ++v) {
      m[v] = load(meta + kLanes * v);
      bad |= metadata_invalid(m[v]);
      value_sums[v] = vi{};
    }
#pragma GCC unroll 2
    for (int r = 0; r < kWordRows; ++r) {
      vi lo[NV], hi[NV], lo_idx[NV], hi_idx[NV];
      for (int v = 0; v < NV; ++v) {
        q8_code_bytes<F>(load(w + r * ldw + kLanes * v), lo[v], hi[v]);
        if (kSigned) {
          lo[v] = sub_bytes(lo[v], offset);
          hi[v] = sub_bytes(hi[v], offset);
          if (kBiased) value_sums[v] = dot_add<kInt16>(dot_add<kInt16>(value_sums[v], ones, lo[v]), ones, hi[v]);
        }
        const vi h = (vi)((vu)m[v] >> (16 * r));
        lo_idx[v] = lo_index(h);
        hi_idx[v] = hi_index(h);
      }
      for (int i = 0; i < MR; ++i) {
        vi x = byte_table(reinterpret_cast<const uint8_t*>(c.x + i * c.ldx) + 16 * r);
        if (kBiased) x ^= splat_i(int32_t(0x80808080u));
        for (int v = 0; v < NV; ++v) {
          const vi x_lo = lookup_bytes(lo_idx[v], x), x_hi = lookup_bytes(hi_idx[v], x);
          if (kSigned) {
            ss[i][v] = dot_add<kInt16>(dot_add<kInt16>(ss[i][v], x_lo, lo[v]), x_hi, hi[v]);
          } else {
            ss[i][v] = dot_add<kInt16>(dot_add<kInt16>(ss[i][v], lo[v], x_lo), hi[v], x_hi);
            ts[i][v] = dot_add<kInt16>(dot_add<kInt16>(ts[i][v], ones, x_lo), ones, x_hi);
          }
        }
      }
    }
    for (int v = 0; v < NV; ++v) value_sums[v] = dot_total<kInt16>(value_sums[v]);
    for (int i = 0; i < MR; ++i)
      for (int v = 0; v < NV; ++v) {
        s[i][v] += dot_total<kInt16>(ss[i][v]);
        if (!kSigned) t[i][v] += dot_total<kInt16>(ts[i][v]);
        if (kBiased) s[i][v] -= value_sums[v] << 7;
      }
    return bad;
  }
};

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
