// The quantizers of torch_marlin/quantize.py ("mse" search, "absmax") on raw
// pointers, dense or after 2:4 pruning (torch_marlin/sparsity.py), written once
// and compiled per ISA like kernels_impl.h:
// quantize_avx512.cpp, quantize_avx2.cpp and quantize_generic.cpp, on the
// vector primitives and fp16 helpers of cpu/cpu_vec.h.
//
// The Python functions are the specification and this code reproduces them
// bit for bit: every float operation is the reference's, in its order (FP
// contraction into FMA is turned off below), and every sum over a group
// follows the reference's fixed pairwise order (quantize._tree_sum: x[i] +
// x[i + n/2], zero-padded to a power of two). tests/test_quantize_native.py
// checks the equality.
//
// A group of 16 to 256 weights is held in vectors of the ISA's width
// (registers) while its ~40 candidates are tried; the rare other groups
// (group_size=-1, and 8: the kept half of a 2:4 group of 16) run the same code
// on vectors in scratch memory, with a lane mask for the padding. The sum
// order does not depend on the vector width.
//
// Like the kernels this includes no C++ library headers and keeps its helpers
// in an anonymous namespace, so the ISA builds cannot mix (ODR).
//
// Usage: define MARLIN_QUANT_NS and the feature macros of cpu/cpu_vec.h (and
// MARLIN_VECTOR_BYTES for a width other than the register's), then include
// this file, once per translation unit.
#pragma once
#include <stdint.h>
#include <string.h>

// Every float operation is the reference's: no contraction into FMA (set
// before the vector helpers, so that it covers them too).
#if defined(__clang__)
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

#define MARLIN_ISA_NS MARLIN_QUANT_NS
#include "cpu/cpu_vec.h"
#include "cpu/quantize_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_QUANT_NS {
namespace {

typedef uint8_t vb __attribute__((vector_size(kLanes)));
typedef float v2f __attribute__((vector_size(8)));
typedef float v16f __attribute__((vector_size(64)));

// The constants of quantize.py.
constexpr float kFp16Max = 65504.0f;
constexpr float kFp16Tiny = 6.103515625e-05f;  // 2^-14
constexpr float kMinDenominator = 1e-30f;      // clamp_min(1e-30) of the refits
constexpr int kMaxGroup = 256;                 // the longest group kept in registers

inline float fp16_round(float f) { return fp16_value(fp16_bits(f)); }

// torch.clamp(x, lo, hi) of a number.
inline float clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }

// --- vectors ------------------------------------------------------------------------------

inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf bit_and(vf a, vi m) { return (vf)((vi)a & m); }

// round(x).clamp(lo, hi) for integer lo, hi: clamping first is the same (up
// to the sign of a zero, which reaches no result), and keeps |x| < 2^22, where
// adding and subtracting 1.5 * 2^23 rounds to an integer, ties to even.
inline vf round_clamped(vf x, float lo, float hi) {
  const vf magic = splat(12582912.0f);
  return (vmin(vmax(x, splat(lo)), splat(hi)) + magic) - magic;
}

