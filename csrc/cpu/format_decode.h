// How the CPU kernels decode each value format (metal/marlin_common.h's
// MARLIN_FOR_EACH_FORMAT): FormatDecode<F>, the 16-entry table decode every
// build has, the per-group scale/zero arithmetic, and the exact bf16 pairs of
// code values for the bf16 dot-product builds. Part of one kernel build (see
// cpu/cpu_vec.h).
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

// FormatDecode<F> is how the kernels decode format F. It is declared without a
// body and defined once per format below, so a format added to
// MARLIN_FOR_EACH_FORMAT without one fails to compile (with_format instantiates
// every kernel for every format). Each defines
//   static constexpr float value(int code)  the code's value before the scale
//                                           (formats with zeros: q; the zero is applied per group)
//   static vi prepare(vi w)                 applied once to a loaded vector of words
//   static vf nibble(vi w, int j)           nibble j's value, of prepared words
//   static constexpr bool kByteTable        AVX2 GEMV: decodes through the byte table below
// A format that is only a table of 16 values derives from TableDecode.
template <int F>
struct FormatDecode;

template <int F>
constexpr float code_value(int code) {
  return FormatDecode<F>::value(code);
}

// The group's `zeros` (formats with zeros): a zero point, w = (value - zero) * scale
// (uint4), or a bias, w = value * scale + bias (affine).
// acc plus a group's share of a dot product, from sum (of value * x) and xsum (of x
// over the group's rows; formats with zeros): the same two instructions for both.
template <int F>
inline vf group_dot(vf acc, vf sum, vf xsum, vf scale, vf zero) {
  if constexpr (kZerosAreBias<F>) return fmadd(scale, sum, fmadd(zero, xsum, acc));
  if constexpr (kHasZeros<F>) sum -= zero * xsum;
  return fmadd(scale, sum, acc);
}

// A dequantized weight from its value v.
template <int F>
inline vf group_weight(vf v, vf scale, vf zero) {
  if constexpr (kZerosAreBias<F>) return fmadd(v, scale, zero);
  if constexpr (kHasZeros<F>) return (v - zero) * scale;
  return v * scale;
}

// AVX-512 decodes every format by table (TableDecode); MARLIN_KERNEL_TABLE_DECODE=1
// makes every build do so (tests/test_format_seam.py checks the table path of each
// build that way, with the kernel harness).
#ifndef MARLIN_KERNEL_TABLE_DECODE
#define MARLIN_KERNEL_TABLE_DECODE MARLIN_KERNEL_AVX512
#endif
constexpr bool kTableDecode = MARLIN_KERNEL_TABLE_DECODE;

// M(0), ..., M(15): a table of the 16 codes' values written out for a vector initializer.
#define MARLIN_CODES_LOW(M) M(0), M(1), M(2), M(3), M(4), M(5), M(6), M(7)
#define MARLIN_CODES_HIGH(M) M(8), M(9), M(10), M(11), M(12), M(13), M(14), M(15)
#define MARLIN_CODES(M) MARLIN_CODES_LOW(M), MARLIN_CODES_HIGH(M)

// The general decode: the 16 values D::value(0..15), looked up by nibble j of
// each word. AVX-512: one vpermps (it reads the low 4 bits of each index);
// AVX2: two vpermps of 8 values (they read the low 3 bits) and a blend on bit
// 3; other builds one load per lane.
template <class D>
inline vf table_nibble(vi w, int j) {
#define MARLIN_V(i) D::value(i)
#if MARLIN_KERNEL_AVX512
  const vf values = {MARLIN_CODES(MARLIN_V)};
  return _mm512_permutexvar_ps((__m512i)((vu)w >> (4 * j)), (__m512)values);
#elif MARLIN_KERNEL_AVX2
  const vf low = {MARLIN_CODES_LOW(MARLIN_V)}, high = {MARLIN_CODES_HIGH(MARLIN_V)};
  const vi index = (vi)((vu)w >> (4 * j));
  return __builtin_ia32_blendvps256(__builtin_ia32_permvarsf256(low, index), __builtin_ia32_permvarsf256(high, index),
                                    (vf)(index << 28));  // bit 3 of the code into the sign: picks high
#else
  constexpr float values[16] = {MARLIN_CODES(MARLIN_V)};
  const vu index = ((vu)w >> (4 * j)) & 15;
  vf v;
  for (int l = 0; l < kLanes; ++l) v[l] = values[index[l]];
  return v;
#endif
#undef MARLIN_V
}

// A format given by its 16 values only (D derives from TableDecode<D> and defines value()).
template <class D>
struct TableDecode {
  static constexpr bool kByteTable = false;
  static vi prepare(vi w) { return w; }
  static vf nibble(vi w, int j) { return table_nibble<D>(w, j); }
};

