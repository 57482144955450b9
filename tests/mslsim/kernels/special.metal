#include <metal_stdlib>
using namespace metal;

constant bool has_bias [[function_constant(0)]];
constant int scale_shift [[function_constant(1)]];
constant bool no_shift = !is_function_constant_defined(scale_shift);
constant constexpr float bias_weight = has_bias ? 1.0h : 0.0h;

kernel void affine(device const float* x [[buffer(0)]],
                   device float* y [[buffer(1)]],
                   device const float* bias [[buffer(2), function_constant(has_bias)]],
                   uint i [[thread_position_in_grid]]) {
  float v = x[i];
  if (!no_shift) v *= float(1 << scale_shift);
  if (has_bias) v += bias[i] * bias_weight;
  y[i] = v;
}

template <typename T, int N>
[[kernel]] void scale_t(device const T* x [[buffer(0)]],
                        device T* y [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  y[i] = x[i] * T(N);
}
template [[host_name("scale_half_3")]] [[kernel]] decltype(scale_t<half, 3>) scale_t<half, 3>;
typedef decltype(scale_t<half, 3>) scale_half_t;   // llama.cpp style: instantiate through a typedef
template [[host_name("scale_half_7")]] [[kernel]] scale_half_t scale_t<half, 7>;
template [[host_name("scale_float_5")]] [[kernel]] void scale_t<float, 5>(
    device const float* x [[buffer(0)]], device float* y [[buffer(1)]], uint i [[thread_position_in_grid]]);

// fp16 / bf16 rounding after every operation
template <typename T>
[[kernel]] void fp16_ops(device const T* a [[buffer(0)]],
                         device const T* b [[buffer(1)]],
                         device T* out [[buffer(2)]],
                         device T* acc [[buffer(3)]],
                         constant uint& n [[buffer(4)]],
                         uint i [[thread_position_in_grid]]) {
  T x = a[i], y = b[i];
  out[4 * i + 0] = x * y + x;          // two roundings
  out[4 * i + 1] = (x - y) / (x + y);
  T t = x;
  t += y;
  t *= y;
  out[4 * i + 2] = t;
  out[4 * i + 3] = T(float(x) * float(y) + float(x));   // explicit float: one rounding
  if (i == 0) {
    T s = T(0);
    for (uint k = 0; k < n; ++k) s += a[k];
    acc[0] = s;
  }
}
template [[host_name("fp16_ops_half")]] [[kernel]] decltype(fp16_ops<half>) fp16_ops<half>;
template [[host_name("fp16_ops_bfloat")]] [[kernel]] decltype(fp16_ops<bfloat>) fp16_ops<bfloat>;

struct Params {
  int n;
  float scale;
  half2 shift;
};

kernel void with_struct(device float* y [[buffer(0)]], constant Params& p [[buffer(1)]],
                        constant float2& v2 [[buffer(2)]], constant half& h [[buffer(3)]],
                        constant bfloat& b [[buffer(4)]], constant ushort& u [[buffer(5)]],
                        uint i [[thread_position_in_grid]]) {
  if (int(i) >= p.n) return;
  y[i] = float(i) * p.scale + float(p.shift.x) + float(p.shift.y) + v2.x - v2.y + float(h) + float(b) + u;
}

[[kernel, max_total_threads_per_threadgroup(64)]] void limited(device float* y [[buffer(0)]],
                                                              uint i [[thread_position_in_grid]]) {
  y[i] = 1.0f;
}
