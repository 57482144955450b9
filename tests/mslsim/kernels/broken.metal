#include <metal_stdlib>
using namespace metal;

// neighbour exchange through threadgroup memory
kernel void exchange_ok(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                        uint tid [[thread_index_in_threadgroup]], uint gid [[thread_position_in_grid]],
                        uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[tid] = x[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[gid] = buf[(tid + 1) % n];
}

kernel void missing_barrier(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                            uint tid [[thread_index_in_threadgroup]], uint gid [[thread_position_in_grid]],
                            uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[tid] = x[gid];
  y[gid] = buf[(tid + 1) % n];
}

kernel void oob_write(device float* y [[buffer(0)]], constant uint& n [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  y[gid] = 1.0f;   // no bounds check: the grid is larger than n
}

kernel void oob_read(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                     uint gid [[thread_position_in_grid]]) {
  y[gid] = x[gid + 1];
}

kernel void too_much_tg(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float big[4096];     // 16 KiB
  threadgroup float more[4096];    // + 16 KiB
  threadgroup float extra[16];     // + 64 B: over 32 KiB
  big[tid] = 1.0f; more[tid] = 2.0f; extra[0] = 3.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = big[tid] + more[tid] + extra[0];
}

kernel void dyn_tg(device float* y [[buffer(0)]], threadgroup float* t [[threadgroup(0)]],
                   uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float s[4096];   // 16 KiB static
  s[tid] = 1.0f;
  t[tid] = 2.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = s[tid] + t[tid];
}

kernel void divergent_barrier(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  if (tid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = 1.0f;
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    y[tid] = 2.0f;
  }
}

kernel void early_exit_barrier(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  if (tid >= 40) return;   // returned threads no longer take part in barriers
  buf[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = buf[39 - tid];
}

kernel void const_cast_write(device const float* x [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  ((device float*)x)[gid] = 0.0f;
}

// thread 0 spins until thread 33 (another simdgroup) sets the flag: atomics yield, so this finishes
kernel void spin_wait_ok(device atomic_uint* flag [[buffer(0)]], device uint* out [[buffer(1)]],
                         uint tid [[thread_index_in_threadgroup]]) {
  if (tid == 0) {
    while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {}
    out[0] = 1;
  } else if (tid == 33) {
    atomic_store_explicit(flag, 1u, memory_order_relaxed);
  }
}

kernel void spin_forever(device atomic_uint* flag [[buffer(0)]]) {
  while (atomic_load_explicit(flag, memory_order_relaxed) == 0) {}
}

kernel void infinite_loop(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  while (y[0] >= 0.0f) {
    y[1 + tid] += 1.0f;
  }
}

kernel void div_zero(device int* y [[buffer(0)]], constant int& d [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  y[i] = y[i] / (d - int(i));
}

kernel void big_stack(device float* y [[buffer(0)]], constant int& n [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  float big[100000];   // 400 KB of thread memory
  for (int k = 0; k < n; ++k) big[k] = y[k % 4] * k;
  threadgroup_barrier(mem_flags::mem_device);  // every thread has read y before any writes it
  y[i] = big[n - 1 - i];
}
