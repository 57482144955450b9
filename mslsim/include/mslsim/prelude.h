// mslsim prelude: the C++17 shim of the Metal Shading Language standard library.
// Included (via -include) before the preprocessed, lightly transformed MSL source.
#pragma once
#include <stdint.h>
#include <stddef.h>
#include <float.h>
#include <limits.h>
#include <type_traits>
#include <utility>
#include <limits>

#include "abi.h"

// ---------------------------------------------------------------- race hooks
// Kernel libraries are compiled with -fsanitize=thread (instrumentation only,
// no TSan runtime): every load and store calls one of these first. An address
// inside the race-checked pool (threadgroup memory and writable device
// buffers) goes to the runtime's race detector (runtime.cpp,
// mslsim_race_access); everything else returns at once.
// Atomics are not instrumented (MSLSIM_NO_TSAN below): they are not races.
#define MSLSIM_NO_TSAN __attribute__((no_sanitize_thread))
#define MSLSIM_HOOK extern "C" __attribute__((no_sanitize_thread, visibility("hidden"), used))
#define MSLSIM_HOOK_ACCESS(name, n, w)                                                            \
  MSLSIM_HOOK void name(void* p) {                                                                \
    if (__builtin_expect((uintptr_t)p - mslsim_race_range.lo < mslsim_race_range.span, 0))        \
      mslsim_race_access((uintptr_t)p, n, w, __builtin_return_address(0));                        \
  }
