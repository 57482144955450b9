// Valid MSL that the strict check must keep accepting (and that runs
// correctly): address spaces deduced by templates, thread arrays and
// references, half literals, address-space-qualified helper parameters and
// member functions, struct copies out of device / constant memory, program-
// scope constants, function constants, simdgroup_matrix loads from device and
// threadgroup memory, as_type, atomics in device and threadgroup memory,
// template recursion over different arguments. tests/mslsim/test_strict.py
#include <metal_atomic>
#include <metal_simdgroup_matrix>
#include <metal_stdlib>
using namespace metal;

constant float kOffsets[4] = {0.5f, 1.5f, 2.5f, 3.5f};
constant constexpr half kHalfStep = 0.25h;
constant bool add_one [[function_constant(0)]];

// the pointer's address space is deduced: works for device, threadgroup and thread
template <typename P> inline float load0(P p) { return float(p[0]); }
template <typename T> inline void store0(T* p, float v) { p[0] = v; }
inline float sum_thread(thread const float* a, int n) {
  float s = 0.0f;
  for (int i = 0; i < n; ++i) s += a[i];
  return s;
}
inline void add_to(thread float& r, float v) { r += v; }
inline float from_device(const device float* p, uint i) { return p[i]; }
inline float from_threadgroup(const threadgroup float* p, uint i) { return p[i]; }
inline float from_constant(constant float& r) { return r; }
template <int N> inline int triangle() { return N + triangle<N - 1>(); }
template <> inline int triangle<0>() { return 0; }

struct Pair {
  float a, b;
  float sum() const { return a + b; }                 // thread objects
  float sum_device() device const { return a + b; }   // device objects
};
struct Params {
  uint n;
  float scale;
  half2 shift;
};

kernel void valid_mix(device float* out [[buffer(0)]],
                      device const Pair* pairs [[buffer(1)]],
                      constant Params& params [[buffer(2)]],
                      device atomic_uint* counter [[buffer(3)]],
                      device const float* in [[buffer(4)]],
                      uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float shared[64];
  threadgroup atomic_uint tg_count;
  thread float local[4] = {1.0f, 2.0f, 3.0f, 4.0f};
  if (tid == 0) atomic_store_explicit(&tg_count, 0u, memory_order_relaxed);
  store0(shared + tid, in[tid]);
  store0(local + 1, 5.0f);  // local = {1, 5, 3, 4}
  add_to(local[0], 1.0f);   // local = {2, 5, 3, 4}
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&tg_count, 1u, memory_order_relaxed);
  atomic_fetch_add_explicit(counter, 1u, memory_order_relaxed);
  Pair p = pairs[tid];        // a struct copied out of device memory
  Params q = params;          // and out of constant memory
  half h = 1.5h * kHalfStep;  // 0.375
  float v = load0(shared + (tid ^ 1)) + load0(in + tid) + load0(local) + sum_thread(local, 4);
  v += from_device(in, tid) + from_threadgroup(shared, tid) + from_constant(params.scale);
  v += p.sum() + pairs[tid].sum_device() + float(q.n) + float(h) + kOffsets[tid % 4];
  v += float(as_type<half2>(as_type<uint>(q.shift)).y) + float(triangle<4>());
  if (add_one) v += 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) out[64] = float(atomic_load_explicit(&tg_count, memory_order_relaxed));
  out[tid] = v;
}

// simdgroup_matrix loads from device and threadgroup memory: out = a * b (8x8, one simdgroup)
kernel void valid_matrix(device const float* a [[buffer(0)]],
                         device const float* b [[buffer(1)]],
                         device float* out [[buffer(2)]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float bt[64];
  bt[lane] = b[lane];
  bt[lane + 32] = b[lane + 32];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_matrix<float, 8, 8> ma, mb, mc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, bt, 8);
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  simdgroup_store(mc, out, 8);
}

// T is deduced with its address space (device float): a thread copy of the value needs remove_address_space
template <typename T> inline float twice(T* p) {
  remove_address_space_t<T> v = p[0];
  return v * 2.0f;
}
kernel void valid_deduced_space(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  x[i] = twice(x + i);
}
