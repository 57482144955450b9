#include <metal_stdlib>
using namespace metal;
kernel void exprs(device float4* o [[buffer(0)]], device const uint* w [[buffer(1)]], device half4* ho [[buffer(2)]],
                  uint i [[thread_position_in_grid]]) {
  float4 v = o[i];
  float2 a = v.xy + v.zw;
  float2 b = -v.xy;
  bool2 c = v.xy > 0.0f;
  float2 d = v.xy * v.zw - 1;
  float3 e = float3(v.x, v.yz);
  v.xyz += e;
  v.w = length(v.xy);
  uint wv = w[i];
  half2 h = as_type<half2>((wv & 0x000F000Fu) | 0x64006400u) - half2(1024.0h);
  half4 h4 = half4(h, as_type<half2>(wv));
  float4 acc = 0;
  acc += float4(h4) * 0.5;
  uint4 u4 = uint4(wv) >> uint4(0, 4, 8, 12);
  u4 = (u4 >> 4) & 0xF;
  float s = simd_sum(acc.x);
  float4 s4 = simd_sum(acc);
  half2 hs = simd_shuffle_xor(h, 1);
  ushort2 us = ushort2(3, 4);
  o[i] = float4(a + b + float2(c) + d, s, s4.w) + float4(float2(hs), float2(us)) + float4(u4);
  ho[i] = h4 * half(2) + half4(1.0h);
  half x = h.x;
  x = max(x, 0.0h);
  x = fma(x, x, x);
  float y = x * 2.0;
  int k = int(y) + (x > 1.0h ? 1 : 0);
  ho[i].x = x + k;
  ho[i].yz = ho[i].zy;
  float m = metal::max(v.x, 1.0f);
  m += metal::precise::exp(m) + fast::log(m);
  o[i].w = m + dot(v.xy, v.zw) + any(c) + all(v == v);
  bfloat bf = bfloat(m);
  bf = bf * bf + bfloat(1);
  o[i].z = float(bf) + float(metal::numeric_limits<half>::max());
  o[i].y = static_cast<float>(h.y) + select(1.0f, 2.0f, m > 0.0f) + clamp(m, 0.0f, 1.0f) + abs(-m) + rsqrt(m);
}