#define MSLSIM_HOOK_SIZES(pre, w) \
  MSLSIM_HOOK_ACCESS(pre##1, 1, w) MSLSIM_HOOK_ACCESS(pre##2, 2, w) MSLSIM_HOOK_ACCESS(pre##4, 4, w) \
  MSLSIM_HOOK_ACCESS(pre##8, 8, w) MSLSIM_HOOK_ACCESS(pre##16, 16, w)
MSLSIM_HOOK_SIZES(__tsan_read, 0)
MSLSIM_HOOK_SIZES(__tsan_write, 1)
MSLSIM_HOOK_SIZES(__tsan_unaligned_read, 0)
MSLSIM_HOOK_SIZES(__tsan_unaligned_write, 1)
MSLSIM_HOOK_SIZES(__tsan_volatile_read, 0)
MSLSIM_HOOK_SIZES(__tsan_volatile_write, 1)
MSLSIM_HOOK_SIZES(__tsan_unaligned_volatile_read, 0)
MSLSIM_HOOK_SIZES(__tsan_unaligned_volatile_write, 1)
#define MSLSIM_HOOK_RANGE(name, w)                                                                \
  MSLSIM_HOOK void name(void* p, unsigned long n) {                                               \
    if (__builtin_expect((uintptr_t)p - mslsim_race_range.lo < mslsim_race_range.span, 0))        \
      mslsim_race_access((uintptr_t)p, n, w, __builtin_return_address(0));                        \
  }
MSLSIM_HOOK_RANGE(__tsan_read_range, 0)
MSLSIM_HOOK_RANGE(__tsan_write_range, 1)
MSLSIM_HOOK void __tsan_init(void) {}
MSLSIM_HOOK void __tsan_func_entry(void*) {}
MSLSIM_HOOK void __tsan_func_exit(void) {}
MSLSIM_HOOK void __tsan_vptr_update(void**, void*) {}
MSLSIM_HOOK void __tsan_vptr_read(void**) {}
#undef MSLSIM_HOOK_SIZES
#undef MSLSIM_HOOK_ACCESS
#undef MSLSIM_HOOK_RANGE

#define __METAL__ 1
#define __METAL_VERSION__ 310
#define __METAL_MACOS__ 1
#define __HAVE_BFLOAT__ 1
#define MSLSIM 1

#define MSLSIM_SITE const char *mslsim_file = __builtin_FILE(), int mslsim_line = __builtin_LINE()

// ------------------------------------------------------------- scalar types
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;

namespace mslsim {

#if defined(__has_builtin)
#if __has_builtin(__builtin_bit_cast)
#define MSLSIM_HAS_BIT_CAST 1
#endif
#endif
#if defined(MSLSIM_HAS_BIT_CAST)
#define MSLSIM_CONSTEXPR_CVT constexpr
template <class To, class From> constexpr To bitcast(const From& f) { return __builtin_bit_cast(To, f); }
#else
#define MSLSIM_CONSTEXPR_CVT
template <class To, class From> inline To bitcast(const From& f) {
  To t;
  __builtin_memcpy(&t, &f, sizeof(To));
  return t;
}
#endif

// Flush-subnormals mode (compile(..., flush_subnormals=True), MSLSIM_FLUSH_SUBNORMALS): half and bfloat
// subnormals become signed zeros when read (h2f, b2f) and when produced (f2h, f2b), as on a GPU that flushes
// them; fp32 arithmetic runs with the FPU's flush-to-zero and denormals-are-zero modes
// (flush_subnormals_in_this_thread).
#if MSLSIM_FLUSH_SUBNORMALS
constexpr uint16_t flush16(uint16_t bits, uint16_t exponent_mask) {
  return (bits & exponent_mask) == 0 ? (uint16_t)(bits & 0x8000) : bits;
}
#else
constexpr uint16_t flush16(uint16_t bits, uint16_t) { return bits; }
#endif

inline void flush_subnormals_in_this_thread() {  // called first in every GPU thread (each fiber has its own FP state)
#if MSLSIM_FLUSH_SUBNORMALS && defined(__x86_64__)
  uint32_t mx;
  asm volatile("stmxcsr %0" : "=m"(mx));
  mx |= 0x8040u;  // FTZ (bit 15) and DAZ (bit 6)
  asm volatile("ldmxcsr %0" : : "m"(mx));
#elif MSLSIM_FLUSH_SUBNORMALS && defined(__aarch64__)
  uint64_t fpcr;
  asm volatile("mrs %0, fpcr" : "=r"(fpcr));
  fpcr |= 1ull << 24;  // FZ: subnormal inputs and results of fp32 / fp64 are zeros
  asm volatile("msr fpcr, %0" : : "r"(fpcr));
#elif MSLSIM_FLUSH_SUBNORMALS
#error "mslsim: flush_subnormals needs x86-64 or aarch64"
#endif
}

MSLSIM_CONSTEXPR_CVT inline float h2f_exact(uint16_t h) {
#if defined(__FLT16_MAX__)
  return (float)bitcast<_Float16>(h);
#else
  uint32_t s = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, r = 0;
  if (e == 0) {
    if (m == 0) r = s;
    else {
      e = 127 - 15 + 1;
      while (!(m & 0x400)) { m <<= 1; e--; }
      m &= 0x3ff;
      r = s | (e << 23) | (m << 13);
    }
  } else if (e == 31) r = s | 0x7f800000u | (m << 13);
  else r = s | ((e + 112) << 23) | (m << 13);
  return bitcast<float>(r);
#endif
}

MSLSIM_CONSTEXPR_CVT inline float h2f(uint16_t h) { return h2f_exact(flush16(h, 0x7c00)); }

MSLSIM_CONSTEXPR_CVT inline uint16_t f2h_exact(float f) {
#if defined(__FLT16_MAX__)
  return bitcast<uint16_t>((_Float16)f);
#else
  uint32_t x = bitcast<uint32_t>(f);
  uint32_t sign = (x >> 16) & 0x8000;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00 | (ax > 0x7f800000u ? 0x200 : 0);
  if (ax >= 0x477ff000u) return sign | 0x7c00;  // rounds to inf
  if (ax < 0x38800000u) {                       // subnormal or zero: let the FPU round
    float a = bitcast<float>(ax) + 0.5f;
    return sign | (uint16_t)(bitcast<uint32_t>(a) - 0x3f000000u);
  }
  uint32_t mant_odd = (ax >> 13) & 1;
  ax += 0xc8000fffu + mant_odd;  // rebias exponent and round to nearest even
  return sign | (uint16_t)(ax >> 13);
#endif
}

MSLSIM_CONSTEXPR_CVT inline uint16_t f2h(float f) { return flush16(f2h_exact(f), 0x7c00); }

MSLSIM_CONSTEXPR_CVT inline float b2f(uint16_t b) { return bitcast<float>((uint32_t)flush16(b, 0x7f80) << 16); }
MSLSIM_CONSTEXPR_CVT inline uint16_t f2b(float f) {
  uint32_t x = bitcast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
  x += 0x7fffu + ((x >> 16) & 1);
  return flush16((uint16_t)(x >> 16), 0x7f80);
}

struct half;
struct bfloat;
template <class T> struct is_fp16 : std::false_type {};
template <> struct is_fp16<half> : std::true_type {};
template <> struct is_fp16<bfloat> : std::true_type {};
template <class T>
constexpr bool is_scalar_like_v = std::is_arithmetic_v<T> || is_fp16<T>::value;

#define MSLSIM_FP16_CLASS(H, TOF, FROMF)                                                  \
  struct H {                                                                             \
    uint16_t bits;                                                                       \
    H() = default;                                                                       \
    template <class T, std::enable_if_t<is_scalar_like_v<T> && !std::is_same_v<T, H>, int> = 0> \
    MSLSIM_CONSTEXPR_CVT H(T v) : bits(FROMF(static_cast<float>(v))) {}                  \
    MSLSIM_CONSTEXPR_CVT operator float() const { return TOF(bits); }                    \
    static constexpr H from_bits(uint16_t b) { H h{}; h.bits = b; return h; }                        \
    constexpr H operator-() const { return from_bits(bits ^ 0x8000); }                             \
    constexpr H operator+() const { return *this; }                                                \
    H& operator++() { *this = H(float(*this) + 1.0f); return *this; }                    \
    H& operator--() { *this = H(float(*this) - 1.0f); return *this; }                    \
    H operator++(int) { H t = *this; ++*this; return t; }                                \
    H operator--(int) { H t = *this; --*this; return t; }                                \
    template <class U> H& operator+=(const U& o) { return *this = H(*this + o); }        \
    template <class U> H& operator-=(const U& o) { return *this = H(*this - o); }        \
    template <class U> H& operator*=(const U& o) { return *this = H(*this * o); }        \
    template <class U> H& operator/=(const U& o) { return *this = H(*this / o); }        \
  };

MSLSIM_FP16_CLASS(half, h2f, f2h)
MSLSIM_FP16_CLASS(bfloat, b2f, f2b)

// half op half -> half (computed in float, rounded); half op float -> float;
// half op integer -> half.
#define MSLSIM_FP16_BINOP(H, OP)                                                          \
  inline H operator OP(H a, H b) { return H(float(a) OP float(b)); }                     \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>                 \
  inline auto operator OP(H a, U b) {                                                    \
    if constexpr (std::is_floating_point_v<U>) return float(a) OP static_cast<float>(b); \
    else return H(float(a) OP float(b));                                                 \
  }                                                                                      \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>                 \
  inline auto operator OP(U a, H b) {                                                    \
    if constexpr (std::is_floating_point_v<U>) return static_cast<float>(a) OP float(b); \
    else return H(float(a) OP float(b));                                                 \
  }
#define MSLSIM_FP16_CMP(H, OP)                                                            \
  inline bool operator OP(H a, H b) { return float(a) OP float(b); }                     \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>                 \
  inline bool operator OP(H a, U b) { return float(a) OP static_cast<float>(b); }        \
  template <class U, std::enable_if_t<std::is_arithmetic_v<U>, int> = 0>                 \
  inline bool operator OP(U a, H b) { return static_cast<float>(a) OP float(b); }
#define MSLSIM_FP16_ALLOPS(H) \
  MSLSIM_FP16_BINOP(H, +) MSLSIM_FP16_BINOP(H, -) MSLSIM_FP16_BINOP(H, *) MSLSIM_FP16_BINOP(H, /) \
  MSLSIM_FP16_CMP(H, <) MSLSIM_FP16_CMP(H, >) MSLSIM_FP16_CMP(H, <=) MSLSIM_FP16_CMP(H, >=)        \
  MSLSIM_FP16_CMP(H, ==) MSLSIM_FP16_CMP(H, !=)
MSLSIM_FP16_ALLOPS(half)
MSLSIM_FP16_ALLOPS(bfloat)

// ------------------------------------------------------------------ vectors
template <class T, int N> struct vec;

template <class T, int S, int... I> struct swz {
  static constexpr int K = sizeof...(I);
  using V = vec<T, K>;
  T d[S];
  operator V() const { return V(d[I]...); }
  swz& operator=(const V& v) {
    int j = 0;
    ((d[I] = v[j++]), ...);
    return *this;
  }
  swz& operator=(const swz& o) { return *this = V(o); }
  template <class U> swz& operator=(const U& u) { return *this = V(u); }
  template <class U> swz& operator+=(const U& u) { return *this = V(*this) + V(u); }
  template <class U> swz& operator-=(const U& u) { return *this = V(*this) - V(u); }
  template <class U> swz& operator*=(const U& u) { return *this = V(*this) * V(u); }
  template <class U> swz& operator/=(const U& u) { return *this = V(*this) / V(u); }
  T operator[](int i) const {
    constexpr int idx[] = {I...};
    return d[idx[i]];
  }
};

template <class T, int N> struct vec_storage;
template <class T> struct vec_storage<T, 2> {
  union {
    T data[2];
    struct { T x, y; };
    struct { T r, g; };
#include "swizzle2.inc"
  };
};
template <class T> struct vec_storage<T, 3> {
  union {
    T data[4];
    struct { T x, y, z; };
    struct { T r, g, b; };
#include "swizzle3.inc"
  };
};
template <class T> struct vec_storage<T, 4> {
  union {
    T data[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
#include "swizzle4.inc"
  };
};

template <class T> struct vec_count { static constexpr int value = 1; };
template <class T, int N> struct vec_count<vec<T, N>> { static constexpr int value = N; };
template <class T, int S, int... I> struct vec_count<swz<T, S, I...>> { static constexpr int value = sizeof...(I); };
template <class T, int N> struct packed_vec;
template <class T, int N> struct vec_count<packed_vec<T, N>> { static constexpr int value = N; };

template <class T> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};

template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;
  vec() = default;
  vec(const vec& o) { for (int i = 0; i < N; ++i) this->data[i] = o.data[i]; }
  vec& operator=(const vec& o) {
    for (int i = 0; i < N; ++i) this->data[i] = o.data[i];
    return *this;
  }
  template <class S, std::enable_if_t<is_scalar_like_v<S>, int> = 0>
  vec(S s) { for (int i = 0; i < N; ++i) this->data[i] = static_cast<T>(s); }
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit vec(const vec<U, N>& o) { for (int i = 0; i < N; ++i) this->data[i] = static_cast<T>(o.data[i]); }
  template <int S2, int... I, std::enable_if_t<sizeof...(I) == N, int> = 0>
  vec(const swz<T, S2, I...>& s) {
    const T v[] = {s.d[I]...};
    for (int i = 0; i < N; ++i) this->data[i] = v[i];
  }
  template <class U, int S2, int... I, std::enable_if_t<sizeof...(I) == N && !std::is_same_v<U, T>, int> = 0>
  explicit vec(const swz<U, S2, I...>& s) {
    const U v[] = {s.d[I]...};
    for (int i = 0; i < N; ++i) this->data[i] = static_cast<T>(v[i]);
  }
  template <class A, class B, class... R,
            std::enable_if_t<(vec_count<A>::value + vec_count<B>::value + (0 + ... + vec_count<R>::value)) == N, int> = 0>
  vec(const A& a, const B& b, const R&... r) {
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, r), ...);
  }
  T& operator[](int i) { return this->data[i]; }
  const T& operator[](int i) const { return this->data[i]; }

 private:
  template <class A> void put(int& k, const A& a) {
    if constexpr (is_scalar_like_v<A>) this->data[k++] = static_cast<T>(a);
    else {
      constexpr int M = vec_count<A>::value;
      for (int i = 0; i < M; ++i) this->data[k++] = static_cast<T>(a[i]);
    }
  }

 public:
#define MSLSIM_VBIN(OP)                                                                     \
  friend vec operator OP(const vec& a, const vec& b) {                                      \
    vec r;                                                                                  \
    for (int i = 0; i < N; ++i) r.data[i] = static_cast<T>(a.data[i] OP b.data[i]);         \
    return r;                                                                               \
  }                                                                                         \
  vec& operator OP##=(const vec& b) { return *this = *this OP b; }
  MSLSIM_VBIN(+) MSLSIM_VBIN(-) MSLSIM_VBIN(*) MSLSIM_VBIN(/) MSLSIM_VBIN(%) MSLSIM_VBIN(&) MSLSIM_VBIN(|)
  MSLSIM_VBIN(^) MSLSIM_VBIN(<<) MSLSIM_VBIN(>>)
#undef MSLSIM_VBIN
#define MSLSIM_VCMP(OP)                                                  \
  friend vec<bool, N> operator OP(const vec& a, const vec& b) {          \
    vec<bool, N> r;                                                      \
    for (int i = 0; i < N; ++i) r.data[i] = a.data[i] OP b.data[i];      \
    return r;                                                            \
  }
  MSLSIM_VCMP(<) MSLSIM_VCMP(>) MSLSIM_VCMP(<=) MSLSIM_VCMP(>=) MSLSIM_VCMP(==) MSLSIM_VCMP(!=)
  MSLSIM_VCMP(&&) MSLSIM_VCMP(||)
#undef MSLSIM_VCMP
  friend vec operator-(const vec& a) {
    vec r;
    for (int i = 0; i < N; ++i) r.data[i] = static_cast<T>(-a.data[i]);
    return r;
  }
  friend vec operator+(const vec& a) { return a; }
  friend vec operator~(const vec& a) {
    vec r;
    for (int i = 0; i < N; ++i) r.data[i] = static_cast<T>(~a.data[i]);
    return r;
  }
  friend vec<bool, N> operator!(const vec& a) {
    vec<bool, N> r;
    for (int i = 0; i < N; ++i) r.data[i] = !a.data[i];
    return r;
  }
  vec& operator++() { return *this = *this + vec(T(1)); }
  vec& operator--() { return *this = *this - vec(T(1)); }
};

