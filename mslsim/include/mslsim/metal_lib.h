// mslsim: namespace metal (functions, traits, simd collectives, simdgroup_matrix, atomics).
#pragma once

namespace metal {

template <class T, int N> using vec = ::mslsim::vec<T, N>;

// ------------------------------------------------------------------- traits
#include "metal_traits.inc"
template <class T> struct is_vector : mslsim::is_vec<T> {};
template <class T> constexpr bool is_vector_v = is_vector<T>::value;

template <class T> struct numeric_limits : std::numeric_limits<T> {};
#define MSLSIM_FP16_LIMITS(H, MAXB, MINB, EPSB, LOWB, DIG)                  \
  template <> struct numeric_limits<H> {                                    \
    static constexpr bool is_specialized = true, is_signed = true, is_integer = false; \
    static constexpr bool has_infinity = true, has_quiet_NaN = true;        \
    static constexpr int digits = DIG;                                      \
    static constexpr H max() { return H::from_bits(MAXB); }                 \
    static constexpr H min() { return H::from_bits(MINB); }                 \
    static constexpr H lowest() { return H::from_bits(LOWB); }              \
    static constexpr H epsilon() { return H::from_bits(EPSB); }             \
    static constexpr H infinity() { return H::from_bits(0x7c00 == MAXB + 1 ? 0x7c00 : 0x7f80); } \
    static constexpr H quiet_NaN() { return H::from_bits(0x7c00 == MAXB + 1 ? 0x7e00 : 0x7fc0); } \
    static constexpr H denorm_min() { return H::from_bits(1); }             \
  };
MSLSIM_FP16_LIMITS(half, 0x7bff, 0x0400, 0x1400, 0xfbff, 11)
MSLSIM_FP16_LIMITS(bfloat, 0x7f7f, 0x0080, 0x3c00, 0xff7f, 8)

// --------------------------------------------------------------- conversion
template <class To, class From> inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: source and destination sizes differ");
  To t;
  __builtin_memcpy((void*)&t, (const void*)&f, sizeof(To));
  return t;
}


// swizzle arguments: forward to the vector overloads
#define MSLSIM_SWZ_FWD1(name) \
  template <class A, std::enable_if_t<mslsim::any_swz_v<A>, int> = 0> inline auto name(const A& a) { return name(mslsim::vv(a)); }
#define MSLSIM_SWZ_FWD2(name)                                                                   \
  template <class A, class B, std::enable_if_t<mslsim::any_swz_v<A, B>, int> = 0>               \
  inline auto name(const A& a, const B& b) { return name(mslsim::vv(a), mslsim::vv(b)); }
#define MSLSIM_SWZ_FWD3(name)                                                                             \
  template <class A, class B, class C, std::enable_if_t<mslsim::any_swz_v<A, B, C>, int> = 0>             \
  inline auto name(const A& a, const B& b, const C& c) { return name(mslsim::vv(a), mslsim::vv(b), mslsim::vv(c)); }

// ------------------------------------------------------------ math functions
#define MSLSIM_UNARY(name, fexpr)                                                     \
  inline float name(float x) { return fexpr; }                                        \
  inline half name(half x) { return half(name(float(x))); }                           \
  inline bfloat name(bfloat x) { return bfloat(name(float(x))); }                     \
  template <class T, int N> inline vec<T, N> name(const vec<T, N>& v) {               \
    vec<T, N> r;                                                                      \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                                    \
    return r;                                                                         \
  }                                                                                   \
  MSLSIM_SWZ_FWD1(name)
