// Shared by every torch_marlin Metal kernel: the function constants and the
// bitwise 4-bit decode of the packing of docs/FORMAT.md (int32 [K/8, N],
// nibble j of word [r, n] = code of B[8r + j, n], least significant nibble
// first). No integer division, and no lookup table in memory (table formats
// index 16 constants held in registers).
//
// marlin_raw_pair<F>(w, p) decodes nibbles p and p + 4 of a word (p = 0..3)
// into a half2 `raw`, exactly:
//   fp4   raw = 2 x e2m1 value, an integer (0, 1, 2, 3, 4, 6, 8, 12, signed);
//         the 1/2 is folded into the group's fp32 scale
//   int4  raw = q - 8
//   uint4 raw = q (the zero point is applied per group, see MarlinParams)
//   affine raw = q (the bias likewise)
//   nf4   raw = the code's table value (marlin_table_pair)
// The pair (p, p + 4) is what one shift-and-mask puts into the two 16-bit
// halves of a word. Kernels reading two *adjacent* K values per lane (the
// simdgroup_matrix fragments) permute K inside each 8-row block to match
// (metal/marlin_tile.h), which does not change any sum over K.
//
// The dequantized weight is (raw - zero) * scale in fp32 (zero = 0 but for
// uint4). Every step is exact for fp4 and int4 (a code has <= 2 significant
// bits, a scale 11), so rounding once to the output dtype gives the CPU op's
// value bit for bit; uint4 computes (q - zero) * scale in fp32 like the CPU op.
#pragma once

#include <metal_simdgroup_matrix>
#include <metal_stdlib>

#include "marlin_common.h"

using namespace metal;
using namespace marlin;  // WeightFormat (template argument F below), tile constants

// Function constants (indices and meaning: MARLIN_FOR_EACH_FUNCTION_CONSTANT).
#define MARLIN_FC_DECLARE(e, name, index, type) constant type name [[function_constant(index)]];
MARLIN_FOR_EACH_FUNCTION_CONSTANT(MARLIN_FC_DECLARE)
#undef MARLIN_FC_DECLARE

// Group of packed row r (marlin_group_rows is a power of two, or 0 for one
// group over all of K: a shift after specialization).
inline uint marlin_group_of(uint r) { return marlin_group_rows == 0 ? 0u : r / marlin_group_rows; }

// FP4 E2M1 nibbles p, p + 4 -> 2 x value in each half, with no subnormal on the
// way (a GPU or compiler may flush fp16 subnormals; the emulator's
// flush-subnormals mode checks it). The word is first moved so that nibble p
// sits at bits 8..11 (p + 4 at 24..27). E1 E0 M moved to bits 10..11, 9 of
// 1.0h (0x3C00) give a = 2^E * (1 + M / 2): 2 x value for E > 0, and 1 or 1.5
// for E = 0, whose 2 x value M = 2a - 2 is the smaller of the two there (for
// E > 0, 2a - 2 >= a). The sign (bit 11, t << 4) is ORed in last, so -0 stays.
inline half2 marlin_fp4_pair(uint w, uint p) {
  const uint t = p < 2 ? w << (8 - 4 * p) : w >> (4 * p - 8);
  const half2 a = as_type<half2>(0x3C003C00u + ((t & 0x07000700u) << 1));
  const half2 twice = min(a, fma(a, half2(2.0h), half2(-2.0h)));
  return as_type<half2>(as_type<uint>(twice) | ((t << 4) & 0x80008000u));
}

// 4-bit q -> half 1024 + q (q ORed into the mantissa of 0x6400 = 1024.0),
// then the magic and the offset are removed in one exact half fma. Nibbles of
// odd p (1, 5 and 3, 7) are decoded in place as 1024 + 16 q (q at mantissa
// bits 4..7) and scaled by 1/16 in the same fma, so a word needs one shift
// (w >> 8). Branch-free: p may differ between the lanes of a simdgroup.
inline half2 marlin_int_pair(uint w, uint p, half offset) {
  const bool odd = (p & 1u) != 0;
  const uint t = (p & 2u) ? w >> 8 : w;
  const half2 h = as_type<half2>((t & (odd ? 0x00F000F0u : 0x000F000Fu)) | 0x64006400u);
  return fma(h, half2(odd ? 0.0625h : 1.0h), half2((odd ? -64.0h : -1024.0h) - offset));
}

// MarlinFormat<F>: how the kernels decode format F. Declared without a body
// and specialised per format below, so a format added to
// MARLIN_FOR_EACH_FORMAT without its specialisation fails to compile (every
// kernel is instantiated for every format). Each defines
//   static half2 raw_pair(uint w, uint p)  nibbles p, p + 4 of w -> raw values, exactly
//   static V scale(V s)                    the group scale (fp32, any vector width) that
//                                          multiplies raw: the scale times 1 / raw's unit
template <WeightFormat F>
struct MarlinFormat;