template <class T, int N> struct packed_storage;
template <class T> struct packed_storage<T, 2> { union { T data[2]; struct { T x, y; }; struct { T r, g; }; }; };
template <class T> struct packed_storage<T, 3> { union { T data[3]; struct { T x, y, z; }; struct { T r, g, b; }; }; };
template <class T> struct packed_storage<T, 4> { union { T data[4]; struct { T x, y, z, w; }; struct { T r, g, b, a; }; }; };

template <class T, int N> struct packed_vec : packed_storage<T, N> {
  packed_vec() = default;
  packed_vec(const vec<T, N>& v) { for (int i = 0; i < N; ++i) this->data[i] = v.data[i]; }
  template <class A, class... R, std::enable_if_t<(sizeof...(R) > 0 || is_scalar_like_v<A>), int> = 0>
  packed_vec(const A& a, const R&... r) : packed_vec(vec<T, N>(a, r...)) {}
  operator vec<T, N>() const {
    vec<T, N> v;
    for (int i = 0; i < N; ++i) v.data[i] = this->data[i];
    return v;
  }
  T& operator[](int i) { return this->data[i]; }
  const T& operator[](int i) const { return this->data[i]; }
};
#define MSLSIM_PBIN(OP)                                                                         \
  template <class T, int N, class U> auto operator OP(const packed_vec<T, N>& a, const U& b) {  \
    return vec<T, N>(a) OP b;                                                                   \
  }                                                                                             \
  template <class T, int N, class U, std::enable_if_t<!std::is_same_v<U, packed_vec<T, N>>, int> = 0> \
  auto operator OP(const U& a, const packed_vec<T, N>& b) { return a OP vec<T, N>(b); }