// E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and the midpoints between them:
// y rounds to the magnitude above every midpoint it exceeds (ties down, as
// torch.bucketize in quantize._round_codes).
constexpr float kE2m1Midpoints[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

// The same rounding by bits for the search (formats.round_e2m1_magnitude):
// from 1 up the magnitudes are the floats with one mantissa bit, so adding just
// under half a step and truncating rounds to nearest, ties down (above 6 it
// reaches 8 or more and is clamped); below 1 the steps are 0.5.
inline vf e2m1_magnitude(vf y) {
  const vf one_bit = vmin((vf)(((vi)y + 0x1FFFFF) & ~0x3FFFFF), splat(6.0f));
  const vf below_one = bit_and(splat(0.5f), y > splat(0.25f)) + bit_and(splat(0.5f), y > splat(0.75f));
  return y < splat(1.0f) ? below_one : one_bit;
}
inline vi e2m1_index(vf y) {
  vi index = vi{};
  for (int i = 0; i < 7; ++i) index -= (y > splat(kE2m1Midpoints[i]));  // true is -1
  return index;
}

// The tail of _tree_sum on one vector: lanes i + i+W/2, then i + i+W/4, ...
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define MARLIN_QUANT_SHUFFLE 1
#endif
#endif
#ifdef MARLIN_QUANT_SHUFFLE
inline float horizontal_sum(v2f v) { return v[0] + v[1]; }
inline float horizontal_sum(v4f v) {
  return horizontal_sum(__builtin_shufflevector(v, v, 0, 1) + __builtin_shufflevector(v, v, 2, 3));
}
#if MARLIN_VECTOR_BYTES >= 32
inline float horizontal_sum(v8f v) {
  return horizontal_sum(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
}
#endif
#if MARLIN_VECTOR_BYTES >= 64
inline float horizontal_sum(v16f v) {
  return horizontal_sum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}
#endif
#else
inline float horizontal_sum(vf v) {
  float t[kLanes];
  memcpy(t, &v, sizeof(t));
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int i = 0; i < width; ++i) t[i] = t[i] + t[i + width];
  return t[0];
}
#endif

// _tree_sum of nv vectors (a power of two) whose first level is done: e holds
// the nv/2 pair sums (or the single vector when nv == 1). Consumes e.
inline float tree_sum(vf* e, int count) {
  for (int half = count / 2; half >= 1; half /= 2)
    for (int i = 0; i < half; ++i) e[i] = e[i] + e[i + half];
  return horizontal_sum(e[0]);
}

// --- value formats: the rounding of torch_marlin/formats.py's descriptors -----------------
// QuantFormat<F> is declared without a body and defined per format, so a format
// without one does not compile. Each defines, for w, a scale s and a zero z
// (used by formats with zeros only):
//   static vf values(vf w, vf s, vf z)  quantize._values: the nearest code's value before
//                                       the scale (minus the zero)
//   static vi codes(vf w, vf s, vf z)   quantize._round_codes: the nearest code
//   kMaxValue (symmetric: the absmax maps to it) or kValueRange (with zeros: the range maps onto it)
template <int kFormat>
struct QuantFormat;

template <>
struct QuantFormat<kFp4> {
  static constexpr float kMaxValue = 6.0f;
  static vf values(vf w, vf s, vf) {
    const vi sign = (vi)w & splat_i(int32_t(0x80000000u));
    const vf magnitude = e2m1_magnitude(bit_and(w, splat_i(0x7FFFFFFF)) / s);
    return (vf)((vi)magnitude | sign);  // copysign(magnitude, w)
  }
  static vi codes(vf w, vf s, vf) {
    const vi index = e2m1_index(bit_and(w, splat_i(0x7FFFFFFF)) / s);
    return index | ((w < splat(0.0f)) & (index > splat_i(0)) & splat_i(8));
  }
};

template <>
struct QuantFormat<kInt4> {
  static constexpr float kMaxValue = 7.0f;
  static vf values(vf w, vf s, vf) { return round_clamped(w / s, -8.0f, 7.0f); }
  static vi codes(vf w, vf s, vf z) { return __builtin_convertvector(values(w, s, z), vi) + kInt4Offset; }
};

template <>
struct QuantFormat<kUint4> {
  static constexpr float kValueRange = 15.0f;
  static vf values(vf w, vf s, vf z) { return round_clamped(w / s + z, 0.0f, 15.0f) - z; }
  static vi codes(vf w, vf s, vf z) { return __builtin_convertvector(round_clamped(w / s + z, 0.0f, 15.0f), vi); }
};

// A format given by its 16 values, ascending by code (kValues): the nearest value
// by counting the midpoints below x = w / s, ties to the smaller value as the
// descriptor's bucketize. Each partial sum of the steps is a table value, so
// the value is exact.
template <const float* kValues>
struct TableQuant {
  static constexpr bool ascending() {
    for (int i = 1; i < 16; ++i)
      if (!(kValues[i - 1] < kValues[i])) return false;
    return true;
  }
  static_assert(ascending(), "a table format's values ascend with the code");
  static constexpr float kMaxValue = kValues[15];
  static constexpr float midpoint(int i) { return (kValues[i - 1] + kValues[i]) / 2; }
  static vf values(vf w, vf s, vf) {
    const vf x = w / s;
    vf v = splat(kValues[0]);
    for (int i = 1; i < 16; ++i) v = v + bit_and(splat(kValues[i] - kValues[i - 1]), x > splat(midpoint(i)));
    return v;
  }
  static vi codes(vf w, vf s, vf) {
    const vf x = w / s;
    vi code = splat_i(0);
    for (int i = 1; i < 16; ++i) code = code - (x > splat(midpoint(i)));  // a true compare is -1
    return code;
  }
};

template <>
struct QuantFormat<kNf4> : TableQuant<kNf4Values> {};

// affine: q (the bias z is added after the scale: reconstruct).
template <>
struct QuantFormat<kAffine> {
  static constexpr float kValueRange = 15.0f;
  static vf values(vf w, vf s, vf z) { return round_clamped((w - z) / s, 0.0f, 15.0f); }
  static vi codes(vf w, vf s, vf z) { return __builtin_convertvector(values(w, s, z), vi); }
};

template <int kFormat>
inline vf code_values(vf w, vf s, vf z) {
  return QuantFormat<kFormat>::values(w, s, z);
}

// The weight a code value v stands for (ValueFormat.weights, as the reference orders it).
template <int kFormat>
inline vf reconstruct(vf v, vf s, vf z) {
  if constexpr (kZerosAreBias<kFormat>) return v * s + z;
  return v * s;
}

// --- one group ----------------------------------------------------------------------------

// Candidates evaluated in one pass over a group: two independent dependency
// chains (divide, round, sum, refit) keep the core busy where one would wait.
constexpr int kPair = 2;
constexpr int kMaxSums = 3 * kPair;

// A group held in kV vectors (registers after inlining and unrolling).
template <int kV>
struct FixedGroup {
  static constexpr bool kMasked = false;
  int vectors() const { return kV; }
  vf* sum_scratch(int k) { return t[k]; }
  vf* q_of(int c) { return q[c]; }
  vf w[kV], wc[kV], q[kPair][kV];
  vf t[kMaxSums][kV > 1 ? kV / 2 : 1];
  const vi* valid = nullptr;
  float len, absmax, lo, hi, w_mean;
};

// Any other group (is_long_group): the same arrays in scratch memory, the
// group copied there, padded with zeros to a power of two and masked by `valid`.
struct LongGroup {
  static constexpr bool kMasked = true;
  int nv;
  int vectors() const { return nv; }
  vf* sum_scratch(int k) { return t + k * (nv > 1 ? nv / 2 : 1); }
  vf* q_of(int c) { return q + c * nv; }
  vf *w, *wc, *q, *t;
  const vi* valid;
  float len, absmax, lo, hi, w_mean;
};

// Arrays of `width` floats a LongGroup uses: w, valid, wc, q (per candidate)
// and the sums' first levels.
constexpr int64_t kLongGroupArrays = 3 + kPair + kMaxSums;

template <class G>
inline vf masked(const G& g, vf p, int j) {
  if constexpr (G::kMasked) return bit_and(p, g.valid[j]);
  return p;
}

// kSums sums over the group at once, of f(j, out) (kSums vectors per j), each
// in _tree_sum order: the first level adds vector i and i + nv/2 as they are made.
template <int kSums, class G, class F>
inline void group_sums(G& g, F f, float* sums) {
  const int nv = g.vectors();
  const int half = nv > 1 ? nv / 2 : 1;
  for (int i = 0; i < half; ++i) {
    vf a[kSums], b[kSums];
    f(i, a);
    if (nv > 1) f(i + half, b);
    for (int k = 0; k < kSums; ++k) {
      vf* t = g.sum_scratch(k);
      t[i] = masked(g, a[k], i);
      if (nv > 1) t[i] = t[i] + masked(g, b[k], i + half);
    }
  }
  for (int k = 0; k < kSums; ++k) sums[k] = tree_sum(g.sum_scratch(k), half);
}

// The statistics every candidate reuses (quantize._symmetric/_asymmetric).
template <int kFormat, class G>
inline void prepare(G& g, float* norm2) {
  const int nv = g.vectors();
  vf mx = vmax(g.w[0], -g.w[0]), lo = g.w[0], hi = g.w[0];
  for (int j = 1; j < nv; ++j) {
    mx = vmax(mx, vmax(g.w[j], -g.w[j]));
    lo = vmin(lo, g.w[j]);
    hi = vmax(hi, g.w[j]);
  }
  float m[kLanes], l[kLanes], h[kLanes];
  memcpy(m, &mx, sizeof(m));
  memcpy(l, &lo, sizeof(l));
  memcpy(h, &hi, sizeof(h));
  g.absmax = m[0], g.lo = l[0], g.hi = h[0];
  for (int i = 1; i < kLanes; ++i) {
    g.absmax = m[i] > g.absmax ? m[i] : g.absmax;
    g.lo = l[i] < g.lo ? l[i] : g.lo;
    g.hi = h[i] > g.hi ? h[i] : g.hi;
  }
  // Padding lanes are zeros; they can only move lo/hi to 0, where the clamps put them anyway.
  g.lo = g.lo > 0.0f ? 0.0f : g.lo;  // amin(-1).clamp(max=0)
  g.hi = g.hi < 0.0f ? 0.0f : g.hi;  // amax(-1).clamp(min=0)
  float sums[2];
  group_sums<2>(g, [&](int j, vf* out) {
    out[0] = g.w[j] * g.w[j];
    out[1] = g.w[j];
  }, sums);
  *norm2 = sums[0];
  if constexpr (kHasZeros<kFormat>) {
    g.w_mean = sums[1] / g.len;
    const vf mean = splat(g.w_mean);
    for (int j = 0; j < nv; ++j) g.wc[j] = g.w[j] - mean;
  }
}

struct Candidate {
  float scale, zero;  // zero: formats with zeros only (affine: the bias)
};

// The squared errors of kCount candidates and, when kRefit, the least-squares
// refits of their scale (and zero) on their codes: one round of the
// reference's inner loop per candidate.
template <int kFormat, bool kRefit, int kCount, class G>
inline void evaluate(G& g, const Candidate* c, Candidate* next, float* err) {
  vf s[kCount], z[kCount];
  for (int i = 0; i < kCount; ++i) s[i] = splat(c[i].scale), z[i] = splat(c[i].zero);
  if constexpr (!kRefit) {
    group_sums<kCount>(g, [&](int j, vf* out) {
      for (int i = 0; i < kCount; ++i) {
        const vf d = reconstruct<kFormat>(code_values<kFormat>(g.w[j], s[i], z[i]), s[i], z[i]) - g.w[j];
        out[i] = d * d;
      }
    }, err);
  } else if constexpr (!kHasZeros<kFormat>) {
    float sums[3 * kCount];
    group_sums<3 * kCount>(g, [&](int j, vf* out) {
      for (int i = 0; i < kCount; ++i) {
        const vf v = code_values<kFormat>(g.w[j], s[i], z[i]);
        const vf d = v * s[i] - g.w[j];
        out[3 * i] = d * d;
        out[3 * i + 1] = v * v;
        out[3 * i + 2] = v * g.w[j];
      }
    }, sums);
    for (int i = 0; i < kCount; ++i) {
      // Least-squares scale for these codes: argmin_s ||v*s - w||.
      const float vv = sums[3 * i + 1], vw = sums[3 * i + 2];
      const float refit = vw / (vv < kMinDenominator ? kMinDenominator : vv);
      err[i] = sums[3 * i];
      next[i].scale = fp16_round(clamp(vv > 0.0f ? refit : c[i].scale, kFp16Tiny, kFp16Max));
      next[i].zero = 0.0f;
    }
  } else {
    float sums[2 * kCount];
    group_sums<2 * kCount>(g, [&](int j, vf* out) {
      for (int i = 0; i < kCount; ++i) {
        const vf v = code_values<kFormat>(g.w[j], s[i], z[i]);
        const vf d = reconstruct<kFormat>(v, s[i], z[i]) - g.w[j];
        out[2 * i] = d * d;
        g.q_of(i)[j] = kZerosAreBias<kFormat> ? v : v + z[i];
        out[2 * i + 1] = g.q_of(i)[j];
      }
    }, sums);
    // Least-squares fit w ~ a*q + b on these codes, then zero = -b/a (affine: bias = b).
    float q_mean[kCount];
    vf qm[kCount];
    for (int i = 0; i < kCount; ++i) {
      err[i] = sums[2 * i];
      q_mean[i] = sums[2 * i + 1] / g.len;
      qm[i] = splat(q_mean[i]);
    }
    group_sums<2 * kCount>(g, [&](int j, vf* out) {
      for (int i = 0; i < kCount; ++i) {
        const vf qc = g.q_of(i)[j] - qm[i];
        out[2 * i] = qc * qc;
        out[2 * i + 1] = qc * g.wc[j];
      }
    }, sums);
    for (int i = 0; i < kCount; ++i) {
      const float var = sums[2 * i], cov = sums[2 * i + 1];
      const float a = cov / (var < kMinDenominator ? kMinDenominator : var);
      const bool ok = var > 0.0f && a > kFp16Tiny;
      next[i].scale = fp16_round(clamp(ok ? a : c[i].scale, kFp16Tiny, kFp16Max));
      const float b = g.w_mean - a * q_mean[i];
      if constexpr (kZerosAreBias<kFormat>) {
        next[i].zero = fp16_round(clamp(ok ? b : c[i].zero, -kFp16Max, kFp16Max));
      } else {
        next[i].zero = fp16_round(clamp(ok ? -b / next[i].scale : c[i].zero, -kFp16Max, kFp16Max));
      }
    }
  }
}

// The candidate of clip ratio r before any refit.
template <int kFormat, class G>
inline Candidate clipped(const G& g, float r) {
  if constexpr (kHasZeros<kFormat>) {
    const float scale = fp16_round(clamp((g.hi - g.lo) * r / QuantFormat<kFormat>::kValueRange, kFp16Tiny, kFp16Max));
    if constexpr (kZerosAreBias<kFormat>) return {scale, fp16_round(clamp(g.lo * r, -kFp16Max, kFp16Max))};
    return {scale, fp16_round(-g.lo * r / scale)};
  } else {
    return {fp16_round(clamp(g.absmax * r / QuantFormat<kFormat>::kMaxValue, kFp16Tiny, kFp16Max)), 0.0f};
  }
}

// Round `round` of every clip ratio, two at a time; refits go to round + 1.
template <int kFormat, bool kRefit, class G>
inline void evaluate_round(G& g, const QuantizeArgs& a, int64_t round, Candidate* c, float* err) {
  const int64_t rounds = a.rounds;
  int64_t i = 0;
  for (; i + kPair <= a.num_ratios; i += kPair) {
    Candidate pair[kPair], next[kPair];
    float e[kPair];
    for (int p = 0; p < kPair; ++p) pair[p] = c[(i + p) * rounds + round];
    evaluate<kFormat, kRefit, kPair>(g, pair, next, e);
    for (int p = 0; p < kPair; ++p) {
      err[(i + p) * rounds + round] = e[p];
      if (kRefit) c[(i + p) * rounds + round + 1] = next[p];
    }
  }
  for (; i < a.num_ratios; ++i) {
    Candidate next;
    evaluate<kFormat, kRefit, 1>(g, &c[i * rounds + round], &next, &err[i * rounds + round]);
    if (kRefit) c[i * rounds + round + 1] = next;
  }
}

// The search of quantize._symmetric/_asymmetric: the candidate with the
// smallest squared error, the earliest one (ratio, then round) on ties. The
// rounds run one after another over all ratios, which only reorders
// independent work; the choice scans the candidates in the reference's order.
template <int kFormat, class G>
inline float search(G& g, const QuantizeArgs& a, Candidate* best) {
  Candidate c[kMaxQuantizeCandidates];
  float err[kMaxQuantizeCandidates];
  err[0] = 0.0f;  // overwritten (the op checks num_ratios >= 1); tells the compiler so
  for (int64_t i = 0; i < a.num_ratios; ++i) c[i * a.rounds] = clipped<kFormat>(g, a.ratios[i]);
  for (int64_t round = 0; round < a.rounds; ++round) {
    // The last round's refit is never tried: skip it.
    if (round + 1 < a.rounds) {
      evaluate_round<kFormat, true>(g, a, round, c, err);
    } else {
      evaluate_round<kFormat, false>(g, a, round, c, err);
    }
  }
  int64_t chosen = 0;
  for (int64_t i = 1; i < a.num_ratios * a.rounds; ++i) chosen = err[i] < err[chosen] ? i : chosen;
  *best = c[chosen];
  return err[chosen];
}

// The codes of the chosen candidate (quantize._round_codes), len of them.
template <int kFormat, class G>
inline void write_codes(const G& g, Candidate c, uint8_t* codes, int64_t len) {
  const vf s = splat(c.scale), z = splat(c.zero);
  for (int j = 0; j < g.vectors(); ++j) {
    const vi code = QuantFormat<kFormat>::codes(g.w[j], s, z);
    const vb bytes = __builtin_convertvector(code, vb);
    const int64_t count = len - kLanes * j < kLanes ? len - kLanes * j : kLanes;
    if (count <= 0) break;
    memcpy(codes + kLanes * j, &bytes, count);
  }
}

template <int kFormat, class G>
inline float quantize_group(G& g, const QuantizeArgs& a, uint8_t* codes, Candidate* best, float* norm2) {
  prepare<kFormat>(g, norm2);
  const float err = search<kFormat>(g, a, best);
  write_codes<kFormat>(g, *best, codes, a.group_len);
  return err;
}

// --- rows ---------------------------------------------------------------------------------

int64_t next_pow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}
int64_t round16(int64_t x) { return (x + 15) / 16 * 16; }

