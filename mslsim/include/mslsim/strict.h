// mslsim strict pass: the MSL surface as *declarations* for `clang -fsyntax-only`
// (mslsim/_strict.py).  Unlike the emulator's prelude,
// the address spaces are real clang address spaces, so clang rejects what the
// Metal compiler rejects: a device / threadgroup / constant pointer or
// reference where another one, or `thread` (the default), is expected.
// Vectors are clang ext_vector types (as in Apple's headers), half is
// _Float16, bfloat is __bf16.  Library functions are declared so that they
// accept every address space Metal's do (templates deduce it).
//
// MSLSIM_STRICT_AS=0 builds the same translation unit without address spaces;
// errors that also occur there are not address-space errors (the emulator's
// C++ compile reports real C++ errors), so the strict pass ignores them.
#pragma once
#include <float.h>
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <limits>
#include <type_traits>
#include <utility>

#if MSLSIM_STRICT_AS
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define threadgroup_imageblock __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#define threadgroup_imageblock
#endif
#define thread
#define kernel
#define vertex
#define fragment
#define ray_data
#define object_data

#define __METAL__ 1
#define __METAL_VERSION__ 310
#define __METAL_MACOS__ 1
#define __HAVE_BFLOAT__ 1
#define MSLSIM 1

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;
typedef __bf16 bfloat16_t;

constexpr half operator""_h(long double v) { return (half)v; }
constexpr half operator""_h(unsigned long long v) { return (half)v; }

namespace mslsim_strict {
// bool vectors are classes: clang's vector comparisons yield integer vectors,
// MSL's yield bool vectors; this one converts from both.
template <int N> struct boolvec {
  bool x, y, z, w;
  boolvec();
  boolvec(bool);
  template <class V> boolvec(V);
  bool& operator[](int);
  bool operator[](int) const;
  boolvec operator!() const;
  boolvec operator&&(boolvec) const;
  boolvec operator||(boolvec) const;
  boolvec operator==(boolvec) const;
  boolvec operator!=(boolvec) const;
};
template <class T, int N> struct vec_sel { typedef T type __attribute__((ext_vector_type(N))); };
template <int N> struct vec_sel<bool, N> { typedef boolvec<N> type; };
}  // namespace mslsim_strict

#define MSLSIM_STRICT_VEC(T, P)                                        \
  typedef T P##2 __attribute__((ext_vector_type(2)));                  \
  typedef T P##3 __attribute__((ext_vector_type(3)));                  \
  typedef T P##4 __attribute__((ext_vector_type(4)));                  \
  typedef T packed_##P##2 __attribute__((ext_vector_type(2)));         \
  typedef T packed_##P##3 __attribute__((ext_vector_type(3)));         \
  typedef T packed_##P##4 __attribute__((ext_vector_type(4)));
MSLSIM_STRICT_VEC(float, float)
MSLSIM_STRICT_VEC(half, half)
MSLSIM_STRICT_VEC(bfloat, bfloat)
MSLSIM_STRICT_VEC(char, char)
MSLSIM_STRICT_VEC(uchar, uchar)
MSLSIM_STRICT_VEC(short, short)
MSLSIM_STRICT_VEC(ushort, ushort)
MSLSIM_STRICT_VEC(int, int)
MSLSIM_STRICT_VEC(uint, uint)
MSLSIM_STRICT_VEC(long, long)
MSLSIM_STRICT_VEC(ulong, ulong)
#undef MSLSIM_STRICT_VEC
typedef mslsim_strict::boolvec<2> bool2;
typedef mslsim_strict::boolvec<3> bool3;
typedef mslsim_strict::boolvec<4> bool4;

// `float4(a, b)`, `half2(x)`, `vec<T, 4>(...)`: the front end rewrites vector
// constructor calls into this (ext vectors have no multi-argument constructor).
template <class V, class... A> V mslsim_mk(A...);