MSLSIM_PBIN(+) MSLSIM_PBIN(-) MSLSIM_PBIN(*) MSLSIM_PBIN(/)
#undef MSLSIM_PBIN

// swizzle arithmetic: convert to vectors (defined after vv below)


template <class T> struct is_swz : std::false_type {};
template <class T, int S, int... I> struct is_swz<swz<T, S, I...>> : std::true_type {};
template <class... A> constexpr bool any_swz_v = (is_swz<A>::value || ...);
template <class X> inline decltype(auto) vv(const X& x) {
  if constexpr (is_swz<X>::value) return vec<std::remove_cv_t<std::remove_reference_t<decltype(x.d[0])>>, X::K>(x);
  else return (x);
}

#define MSLSIM_SBIN(OP)                                                                       \
  template <class A, class B, std::enable_if_t<any_swz_v<A, B>, int> = 0>                      \
  inline auto operator OP(const A& a, const B& b) { return vv(a) OP vv(b); }
MSLSIM_SBIN(+) MSLSIM_SBIN(-) MSLSIM_SBIN(*) MSLSIM_SBIN(/) MSLSIM_SBIN(%) MSLSIM_SBIN(&) MSLSIM_SBIN(|)
MSLSIM_SBIN(^) MSLSIM_SBIN(<<) MSLSIM_SBIN(>>) MSLSIM_SBIN(<) MSLSIM_SBIN(>) MSLSIM_SBIN(<=) MSLSIM_SBIN(>=)
MSLSIM_SBIN(==) MSLSIM_SBIN(!=) MSLSIM_SBIN(&&) MSLSIM_SBIN(||)
#undef MSLSIM_SBIN
#define MSLSIM_SUN(OP) \
  template <class A, std::enable_if_t<any_swz_v<A>, int> = 0> inline auto operator OP(const A& a) { return OP vv(a); }