// E2M1 code (0..15) -> fp32 with neither tables nor compares (GCC turns
// vector compares into scalar code without AVX). The magnitude bits e:m,
// placed in the fp32 exponent (rebased by 126) and top mantissa bit, give
// t = 0.5, 0.75, 1, 1.5, ..., 6: right except for codes 0 and 1 (0, 0.5).
// min(t, 2t - 1) fixes exactly those, written as t - relu(1 - t), with
// relu(y) = (y + |y|) / 2; every step is exact. The sign bit is ORed in.
inline vf decode_fp4(vi code) {
  const vf t = (vf)(((code & 7) << 22) + (126 << 23));
  const vf y = 1.f - t;
  const vf magnitude = t - (y + (vf)((vi)y & 0x7FFFFFFF)) * 0.5f;
  return (vf)((vi)magnitude | ((code & 8) << 28));
}

// fp4: E2M1 (fp4 code 8 is -0).
template <>
struct FormatDecode<kFp4> {
  static constexpr bool kByteTable = MARLIN_KERNEL_AVX2;
  static constexpr float value(int code) {
    constexpr float e2m1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    return code & 8 ? -e2m1[code & 7] : e2m1[code & 7];
  }
  static vi prepare(vi w) { return w; }
  static vf nibble(vi w, int j) {
    if constexpr (kTableDecode) return table_nibble<FormatDecode>(w, j);
#if MARLIN_KERNEL_AVX2
    // vpermps reads only the low 3 bits of each index: a magnitude table
    // lookup without masking; the sign bit is moved to bit 31.
    const vf magnitudes = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    const vf mag = __builtin_ia32_permvarsf256(magnitudes, (vi)((vu)w >> (4 * j)));
    return (vf)((vi)mag ^ ((w << (28 - 4 * j)) & int32_t(0x80000000u)));
#else
    return decode_fp4((vi)((vu)w >> (4 * j)) & 15);
#endif
  }
};

// int4: q - 8 (exact, no zero point needed). prepare flips each nibble's top
// bit, so that the nibble read as a signed 4-bit number is q - 8.
template <>
struct FormatDecode<kInt4> {
  static constexpr bool kByteTable = false;
  static constexpr float value(int code) { return float(code - kInt4Offset); }
  static vi prepare(vi w) { return kTableDecode ? w : w ^ int32_t(0x88888888u); }
  static vf nibble(vi w, int j) {
    if constexpr (kTableDecode) return table_nibble<FormatDecode>(w, j);
    return __builtin_convertvector((w << (28 - 4 * j)) >> 28, vf);
  }
};

// uint4: q (the zero point is applied per group).
template <>
struct FormatDecode<kUint4> {
  static constexpr bool kByteTable = false;
  static constexpr float value(int code) { return float(code); }
  static vi prepare(vi w) { return w; }
  static vf nibble(vi w, int j) {
    if constexpr (kTableDecode) return table_nibble<FormatDecode>(w, j);
    return __builtin_convertvector((vi)((vu)w >> (4 * j)) & 15, vf);
  }
};

// affine: q, as uint4 (the bias is applied per group).
template <>
struct FormatDecode<kAffine> : FormatDecode<kUint4> {};

// nf4: bitsandbytes' NF4 table in fp16 (kNf4Values); no bit trick, the table decode.
template <>
struct FormatDecode<kNf4> : TableDecode<FormatDecode<kNf4>> {
  static constexpr float value(int code) { return kNf4Values[code]; }
};

// --- int8 activations ----------------------------------------------------------------
// A format whose values times 1 or 2 are integers: the int8-activation GEMV
// multiplies x's int8 values by code bytes u = kDivisor * value + kOffset (0..127,
// unsigned for vpdpbusd) and takes the offset back out per block with x's sums:
// value = (u - kOffset) / kDivisor. int4: u = q, offset 8; uint4 and affine: u = q
// (their zeros and biases are applied per group); fp4: u = 2 * value + 12. nf4's
// values are not small integers: it keeps the float path.
template <int F>
struct Q8Decode {
  static constexpr bool integer_at(int divisor) {
    for (int i = 0; i < 16; ++i) {
      const float v = divisor * code_value<F>(i);
      if (v != float(int(v)) || v < -64 || v > 64) return false;
    }
    return true;
  }
  static constexpr int kDivisor = integer_at(1) ? 1 : integer_at(2) ? 2 : 0;
  static constexpr bool kApplies = kDivisor != 0;
  static constexpr int lowest() {
    int low = 0;
    for (int i = 0; i < 16; ++i) low = int(kDivisor * code_value<F>(i)) < low ? int(kDivisor * code_value<F>(i)) : low;
    return low;
  }
  static constexpr int kOffset = -lowest();
  static constexpr uint8_t byte(int code) { return uint8_t(int(kDivisor * code_value<F>(code)) + kOffset); }
  static constexpr bool identity() {
    for (int i = 0; i < 16; ++i)
      if (byte(i) != i) return false;
    return true;
  }
  static constexpr bool kIdentity = identity();  // u is the code itself: no lookup
  static constexpr int highest_byte() {
    int high = 0;
    for (int i = 0; i < 16; ++i) high = byte(i) > high ? byte(i) : high;
    return high;
  }
  static constexpr int kMaxByte = highest_byte();  // int4, uint4, affine: 15; fp4: 24
  static_assert(!kApplies || !kZerosAreBias<F> || kOffset == 0, "a bias format's codes are their values");
};