MSLSIM_UNARY(exp, __builtin_expf(x))
MSLSIM_UNARY(exp2, __builtin_exp2f(x))
MSLSIM_UNARY(exp10, __builtin_powf(10.0f, x))
MSLSIM_UNARY(log, __builtin_logf(x))
MSLSIM_UNARY(log2, __builtin_log2f(x))
MSLSIM_UNARY(log10, __builtin_log10f(x))
MSLSIM_UNARY(sqrt, __builtin_sqrtf(x))
MSLSIM_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
MSLSIM_UNARY(sin, __builtin_sinf(x))
MSLSIM_UNARY(cos, __builtin_cosf(x))
MSLSIM_UNARY(tan, __builtin_tanf(x))
MSLSIM_UNARY(asin, __builtin_asinf(x))
MSLSIM_UNARY(acos, __builtin_acosf(x))
MSLSIM_UNARY(atan, __builtin_atanf(x))
MSLSIM_UNARY(sinh, __builtin_sinhf(x))
MSLSIM_UNARY(cosh, __builtin_coshf(x))
MSLSIM_UNARY(tanh, __builtin_tanhf(x))
MSLSIM_UNARY(asinh, __builtin_asinhf(x))
MSLSIM_UNARY(acosh, __builtin_acoshf(x))
MSLSIM_UNARY(atanh, __builtin_atanhf(x))
MSLSIM_UNARY(floor, __builtin_floorf(x))
MSLSIM_UNARY(ceil, __builtin_ceilf(x))
MSLSIM_UNARY(round, __builtin_roundf(x))
MSLSIM_UNARY(rint, __builtin_rintf(x))
MSLSIM_UNARY(trunc, __builtin_truncf(x))
MSLSIM_UNARY(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MSLSIM_UNARY(fabs, __builtin_fabsf(x))
MSLSIM_UNARY(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MSLSIM_UNARY(sign, (x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : x))
#undef MSLSIM_UNARY

#define MSLSIM_BINARY(name, fexpr)                                                                \
  inline float name(float x, float y) { return fexpr; }                                           \
  inline half name(half x, half y) { return half(name(float(x), float(y))); }                     \
  inline bfloat name(bfloat x, bfloat y) { return bfloat(name(float(x), float(y))); }             \
  template <class T, int N> inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {       \
    vec<T, N> r;                                                                                  \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]);                                          \
    return r;                                                                                     \
  }                                                                                               \
  template <class T, int N, class S, std::enable_if_t<mslsim::is_scalar_like_v<S>, int> = 0>      \
  inline vec<T, N> name(const vec<T, N>& a, S b) { return name(a, vec<T, N>(b)); }        \
  MSLSIM_SWZ_FWD2(name)
MSLSIM_BINARY(pow, __builtin_powf(x, y))
MSLSIM_BINARY(powr, __builtin_powf(x, y))
MSLSIM_BINARY(atan2, __builtin_atan2f(x, y))
MSLSIM_BINARY(fmod, __builtin_fmodf(x, y))
MSLSIM_BINARY(fmin, __builtin_fminf(x, y))
MSLSIM_BINARY(fmax, __builtin_fmaxf(x, y))
MSLSIM_BINARY(copysign, __builtin_copysignf(x, y))
MSLSIM_BINARY(step, (y < x ? 0.0f : 1.0f))
MSLSIM_BINARY(divide, x / y)
#undef MSLSIM_BINARY

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
inline bfloat fma(bfloat a, bfloat b, bfloat c) { return bfloat(__builtin_fmaf(float(a), float(b), float(c))); }
template <class T, int N> inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}

// min / max / clamp / abs for every scalar type
#define MSLSIM_MINMAX(T)                                                        \
  inline T min(T a, T b) { return b < a ? b : a; }                              \
  inline T max(T a, T b) { return a < b ? b : a; }                              \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }              \
  inline T min3(T a, T b, T c) { return min(min(a, b), c); }                    \
  inline T max3(T a, T b, T c) { return max(max(a, b), c); }
