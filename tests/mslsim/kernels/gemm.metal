// Tiled simdgroup_matrix GEMM, MLX steel style: C[M,N] = A[M,K] * B (B is [K,N],
// or [N,K] when transpose_b).  32x32 output tile per threadgroup of 4
// simdgroups (2x2), each simdgroup owns a 16x16 block = 2x2 8x8 fragments.
#include <metal_stdlib>
using namespace metal;

#define BM 32
#define BN 32
#define BK 16

template <typename T, bool transpose_b>
[[kernel]] void gemm(
    const device T* A [[buffer(0)]],
    const device T* B [[buffer(1)]],
    device T* C [[buffer(2)]],
    constant int& M [[buffer(3)]],
    constant int& N [[buffer(4)]],
    constant int& K [[buffer(5)]],
    uint3 tgid [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sgid [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup T As[BM * BK];
  threadgroup T Bs[BK * BN];
  const int row0 = tgid.y * BM, col0 = tgid.x * BN;
  const int sm = (sgid / 2) * 16, sn = (sgid % 2) * 16;
  simdgroup_matrix<float, 8, 8> acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int k0 = 0; k0 < K; k0 += BK) {
    // cooperative loads: 128 threads, 512 elements per tile
    for (int e = tid; e < BM * BK; e += 128) {
      int r = e / BK, c = e % BK;
      As[e] = A[(row0 + r) * K + k0 + c];
    }
    for (int e = tid; e < BK * BN; e += 128) {
      if (transpose_b) {
        int n = e / BK, k = e % BK;   // Bs stored [BN][BK]
        Bs[e] = B[(col0 + n) * K + k0 + k];
      } else {
        int k = e / BN, n = e % BN;   // Bs stored [BK][BN]
        Bs[e] = B[(k0 + k) * N + col0 + n];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < BK; kk += 8) {
      simdgroup_matrix<T, 8, 8> a[2], b[2];
      for (int i = 0; i < 2; ++i)
        simdgroup_load(a[i], As, BK, ulong2(kk, sm + 8 * i));
      for (int j = 0; j < 2; ++j) {
        if (transpose_b)
          // origin is (column, row) of the loaded 8x8 block: column n, row k
          simdgroup_load(b[j], Bs, BK, ulong2(sn + 8 * j, kk), true);
        else
          simdgroup_load(b[j], Bs, BN, ulong2(sn + 8 * j, kk));
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j)
          simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      simdgroup_matrix<T, 8, 8> out;
      out.thread_elements()[0] = static_cast<T>(acc[i][j].thread_elements()[0]);
      out.thread_elements()[1] = static_cast<T>(acc[i][j].thread_elements()[1]);
      simdgroup_store(out, C, N, ulong2(col0 + sn + 8 * j, row0 + sm + 8 * i));
    }
}

#define instantiate_gemm(name, T, tb) \
  template [[host_name(name)]] [[kernel]] decltype(gemm<T, tb>) gemm<T, tb>;

instantiate_gemm("gemm_f16_nn", half, false)
instantiate_gemm("gemm_f16_nt", half, true)
instantiate_gemm("gemm_f32_nn", float, false)
instantiate_gemm("gemm_bf16_nt", bfloat, true)

// thread_elements round trip: write each lane's fragment directly (as lvalue),
// store with simdgroup_store; then load back and write out per lane.
kernel void fragment_layout(device float* out [[buffer(0)]],
                            device float* lanes [[buffer(1)]],
                            uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_matrix<float, 8, 8> m;
  m.thread_elements()[0] = lane * 2;
  m.thread_elements()[1] = lane * 2 + 1;
  simdgroup_store(m, out, 8);
  // lanes are not assumed to run in lockstep: other lanes' stores are visible after a barrier
  simdgroup_barrier(mem_flags::mem_device);
  simdgroup_matrix<float, 8, 8> back;
  simdgroup_load(back, out, 8, ulong2(0, 0), true);   // transposed load
  thread auto& f = back.thread_elements();
  lanes[2 * lane] = f[0];
  lanes[2 * lane + 1] = f.y;
}

// D may alias an operand: D = A * D + C with a diagonal A
kernel void mma_alias(device const half* a [[buffer(0)]],
                      device const half* b [[buffer(1)]],
                      device half* out [[buffer(2)]]) {
  simdgroup_matrix<half, 8, 8> A, B;
  simdgroup_matrix<half, 8, 8> I = simdgroup_matrix<half, 8, 8>(2.0h);
  simdgroup_load(A, a);
  simdgroup_load(B, b);
  simdgroup_multiply_accumulate(B, A, B, B);   // B = A*B + B
  simdgroup_multiply(B, I, B);                 // B = 2*B
  simdgroup_store(B, out);
}
