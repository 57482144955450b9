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

// ------------------------------------------------------------- barrier flags
// a barrier orders only the memory its mem_flags name: mem_none is an execution barrier
kernel void threadgroup_mem_none(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                                 uint n [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[tid] = float(tid);  // race: threadgroup_mem_none
  threadgroup_barrier(mem_flags::mem_none);
  y[tid] = buf[(tid + 1) % n];  // race: threadgroup_mem_none
}

// ------------------------------------------- device memory within a threadgroup
// Each threadgroup works on its own 2n floats of y (races between threadgroups are not checked).
// A neighbour's element read without a barrier.
kernel void device_no_barrier(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                              uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  device float* mine = y + g * 2 * n;
  mine[tid] = float(tid);               // race: device_no_barrier
  mine[n + tid] = mine[(tid + 1) % n];  // race: device_no_barrier
}

// mem_threadgroup orders threadgroup memory only
kernel void device_threadgroup_flag(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                                    uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  device float* mine = y + g * 2 * n;
  mine[tid] = float(tid);  // race: device_threadgroup_flag
  threadgroup_barrier(mem_flags::mem_threadgroup);
  mine[n + tid] = mine[(tid + 1) % n];  // race: device_threadgroup_flag
}

// mem_none orders nothing
kernel void device_mem_none(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                            uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  device float* mine = y + g * 2 * n;
  mine[tid] = float(tid);  // race: device_mem_none
  threadgroup_barrier(mem_flags::mem_none);
  mine[n + tid] = mine[(tid + 1) % n];  // race: device_mem_none
}

// a read, then another thread's write of the same element (write after read)
kernel void device_write_after_read(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                                    uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  device float* mine = y + g * 2 * n;
  const float next = mine[(tid + 1) % n];  // race: device_write_after_read
  threadgroup_barrier(mem_flags::mem_threadgroup);
  mine[tid] = next;  // race: device_write_after_read
}

// a thread reads back its own store (not checked again: nothing can have changed), then a neighbour
// overwrites the element: still reported
kernel void device_own_read_back(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                                 uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  device float* mine = y + g * 2 * n;
  mine[tid] = float(tid);  // race: device_own_read_back
  const float own = mine[tid];
  mine[(tid + 1) % n] = own;  // race: device_own_read_back
}

// lanes of one simdgroup: a simdgroup_barrier with mem_threadgroup does not order device memory
kernel void device_simd_threadgroup_flag(device float* y [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                                         uint g [[threadgroup_position_in_grid]]) {
  device float* mine = y + g * 64;
  mine[lane] = float(lane);  // race: device_simd_threadgroup_flag
  simdgroup_barrier(mem_flags::mem_threadgroup);
  mine[32 + lane] = mine[lane ^ 1];  // race: device_simd_threadgroup_flag
}

// race free: device memory ordered by barriers with mem_device (alone or with other flags), between the
// lanes of a simdgroup by a simdgroup_barrier with mem_device; an element all threads only read
kernel void device_ordered_ok(device float* y [[buffer(0)]], uint tid [[thread_index_in_threadgroup]],
                              uint n [[threads_per_threadgroup]], uint g [[threadgroup_position_in_grid]],
                              uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  device float* mine = y + g * 2 * n;
  mine[n + tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_device);
  const float a = mine[n + (tid + 1) % n] + mine[n];
  threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);  // reads before the writes
  mine[n + tid] = a;
  mine[n + tid] += 1.0f;  // the same thread may read and write its own element
  simdgroup_barrier(mem_flags::mem_device);
  mine[tid] = mine[n + sg * 32 + (lane ^ 1)];
}