MSLSIM_SUN(-) MSLSIM_SUN(+) MSLSIM_SUN(~) MSLSIM_SUN(!)
#undef MSLSIM_SUN

template <class T> struct scalar_of { using type = T; };
template <class T, int N> struct scalar_of<vec<T, N>> { using type = T; };

// thunk helpers --------------------------------------------------------------
enum { K_BUF = 0, K_TG = 1, K_BUILTIN = 2 };

template <class T> T make_builtin(const ThreadCtx* c, int b) {
  const uint32_t* v;
  uint32_t s;
  switch (b) {
    case 0: v = c->tpig; break;
    case 1: v = c->tpitg; break;
    case 2: v = c->tgpig; break;
    case 3: v = c->tptg; break;
    case 4: v = c->tgpg; break;
    case 5: v = c->tpg; break;
    case 6: s = c->tiitg; v = &s; break;
    case 7: s = c->tiisg; v = &s; break;
    case 8: s = c->sgiitg; v = &s; break;
    case 9: s = c->tpsg; v = &s; break;
    case 10: s = c->sgptg; v = &s; break;
    case 11: s = c->tiisg % 4; v = &s; break;   // thread_index_in_quadgroup
    case 12: s = c->tiitg / 4; v = &s; break;   // quadgroup_index_in_threadgroup
    default: s = 0; v = &s;
  }
  if constexpr (is_vec<T>::value) {
    T r;
    for (int i = 0; i < T::size; ++i) r[i] = static_cast<typename T::value_type>(v[i]);
    return r;
  } else {
    return static_cast<T>(v[0]);
  }
}

