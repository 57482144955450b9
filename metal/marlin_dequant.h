// Shared by every torch_marlin Metal kernel: bitwise 4-bit -> float dequant
// of the packing of docs/FORMAT.md (int32 [K/8, N], nibble j of word [r, n]
// = code of B[8r + j, n], least significant nibble first). No lookup tables.
//
// Each helper decodes a *consecutive* nibble pair (j, j + 1) of one word into
// a half2 `raw` whose .x is nibble j and .y is nibble j + 1, so one lane can
// fill the two elements of a simdgroup_matrix fragment it owns (two adjacent
// K values of one output column) straight from one packed word.
//
// The dequantized weight is then (float(raw) - offset) * scale with per
// (group, column) constants from make_params():
//   fp4   raw = e2m1 bits moved into half fields = value * 2^-14, offset 0,
//         scale * 2^14 (the exponent-bias correction folded into the scale)
//   int4  raw = 1024 + q (0x6400 magic), offset 1024 + 8
//   uint4 raw = 1024 + q (0x6400 magic), offset 1024, then - zero
// Every step is exact in fp32 for fp4 and int4 (a code has <= 2 significant
// bits, a scale 11), so rounding the result once to the output dtype gives
// the CPU op's value bit for bit. uint4 computes (q - zero) * scale in fp32
// like the CPU op (1024 + zero would not be exact in fp32 for small zeros).
#pragma once

#include <metal_simdgroup_matrix>
#include <metal_stdlib>

#include "marlin_common.h"

using namespace metal;
using namespace marlin;  // WeightFormat (template argument F below), tile constants

// Nibbles j and j + 1 of `w` moved to bits 0..3 and 16..19 (one per half lane).
inline uint marlin_spread_pair(uint w, uint j) {
  const uint t = w >> (4u * j);
  return (t & 0xFu) | ((t & 0xF0u) << 12);
}

// FP4 E2M1 [S E1 E0 M] -> half [S 00 0E1 E0 M 000000000]: sign to bit 15,
// exponent and mantissa to bits 11..9. As a half this is value * 2^-14 for
// every code, normal (E > 0: exponent field E, bias 15 instead of 1) and
// subnormal alike (0x1 -> 0x0200 = 2^-15 = 0.5 * 2^-14), and keeps -0 (0x8000).
inline half2 marlin_fp4_pair_raw(uint w, uint j) {
  const uint x = marlin_spread_pair(w, j);
  const uint bits = ((x & 0x00080008u) << 12) | ((x & 0x00070007u) << 9);
  return as_type<half2>(bits);
}

// 4-bit q -> half 1024 + q: q ORed into the mantissa of 0x6400 (= 1024.0).
inline half2 marlin_u4_pair_raw(uint w, uint j) {
  return as_type<half2>(marlin_spread_pair(w, j) | 0x64006400u);
}

struct MarlinDequantParams {
  float scale;   // multiplies (raw - offset - zero)
  float offset;  // subtracted from raw (exact)
  float zero;    // uint4 only: zero point, subtracted after the offset
};

template <WeightFormat F>
inline MarlinDequantParams marlin_make_params(half scale, half zero) {
  MarlinDequantParams p;
  if (F == kFp4) {
    p.scale = float(scale) * 16384.0f;  // 2^14: FP4 bias 1 -> FP16 bias 15
    p.offset = 0.0f;
    p.zero = 0.0f;
  } else if (F == kInt4) {
    p.scale = float(scale);
    p.offset = 1032.0f;  // magic 1024 + int4 offset 8
    p.zero = 0.0f;
  } else {
    p.scale = float(scale);
    p.offset = 1024.0f;  // magic
    p.zero = float(zero);
  }
  return p;
}

template <WeightFormat F>
inline half2 marlin_pair_raw(uint w, uint j) {
  if (F == kFp4) return marlin_fp4_pair_raw(w, j);
  return marlin_u4_pair_raw(w, j);
}

// Dequantized weights of nibbles (j, j + 1) of `w` in fp32.
template <WeightFormat F>
inline float2 marlin_dequant_pair(uint w, uint j, MarlinDequantParams p) {
  const float2 raw = float2(marlin_pair_raw<F>(w, j));
  if (has_zeros(F)) return ((raw - p.offset) - p.zero) * p.scale;
  return (raw - p.offset) * p.scale;
}

// Group params of column `n` for packed row `r` (8 K values; a group always
// holds whole rows since group sizes are multiples of 8).
template <WeightFormat F>
inline MarlinDequantParams marlin_load_params(const device half* scales, const device half* zeros,
                                              uint r, uint n, uint N, uint group_rows) {
  const ulong idx = ulong((8u * r) / group_rows) * N + n;
  return marlin_make_params<F>(scales[idx], has_zeros(F) ? zeros[idx] : half(0.0h));
}

// Sets this lane's two elements of an 8x8 fragment (element-wise, the form
// Apple's compiler is known to accept for thread_elements()).
inline void marlin_set_elements(thread simdgroup_matrix<float, 8, 8>& m, float2 v) {
  m.thread_elements()[0] = v.x;
  m.thread_elements()[1] = v.y;
}

// Function constants shared by the GEMV/GEMM kernels (set by the dispatch
// plan, csrc/core/metal_plan.cpp).
constant bool marlin_has_bias [[function_constant(0)]];     // add bias[n] before rounding
constant bool marlin_write_partial [[function_constant(1)]];  // K-split: store fp32 partials