MSLSIM_MINMAX(char)
MSLSIM_MINMAX(signed char)
MSLSIM_MINMAX(uchar)
MSLSIM_MINMAX(short)
MSLSIM_MINMAX(ushort)
MSLSIM_MINMAX(int)
MSLSIM_MINMAX(uint)
MSLSIM_MINMAX(long)
MSLSIM_MINMAX(ulong)
MSLSIM_MINMAX(long long)
MSLSIM_MINMAX(unsigned long long)
#undef MSLSIM_MINMAX
inline float min(float a, float b) { return __builtin_fminf(a, b); }
inline float max(float a, float b) { return __builtin_fmaxf(a, b); }
inline float clamp(float x, float lo, float hi) { return min(max(x, lo), hi); }
inline half min(half a, half b) { return half(__builtin_fminf(a, b)); }
inline half max(half a, half b) { return half(__builtin_fmaxf(a, b)); }
inline half clamp(half x, half lo, half hi) { return min(max(x, lo), hi); }
inline bfloat min(bfloat a, bfloat b) { return bfloat(__builtin_fminf(a, b)); }
inline bfloat max(bfloat a, bfloat b) { return bfloat(__builtin_fmaxf(a, b)); }
inline bfloat clamp(bfloat x, bfloat lo, bfloat hi) { return min(max(x, lo), hi); }
template <class T, int N> inline vec<T, N> min(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(a[i], b[i]);
  return r;
}
template <class T, int N> inline vec<T, N> max(const vec<T, N>& a, const vec<T, N>& b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(a[i], b[i]);
  return r;
}
template <class T, int N, class L, class H> inline vec<T, N> clamp(const vec<T, N>& x, const L& lo, const H& hi) {
  return min(max(x, vec<T, N>(lo)), vec<T, N>(hi));
}
inline int abs(int x) { return x < 0 ? -x : x; }
inline short abs(short x) { return x < 0 ? -x : x; }
inline char abs(char x) { return x < 0 ? -x : x; }
inline long abs(long x) { return x < 0 ? -x : x; }
inline uint abs(uint x) { return x; }
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return half::from_bits(x.bits & 0x7fff); }
inline bfloat abs(bfloat x) { return bfloat::from_bits(x.bits & 0x7fff); }
template <class T, int N> inline vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}
template <class T> inline T mix(T x, T y, float a) { return x + (y - x) * a; }
template <class T, int N> inline vec<T, N> mix(const vec<T, N>& x, const vec<T, N>& y, const vec<T, N>& a) {
  return x + (y - x) * a;
}
template <class T> inline T smoothstep(T e0, T e1, T x) {
  T t = clamp((x - e0) / (e1 - e0), T(0), T(1));
  return t * t * (T(3) - T(2) * t);
}

inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool signbit(float x) { return __builtin_signbit(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
inline bool signbit(half x) { return x.bits >> 15; }
inline bool isnan(bfloat x) { return __builtin_isnan(float(x)); }
inline bool isinf(bfloat x) { return __builtin_isinf(float(x)); }
inline bool isfinite(bfloat x) { return __builtin_isfinite(float(x)); }
inline bool signbit(bfloat x) { return x.bits >> 15; }
template <class T, int N> inline vec<bool, N> isnan(const vec<T, N>& v) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r[i] = isnan(v[i]);
  return r;
}
inline float ldexp(float x, int e) { return __builtin_ldexpf(x, e); }
inline half ldexp(half x, int e) { return half(__builtin_ldexpf(float(x), e)); }

template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = s + a[i] * b[i];
  return s;
}
template <class T, int N> inline T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }
template <class T, int N> inline vec<T, N> normalize(const vec<T, N>& a) { return a * rsqrt(dot(a, a)); }
template <class T> inline vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}
template <int N> inline bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) if (!v[i]) return false;
  return true;
}
template <int N> inline bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class T, std::enable_if_t<!mslsim::is_vec<T>::value, int> = 0> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N> inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) { return c ? b : a; }

template <class T> inline T popcount(T x) { return (T)__builtin_popcountll((unsigned long long)(std::make_unsigned_t<T>)x); }
template <class T> inline T clz(T x) {
  using U = std::make_unsigned_t<T>;
  return x == 0 ? (T)(sizeof(T) * 8) : (T)(__builtin_clzll((unsigned long long)(U)x) - (64 - sizeof(T) * 8));
}
template <class T> inline T ctz(T x) { return x == 0 ? (T)(sizeof(T) * 8) : (T)__builtin_ctzll((unsigned long long)x); }
template <class T> inline T extract_bits(T x, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return 0;
  U m = bits >= sizeof(T) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
  return (T)(((U)x >> offset) & m);
}
template <class T> inline T insert_bits(T base, T insert, uint offset, uint bits) {
  using U = std::make_unsigned_t<T>;
  U m = bits >= sizeof(T) * 8 ? (U)~(U)0 : (U)(((U)1 << bits) - 1);
  return (T)(((U)base & ~(U)(m << offset)) | (((U)insert & m) << offset));
}
template <class T> inline T mulhi(T a, T b) {
  return (T)(((long long)a * (long long)b) >> (sizeof(T) * 8));
}
template <class T> inline T reverse_bits(T x) {
  T r = 0;
  for (unsigned i = 0; i < sizeof(T) * 8; ++i) r |= ((x >> i) & 1) << (sizeof(T) * 8 - 1 - i);
  return r;
}

