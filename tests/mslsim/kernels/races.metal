// Threadgroup-memory races the emulator must report (two threads, at least
// one writing, not ordered by a barrier) and race-free patterns it must not.
// Lines marked `// race: <kernel>` are the accesses a report must name.
// tests/mslsim/test_races.py
#include <metal_atomic>
#include <metal_stdlib>
using namespace metal;

// two plain stores of different threads to one location in one barrier interval
kernel void write_write(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float slot[32];
  slot[tid / 2] = float(tid);  // race: write_write
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = slot[tid / 2];
}

// a neighbour's value read without a barrier after the stores
kernel void read_write(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                       uint tid [[thread_index_in_threadgroup]], uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[tid] = x[tid];          // race: read_write
  y[tid] = buf[(tid + 1) % n];  // race: read_write
}

// lanes of one simdgroup exchange through threadgroup memory with no simdgroup_barrier
kernel void simd_unsynced(device float* y [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float buf[32];
  buf[lane] = float(lane);  // race: simd_unsynced
  y[lane] = buf[lane ^ 1];  // race: simd_unsynced
}

// a simdgroup_barrier orders the lanes of one simdgroup only, not two simdgroups
kernel void cross_simdgroup(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  buf[tid] = float(tid);  // race: cross_simdgroup
  simdgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = buf[(tid + 32) % 64];  // race: cross_simdgroup
}

// ---------------------------------------------------------------- race free
// barrier-separated phases, buffer reuse after a barrier, read-read sharing
kernel void phases_ok(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                      uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float a = buf[(tid + 1) % n] + buf[0];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  buf[tid] = a * 2.0f;
  buf[tid] += 1.0f;  // the same thread may read and write its own element
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = buf[(tid + 2) % n];
}

// atomics are not races
kernel void atomics_ok(device uint* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup atomic_uint count;
  if (tid == 0) atomic_store_explicit(&count, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
  atomic_fetch_max_explicit(&count, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[tid] = atomic_load_explicit(&count, memory_order_relaxed);
}

// lanes of one simdgroup exchange through threadgroup memory, ordered by a
// simdgroup_barrier, then by a simd collective
kernel void simd_ordered_ok(device float* y [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float buf[2][32];
  buf[sg][lane] = float(lane);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  float a = buf[sg][lane ^ 1];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  buf[sg][lane] = a * 2.0f;
  float s = simd_sum(a);  // a collective orders the lanes too
  y[sg * 32 + lane] = buf[sg][lane ^ 2] + s;
}

// double buffering: write one half while the other is read, one barrier per step
kernel void double_buffer_ok(device const float* x [[buffer(0)]], device float* y [[buffer(1)]],
                             uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tiles[2][64];
  tiles[0][tid] = x[tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float acc = 0.0f;
  for (uint step = 0; step < 4; ++step) {
    const uint cur = step % 2;
    if (step + 1 < 4) tiles[cur ^ 1][tid] = x[(step + 1) * 64 + tid];
    acc += tiles[cur][63 - tid];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  y[tid] = acc;
}