// Group sizes 16..256 are held in registers; group_size=-1 (one group of any
// length) and 8 run in scratch memory.
bool is_long_group(const QuantizeArgs& a) {
  return a.group_len < 16 || a.group_len > kMaxGroup || next_pow2(a.group_len) != a.group_len;
}
int64_t long_group_width(const QuantizeArgs& a) { return next_pow2(a.group_len < kLanes ? kLanes : a.group_len); }

// Codes per row: a 2:4 row keeps half of K.
int64_t row_codes(const QuantizeArgs& a) { return a.metadata ? a.padded_k / 2 : a.padded_k; }

// Floats of each piece of the scratch (each a multiple of 16, so 64-byte aligned).
struct ScratchLayout {
  int64_t row, codes, block_scales, nibbles, long_group;
  explicit ScratchLayout(const QuantizeArgs& a) {
    const int64_t groups = row_codes(a) / a.group_len;
    const int64_t width = is_long_group(a) ? long_group_width(a) : 0;
    row = round16(a.padded_k);
    codes = round16((kQuantizeBlockRows * row_codes(a) + 3) / 4);
    block_scales = round16((2 * kQuantizeBlockRows * groups + 1) / 2);  // scales then zeros, fp16
    nibbles = a.metadata ? round16((kQuantizeBlockRows * a.padded_k / 4 + 3) / 4) : 0;  // 2:4 positions
    long_group = kLongGroupArrays * width;
  }
  int64_t total() const { return row + codes + block_scales + nibbles + long_group; }
};