MSLSIM_SWZ_FWD1(abs)
MSLSIM_SWZ_FWD1(isnan)
MSLSIM_SWZ_FWD1(length)
MSLSIM_SWZ_FWD1(normalize)
MSLSIM_SWZ_FWD1(all)
MSLSIM_SWZ_FWD1(any)
MSLSIM_SWZ_FWD2(min)
MSLSIM_SWZ_FWD2(max)
MSLSIM_SWZ_FWD2(dot)
MSLSIM_SWZ_FWD2(cross)
MSLSIM_SWZ_FWD3(clamp)
MSLSIM_SWZ_FWD3(fma)
MSLSIM_SWZ_FWD3(mix)
MSLSIM_SWZ_FWD3(select)

namespace fast { using namespace ::metal; }
namespace precise { using namespace ::metal; }

// ----------------------------------------------------------------- barriers
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags((uint)a | (uint)b); }

// A barrier orders (for the race detector) the memory its flags name: mem_none is an execution
// barrier only. A simdgroup_barrier is a collective without a function; p0 carries its flags.
inline void threadgroup_barrier(mem_flags f, MSLSIM_SITE) { mslsim_tg_barrier((uint)f, mslsim_file, mslsim_line); }
inline void simdgroup_barrier(mem_flags f, MSLSIM_SITE) {
  mslsim::Coll c{};
  c.p0 = (uint)f;
  mslsim_simd_collective(&c, mslsim_file, mslsim_line);
}
inline void threadgroup_barrier(MSLSIM_SITE) { threadgroup_barrier(mem_flags::mem_none, mslsim_file, mslsim_line); }
inline void simdgroup_barrier(MSLSIM_SITE) { simdgroup_barrier(mem_flags::mem_none, mslsim_file, mslsim_line); }

// --------------------------------------------------------- simd collectives
}  // namespace metal