namespace metal {
template <class T, int N> using vec = typename mslsim_strict::vec_sel<T, N>::type;
using ::mslsim_mk;

#include "metal_traits.inc"
#if MSLSIM_STRICT_AS
template <class T> struct remove_address_space<device T> { typedef T type; };
template <class T> struct remove_address_space<constant T> { typedef T type; };
template <class T> struct remove_address_space<threadgroup T> { typedef T type; };
#endif
template <class T> struct is_vector : std::false_type {};
template <class T> constexpr bool is_vector_v = is_vector<T>::value;
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 11;
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)0.0009765625f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half denorm_min() { return (half)5.9604644775390625e-08f; }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 8;
  static bfloat max();
  static bfloat min();
  static bfloat lowest();
  static bfloat epsilon();
  static bfloat infinity();
  static bfloat quiet_NaN();
  static bfloat denorm_min();
};

template <class To, class From> To as_type(From);

// Element-wise functions: any scalar or vector, result of the first argument's type.
#define MSLSIM_STRICT_FN(name) template <class T, class... R> T name(T, R...);
MSLSIM_STRICT_FN(abs) MSLSIM_STRICT_FN(acos) MSLSIM_STRICT_FN(acosh) MSLSIM_STRICT_FN(asin)
MSLSIM_STRICT_FN(asinh) MSLSIM_STRICT_FN(atan) MSLSIM_STRICT_FN(atan2) MSLSIM_STRICT_FN(atanh)
MSLSIM_STRICT_FN(ceil) MSLSIM_STRICT_FN(clamp) MSLSIM_STRICT_FN(clz) MSLSIM_STRICT_FN(copysign)
MSLSIM_STRICT_FN(cos) MSLSIM_STRICT_FN(cosh) MSLSIM_STRICT_FN(cospi) MSLSIM_STRICT_FN(ctz)
MSLSIM_STRICT_FN(divide) MSLSIM_STRICT_FN(exp) MSLSIM_STRICT_FN(exp10) MSLSIM_STRICT_FN(exp2)
MSLSIM_STRICT_FN(extract_bits) MSLSIM_STRICT_FN(fabs) MSLSIM_STRICT_FN(fdim) MSLSIM_STRICT_FN(floor)
MSLSIM_STRICT_FN(fma) MSLSIM_STRICT_FN(fmax) MSLSIM_STRICT_FN(fmax3) MSLSIM_STRICT_FN(fmin)
MSLSIM_STRICT_FN(fmin3) MSLSIM_STRICT_FN(fmod) MSLSIM_STRICT_FN(fract) MSLSIM_STRICT_FN(insert_bits)
MSLSIM_STRICT_FN(ldexp) MSLSIM_STRICT_FN(log) MSLSIM_STRICT_FN(log10) MSLSIM_STRICT_FN(log2)
MSLSIM_STRICT_FN(mad) MSLSIM_STRICT_FN(max) MSLSIM_STRICT_FN(max3) MSLSIM_STRICT_FN(median3)
MSLSIM_STRICT_FN(min) MSLSIM_STRICT_FN(min3) MSLSIM_STRICT_FN(mix) MSLSIM_STRICT_FN(mulhi)
MSLSIM_STRICT_FN(normalize) MSLSIM_STRICT_FN(popcount) MSLSIM_STRICT_FN(pow) MSLSIM_STRICT_FN(powr)
MSLSIM_STRICT_FN(precise_divide) MSLSIM_STRICT_FN(reverse_bits) MSLSIM_STRICT_FN(rint)
MSLSIM_STRICT_FN(rotate) MSLSIM_STRICT_FN(round) MSLSIM_STRICT_FN(rsqrt) MSLSIM_STRICT_FN(saturate)
MSLSIM_STRICT_FN(sign) MSLSIM_STRICT_FN(sin) MSLSIM_STRICT_FN(sinh) MSLSIM_STRICT_FN(sinpi)
MSLSIM_STRICT_FN(smoothstep) MSLSIM_STRICT_FN(sqrt) MSLSIM_STRICT_FN(step) MSLSIM_STRICT_FN(tan)
MSLSIM_STRICT_FN(tanh) MSLSIM_STRICT_FN(tanpi) MSLSIM_STRICT_FN(trunc) MSLSIM_STRICT_FN(absdiff)
MSLSIM_STRICT_FN(addsat) MSLSIM_STRICT_FN(subsat) MSLSIM_STRICT_FN(hadd) MSLSIM_STRICT_FN(rhadd)
MSLSIM_STRICT_FN(madhi) MSLSIM_STRICT_FN(madsat) MSLSIM_STRICT_FN(select) MSLSIM_STRICT_FN(cross)
MSLSIM_STRICT_FN(reflect) MSLSIM_STRICT_FN(faceforward) MSLSIM_STRICT_FN(refract)
#undef MSLSIM_STRICT_FN
template <class T> struct mslsim_elem { typedef T type; };
template <class T> struct mslsim_elem<T __attribute__((ext_vector_type(2)))> { typedef T type; };
template <class T> struct mslsim_elem<T __attribute__((ext_vector_type(3)))> { typedef T type; };
template <class T> struct mslsim_elem<T __attribute__((ext_vector_type(4)))> { typedef T type; };
template <class T> typename mslsim_elem<T>::type dot(T, T);
template <class T> typename mslsim_elem<T>::type length(T);
template <class T> typename mslsim_elem<T>::type length_squared(T);
template <class T> typename mslsim_elem<T>::type distance(T, T);
template <class T> bool all(T);
template <class T> bool any(T);
template <class T> bool isnan(T);
template <class T> bool isinf(T);
template <class T> bool isfinite(T);
template <class T> bool signbit(T);
template <class T> bool isnormal(T);
template <class T> auto frexp(T, thread int&) -> T;
template <class T> auto modf(T, thread T&) -> T;
namespace fast { using namespace ::metal; }
namespace precise { using namespace ::metal; }