// Row n as float32 into dst[0, width), zeros after k; false if it holds NaN or Inf.
bool load_row(const QuantizeArgs& a, int64_t n, float* dst, int64_t width) {
  const int64_t k = a.k;
  if (a.source == kSourceFloat32) {
    memcpy(dst, static_cast<const float*>(a.weight) + n * a.row_stride, k * sizeof(float));
  } else {
    const uint16_t* src = static_cast<const uint16_t*>(a.weight) + n * a.row_stride;
    if (a.source == kSourceBFloat16) {
      uint32_t* bits = reinterpret_cast<uint32_t*>(dst);
      for (int64_t i = 0; i < k; ++i) bits[i] = uint32_t(src[i]) << 16;
    } else {
      fp16_to_float(dst, src, k);
    }
  }
  memset(dst + k, 0, (width - k) * sizeof(float));
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(dst);
  uint32_t bad = 0;
  for (int64_t i = 0; i < k; ++i) bad |= (bits[i] & 0x7F800000u) == 0x7F800000u;
  return !bad;
}

// Row n of the weight, loaded into row[0, padded_k), pruned to 2:4 in place
// (sparsity.mask_2to4): the kept weights to row[0, padded_k / 2) in K order and
// each block's positions pos0 | pos1 << 2 to nibbles. Scores are |w|, or
// a.scores and -1 for the padding (as quantize_sparse pads them). Returns the
// sum of the pruned weights' squares.
double prune_row(const QuantizeArgs& a, int64_t n, float* row, uint8_t* nibbles) {
  const float* given = a.scores ? a.scores + n * a.scores_stride : nullptr;
  double pruned = 0.0;
  for (int64_t b = 0; b < a.padded_k / 4; ++b) {
    const float* w = row + 4 * b;
    float s[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t col = 4 * b + i;
      s[i] = !given ? __builtin_fabsf(w[i]) : col < a.k ? given[col] : -1.0f;
    }
    // Entry i is kept when fewer than two entries beat it: greater, or equal at a lower index.
    int kept[2] = {0, 1}, count = 0;
    for (int i = 0; i < 4 && count < 2; ++i) {
      int beaten = 0;
      for (int j = 0; j < 4; ++j) beaten += s[j] > s[i] || (s[j] == s[i] && j < i);
      if (beaten < 2) kept[count++] = i;
    }
    const float w0 = w[kept[0]], w1 = w[kept[1]];
    for (int i = 0; i < 4; ++i) pruned += i == kept[0] || i == kept[1] ? 0.0 : double(w[i]) * w[i];
    row[2 * b] = w0;  // in place: 2b + 1 <= 4b + 1, this block or an earlier one, all read
    row[2 * b + 1] = w1;
    nibbles[b] = uint8_t(kept[0] | kept[1] << 2);
  }
  return pruned;
}