namespace mslsim {
enum CollOp { C_SUM, C_PROD, C_MIN, C_MAX, C_AND, C_OR, C_XOR, C_PREFIX_EX_SUM, C_PREFIX_IN_SUM,
              C_PREFIX_EX_PROD, C_PREFIX_IN_PROD, C_SHUFFLE, C_SHUFFLE_XOR, C_SHUFFLE_DOWN,
              C_SHUFFLE_UP, C_BROADCAST, C_BROADCAST_FIRST, C_SHUFFLE_ROT_DOWN, C_SHUFFLE_ROT_UP };

template <class T> inline T op_min(const T& a, const T& b) { using metal::min; return min(a, b); }
template <class T> inline T op_max(const T& a, const T& b) { using metal::max; return max(a, b); }

// Q = lanes per group (32 for simd, 4 for quad)
template <class T, int OP, int Q> void coll_fn(Coll* const* L, int n) {
  Coll* by_lane[32] = {};
  for (int i = 0; i < n; ++i) by_lane[L[i]->lane] = L[i];
  for (int i = 0; i < n; ++i) {
    Coll* me = L[i];
    int lane = me->lane;
    int qbase = (lane / Q) * Q, ql = lane % Q;
    T r = *(const T*)me->in;
    auto val = [&](int l) -> const T& { return *(const T*)by_lane[l]->in; };
    if constexpr (OP <= C_XOR) {
      bool first = true;
      for (int l = qbase; l < qbase + Q; ++l) {
        if (!by_lane[l]) continue;
        if (first) { r = val(l); first = false; continue; }
        if constexpr (OP == C_SUM) r = r + val(l);
        else if constexpr (OP == C_PROD) r = r * val(l);
        else if constexpr (OP == C_MIN) r = op_min(r, val(l));
        else if constexpr (OP == C_MAX) r = op_max(r, val(l));
        else if constexpr (OP == C_AND) r = r & val(l);
        else if constexpr (OP == C_OR) r = r | val(l);
        else r = r ^ val(l);
      }
    } else if constexpr (OP >= C_PREFIX_EX_SUM && OP <= C_PREFIX_IN_PROD) {
      constexpr bool prod = OP == C_PREFIX_EX_PROD || OP == C_PREFIX_IN_PROD;
      constexpr bool incl = OP == C_PREFIX_IN_SUM || OP == C_PREFIX_IN_PROD;
      r = T(prod ? 1 : 0);
      for (int l = qbase; l < lane + (incl ? 1 : 0); ++l) {
        if (!by_lane[l]) continue;
        if constexpr (prod) r = r * val(l);
        else r = r + val(l);
      }
    } else {
      long long p = me->p0;
      int src = -1;
      if constexpr (OP == C_SHUFFLE) src = qbase + (int)(p % Q);
      else if constexpr (OP == C_SHUFFLE_XOR) src = qbase + ((ql ^ (int)p) & (Q - 1));
      else if constexpr (OP == C_SHUFFLE_DOWN) src = ql + p < Q ? lane + (int)p : -1;
      else if constexpr (OP == C_SHUFFLE_UP) src = ql - p >= 0 ? lane - (int)p : -1;
      else if constexpr (OP == C_SHUFFLE_ROT_DOWN) src = qbase + (int)((ql + p) % Q);
      else if constexpr (OP == C_SHUFFLE_ROT_UP) src = qbase + (int)(((ql - p) % Q + Q) % Q);
      else if constexpr (OP == C_BROADCAST) src = qbase + (int)(p % Q);
      else {
        for (int l = qbase; l < qbase + Q; ++l)
          if (by_lane[l]) { src = l; break; }
      }
      if (src >= 0 && src < 32 && by_lane[src]) r = val(src);
    }
    *(T*)me->out = r;
  }
}

template <class T, int OP, int Q> inline T collective(const T& x, long long p, const char* file, int line) {
  T out = x;
  Coll c{};
  c.fn = &coll_fn<T, OP, Q>;
  c.in = &x;
  c.out = &out;
  c.p0 = p;
  mslsim_simd_collective(&c, file, line);
  return out;
}

inline void vote_fn(Coll* const* L, int n) {
  uint64_t m = 0;
  for (int i = 0; i < n; ++i)
    if (*(const bool*)L[i]->in) m |= 1ull << L[i]->lane;
  for (int i = 0; i < n; ++i) *(uint64_t*)L[i]->out = m;
}
inline void active_fn(Coll* const* L, int n) {
  uint64_t m = 0;
  for (int i = 0; i < n; ++i) m |= 1ull << L[i]->lane;
  for (int i = 0; i < n; ++i) *(uint64_t*)L[i]->out = m;
}
}  // namespace mslsim

