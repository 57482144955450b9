// Vector primitives of one instruction-set build of the CPU code (kernels and
// quantizer): vector types of the build's width, loads, stores, broadcasts,
// FMA, fp16 <-> fp32, bf16 pair dot products.
//
// GCC/Clang vector extensions give vectors of kLanes floats: one AVX-512
// register (16), one AVX2 register (8), or for the portable build two
// SSE/NEON registers (8; the quantizer's portable build asks for one, 4).
// A few x86/Arm builtins are used where a build has them.
//
// Each build is its own translation unit (kernels_<isa>.cpp, quantize_<isa>.cpp)
// that defines MARLIN_ISA_NS (its namespace) and the feature macros below (all
// default to 0), then includes its top header (kernels_impl.h, quantize_impl.h).
// Everything here is in an anonymous namespace and includes no C++ library
// headers, so the ISA builds cannot leak into each other through shared inline
// functions (ODR).
//   MARLIN_KERNEL_AVX2      AVX2 + FMA + F16C builtins, 8 lanes
//   MARLIN_KERNEL_AVX512    AVX-512 F/BW/VL/DQ intrinsics, 16 lanes
//   MARLIN_KERNEL_BF16_DOT  bf16 pair dot products: AVX512-BF16 + VBMI (with
//                           MARLIN_KERNEL_AVX512) or Arm BF16
//   MARLIN_KERNEL_VNNI      vpdpbusd for int8 dot products: AVX512-VNNI (with
//                           MARLIN_KERNEL_AVX512), or on 256-bit registers in an
//                           AVX2 build (AVX-VNNI, or AVX512-VNNI with AVX512-VL)
//   MARLIN_KERNEL_DOTPROD   Arm dot product (sdot) for int8 dot products
//   MARLIN_KERNEL_VBMI2     AVX512-VBMI2 (with MARLIN_KERNEL_AVX512): the rans
//                           decode's vpexpandw and vpshrdvw
//   MARLIN_VECTOR_BYTES     the vector width, if not the build's register width
#pragma once
#include <stdint.h>
#include <string.h>

#ifndef MARLIN_ISA_NS
#error "define MARLIN_ISA_NS (the build's namespace) before including cpu/cpu_vec.h"
#endif
#ifndef MARLIN_KERNEL_AVX2
#define MARLIN_KERNEL_AVX2 0
#endif
#ifndef MARLIN_KERNEL_AVX512
#define MARLIN_KERNEL_AVX512 0
#endif
#ifndef MARLIN_KERNEL_BF16_DOT
#define MARLIN_KERNEL_BF16_DOT 0
#endif
#ifndef MARLIN_KERNEL_VNNI
#define MARLIN_KERNEL_VNNI 0
#endif
#ifndef MARLIN_KERNEL_DOTPROD
#define MARLIN_KERNEL_DOTPROD 0
#endif
#ifndef MARLIN_KERNEL_VBMI2
#define MARLIN_KERNEL_VBMI2 0
#endif
#define MARLIN_KERNEL_F16C (MARLIN_KERNEL_AVX2 || MARLIN_KERNEL_AVX512)
#if MARLIN_KERNEL_AVX512 || MARLIN_KERNEL_AVX2
// GCC 12's own _mm512_undefined_ps (`__m512 __Y = __Y;`) trips -Wmaybe-uninitialized
// wherever an AVX-512 intrinsic using it is inlined (hundreds of false warnings); GCC 13 fixed it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif
#ifndef MARLIN_VECTOR_BYTES
#define MARLIN_VECTOR_BYTES (MARLIN_KERNEL_AVX512 ? 64 : 32)
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

constexpr int kLanes = MARLIN_VECTOR_BYTES / 4;
typedef float vf __attribute__((vector_size(MARLIN_VECTOR_BYTES)));
typedef int32_t vi __attribute__((vector_size(MARLIN_VECTOR_BYTES)));
typedef uint32_t vu __attribute__((vector_size(MARLIN_VECTOR_BYTES)));
typedef short v8h __attribute__((vector_size(16)));  // 8 fp16 values
typedef float v4f __attribute__((vector_size(16)));
typedef float v8f __attribute__((vector_size(32)));

// --- fp16 -------------------------------------------------------------------------------