// Word kw of row r packs bytes[r * len + 8kw + order[j]] at bits 4j..4j+3,
// j = 0..7, into dst[kw * n + r].
void pack_rows(const uint8_t* bytes, int64_t len, int64_t rows, const int* order, int32_t* dst, int64_t n) {
  for (int64_t kw = 0; kw < len / 8; ++kw) {
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* c = bytes + r * len + 8 * kw;
      uint32_t word = 0;
      for (int j = 0; j < 8; ++j) word |= uint32_t(c[order[j]]) << (4 * j);
      dst[kw * n + r] = int32_t(word);
    }
  }
}
constexpr int kKOrder[8] = {0, 1, 2, 3, 4, 5, 6, 7};
constexpr int kSparseValueOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};  // layouts/sparse24.py VALUE_ORDER

template <int kFormat, int kV>
float quantize_fixed(const float* w, const QuantizeArgs& a, uint8_t* codes, Candidate* best, float* norm2) {
  FixedGroup<kV> g;
  for (int j = 0; j < kV; ++j) g.w[j] = load(w + kLanes * j);
  g.len = float(a.group_len);
  return quantize_group<kFormat>(g, a, codes, best, norm2);
}

template <int kFormat>
float quantize_long(const float* w, const QuantizeArgs& a, float* scratch, uint8_t* codes, Candidate* best,
                    float* norm2) {
  LongGroup g;
  const int64_t width = long_group_width(a);
  g.nv = int(width / kLanes);
  g.len = float(a.group_len);
  // A copy: the row's next group (group_len 8) must read as padding, and vectors must be aligned.
  float* group = scratch;
  memcpy(group, w, a.group_len * sizeof(float));
  memset(group + a.group_len, 0, (width - a.group_len) * sizeof(float));
  g.w = reinterpret_cast<vf*>(group);
  vi* valid = reinterpret_cast<vi*>(scratch + width);
  for (int64_t i = 0; i < width; ++i) reinterpret_cast<int32_t*>(valid)[i] = i < a.group_len ? -1 : 0;
  g.valid = valid;
  g.wc = reinterpret_cast<vf*>(scratch + 2 * width);
  g.q = reinterpret_cast<vf*>(scratch + 3 * width);
  g.t = reinterpret_cast<vf*>(scratch + (3 + kPair) * width);
  return quantize_group<kFormat>(g, a, codes, best, norm2);
}