template <class T> T make_arg(ThreadCtx* c, int kind, int idx) {
  if constexpr (std::is_pointer_v<T>) {
    return kind == K_TG ? (T)c->tgbufs[idx] : (T)c->bufs[idx];
  } else if constexpr (std::is_reference_v<T>) {
    return *(std::remove_reference_t<T>*)c->bufs[idx];
  } else {
    if (kind == K_BUILTIN) return make_builtin<T>(c, idx);
    T v;
    __builtin_memcpy((void*)&v, c->bufs[idx], sizeof(T));
    return v;
  }
}

template <class T> struct fn_traits;
template <class R, class... A> struct fn_traits<R(A...)> {
  static constexpr int arity = sizeof...(A);
  template <size_t... I>
  static void call(R (*fn)(A...), ThreadCtx* c, const int* k, const int* x, std::index_sequence<I...>) {
    fn(make_arg<A>(c, k[I], x[I])...);
  }
  template <class P> static long long info1(int field) {
    using B = std::remove_reference_t<std::remove_pointer_t<P>>;
    using U = std::remove_cv_t<B>;
    switch (field) {
      case 0: if constexpr (std::is_void_v<U>) return 1; else return (long long)sizeof(U);
      case 1: return std::is_const_v<B> ? 1 : 0;
      case 2: return std::is_pointer_v<P> ? 1 : std::is_reference_v<P> ? 2 : 0;
      case 3:
        if constexpr (std::is_same_v<U, bool>) return 6;
        else if constexpr (std::is_same_v<U, half>) return 4;
        else if constexpr (std::is_same_v<U, bfloat>) return 5;
        else if constexpr (std::is_floating_point_v<U>) return 3;
        else if constexpr (std::is_integral_v<U> && std::is_signed_v<U>) return 1;
        else if constexpr (std::is_integral_v<U>) return 2;
        else return 0;
      case 4:  // components: 1 for a scalar, N for vec<T, N>, 0 for anything else
        if constexpr (is_vec<U>::value) return U::size;
        else return is_scalar_like_v<U> ? 1 : 0;
      case 5:  // type code (as field 3) of a vector's elements or the scalar
        if constexpr (is_vec<U>::value) return info1<typename U::value_type>(3);
        else return info1<P>(3);
      case 6:  // size of a vector's elements or the scalar
        if constexpr (is_vec<U>::value) return (long long)sizeof(typename U::value_type);
        else return info1<P>(0);
    }
    return -1;
  }
  static long long info(int i, int field) {
    long long r[] = {0, info1<A>(field)...};
    return (i < 0 || i >= (int)sizeof...(A)) ? -1 : r[i + 1];
  }
};