namespace metal {

#define MSLSIM_SIMD1(name, OP, Q) \
  template <class T> inline T name(T x, MSLSIM_SITE) { return mslsim::collective<T, mslsim::OP, Q>(x, 0, mslsim_file, mslsim_line); }
#define MSLSIM_SIMD2(name, OP, Q)                                                          \
  template <class T, class I> inline T name(T x, I p, MSLSIM_SITE) {                       \
    return mslsim::collective<T, mslsim::OP, Q>(x, (long long)p, mslsim_file, mslsim_line); \
  }
MSLSIM_SIMD1(simd_sum, C_SUM, 32)
MSLSIM_SIMD1(simd_product, C_PROD, 32)
MSLSIM_SIMD1(simd_min, C_MIN, 32)
MSLSIM_SIMD1(simd_max, C_MAX, 32)
MSLSIM_SIMD1(simd_and, C_AND, 32)
MSLSIM_SIMD1(simd_or, C_OR, 32)
MSLSIM_SIMD1(simd_xor, C_XOR, 32)
MSLSIM_SIMD1(simd_prefix_exclusive_sum, C_PREFIX_EX_SUM, 32)
MSLSIM_SIMD1(simd_prefix_inclusive_sum, C_PREFIX_IN_SUM, 32)
MSLSIM_SIMD1(simd_prefix_exclusive_product, C_PREFIX_EX_PROD, 32)
MSLSIM_SIMD1(simd_prefix_inclusive_product, C_PREFIX_IN_PROD, 32)
MSLSIM_SIMD1(simd_broadcast_first, C_BROADCAST_FIRST, 32)
MSLSIM_SIMD2(simd_shuffle, C_SHUFFLE, 32)
MSLSIM_SIMD2(simd_shuffle_xor, C_SHUFFLE_XOR, 32)
MSLSIM_SIMD2(simd_shuffle_down, C_SHUFFLE_DOWN, 32)
MSLSIM_SIMD2(simd_shuffle_up, C_SHUFFLE_UP, 32)
MSLSIM_SIMD2(simd_shuffle_rotate_down, C_SHUFFLE_ROT_DOWN, 32)
MSLSIM_SIMD2(simd_shuffle_rotate_up, C_SHUFFLE_ROT_UP, 32)
MSLSIM_SIMD2(simd_broadcast, C_BROADCAST, 32)
MSLSIM_SIMD1(quad_sum, C_SUM, 4)
MSLSIM_SIMD1(quad_product, C_PROD, 4)
MSLSIM_SIMD1(quad_min, C_MIN, 4)
MSLSIM_SIMD1(quad_max, C_MAX, 4)
MSLSIM_SIMD1(quad_prefix_exclusive_sum, C_PREFIX_EX_SUM, 4)
MSLSIM_SIMD1(quad_prefix_inclusive_sum, C_PREFIX_IN_SUM, 4)
MSLSIM_SIMD2(quad_shuffle, C_SHUFFLE, 4)
MSLSIM_SIMD2(quad_shuffle_xor, C_SHUFFLE_XOR, 4)
MSLSIM_SIMD2(quad_shuffle_down, C_SHUFFLE_DOWN, 4)
MSLSIM_SIMD2(quad_shuffle_up, C_SHUFFLE_UP, 4)
MSLSIM_SIMD2(quad_broadcast, C_BROADCAST, 4)
#undef MSLSIM_SIMD1
#undef MSLSIM_SIMD2

struct simd_vote {
  typedef uint64_t vote_t;
  vote_t v;
  explicit operator vote_t() const { return v; }
  bool all() const { return v == 0xffffffffull; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool b, MSLSIM_SITE) {
  uint64_t out = 0;
  mslsim::Coll c{};
  c.fn = &mslsim::vote_fn;
  c.in = &b;
  c.out = &out;
  mslsim_simd_collective(&c, mslsim_file, mslsim_line);
  return simd_vote{out};
}
inline simd_vote simd_active_threads_mask(MSLSIM_SITE) {
  uint64_t out = 0;
  mslsim::Coll c{};
  c.fn = &mslsim::active_fn;
  c.out = &out;
  mslsim_simd_collective(&c, mslsim_file, mslsim_line);
  return simd_vote{out};
}
inline bool simd_all(bool b, MSLSIM_SITE) {
  return mslsim::collective<int, mslsim::C_MIN, 32>(b ? 1 : 0, 0, mslsim_file, mslsim_line) != 0;
}
inline bool simd_any(bool b, MSLSIM_SITE) { return (uint64_t)simd_ballot(b, mslsim_file, mslsim_line) != 0; }
inline bool simd_is_first(MSLSIM_SITE) {
  uint64_t m = (uint64_t)simd_active_threads_mask(mslsim_file, mslsim_line);
  return (m & ((1ull << mslsim_lane()) - 1)) == 0;
}

// ----------------------------------------------------------- simdgroup_matrix
template <class T, int Cols, int Rows> struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "mslsim: only 8x8 simdgroup matrices are supported");
  vec<T, 2> e;
  simdgroup_matrix() : e(T(0)) {}
  explicit simdgroup_matrix(T d);
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

}  // namespace metal

