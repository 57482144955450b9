// CPU kernels for torch.ops.marlin.* on raw pointers, written once and
// compiled once per instruction set (kernels_<isa>.cpp); csrc/cpu/ops.cpp
// picks a build at run time.
//
// Everything here is in an anonymous namespace and includes no C++ library
// headers, so the ISA builds cannot leak into each other through shared
// inline functions (ODR). GCC/Clang vector extensions give vectors of
// kLanes floats: one AVX-512 register (16), one AVX2 register (8), or two
// SSE/NEON registers (8). A few x86/Arm builtins are used where a build
// has them.
//
// Usage: define MARLIN_KERNEL_NS, MARLIN_KERNEL_NAME and the feature macros
// below (all default to 0), then include this file.
//   MARLIN_KERNEL_AVX2      AVX2 + FMA + F16C builtins, 8 lanes
//   MARLIN_KERNEL_AVX512    AVX-512 F/BW/VL/DQ intrinsics, 16 lanes
//   MARLIN_KERNEL_BF16_DOT  bf16 pair dot products for bf16 activations:
//                           AVX512-BF16 + VBMI (with MARLIN_KERNEL_AVX512) or Arm BF16
#include <stdint.h>
#include <string.h>

#include "cpu/kernel_args.h"

#ifndef MARLIN_KERNEL_AVX2
#define MARLIN_KERNEL_AVX2 0
#endif
#ifndef MARLIN_KERNEL_AVX512
#define MARLIN_KERNEL_AVX512 0
#endif
#ifndef MARLIN_KERNEL_BF16_DOT
#define MARLIN_KERNEL_BF16_DOT 0
#endif
// MARLIN_KERNEL_RANS: instead of the dense and 2:4 entry points, the
// entropy-coded layout's (csrc/cpu/rans_kernels_impl.h, its own table
// rans_kernels), on the same pieces: csrc/cpu/rans_kernels_<isa>.cpp.
#ifndef MARLIN_KERNEL_RANS
#define MARLIN_KERNEL_RANS 0
#endif
#if MARLIN_KERNEL_AVX512
// GCC 12's own _mm512_undefined_ps (`__m512 __Y = __Y;`) trips -Wmaybe-uninitialized
// wherever an AVX-512 intrinsic using it is inlined (hundreds of false warnings); GCC 13 fixed it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define MARLIN_VECTOR_BYTES 64
#else
#define MARLIN_VECTOR_BYTES 32
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace marlin {
namespace cpu {
namespace MARLIN_KERNEL_NS {
namespace {

constexpr int kLanes = MARLIN_VECTOR_BYTES / 4;
typedef float vf __attribute__((vector_size(MARLIN_VECTOR_BYTES)));
typedef int32_t vi __attribute__((vector_size(MARLIN_VECTOR_BYTES)));
typedef uint32_t vu __attribute__((vector_size(MARLIN_VECTOR_BYTES)));

constexpr int kStrip = int(kGemvBlockCols);  // gemv: columns whose accumulators stay in L1
constexpr int kChunkWords = 16;              // gemv: word rows decoded per pass (128 K values)
constexpr int kPanelStrips = 8;              // gemv: strips per panel (see gemv_impl)
constexpr int kTileCols = int(kGemmBlockCols);
constexpr int kTileRows = int(kGemmBlockRows);  // a 64 KiB fp32 tile: stays in L2
constexpr int kMaxRows = int(kGemvMaxRows);

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

inline vf load(const float* p) {
  vf v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline vi load(const int32_t* p) {
  vi v;
  memcpy(&v, p, sizeof(v));
  return v;
}
inline void store(float* p, vf v) { memcpy(p, &v, sizeof(v)); }
inline vf splat(float f) {  // one vbroadcastss
#if MARLIN_KERNEL_AVX512
  return _mm512_set1_ps(f);
#else
  return vf{f, f, f, f, f, f, f, f};
#endif
}
// 32 bits of memory in every lane (a bf16 pair of x), without float semantics.
inline vf splat_bits(const void* p) {
  float f;
  memcpy(&f, p, 4);
  return splat(f);
}

// a * b + c; -std=c++20 turns off FP contraction, so ask for the FMA.
inline vf fmadd(vf a, vf b, vf c) {
#if MARLIN_KERNEL_AVX512
  return _mm512_fmadd_ps(a, b, c);
#elif MARLIN_KERNEL_AVX2
  return __builtin_ia32_vfmaddps256(a, b, c);
#elif defined(__aarch64__)
  float32x4_t av[2], bv[2], cv[2];  // vf is two NEON registers
  memcpy(av, &a, sizeof(a));
  memcpy(bv, &b, sizeof(b));
  memcpy(cv, &c, sizeof(c));
  for (int h = 0; h < 2; ++h) cv[h] = vfmaq_f32(cv[h], av[h], bv[h]);
  memcpy(&c, cv, sizeof(c));
  return c;
#else
  return a * b + c;
#endif
}

// --- value formats ----------------------------------------------------------------
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
template <int F>
constexpr bool kHasZeros = has_zeros(WeightFormat(F));
template <int F>
constexpr bool kZerosAreBias = zeros_are_bias(WeightFormat(F));

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

// c + (bf16 pairs a) . (bf16 pairs b), lane by lane.
inline vf dot_pairs(vf c, vf a, vf b) {
#if MARLIN_KERNEL_AVX512
  return _mm512_dpbf16_ps(c, (__m512bh)a, (__m512bh)b);
#else
  float32x4_t cv[2], av[2], bv[2];
  memcpy(cv, &c, sizeof(c));
  memcpy(av, &a, sizeof(a));
  memcpy(bv, &b, sizeof(b));
  for (int h = 0; h < 2; ++h) cv[h] = vbfdotq_f32(cv[h], (bfloat16x8_t)av[h], (bfloat16x8_t)bv[h]);
  memcpy(&c, cv, sizeof(c));
  return c;
#endif
}

#endif  // MARLIN_KERNEL_BF16_DOT

// Copies `count` (<= width) words/values into a zero-padded local row so
// tails need no separate code path.
inline void copy_words(int32_t* dst, const int32_t* src, int64_t count, int width) {
  memcpy(dst, src, count * sizeof(int32_t));
  memset(dst + count, 0, (width - count) * sizeof(int32_t));
}
inline void copy_halves(float* dst, const uint16_t* src, int64_t count, int width) {
#if MARLIN_KERNEL_AVX512
  if (count == width) {  // 16 at a time
    for (int i = 0; i < width; i += 16) {
      __m256i h;
      memcpy(&h, src + i, sizeof(h));
      store(dst + i, _mm512_cvtph_ps(h));
    }
    return;
  }
#elif MARLIN_KERNEL_AVX2
  if (count == width) {  // F16C: 8 at a time
    typedef short v8h __attribute__((vector_size(16)));
    for (int i = 0; i < width; i += 8) {
      v8h h;
      memcpy(&h, src + i, sizeof(h));
      store(dst + i, __builtin_ia32_vcvtph2ps256(h));
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
    // Balanced blocks (8 rows = 4 + 4, not 6 + 2): a thin block wastes decodes.
    const int left = rows - i, blocks = (left + block_rows - 1) / block_rows;
    const int mr = (left + blocks - 1) / blocks;
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
  float* sums = new float[2 * padded_cols];
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
  delete[] sums;
}

// ---------------------------------------------------------------------------
// Tiled GEMM (more rows): dequantize a cache-sized tile once, then a
// register-blocked micro-kernel reuses it for every row.

// Dequantizes rows [k0, k0 + rows) x columns [nb, nb + 64) of B into an
// fp32 tile with row stride 64 (columns past N are zero).
template <int F>
void dequant_tile(const GemmArgs& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(64) int32_t words[kTileCols];
  alignas(64) float scale[kTileCols], zero[kTileCols];
  int64_t group = -1;
  for (int64_t r = k0 / 8; r < (k0 + rows) / 8; ++r) {
    const int64_t g = r * 8 / a.group_rows;
    if (g != group) {  // groups span whole words: group_rows is a multiple of 8
      group = g;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + nb, cols, kTileCols);
    }
    const int32_t* src = a.packed + r * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      src = words;
    }
    float* dst = tile + (r * 8 - k0) * kTileCols;
    for (int q = 0; q < kTileCols / kLanes; ++q) {
      const vi w = prepare_words<F>(load(src + kLanes * q));
      const vf s = load(scale + kLanes * q);
      const vf z = kHasZeros<F> ? load(zero + kLanes * q) : vf{};
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const vf v = decode_nibble<F>(w, j);
        store(dst + j * kTileCols + kLanes * q, group_weight<F>(v, s, z));
      }
    }
  }
}

// acc[0:MR, col:col+2*kLanes] += x[0:MR, k0:k0+rows] @ tile[:, col:col+2*kLanes]
// (acc row stride kTileCols, x row stride K).
template <int MR>
inline void micro_kernel(const float* x, int64_t ldx, int64_t rows, const float* tile, int col, float* acc) {
  vf c[MR][2];
  for (int i = 0; i < MR; ++i) {
    c[i][0] = load(acc + i * kTileCols + col);
    c[i][1] = load(acc + i * kTileCols + col + kLanes);
  }
  for (int64_t k = 0; k < rows; ++k) {
    const vf b0 = load(tile + k * kTileCols + col), b1 = load(tile + k * kTileCols + col + kLanes);
    for (int i = 0; i < MR; ++i) {
      const vf xs = splat(x[i * ldx + k]);
      c[i][0] = fmadd(xs, b0, c[i][0]);
      c[i][1] = fmadd(xs, b1, c[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    store(acc + i * kTileCols + col, c[i][0]);
    store(acc + i * kTileCols + col + kLanes, c[i][1]);
  }
}

// Rows per micro-kernel call: 6 x 2 vectors use 12 of AVX2's 16 registers,
// 12 x 2 use 24 of AVX-512's 32.
constexpr int kMicroRows = MARLIN_KERNEL_AVX512 ? 12 : 6;

// Calls body.template operator()<MR>() for MR = rows (1..Max <= 12).
#define MARLIN_ROWS_CASE(MR) \
  case MR: body.template operator()<(MR <= Max ? MR : 1)>(); break;
template <int Max = kMicroRows, class Body>
inline void with_rows(int rows, Body&& body) {
  switch (rows) {
    MARLIN_ROWS_CASE(1) MARLIN_ROWS_CASE(2) MARLIN_ROWS_CASE(3) MARLIN_ROWS_CASE(4) MARLIN_ROWS_CASE(5)
    MARLIN_ROWS_CASE(6) MARLIN_ROWS_CASE(7) MARLIN_ROWS_CASE(8) MARLIN_ROWS_CASE(9) MARLIN_ROWS_CASE(10)
    MARLIN_ROWS_CASE(11) MARLIN_ROWS_CASE(12)
    default: break;
  }
}
#undef MARLIN_ROWS_CASE

// out[m0:m1, nb:nb+64] through fp32 tiles of B that fill(k0, rows, tile)
// writes (the dense dequant_tile, or the 2:4 one).
template <class Fill>
void gemm_tiles(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch, Fill&& fill) {
  float* tile = scratch;
  float* acc = scratch + kTileRows * kTileCols;
  memset(acc, 0, (m1 - m0) * kTileCols * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    fill(k0, rows, tile);
    // Column slices outer: one slice of the tile (16 or 32 KiB) stays in L1
    // while every row block streams past it. (Copying x's block to a
    // stride without L1 set aliasing was measured 1.1x slower.)
    for (int col = 0; col < kTileCols; col += 2 * kLanes) {
      for (int64_t m = m0; m < m1; m += kMicroRows) {
        const float* x = a.x + m * a.k + k0;
        float* c = acc + (m - m0) * kTileCols;
        with_rows(int(m1 - m < kMicroRows ? m1 - m : kMicroRows),
                  [&]<int MR>() { micro_kernel<MR>(x, a.k, rows, tile, col, c); });
      }
    }
  }
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  for (int64_t m = m0; m < m1; ++m)
    memcpy(a.out + m * a.n + nb, acc + (m - m0) * kTileCols, cols * sizeof(float));
}

template <int F>
void gemm_tile_impl(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  gemm_tiles(a, m0, m1, nb, scratch, [&](int64_t k0, int64_t rows, float* tile) { dequant_tile<F>(a, k0, rows, nb, tile); });
}

#if MARLIN_KERNEL_BF16_DOT
// bf16 x: the tile holds bf16 pairs of the codes' values (no scale), pair
// row q = K rows 2q, 2q + 1; the micro-kernel sums one group segment in
// registers and applies the scale (and zero) once per segment.

constexpr int kDotCols = MARLIN_KERNEL_AVX512 ? 64 : 16;  // columns per micro-kernel call
constexpr int kDotVectors = kDotCols / kLanes;
constexpr int kDotRows = MARLIN_KERNEL_AVX512 ? 6 : 4;

// Tile rows [k0, k0 + rows) x 64 columns: (rows / 2) x 64 pairs.
template <int F>
void dequant_pairs_tile(const GemmArgs& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(64) int32_t words[kTileCols];
  for (int64_t r = k0 / 8; r < (k0 + rows) / 8; ++r) {
    const int32_t* src = a.packed + r * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      src = words;
    }
    float* dst = tile + (r * 8 - k0) / 2 * kTileCols;
    for (int q = 0; q < kTileCols / kLanes; ++q) {
      const vi w = prepare_words<F>(load(src + kLanes * q));
      for (int p = 0; p < 4; ++p) store(dst + p * kTileCols + kLanes * q, decode_pair<F>(w, p));
    }
  }
}

// acc[0:MR, col:col+kDotCols] += scale * (x[0:MR, segment] @ tile[pairs, col:...]), and for
// formats with zeros once per group (xsum set: x's sums over the group, row stride ldxsum)
// the zero point's or the bias's term (group_dot).
template <int F, int MR>
inline void micro_dot(const uint16_t* x, int64_t ldx, int64_t pairs, const float* tile, int col,
                      const float* scale, const float* zero, const float* xsum, int64_t ldxsum, float* acc) {
  vf p[MR][kDotVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kDotVectors; ++v) p[i][v] = vf{};
  for (int64_t q = 0; q < pairs; ++q) {
    vf b[kDotVectors];
    for (int v = 0; v < kDotVectors; ++v) b[v] = load(tile + q * kTileCols + col + kLanes * v);
    for (int i = 0; i < MR; ++i) {
      const vf xs = splat_bits(x + i * ldx + 2 * q);
      for (int v = 0; v < kDotVectors; ++v) p[i][v] = dot_pairs(p[i][v], b[v], xs);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < kDotVectors; ++v) {
      const int o = col + kLanes * v;
      vf sum = p[i][v];
      const vf a = load(acc + i * kTileCols + o), s = load(scale + o);
      store(acc + i * kTileCols + o, kHasZeros<F> && xsum ? group_dot<F>(a, sum, splat(xsum[i * ldxsum]), s, load(zero + o))
                                                          : fmadd(s, sum, a));
    }
  }
}

// out[m0:m1, nb:nb+64] through pair tiles that fill(k0, rows, tile) writes
// (the dense dequant_pairs_tile, or the 2:4 one).
template <int F, class Fill>
void gemm_tiles_dot(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch, Fill&& fill) {
  float* tile = scratch;
  float* acc = scratch + kTileRows * kTileCols;
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(64) float scale[kTileCols], zero[kTileCols];
  memset(acc, 0, (m1 - m0) * kTileCols * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    fill(k0, rows, tile);
    for (int64_t s0 = k0; s0 < k0 + rows;) {
      const int64_t g = s0 / a.group_rows;
      const int64_t s1 = (g + 1) * a.group_rows < k0 + rows ? (g + 1) * a.group_rows : k0 + rows;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + nb, cols, kTileCols);
      const float* pairs = tile + (s0 - k0) / 2 * kTileCols;
      for (int64_t m = m0; m < m1;) {
        const int64_t left = m1 - m, blocks = (left + kDotRows - 1) / kDotRows;
        const int mr = int((left + blocks - 1) / blocks);
        const uint16_t* x = a.x_bf16 + m * a.k + s0;
        const float* xsum = kHasZeros<F> && s0 == g * a.group_rows ? a.xsum + m * a.groups + g : nullptr;
        float* c = acc + (m - m0) * kTileCols;
        for (int col = 0; col < kTileCols; col += kDotCols) {
          switch (mr) {
#define MARLIN_MICRO_DOT(MR) micro_dot<F, MR>(x, a.k, (s1 - s0) / 2, pairs, col, scale, zero, xsum, a.groups, c)
            case 1: MARLIN_MICRO_DOT(1); break;
            case 2: MARLIN_MICRO_DOT(2); break;
            case 3: MARLIN_MICRO_DOT(3); break;
            case 4: MARLIN_MICRO_DOT(4); break;
            case 5: MARLIN_MICRO_DOT(5); break;
            default: MARLIN_MICRO_DOT(6); break;
#undef MARLIN_MICRO_DOT
          }
        }
        m += mr;
      }
      s0 = s1;
    }
  }
  for (int64_t m = m0; m < m1; ++m)
    memcpy(a.out + m * a.n + nb, acc + (m - m0) * kTileCols, cols * sizeof(float));
}

template <int F>
void gemm_tile_dot(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  gemm_tiles_dot<F>(a, m0, m1, nb, scratch,
                    [&](int64_t k0, int64_t rows, float* tile) { dequant_pairs_tile<F>(a, k0, rows, nb, tile); });
}
#endif  // MARLIN_KERNEL_BF16_DOT

// The format (and x's type) is dispatched once here so the inner loops are branch-free.
template <int F>
void gemv_format(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; m += kMaxRows) {
    const int64_t e = m1 - m < kMaxRows ? m1 : m + kMaxRows;
#if MARLIN_KERNEL_BF16_DOT
    if (a.x_bf16) {
      if (kGemvStream && e - m == 1 && n1 - n0 >= kStreamMinCols)
        gemv_stream<F, true>(a, m, n0, n1);
      else
        gemv_impl<F, true>(a, m, e, n0, n1);
      continue;
    }
#endif
    if (kGemvStream && e - m == 1 && n1 - n0 >= kStreamMinCols)
      gemv_stream<F, false>(a, m, n0, n1);
    else
      gemv_impl<F, false>(a, m, e, n0, n1);
  }
}

template <int F>
void gemm_tile_format(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
#if MARLIN_KERNEL_BF16_DOT
  if (a.x_bf16) return gemm_tile_dot<F>(a, m0, m1, nb, scratch);
#endif
  gemm_tile_impl<F>(a, m0, m1, nb, scratch);
}

#if !MARLIN_KERNEL_RANS
void gemv(const GemmArgs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  with_format(a.format, [&]<int F>() { gemv_format<F>(a, m0, m1, n0, n1); });
}

// out[m0:m1, nb:nb+64] = x @ B for one column tile; `scratch` holds
// gemm_scratch_floats(m1 - m0) floats.
void gemm_tile(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  with_format(a.format, [&]<int F>() { gemm_tile_format<F>(a, m0, m1, nb, scratch); });
}

void dequantize_rows(const GemmArgs& a, int64_t k0, int64_t k1, int64_t nb, float* tile) {
  with_format(a.format, [&]<int F>() { dequant_tile<F>(a, k0, k1 - k0, nb, tile); });
}

// The 2:4 layout's kernels, on the pieces above.
#include "cpu/sparse24_kernels_impl.h"
#else
#include "cpu/rans_kernels_impl.h"
#endif

}  // namespace

#if MARLIN_KERNEL_RANS
extern const RansKernels rans_kernels = {MARLIN_KERNEL_NAME, rans_gemv, rans_gemm_tile, rans_decode_chunk};
#else
extern const CpuKernels kernels = {MARLIN_KERNEL_NAME,     gemv,
                                   gemm_tile,              dequantize_rows,
                                   bool(MARLIN_KERNEL_BF16_DOT), sparse24_gemv,
                                   sparse24_gemm_tile,     sparse24_dequantize_rows,
                                   kSparseDot};
#endif

}  // namespace MARLIN_KERNEL_NS
}  // namespace cpu
}  // namespace marlin