template <class F> struct fn_traits<F*> : fn_traits<F> {};

template <class T> long long value_info(int field) {
  return fn_traits<void(T)>::template info1<T>(field);
}

}  // namespace mslsim

MSLSIM_CONSTEXPR_CVT inline mslsim::half operator""_h(long double v) { return mslsim::half(static_cast<float>(v)); }
MSLSIM_CONSTEXPR_CVT inline mslsim::half operator""_h(unsigned long long v) {
  return mslsim::half(static_cast<float>(v));
}

using mslsim::half;
using mslsim::bfloat;
typedef mslsim::bfloat bfloat16_t;

#define MSLSIM_VEC_TYPES(T, P)                          \
  typedef mslsim::vec<T, 2> P##2;                       \
  typedef mslsim::vec<T, 3> P##3;                       \
  typedef mslsim::vec<T, 4> P##4;                       \
  typedef mslsim::packed_vec<T, 2> packed_##P##2;       \
  typedef mslsim::packed_vec<T, 3> packed_##P##3;       \
  typedef mslsim::packed_vec<T, 4> packed_##P##4;
MSLSIM_VEC_TYPES(float, float)
MSLSIM_VEC_TYPES(half, half)
MSLSIM_VEC_TYPES(bfloat, bfloat)
MSLSIM_VEC_TYPES(int, int)
MSLSIM_VEC_TYPES(uint, uint)
MSLSIM_VEC_TYPES(short, short)
MSLSIM_VEC_TYPES(ushort, ushort)
MSLSIM_VEC_TYPES(char, char)
MSLSIM_VEC_TYPES(uchar, uchar)
MSLSIM_VEC_TYPES(long, long)
MSLSIM_VEC_TYPES(ulong, ulong)
MSLSIM_VEC_TYPES(bool, bool)

#include "metal_lib.h"