// ------------------------------------------------------------- barriers
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
mem_flags operator|(mem_flags, mem_flags);
void threadgroup_barrier(mem_flags = mem_flags::mem_none);
void simdgroup_barrier(mem_flags = mem_flags::mem_none);

// ----------------------------------------------------- simd collectives
#define MSLSIM_STRICT_C1(name) template <class T> T name(T);
#define MSLSIM_STRICT_C2(name) template <class T, class I> T name(T, I);
MSLSIM_STRICT_C1(simd_sum) MSLSIM_STRICT_C1(simd_product) MSLSIM_STRICT_C1(simd_min) MSLSIM_STRICT_C1(simd_max)
MSLSIM_STRICT_C1(simd_and) MSLSIM_STRICT_C1(simd_or) MSLSIM_STRICT_C1(simd_xor)
MSLSIM_STRICT_C1(simd_prefix_exclusive_sum) MSLSIM_STRICT_C1(simd_prefix_inclusive_sum)
MSLSIM_STRICT_C1(simd_prefix_exclusive_product) MSLSIM_STRICT_C1(simd_prefix_inclusive_product)
MSLSIM_STRICT_C1(simd_broadcast_first)
MSLSIM_STRICT_C2(simd_shuffle) MSLSIM_STRICT_C2(simd_shuffle_xor) MSLSIM_STRICT_C2(simd_shuffle_down)
MSLSIM_STRICT_C2(simd_shuffle_up) MSLSIM_STRICT_C2(simd_shuffle_rotate_down) MSLSIM_STRICT_C2(simd_shuffle_rotate_up)
MSLSIM_STRICT_C2(simd_broadcast)
MSLSIM_STRICT_C1(quad_sum) MSLSIM_STRICT_C1(quad_product) MSLSIM_STRICT_C1(quad_min) MSLSIM_STRICT_C1(quad_max)
MSLSIM_STRICT_C1(quad_prefix_exclusive_sum) MSLSIM_STRICT_C1(quad_prefix_inclusive_sum)
MSLSIM_STRICT_C2(quad_shuffle) MSLSIM_STRICT_C2(quad_shuffle_xor) MSLSIM_STRICT_C2(quad_shuffle_down)
MSLSIM_STRICT_C2(quad_shuffle_up) MSLSIM_STRICT_C2(quad_broadcast)
#undef MSLSIM_STRICT_C1
#undef MSLSIM_STRICT_C2
struct simd_vote {
  typedef uint64_t vote_t;
  explicit operator vote_t() const;
  bool all() const;
  bool any() const;
};
simd_vote simd_ballot(bool);
simd_vote simd_active_threads_mask();
bool simd_all(bool);
bool simd_any(bool);
bool simd_is_first();

// ----------------------------------------------------- simdgroup_matrix
template <class T, int Cols, int Rows> struct simdgroup_matrix {
  simdgroup_matrix();
  explicit simdgroup_matrix(T);
  thread vec<T, 2>& thread_elements();
  thread const vec<T, 2>& thread_elements() const;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int Cols = 8, int Rows = 8> simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T);