// The code bytes of a loaded word vector: lo holds nibbles 0, 2, 4, 6 of each word
// (K rows 8r, 8r + 2, ...), one per byte, hi nibbles 1, 3, 5, 7.
template <int F>
inline void q8_code_bytes(vi w, vi& lo, vi& hi) {
  lo = w & 0x0F0F0F0F;
  hi = (vi)((vu)w >> 4) & 0x0F0F0F0F;
  if constexpr (!Q8Decode<F>::kIdentity) {
#define MARLIN_U(i) Q8Decode<F>::byte(i)
    static constexpr uint8_t table[16] = {MARLIN_CODES(MARLIN_U)};
#undef MARLIN_U
    lo = lookup_bytes(lo, table);
    hi = lookup_bytes(hi, table);
  }
}

// Prepares a loaded word vector for decode_nibble.
template <int F>
inline vi prepare_words(vi w) {
  return FormatDecode<F>::prepare(w);
}

// Value of nibble j (K row 8r + j) of prepared words (formats with zeros: q).
template <int F>
inline vf decode_nibble(vi w, int j) {
  return FormatDecode<F>::nibble(w, j);
}

// ---------------------------------------------------------------------------
// bf16 dot products (MARLIN_KERNEL_BF16_DOT): x stays bf16, each code is
// decoded to its exact bf16 value, the products are exact in fp32 and sums are
// fp32; scales are applied per group in fp32, as in the fp32 path. Lane i of
// a pair vector holds the values of K rows 2p and 2p + 1 (nibbles 2p, 2p + 1
// of word i), matching x's natural layout: one 32-bit broadcast of x per pair.
#if MARLIN_KERNEL_BF16_DOT

inline uint16_t bf16_bits(float f) {  // exact for the code values
  uint32_t u;
  memcpy(&u, &f, 4);
  return uint16_t(u >> 16);
}

#if MARLIN_KERNEL_AVX512
// Two nibbles of each word as a bf16 pair: vpmultishiftqb moves the 8 bits
// at the offsets in `select` (one byte per byte of each 64-bit lane, so the
// even bytes pick the low and high 16-bit halves' nibbles of both words)
// into place, and vpermw decodes the low 5 bits of each 16-bit half: the 16
// values are stored twice, so the 5th bit (the next nibble) is ignored.
template <int F>
inline vf decode_bf16_pairs(vi w, int64_t select) {
  typedef short v32s __attribute__((vector_size(64)));
#define MARLIN_V(i) short(bf16_bits(code_value<F>(i)))
  const v32s values = {MARLIN_CODES(MARLIN_V), MARLIN_CODES(MARLIN_V)};
#undef MARLIN_V
  return (vf)_mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(select), (__m512i)w),
                                      (__m512i)values);
}
#endif

// Whether code_value<F> of every code is exact in bf16 (its low 16 bits are 0).
template <int F>
constexpr bool values_fit_bf16() {
  for (int i = 0; i < 16; ++i)
    if (__builtin_bit_cast(uint32_t, code_value<F>(i)) & 0xFFFFu) return false;
  return true;
}

// Pair p (0..3) of each prepared word. The ops give bf16 x only to formats
// with values_exact_in_bf16 (metal/marlin_common.h), which this checks.
template <int F>
inline vf decode_pair(vi w, int p) {
  static_assert(!values_exact_in_bf16(WeightFormat(F)) || values_fit_bf16<F>(),
                "values_exact_in_bf16 claims bf16-exact values that are not");
#if MARLIN_KERNEL_AVX512
  // Nibbles 2p, 2p + 1: word bits 8p.. and 8p + 4...
  return decode_bf16_pairs<F>(w, 0x2424202004040000ll + 0x0808080808080808ll * p);
#else
  // Both nibbles decoded in fp32 (exact in bf16): keep their top halves.
  const vu lo = (vu)decode_nibble<F>(w, 2 * p), hi = (vu)decode_nibble<F>(w, 2 * p + 1);
  return (vf)((lo >> 16) | (hi & 0xFFFF0000u));
#endif
}

#endif  // MARLIN_KERNEL_BF16_DOT

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