// fp4 raw values are 2 x value: the group scale is halved in fp32, exactly.
constant constexpr float kMarlinFp4ScaleFold = 0.5f;

template <>
struct MarlinFormat<kFp4> {
  static half2 raw_pair(uint w, uint p) { return marlin_fp4_pair(w, p); }
  template <typename V>
  static V scale(V s) { return s * kMarlinFp4ScaleFold; }
};

template <>
struct MarlinFormat<kUint4> {
  static half2 raw_pair(uint w, uint p) { return marlin_int_pair(w, p, 0.0h); }
  template <typename V>
  static V scale(V s) { return s; }
};

// affine: raw = q like uint4; the bias is added after the scale (marlin_dequant_pair).
template <>
struct MarlinFormat<kAffine> {
  static half2 raw_pair(uint w, uint p) { return marlin_int_pair(w, p, 0.0h); }
  template <typename V>
  static V scale(V s) { return s; }
};

template <>
struct MarlinFormat<kInt4> {
  static half2 raw_pair(uint w, uint p) { return marlin_int_pair(w, p, half(kInt4Offset)); }
  template <typename V>
  static V scale(V s) { return s; }
};

// The general table decode: nibbles p, p + 4 of w looked up in the format's 16
// values (exact in half). The values are a private array of constants, not a
// `constant` buffer: loop-invariant, so the compiler materializes them once per
// thread (8 32-bit registers) and each code costs an indexed register read, no
// memory access. Per pair: the two indices (one shift and two ands, p = 0 no
// shift; docs/KERNELS.md counts them).
inline half2 marlin_table_pair(uint w, uint p, thread const half* values) {
  const uint t = w >> (4 * p);
  return half2(values[t & 15u], values[(t >> 16) & 15u]);
}

#define MARLIN_HALF_TABLE(v)                                                                            \
  {half(v[0]), half(v[1]), half(v[2]),  half(v[3]),  half(v[4]),  half(v[5]),  half(v[6]),  half(v[7]), \
   half(v[8]), half(v[9]), half(v[10]), half(v[11]), half(v[12]), half(v[13]), half(v[14]), half(v[15])}

template <>
struct MarlinFormat<kNf4> {
  static half2 raw_pair(uint w, uint p) {
    const half values[16] = MARLIN_HALF_TABLE(kNf4Values);
    return marlin_table_pair(w, p, values);
  }
  template <typename V>
  static V scale(V s) { return s; }
};

template <WeightFormat F>
inline half2 marlin_raw_pair(uint w, uint p) {
  return MarlinFormat<F>::raw_pair(w, p);
}

// Per (group, column) constants: dequantized weight = (raw - zero) * scale, or
// raw * scale + zero for a format whose zeros are a bias (zeros_are_bias: affine).
struct MarlinParams {
  float scale;  // MarlinFormat<F>::scale of the stored scale (fp4: scale * kMarlinFp4ScaleFold)
  float zero;   // formats with zeros only: the zero point or the bias
};

template <WeightFormat F>
inline MarlinParams marlin_params(half scale, half zero) {
  MarlinParams p;
  p.scale = MarlinFormat<F>::scale(float(scale));
  p.zero = has_zeros(F) ? float(zero) : 0.0f;
  return p;
}

// Group params of column n in group g.
template <WeightFormat F>
inline MarlinParams marlin_load_params(const device half* scales, const device half* zeros, uint g, uint n,
                                       uint N) {
  const ulong idx = ulong(g) * N + n;
  return marlin_params<F>(scales[idx], has_zeros(F) ? zeros[idx] : 0.0h);
}

// Dequantized weights of nibbles p, p + 4 of w in fp32.
template <WeightFormat F>
inline float2 marlin_dequant_pair(uint w, uint p, MarlinParams params) {
  const float2 raw = float2(marlin_raw_pair<F>(w, p));
  if (zeros_are_bias(F)) return fma(raw, float2(params.scale), float2(params.zero));
  if (has_zeros(F)) return (raw - params.zero) * params.scale;
  return raw * params.scale;
}

// acc plus a group's share of a dot product from sum = sum of raw * x and xsum =
// sum of x over the group's rows (formats with zeros): scale * (sum - zero * xsum),
// or scale * sum + bias * xsum; two fmas either way.
template <WeightFormat F>
inline float marlin_group_dot(float acc, float sum, float xsum, float scale, float zero) {
  if (zeros_are_bias(F)) return fma(scale, sum, fma(zero, xsum, acc));
  if (has_zeros(F)) sum = fma(-zero, xsum, sum);
  return fma(scale, sum, acc);
}