#if MSLSIM_STRICT_AS
// Metal loads / stores matrices from device or threadgroup memory only, of the matrix's own element type.
#define MSLSIM_STRICT_MATRIX_MEM(AS)                                                                          \
  template <class T, int C, int R>                                                                            \
  void simdgroup_load(thread simdgroup_matrix<T, C, R>&, const AS T*, ulong = C, vec<ulong, 2> = 0, bool = false); \
  template <class T, int C, int R>                                                                            \
  void simdgroup_store(thread const simdgroup_matrix<T, C, R>&, AS T*, ulong = C, vec<ulong, 2> = 0, bool = false);
MSLSIM_STRICT_MATRIX_MEM(device)
MSLSIM_STRICT_MATRIX_MEM(threadgroup)
#undef MSLSIM_STRICT_MATRIX_MEM
#else
template <class T, int C, int R>
void simdgroup_load(thread simdgroup_matrix<T, C, R>&, const T*, ulong = C, vec<ulong, 2> = 0, bool = false);
template <class T, int C, int R>
void simdgroup_store(thread const simdgroup_matrix<T, C, R>&, T*, ulong = C, vec<ulong, 2> = 0, bool = false);
#endif
template <class D, class A, class B, class C> void simdgroup_multiply_accumulate(thread D&, thread const A&, thread const B&, thread const C&);
template <class D, class A, class B> void simdgroup_multiply(thread D&, thread const A&, thread const B&);

// -------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = 0, memory_order_acquire, memory_order_release, memory_order_acq_rel,
                    memory_order_seq_cst };
template <class T> struct atomic { T mslsim_value; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
template <class A> struct mslsim_atomic_value;
template <class T> struct mslsim_atomic_value<atomic<T>> { typedef T type; };
template <class T> struct mslsim_atomic_value<const atomic<T>> { typedef T type; };
template <class T> struct mslsim_atomic_value<volatile atomic<T>> { typedef T type; };
#if MSLSIM_STRICT_AS
template <class T> struct mslsim_atomic_value<device atomic<T>> { typedef T type; };
template <class T> struct mslsim_atomic_value<volatile device atomic<T>> { typedef T type; };
template <class T> struct mslsim_atomic_value<threadgroup atomic<T>> { typedef T type; };
template <class T> struct mslsim_atomic_value<volatile threadgroup atomic<T>> { typedef T type; };
#endif
#define MSLSIM_ATOMIC_T typename mslsim_atomic_value<A>::type
template <class A, class U> void atomic_store_explicit(A*, U, memory_order);
template <class A> MSLSIM_ATOMIC_T atomic_load_explicit(A*, memory_order);
template <class A, class U> MSLSIM_ATOMIC_T atomic_exchange_explicit(A*, U, memory_order);
template <class A, class E, class U>
bool atomic_compare_exchange_weak_explicit(A*, E*, U, memory_order, memory_order);
template <class A, class E, class U>
bool atomic_compare_exchange_strong_explicit(A*, E*, U, memory_order, memory_order);
#define MSLSIM_STRICT_RMW(name) template <class A, class U> MSLSIM_ATOMIC_T atomic_##name##_explicit(A*, U, memory_order);
MSLSIM_STRICT_RMW(fetch_add) MSLSIM_STRICT_RMW(fetch_sub) MSLSIM_STRICT_RMW(fetch_min) MSLSIM_STRICT_RMW(fetch_max)
MSLSIM_STRICT_RMW(fetch_and) MSLSIM_STRICT_RMW(fetch_or) MSLSIM_STRICT_RMW(fetch_xor)
#undef MSLSIM_STRICT_RMW
#undef MSLSIM_ATOMIC_T
}  // namespace metal

// Function constants and kernel-scope threadgroup declarations, as rewritten by the front end.
#define MSLSIM_FC(name, ...) \
  constant __VA_ARGS__ name = __VA_ARGS__(); \
  bool mslsim_fcdef_##name = false
template <class T> threadgroup T& mslsim_threadgroup_variable();
#define MSLSIM_TG_DECL(name, dims, ...)           \
  typedef __VA_ARGS__ mslsim_tgt_##name dims;      \
  threadgroup mslsim_tgt_##name& name = mslsim_threadgroup_variable<mslsim_tgt_##name>()

#include "metal_constants.inc"