template <int kFormat>
float quantize_one(float* w, const QuantizeArgs& a, float* long_scratch, uint8_t* codes, Candidate* best,
                   float* norm2) {
  if (is_long_group(a)) return quantize_long<kFormat>(w, a, long_scratch, codes, best, norm2);
  switch (a.group_len) {
    case 16: return quantize_fixed<kFormat, 16 / kLanes>(w, a, codes, best, norm2);
    case 32: return quantize_fixed<kFormat, 32 / kLanes>(w, a, codes, best, norm2);
    case 64: return quantize_fixed<kFormat, 64 / kLanes>(w, a, codes, best, norm2);
    case 128: return quantize_fixed<kFormat, 128 / kLanes>(w, a, codes, best, norm2);
    default: return quantize_fixed<kFormat, 256 / kLanes>(w, a, codes, best, norm2);
  }
}

}  // namespace

int64_t quantize_scratch_floats(const QuantizeArgs& a) { return ScratchLayout(a).total(); }

QuantizeSums quantize_rows(const QuantizeArgs& a, int64_t n0, int64_t n1, float* scratch) {
  const ScratchLayout layout(a);
  float* row = scratch;
  uint8_t* codes = reinterpret_cast<uint8_t*>(scratch + layout.row);
  uint16_t* block_scales = reinterpret_cast<uint16_t*>(scratch + layout.row + layout.codes);
  uint8_t* nibbles = reinterpret_cast<uint8_t*>(scratch + layout.row + layout.codes + layout.block_scales);
  float* long_scratch = scratch + layout.row + layout.codes + layout.block_scales + layout.nibbles;
  const int64_t len = row_codes(a), groups = len / a.group_len, blocks = a.padded_k / 4;
  uint16_t* block_zeros = block_scales + kQuantizeBlockRows * groups;
  QuantizeSums sums{0.0, 0.0, -1};
  for (int64_t nb = n0; nb < n1; nb += kQuantizeBlockRows) {
    const int64_t rows = n1 - nb < kQuantizeBlockRows ? n1 - nb : kQuantizeBlockRows;
    for (int64_t r = 0; r < rows; ++r) {
      if (!load_row(a, nb + r, row, layout.row)) {
        sums.bad_row = nb + r;
        return sums;
      }
      if (a.metadata) {
        const double pruned = prune_row(a, nb + r, row, nibbles + r * blocks);
        sums.err2 += pruned;
        sums.norm2 += pruned;
      }
      for (int64_t g = 0; g < groups; ++g) {
        float* w = row + g * a.group_len;
        uint8_t* c = codes + r * len + g * a.group_len;
        Candidate best{0.0f, 0.0f};
        float norm2 = 0.0f, err;
        err = with_format(a.format, [&]<int F>() { return quantize_one<F>(w, a, long_scratch, c, &best, &norm2); });
        sums.err2 += err;
        sums.norm2 += norm2;
        block_scales[r * groups + g] = fp16_bits(best.scale);
        block_zeros[r * groups + g] = fp16_bits(best.zero);
      }
    }
    // Dense: word kw of row n holds codes 8kw..8kw+7, code j at bits 4j..4j+3. 2:4: the
    // kept codes in the values' nibble order, and the block positions as they are.
    pack_rows(codes, len, rows, a.metadata ? kSparseValueOrder : kKOrder, a.packed + nb, a.n);
    if (a.metadata) pack_rows(nibbles, blocks, rows, kKOrder, a.metadata + nb, a.n);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r = 0; r < rows; ++r) {
        a.scales[g * a.n + nb + r] = block_scales[r * groups + g];
        if (a.zeros) a.zeros[g * a.n + nb + r] = block_zeros[r * groups + g];
      }
    }
  }
  return sums;
}

}  // namespace MARLIN_QUANT_NS
}  // namespace cpu
}  // namespace marlin