namespace mslsim {
// lane l holds row (l/4 & 4) + (l/2)%4, columns (l/4 & 2)*2 + (l%2)*2 (+1)
inline int mrow(int l) { return ((l / 4) & 4) + (l / 2) % 4; }
inline int mcol(int l) { return ((l / 4) & 2) * 2 + (l % 2) * 2; }

template <class T, class TA, class TB, class TC> void mma_fn(Coll* const* L, int n) {
  float A[8][8] = {}, B[8][8] = {}, C[8][8] = {};
  for (int i = 0; i < n; ++i) {
    int l = L[i]->lane, r = mrow(l), c = mcol(l);
    auto a = (const metal::simdgroup_matrix<TA, 8, 8>*)L[i]->a;
    auto b = (const metal::simdgroup_matrix<TB, 8, 8>*)L[i]->b;
    for (int j = 0; j < 2; ++j) {
      A[r][c + j] = static_cast<float>(a->e[j]);
      B[r][c + j] = static_cast<float>(b->e[j]);
    }
    if (L[i]->c) {
      auto cc = (const metal::simdgroup_matrix<TC, 8, 8>*)L[i]->c;
      for (int j = 0; j < 2; ++j) C[r][c + j] = static_cast<float>(cc->e[j]);
    }
  }
  for (int i = 0; i < n; ++i) {
    int l = L[i]->lane, r = mrow(l), c = mcol(l);
    auto d = (metal::simdgroup_matrix<T, 8, 8>*)L[i]->d;
    for (int j = 0; j < 2; ++j) {
      float acc = C[r][c + j];
      for (int k = 0; k < 8; ++k) acc = acc + A[r][k] * B[k][c + j];
      d->e[j] = static_cast<T>(acc);
    }
  }
}
}  // namespace mslsim

namespace metal {
template <class T, int Cols, int Rows> simdgroup_matrix<T, Cols, Rows>::simdgroup_matrix(T dv) {
  int l = mslsim_lane(), r = mslsim::mrow(l), c = mslsim::mcol(l);
  for (int j = 0; j < 2; ++j) e[j] = (r == c + j) ? dv : T(0);
}
template <class T, int Cols = 8, int Rows = 8> inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e = vec<T, 2>(v);
  return m;
}
template <class T, class U>
inline void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, const U* src, ulong elements_per_row = 8,
                           vec<ulong, 2> matrix_origin = vec<ulong, 2>(0), bool transpose = false) {
  // matrix_origin = (column, row) of the block in the loaded (logical) matrix; with transpose the
  // logical element (r, c) is read from memory row c, column r.
  int l = mslsim_lane(), r = mslsim::mrow(l), c = mslsim::mcol(l);
  for (int j = 0; j < 2; ++j) {
    ulong rr = matrix_origin.y + r, cc = matrix_origin.x + c + j;
    d.e[j] = static_cast<T>(transpose ? src[cc * elements_per_row + rr] : src[rr * elements_per_row + cc]);
  }
}
template <class T, class U>
inline void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, U* dst, ulong elements_per_row = 8,
                            vec<ulong, 2> matrix_origin = vec<ulong, 2>(0), bool transpose = false) {
  int l = mslsim_lane(), r = mslsim::mrow(l), c = mslsim::mcol(l);
  for (int j = 0; j < 2; ++j) {
    ulong rr = matrix_origin.y + r, cc = matrix_origin.x + c + j;
    (transpose ? dst[cc * elements_per_row + rr] : dst[rr * elements_per_row + cc]) = static_cast<U>(m.e[j]);
  }
}
template <class T, class TA, class TB, class TC>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                          const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c,
                                          MSLSIM_SITE) {
  mslsim::Coll k{};
  k.fn = &mslsim::mma_fn<T, TA, TB, TC>;
  k.a = &a;
  k.b = &b;
  k.c = &c;
  k.d = &d;
  mslsim_simd_collective(&k, mslsim_file, mslsim_line);
}
template <class T, class TA, class TB>
inline void simdgroup_multiply(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                               const simdgroup_matrix<TB, 8, 8>& b, MSLSIM_SITE) {
  mslsim::Coll k{};
  k.fn = &mslsim::mma_fn<T, TA, TB, T>;
  k.a = &a;
  k.b = &b;
  k.c = nullptr;
  k.d = &d;
  mslsim_simd_collective(&k, mslsim_file, mslsim_line);
}