#if MARLIN_KERNEL_F16C
inline uint16_t fp16_bits(float f) {
  const v8h h = __builtin_ia32_vcvtps2ph(v4f{f, 0, 0, 0}, 0);  // 0: to nearest, ties to even
  return uint16_t(h[0]);
}
inline float fp16_value(uint16_t h) { return __builtin_ia32_vcvtph2ps(v8h{short(h)})[0]; }
#else
// Nearest fp16 of a float, ties to even (as torch's .to(torch.float16)).
inline uint16_t fp16_bits(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00;   // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00;  // 65520 and up round to infinity
  if (a < 0x38800000u) {                       // below 2^-14: subnormal, steps of 2^-24
    float m;
    memcpy(&m, &a, 4);
    m = m * 16777216.0f;                       // exact: times 2^24, below 1024
    m = (m + 8388608.0f) - 8388608.0f;         // to an integer, ties to even
    return sign | uint16_t(m);                 // 1024 is the smallest normal's bit pattern
  }
  a -= 112u << 23;                                       // exponent bias 127 -> 15
  return sign | uint16_t((a + 0xFFFu + ((a >> 13) & 1u)) >> 13);  // drop 13 bits, ties to even
}
// The float an fp16 bit pattern stands for (exact).
inline float fp16_value(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits;
  if (e == 0) {
    const float v = float(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    memcpy(&bits, &v, 4);
    bits |= sign;
  } else {
    bits = sign | (e == 31 ? 0x7F800000u : (e + 112) << 23) | (m << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
#endif

// dst[0, count) = the floats of count fp16 values.
inline void fp16_to_float(float* dst, const uint16_t* src, int64_t count) {
  int64_t i = 0;
#if MARLIN_KERNEL_AVX512
  for (; i + 16 <= count; i += 16) {
    __m256i h;
    memcpy(&h, src + i, sizeof(h));
    const __m512 f = _mm512_cvtph_ps(h);
    memcpy(dst + i, &f, sizeof(f));
  }
#endif
#if MARLIN_KERNEL_F16C
  for (; i + 8 <= count; i += 8) {
    v8h h;
    memcpy(&h, src + i, sizeof(h));
    const v8f f = __builtin_ia32_vcvtph2ps256(h);
    memcpy(dst + i, &f, sizeof(f));
  }
#endif
  for (; i < count; ++i) dst[i] = fp16_value(src[i]);
}

// --- vectors ------------------------------------------------------------------------------

// kLanes floats from kLanes fp16 values (exact).
inline vf load_halves(const uint16_t* p) {
#if MARLIN_KERNEL_AVX512 && MARLIN_VECTOR_BYTES == 64
  __m256i h;
  memcpy(&h, p, sizeof(h));
  return (vf)_mm512_cvtph_ps(h);
#elif MARLIN_KERNEL_F16C && MARLIN_VECTOR_BYTES == 32
  v8h h;
  memcpy(&h, p, sizeof(h));
  return __builtin_ia32_vcvtph2ps256(h);
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = fp16_value(p[i]);
  return v;
#endif
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
inline vf splat(float f) {  // one vbroadcastss; exact, -0 included
#if MARLIN_KERNEL_AVX512
  return _mm512_set1_ps(f);
#else
  return f - vf{};  // x - (+0) is x: a broadcast
#endif
}
inline vi splat_i(int32_t i) { return vi{} + i; }
// 32 bits of memory in every lane (a bf16 pair of x), without float semantics.
inline vf splat_bits(const void* p) {
  float f;
  memcpy(&f, p, 4);
  return splat(f);
}

// a * b + c in one rounding, asked for explicitly. Plain `a * b + c` is no
// guarantee either way: GCC contracts it into an FMA in C++ whatever -std says
// (measured with GCC 12), so which products fuse can change with the code around them.
inline vf fmadd(vf a, vf b, vf c) {
#if MARLIN_KERNEL_AVX512
  return _mm512_fmadd_ps(a, b, c);
#elif MARLIN_KERNEL_AVX2
  return __builtin_ia32_vfmaddps256(a, b, c);
#elif defined(__aarch64__)
  constexpr int kRegisters = MARLIN_VECTOR_BYTES / 16;  // vf is kRegisters NEON registers
  float32x4_t av[kRegisters], bv[kRegisters], cv[kRegisters];
  memcpy(av, &a, sizeof(a));
  memcpy(bv, &b, sizeof(b));
  memcpy(cv, &c, sizeof(c));
  for (int h = 0; h < kRegisters; ++h) cv[h] = vfmaq_f32(cv[h], av[h], bv[h]);
  memcpy(&c, cv, sizeof(c));
  return c;
#else
  return a * b + c;
#endif
}

#if MARLIN_KERNEL_BF16_DOT
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

// --- int8 dot products --------------------------------------------------------------------
// Each 32-bit lane holds 4 bytes; these are what llama.cpp's Q8_0 dot products
// use per instruction set.

// acc + sum over the 4 bytes of each lane of u * x, u unsigned below 128 (so
// also a valid signed byte), x signed: vpdpbusd (AVX512-VNNI, AVX-VNNI), vpmaddubsw +
// vpmaddwd (AVX-512 BW, AVX2; no saturation: |u * x + u * x| < 2^15), sdot (Arm
// dot product), or shifts and multiplies.
inline vi dot4(vi acc, vi u, vi x) {
#if MARLIN_KERNEL_AVX512 && MARLIN_KERNEL_VNNI
  return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, (__m512i)x);
#elif MARLIN_KERNEL_AVX2 && MARLIN_KERNEL_VNNI
  // The builtin, not an intrinsic: VEX (avxvnni) or EVEX (avx512vnni, avx512vl) as the target allows.
  return (vi)__builtin_ia32_vpdpbusd_v8si((__v8si)acc, (__v8si)u, (__v8si)x);
#elif MARLIN_KERNEL_AVX512
  return acc + (vi)_mm512_madd_epi16(_mm512_maddubs_epi16((__m512i)u, (__m512i)x), _mm512_set1_epi16(1));
#elif MARLIN_KERNEL_AVX2
  return acc + (vi)_mm256_madd_epi16(_mm256_maddubs_epi16((__m256i)u, (__m256i)x), _mm256_set1_epi16(1));
#elif defined(__aarch64__) && MARLIN_KERNEL_DOTPROD
  constexpr int kRegisters = MARLIN_VECTOR_BYTES / 16;
  int32x4_t av[kRegisters], uv[kRegisters], xv[kRegisters];
  memcpy(av, &acc, sizeof(acc));
  memcpy(uv, &u, sizeof(u));
  memcpy(xv, &x, sizeof(x));
  for (int h = 0; h < kRegisters; ++h) av[h] = vdotq_s32(av[h], vreinterpretq_s8_s32(uv[h]), vreinterpretq_s8_s32(xv[h]));
  memcpy(&acc, av, sizeof(acc));
  return acc;
#else
  for (int j = 0; j < 4; ++j) acc += (vi)(((vu)u >> (8 * j)) & 0xFF) * ((x << (24 - 8 * j)) >> 24);
  return acc;
#endif
}

// vpmaddubsw without its vpmaddwd (the builds whose dot4 is the pair): dot2_i16
// gives, per 16-bit half of each lane, u0 * x0 + u1 * x1 for its 2 bytes (u unsigned,
// x signed) as int16, saturated; add_i16 adds such int16 sums, wrapping; widen_i16 adds
// the two halves of each lane into an int32 (dot4 = acc + widen_i16(dot2_i16)). The
// empty asm keeps each add where the caller put it: GCC otherwise regroups a block's
// adds after all of its vpmaddubsw and spills their results to the stack.
#if (MARLIN_KERNEL_AVX2 || MARLIN_KERNEL_AVX512) && !MARLIN_KERNEL_VNNI
constexpr bool kDotInt16 = true;
#if MARLIN_KERNEL_AVX512
inline vi dot2_i16(vi u, vi x) { return (vi)_mm512_maddubs_epi16((__m512i)u, (__m512i)x); }
inline vi add_i16(vi a, vi b) {
  vi sum = (vi)_mm512_add_epi16((__m512i)a, (__m512i)b);
  asm("" : "+v"(sum));
  return sum;
}
inline vi widen_i16(vi s) { return (vi)_mm512_madd_epi16((__m512i)s, _mm512_set1_epi16(1)); }
#else
inline vi dot2_i16(vi u, vi x) { return (vi)_mm256_maddubs_epi16((__m256i)u, (__m256i)x); }
inline vi add_i16(vi a, vi b) {
  vi sum = (vi)_mm256_add_epi16((__m256i)a, (__m256i)b);
  asm("" : "+x"(sum));
  return sum;
}
inline vi widen_i16(vi s) { return (vi)_mm256_madd_epi16((__m256i)s, _mm256_set1_epi16(1)); }
#endif
#else
constexpr bool kDotInt16 = false;  // stubs for the discarded `if constexpr (kInt16)` branches
inline vi dot2_i16(vi, vi) { return vi{}; }
inline vi add_i16(vi, vi) { return vi{}; }
inline vi widen_i16(vi) { return vi{}; }
#endif

// A block's sum of dot products, several dot4 in a row: with kInt16 (kDotInt16 and
// sums proven below 2^15: int16_rows) as int16 pair sums, one vpmaddwd for all of them
// (dot_total), saving one per dot4; else dot4 into int32 lanes. Start from vi{}.
template <bool kInt16>
inline vi dot_add(vi acc, vi u, vi x) {
  if constexpr (kInt16)
    return add_i16(acc, dot2_i16(u, x));
  else
    return dot4(acc, u, x);
}
template <bool kInt16>
inline vi dot_total(vi acc) {
  if constexpr (kInt16)
    return widen_i16(acc);
  else
    return acc;
}

// How many of n word rows may sum their dot_add in int16 (a divisor of n; 0: not one),
// each row adding 2 per int16 lane (its lo and hi code bytes: 4 products) with
// |u| <= max_u, |x| <= max_x: every partial sum stays within 4 * rows * max_u * max_x
// <= 32767, no saturation in vpmaddubsw and no wrap in add_i16.
constexpr int int16_rows(int n, int max_u, int max_x) {
  int rows = n;
  while (rows > 0 && (n % rows != 0 || 4 * rows * max_u * max_x > 32767)) --rows;
  return rows;
}

// dot4 multiplies signed bytes on both sides (sdot); elsewhere u is unsigned.
#if defined(__aarch64__) && MARLIN_KERNEL_DOTPROD
constexpr bool kDot4Symmetric = true;
#else
constexpr bool kDot4Symmetric = false;
#endif

// 16 bytes in every 128-bit lane: a table for lookup_bytes.
inline vi byte_table(const uint8_t* table) {
#if MARLIN_KERNEL_AVX512
  __m128i t;
  memcpy(&t, table, 16);
  return (vi)_mm512_broadcast_i32x4(t);
#elif MARLIN_KERNEL_AVX2
  __m128i t;
  memcpy(&t, table, 16);
  return (vi)_mm256_broadcastsi128_si256(t);
#else
  vi v;
  for (unsigned i = 0; i < sizeof(vi); i += 16) memcpy(reinterpret_cast<char*>(&v) + i, table, 16);
  return v;
#endif
}

// Each byte b (below 16) of v replaced by byte b of its 128-bit lane of `table` (byte_table).
inline vi lookup_bytes(vi v, vi table) {
#if MARLIN_KERNEL_AVX512
  return (vi)_mm512_shuffle_epi8((__m512i)table, (__m512i)v);
#elif MARLIN_KERNEL_AVX2
  return (vi)_mm256_shuffle_epi8((__m256i)table, (__m256i)v);
#elif defined(__aarch64__)
  constexpr int kRegisters = MARLIN_VECTOR_BYTES / 16;
  uint8x16_t vv[kRegisters], t[kRegisters];
  memcpy(vv, &v, sizeof(v));
  memcpy(t, &table, sizeof(table));
  for (int h = 0; h < kRegisters; ++h) vv[h] = vqtbl1q_u8(t[h], vv[h]);
  memcpy(&v, vv, sizeof(v));
  return v;
#else
  uint8_t bytes[sizeof(vi)], t[sizeof(vi)];
  memcpy(bytes, &v, sizeof(v));
  memcpy(t, &table, sizeof(table));
  for (unsigned i = 0; i < sizeof(vi); ++i) bytes[i] = t[i / 16 * 16 + bytes[i]];
  memcpy(&v, bytes, sizeof(v));
  return v;
#endif
}

// Each byte b (below 16) of v replaced by table[b] (16 bytes).
inline vi lookup_bytes(vi v, const uint8_t* table) { return lookup_bytes(v, byte_table(table)); }

// Bytewise a - b (wrapping).
inline vi sub_bytes(vi a, vi b) {
  typedef int8_t vb __attribute__((vector_size(MARLIN_VECTOR_BYTES)));
  return (vi)((vb)a - (vb)b);
}

// Copies `count` (<= width) words/values into a zero-padded local row so
// tails need no separate code path.
inline void copy_words(int32_t* dst, const int32_t* src, int64_t count, int width) {
  memcpy(dst, src, count * sizeof(int32_t));
  memset(dst + count, 0, (width - count) * sizeof(int32_t));
}
inline void copy_halves(float* dst, const uint16_t* src, int64_t count, int width) {
  fp16_to_float(dst, src, count);
  for (int64_t i = count; i < width; ++i) dst[i] = 0.f;
}

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
