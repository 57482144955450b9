#include <metal_stdlib>
using namespace metal;

kernel void vector_add(device const float* a [[buffer(0)]],
                       device const float* b [[buffer(1)]],
                       device float* c [[buffer(2)]],
                       constant uint& n [[buffer(3)]],
                       uint gid [[thread_position_in_grid]]) {
  if (gid >= n) return;
  c[gid] = a[gid] + b[gid];
}

// simd_sum + threadgroup memory + barrier + device atomics
kernel void reduce_sum(device const float* x [[buffer(0)]],
                       device atomic_float* total [[buffer(1)]],
                       device atomic_uint* count [[buffer(2)]],
                       constant uint& n [[buffer(3)]],
                       uint gid [[thread_position_in_grid]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint nsg [[simdgroups_per_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float partial[32];
  float v = gid < n ? x[gid] : 0.0f;
  v = simd_sum(v);
  if (lane == 0) partial[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float s = lane < nsg ? partial[lane] : 0.0f;
    s = simd_sum(s);
    if (lane == 0) {
      atomic_fetch_add_explicit(total, s, memory_order_relaxed);
      atomic_fetch_add_explicit(count, 1u, memory_order_relaxed);
    }
  }
}

// threadgroup-wide exclusive prefix sum (one threadgroup scans one block)
kernel void prefix_sum(device const int* x [[buffer(0)]],
                       device int* y [[buffer(1)]],
                       threadgroup int* sums [[threadgroup(0)]],
                       uint gid [[thread_position_in_grid]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint nsg [[simdgroups_per_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
  int v = x[gid];
  int ex = simd_prefix_exclusive_sum(v);
  int in = simd_prefix_inclusive_sum(v);
  if (lane == 31) sums[sg] = in;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    int s = lane < nsg ? sums[lane] : 0;
    s = simd_prefix_exclusive_sum(s);
    if (lane < nsg) sums[lane] = s;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = ex + sums[sg];
}

// one output row per lane per op
kernel void simd_ops(device const float* x [[buffer(0)]],
                     device float* out [[buffer(1)]],
                     device uint* bits [[buffer(2)]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint tid [[thread_index_in_threadgroup]]) {
  float v = x[tid];
  out[0 * 32 + lane] = simd_shuffle(v, (lane * 7) % 32);
  out[1 * 32 + lane] = simd_shuffle_xor(v, 5);
  out[2 * 32 + lane] = simd_shuffle_down(v, 3);
  out[3 * 32 + lane] = simd_shuffle_up(v, 3);
  out[4 * 32 + lane] = simd_broadcast(v, 9);
  out[5 * 32 + lane] = simd_max(v);
  out[6 * 32 + lane] = simd_min(v);
  out[7 * 32 + lane] = quad_sum(v);
  out[8 * 32 + lane] = simd_prefix_inclusive_sum(v);
  simdgroup_barrier(mem_flags::mem_none);
  bool big = v > 0.0f;
  // every lane takes part in the votes; one lane stores them (stores of all lanes would race)
  const uint ballot = uint(uint64_t(simd_ballot(big)));
  const uint all_big = simd_all(big) ? 1 : 0, any_big = simd_any(big) ? 1 : 0, all_true = simd_all(true) ? 1 : 0;
  if (lane == 0) {
    bits[0] = ballot;
    bits[1] = all_big;
    bits[2] = any_big;
    bits[3] = all_true;
  }
  // a returned lane no longer takes part
  if (lane >= 16) return;
  out[9 * 32 + lane] = simd_sum(v);
}

kernel void vectors(device const float4* a [[buffer(0)]],
                    device float4* out [[buffer(1)]],
                    device packed_half3* ph [[buffer(2)]],
                    device uint* u [[buffer(3)]],
                    uint i [[thread_position_in_grid]]) {
  float4 v = a[i];
  float4 r = v.wzyx * 2.0 + float4(v.xy, 1.0, v.w);
  r.xy = r.yx;
  r.z += 0.5f;
  float2 t = v.zw;
  r.w = dot(t, float2(1.0, -1.0));
  out[3 * i] = r;
  out[3 * i + 1] = select(float4(0), v, v > 0.0f);
  out[3 * i + 2] = float4(clamp(v.xyz, -0.5f, 0.5f), max(abs(v.x), v.y));
  half3 h = half3(v.xyz);
  ph[i] = h * 2.0h;
  u[i] = as_type<uint>(v.x) ^ as_type<uint>(half2(v.zw));
}

kernel void builtins(device uint* out [[buffer(0)]],
                     uint3 tpig [[thread_position_in_grid]],
                     uint3 tpitg [[thread_position_in_threadgroup]],
                     ushort3 tgpig [[threadgroup_position_in_grid]],
                     uint3 tptg [[threads_per_threadgroup]],
                     uint3 tgpg [[threadgroups_per_grid]],
                     uint3 tpg [[threads_per_grid]],
                     uint tiitg [[thread_index_in_threadgroup]],
                     ushort tiisg [[thread_index_in_simdgroup]],
                     ushort sgiitg [[simdgroup_index_in_threadgroup]],
                     uint tpsg [[threads_per_simdgroup]],
                     uint sgptg [[simdgroups_per_threadgroup]]) {
  uint g = (tpig.z * tpg.y + tpig.y) * tpg.x + tpig.x;
  device uint* o = out + g * 16;
  o[0] = tpig.x; o[1] = tpig.y; o[2] = tpig.z;
  o[3] = tpitg.x; o[4] = tpitg.y; o[5] = tpitg.z;
  o[6] = tgpig.x; o[7] = tgpig.y; o[8] = tgpig.z;
  o[9] = tptg.x * tptg.y * tptg.z;
  o[10] = tgpg.x * tgpg.y * tgpg.z;
  o[11] = tiitg; o[12] = tiisg; o[13] = sgiitg; o[14] = tpsg; o[15] = sgptg;
}

// device references: a writable atomic counter and a writable struct
struct Acc { float sum; uint n; };
kernel void device_refs(device atomic_uint& counter [[buffer(0)]], device Acc& acc [[buffer(1)]],
                        uint tid [[thread_index_in_threadgroup]]) {
  atomic_fetch_add_explicit(&counter, 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_device);
  if (tid == 0) { acc.sum = 2.5f; acc.n = atomic_load_explicit(&counter, memory_order_relaxed); }
}
