// Code Apple's Metal compiler rejects, one case per rule (compiled with
// defines={"CASE_<NAME>": 1}); the line marked `// expect: <name>` is the one
// the error must name. tests/mslsim/test_strict.py
#include <metal_stdlib>
using namespace metal;

inline float read_thread(thread const float* p) { return p[0]; }
inline float read_thread_ref(thread const float& r) { return r; }
inline void store_device(device float* p, float v) { p[0] = v; }
inline thread float* as_thread(device float* p) {
#if CASE_AS_RETURN
  return p;  // expect: as_return
#else
  return nullptr;
#endif
}
template <typename T> inline T first(thread const T* p) { return p[0]; }
struct Counter {
  float total;
  float get() const { return total; }  // a thread method: not callable on device memory
};
struct Sink {
  thread float* p;
  void set(thread float* q) { p = q; }
};
// a template with a default argument and an operator just before the program-scope cases: the scan
// of the declarations must not swallow the next one
template <typename T, int N = 4> inline T scaled_by(T v) { return v * T(N); }
inline Sink& operator+=(thread Sink& s, thread float* q) { s.p = q; return s; }
#if CASE_PROGRAM_SCOPE_DEVICE
device float g_bias = 1.0f;  // expect: program_scope_device
#endif
#if CASE_PROGRAM_SCOPE_CONSTEXPR
constexpr float kScale = 2.0f;  // expect: program_scope_constexpr
#endif
#if CASE_PROGRAM_SCOPE_THREADGROUP
threadgroup float g_tile[64];  // expect: program_scope_threadgroup
#endif

kernel void strict_case(device float* x [[buffer(0)]],
                        constant float* c [[buffer(1)]],
                        device Counter* counters [[buffer(2)]],
                        uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  thread float local[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  float y = local[tid % 4];
#if CASE_AS_CALL
  y += read_thread(x);  // expect: as_call
#endif
#if CASE_AS_CALL_THREADGROUP
  store_device(buf, y);  // expect: as_call_threadgroup
#endif
#if CASE_AS_CALL_CONSTANT
  y += read_thread(c);  // expect: as_call_constant
#endif
#if CASE_AS_REFERENCE
  y += read_thread_ref(x[1]);  // expect: as_reference
#endif
#if CASE_AS_ASSIGN
  thread float* p = local;
  p = x;  // expect: as_assign
  y += p[0];
#endif
#if CASE_AS_INIT
  device float* q = c;  // expect: as_init
  y += q[0];
#endif
#if CASE_AS_INIT_REFERENCE
  thread float& r = buf[tid];  // expect: as_init_reference
  y += r;
#endif
#if CASE_AS_RETURN
  y += as_thread(x)[0];
#endif
#if CASE_AS_TEMPLATE
  y += first<float>(x);  // expect: as_template
#endif
#if CASE_AS_MEMBER_THIS
  y += counters[0].get();  // expect: as_member_this
#endif
#if CASE_AS_MEMBER_PARAM
  Sink s;
  s.set(x);  // expect: as_member_param
#endif
#if CASE_AS_SIMDGROUP_LOAD
  simdgroup_matrix<float, 8, 8> m;
  simdgroup_load(m, local, 2);  // expect: as_simdgroup_load
#endif
#if CASE_AS_C_CAST
  thread float* cast = (thread float*)x;  // expect: as_c_cast
  y += cast[0];
#endif
#if CASE_AS_C_CAST_THREADGROUP
  device float* shared_as_device = (device float*)buf;  // expect: as_c_cast_threadgroup
  y += shared_as_device[0];
#endif
#if CASE_VLA
  float scratch[tid + 1];  // expect: vla
  scratch[tid] = y;
  y = scratch[tid];
#endif
#if CASE_DOUBLE
  double d = y;  // expect: double
  y = float(d);
#endif
#if CASE_GOTO
  if (tid == 0) goto done;  // expect: goto
#endif
#if CASE_NEW
  thread float* heap = new float[4];  // expect: new
  y += heap[0];
#endif
#if CASE_DELETE
  delete local;  // expect: delete
#endif
#if CASE_THREAD_LOCAL
  thread_local float t = 0.0f;  // expect: thread_local
  y += t;
#endif
#if CASE_EXCEPTIONS
  if (y < 0.0f) throw 1;  // expect: exceptions
#endif
#if CASE_STD
  y = std::max(y, 0.0f);  // expect: std
#endif
  buf[tid] = y;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  x[tid] = buf[tid] + c[0];
#if CASE_GOTO
done:
  return;
#endif
}

#if CASE_KERNEL_POINTER_NO_AS
kernel void no_as(float* x [[buffer(0)]],  // expect: kernel_pointer_no_as
                  uint i [[thread_position_in_grid]]) {
  x[i] = 1.0f;
}
#endif
#if CASE_KERNEL_POINTER_THREAD
kernel void thread_as(device float* x [[buffer(0)]],
                      thread float* y [[buffer(1)]],  // expect: kernel_pointer_thread
                      uint i [[thread_position_in_grid]]) {
  x[i] = y[i];
}
#endif
#if CASE_KERNEL_REFERENCE_NO_AS
kernel void ref_no_as(device float* x [[buffer(0)]],
                      uint& n [[buffer(1)]],  // expect: kernel_reference_no_as
                      uint i [[thread_position_in_grid]]) {
  x[i] = float(n);
}
#endif
#if CASE_KERNEL_RETURN
kernel float returns_value(device float* x [[buffer(0)]],  // expect: kernel_return
                           uint i [[thread_position_in_grid]]) {
  return x[i];
}
#endif
#if CASE_BUILTIN_FLOAT
kernel void builtin_float(device float* x [[buffer(0)]],
                          float i [[thread_position_in_grid]]) {  // expect: builtin_float
  x[uint(i)] = 1.0f;
}
#endif
#if CASE_BUILTIN_INT
kernel void builtin_int(device float* x [[buffer(0)]],
                        int lane [[thread_index_in_simdgroup]]) {  // expect: builtin_int
  x[lane] = 1.0f;
}
#endif
#if CASE_BUILTIN_VECTOR
kernel void builtin_vector(device float* x [[buffer(0)]],
                           uint2 tid [[thread_index_in_threadgroup]]) {  // expect: builtin_vector
  x[tid.x] = 1.0f;
}
#endif
#if CASE_VIRTUAL
struct Shape {
  virtual float area() const { return 0.0f; }  // expect: virtual
};
#endif
#if CASE_TRY
inline float guarded(float v) {
  try {  // expect: try
    return v;
  } catch (...) {
    return 0.0f;
  }
}
#endif
#if CASE_RECURSION
inline uint factorial(uint n) {
  return n <= 1 ? 1 : n * factorial(n - 1);  // expect: recursion
}
kernel void recursive(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = float(factorial(i));
}
#endif
#if CASE_MUTUAL_RECURSION
inline uint is_odd(uint n);
inline uint is_even(uint n) { return n == 0 ? 1 : is_odd(n - 1); }
inline uint is_odd(uint n) {
  return n == 0 ? 0 : is_even(n - 1);  // expect: mutual_recursion
}
kernel void mutual(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = float(is_even(i));
}
#endif
#if CASE_STD_HEADER
#include <cmath>  // expect: std_header
#endif