// ------------------------------------------------------------------ atomics
enum memory_order { memory_order_relaxed = 0, memory_order_acquire, memory_order_release, memory_order_acq_rel,
                    memory_order_seq_cst };
template <class T> struct atomic { T v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;

#define MSLSIM_AP(obj) (const_cast<T*>(&(obj)->v))
template <class T> MSLSIM_NO_TSAN inline void atomic_store_explicit(volatile atomic<T>* o, T x, memory_order) {
  __atomic_store(MSLSIM_AP(o), &x, __ATOMIC_SEQ_CST);
}
template <class T> MSLSIM_NO_TSAN inline T atomic_load_explicit(volatile atomic<T>* o, memory_order) {
  mslsim_yield();  // lets spin-waits on other threads make progress
  T r;
  __atomic_load(MSLSIM_AP(o), &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class T> MSLSIM_NO_TSAN inline T atomic_exchange_explicit(volatile atomic<T>* o, T x, memory_order) {
  T r;
  __atomic_exchange(MSLSIM_AP(o), &x, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class T>
MSLSIM_NO_TSAN inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, T* expected, T desired, memory_order,
                                                  memory_order) {
  bool ok = __atomic_compare_exchange(MSLSIM_AP(o), expected, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  if (!ok) mslsim_yield();
  return ok;
}
template <class T>
MSLSIM_NO_TSAN inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* o, T* expected, T desired, memory_order a,
                                                    memory_order b) {
  return atomic_compare_exchange_weak_explicit(o, expected, desired, a, b);
}
template <class T, class F> MSLSIM_NO_TSAN inline T mslsim_atomic_rmw(volatile atomic<T>* o, F f) {
  T old;
  __atomic_load(MSLSIM_AP(o), &old, __ATOMIC_SEQ_CST);
  while (true) {
    T nv = f(old);
    if (__atomic_compare_exchange(MSLSIM_AP(o), &old, &nv, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
  }
}
#define MSLSIM_ARMW(name, EXPR)                                                                       \
  template <class T, class U> MSLSIM_NO_TSAN inline T atomic_##name##_explicit(volatile atomic<T>* o, U arg, memory_order) { \
    T a = static_cast<T>(arg);                                                                        \
    return mslsim_atomic_rmw(o, [a](T x) { return static_cast<T>(EXPR); });                          \
  }
MSLSIM_ARMW(fetch_add, x + a)
MSLSIM_ARMW(fetch_sub, x - a)
MSLSIM_ARMW(fetch_min, (a < x ? a : x))
MSLSIM_ARMW(fetch_max, (x < a ? a : x))
MSLSIM_ARMW(fetch_and, x & a)
MSLSIM_ARMW(fetch_or, x | a)
MSLSIM_ARMW(fetch_xor, x ^ a)
#undef MSLSIM_ARMW
#undef MSLSIM_AP

}  // namespace metal

// kernel-scope threadgroup declarations (rewritten by the front end)
#define MSLSIM_TG_DECL(name, dims, ...)                                                                   \
  static char mslsim_tgkey_##name;                                                                        \
  typedef __VA_ARGS__ mslsim_tgt_##name dims;                                                             \
  mslsim_tgt_##name& name = *reinterpret_cast<mslsim_tgt_##name*>(mslsim_tg_alloc(                        \
      &mslsim_tgkey_##name, sizeof(mslsim_tgt_##name), alignof(mslsim_tgt_##name), __FILE__, __LINE__))

#define MSLSIM_FC(name, ...)  \
  __VA_ARGS__ name = __VA_ARGS__(); \
  bool mslsim_fcdef_##name = false
#include "metal_constants.inc"
