// Kernels written in the style of MLX's quantized.h / steel (not copied):
// static constant constexpr const, const constant int&, METAL_FUNC helpers
// taking attributed parameters, thread arrays, uint16 weight reads, simd_sum,
// a BlockMMA-like struct that fills simdgroup_matrix fragments by hand.
#include <metal_simdgroup>
#include <metal_stdlib>

using namespace metal;

#define MTL_CONST static constant constexpr const
#define PRAGMA_UNROLL _Pragma("clang loop unroll(full)")

MTL_CONST int SIMD_SIZE = 32;

template <typename T, typename U, int values_per_thread>
METAL_FUNC U load_x(const device T* x, thread U* x_thread) {
  U sum = 0;
  for (int i = 0; i < values_per_thread; i += 4) {
    sum += x[i] + x[i + 1] + x[i + 2] + x[i + 3];
    x_thread[i] = x[i];
    x_thread[i + 1] = x[i + 1] / 16.0f;
    x_thread[i + 2] = x[i + 2] / 256.0f;
    x_thread[i + 3] = x[i + 3] / 4096.0f;
  }
  return sum;
}

template <typename U, int values_per_thread>
METAL_FUNC U qdot4(const device uint8_t* w, const thread U* x_thread, U scale, U bias, U sum) {
  const device uint16_t* ws = (const device uint16_t*)w;
  U accum = 0;
  PRAGMA_UNROLL
  for (int i = 0; i < values_per_thread / 4; i++) {
    accum += (x_thread[4 * i] * (ws[i] & 0x000f) + x_thread[4 * i + 1] * (ws[i] & 0x00f0) +
              x_thread[4 * i + 2] * (ws[i] & 0x0f00) + x_thread[4 * i + 3] * (ws[i] & 0xf000));
  }
  return scale * accum + sum * bias;
}

// y[n] = sum_k x[k] * (scale[n, k/gs] * q[n, k] + bias[n, k/gs]); 4-bit q, 8 per uint32
template <typename T, int group_size>
METAL_FUNC void qmv_impl(const device uint32_t* w, const device T* scales, const device T* biases,
                         const device T* x, device T* y, const constant int& in_vec_size,
                         const constant int& out_vec_size,
                         uint3 tid [[threadgroup_position_in_grid]],
                         uint simd_gid [[simdgroup_index_in_threadgroup]],
                         uint simd_lid [[thread_index_in_simdgroup]]) {
  constexpr int num_simdgroups = 2;
  constexpr int results_per_simdgroup = 4;
  constexpr int values_per_thread = 8;
  constexpr int block_size = values_per_thread * SIMD_SIZE;
  constexpr int scale_step_per_thread = group_size / values_per_thread;
  typedef float U;
  thread U x_thread[values_per_thread];
  thread U result[results_per_simdgroup] = {0};

  const int in_vec_size_w = in_vec_size / 2;   // bytes per row
  const int in_vec_size_g = in_vec_size / group_size;
  const int out_row = tid.x * (num_simdgroups * results_per_simdgroup) + simd_gid * results_per_simdgroup;
  if (out_row >= out_vec_size) return;

  const device uint8_t* ws = (const device uint8_t*)w + out_row * in_vec_size_w + simd_lid * values_per_thread / 2;
  scales += out_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  biases += out_row * in_vec_size_g + simd_lid / scale_step_per_thread;
  x += simd_lid * values_per_thread;
  y += out_row;

  for (int k = 0; k < in_vec_size; k += block_size) {
    U sum = load_x<T, U, values_per_thread>(x, x_thread);
    for (int row = 0; row < results_per_simdgroup; row++) {
      auto wl = ws + row * in_vec_size_w;
      const device T* sl = scales + row * in_vec_size_g;
      const device T* bl = biases + row * in_vec_size_g;
      U s = sl[0];
      U b = bl[0];
      result[row] += qdot4<U, values_per_thread>(wl, x_thread, s, b, sum);
    }
    ws += block_size / 2;
    scales += block_size / group_size;
    biases += block_size / group_size;
    x += block_size;
  }
  for (int row = 0; row < results_per_simdgroup; row++) {
    result[row] = simd_sum(result[row]);
    if (simd_lid == 0) y[row] = static_cast<T>(result[row]);
  }
}

template <typename T, int group_size>
[[kernel]] void qmv(const device uint32_t* w [[buffer(0)]], const device T* scales [[buffer(1)]],
                    const device T* biases [[buffer(2)]], const device T* x [[buffer(3)]],
                    device T* y [[buffer(4)]], const constant int& in_vec_size [[buffer(5)]],
                    const constant int& out_vec_size [[buffer(6)]],
                    uint3 tid [[threadgroup_position_in_grid]],
                    uint simd_gid [[simdgroup_index_in_threadgroup]],
                    uint simd_lid [[thread_index_in_simdgroup]]) {
  qmv_impl<T, group_size>(w, scales, biases, x, y, in_vec_size, out_vec_size, tid, simd_gid, simd_lid);
}

#define instantiate_qmv(type, gs) \
  template [[host_name("qmv_" #type "_gs_" #gs)]] [[kernel]] decltype(qmv<type, gs>) qmv<type, gs>;
instantiate_qmv(half, 32)
instantiate_qmv(half, 64)
instantiate_qmv(float, 32)
instantiate_qmv(bfloat16_t, 64)

// ---- BlockMMA-like: fragments filled by hand through thread_elements() ----
template <typename T, int BM, int BN, int BK, int WM, int WN, short lda, short ldb>
struct Mma {
  MTL_CONST short TM = BM / (8 * WM);
  MTL_CONST short TN = BN / (8 * WN);
  simdgroup_matrix<float, 8, 8> As[TM];
  simdgroup_matrix<float, 8, 8> Bs[TN];
  simdgroup_matrix<float, 8, 8> acc[TM * TN] = {simdgroup_matrix<float, 8, 8>(0)};
  const short tm, tn;
  short sm, sn;

  METAL_FUNC Mma(ushort sgid [[simdgroup_index_in_threadgroup]], ushort lane [[thread_index_in_simdgroup]])
      : tm(8 * (sgid / WN)), tn(8 * (sgid % WN)) {
    short qid = lane / 4;
    sm = (qid & 4) + (lane / 2) % 4;
    sn = (qid & 2) * 2 + (lane % 2) * 2;
  }

  METAL_FUNC void mma(const threadgroup T* A, const threadgroup T* B) {
    A += (tm + sm) * lda + sn;
    B += sm * ldb + tn + sn;
    PRAGMA_UNROLL
    for (short kk = 0; kk < BK; kk += 8) {
      simdgroup_barrier(mem_flags::mem_none);
      for (short i = 0; i < TM; i++) {
        As[i].thread_elements()[0] = static_cast<float>(A[i * 8 * WM * lda]);
        As[i].thread_elements()[1] = static_cast<float>(A[i * 8 * WM * lda + 1]);
      }
      simdgroup_barrier(mem_flags::mem_none);
      for (short j = 0; j < TN; j++) {
        thread auto& f = Bs[j].thread_elements();
        f = float2(B[j * 8 * WN], B[j * 8 * WN + 1]);
      }
      simdgroup_barrier(mem_flags::mem_none);
      for (short i = 0; i < TM; i++)
        for (short j = 0; j < TN; j++) {
          short js = (i % 2) ? (TN - 1 - j) : j;
          simdgroup_multiply_accumulate(acc[i * TN + js], As[i], Bs[js], acc[i * TN + js]);
        }
      A += 8;
      B += 8 * ldb;
    }
  }

  METAL_FUNC void store_safe(device T* C, const int ldc, short2 dims) const {
    C += (sm + tm) * ldc + tn + sn;
    dims -= short2(tn + sn, sm + tm);
    for (int i = 0; i < TM; i++) {
      if (i * 8 * WM >= dims.y) continue;
      for (int j = 0; j < TN; j++) {
        thread const auto& a = acc[i * TN + j].thread_elements();
        int off = (i * 8 * WM) * ldc + j * 8 * WN;
        if (j * 8 * WN < dims.x) C[off] = static_cast<T>(a[0]);
        if (j * 8 * WN + 1 < dims.x) C[off + 1] = static_cast<T>(a.y);
      }
    }
  }
};

// C[M,N] = A[M,K] B[K,N]; M, N arbitrary (masked), K a multiple of 16
template <typename T>
[[kernel]] void block_gemm(const device T* A [[buffer(0)]], const device T* B [[buffer(1)]],
                           device T* C [[buffer(2)]], const constant int3& mnk [[buffer(3)]],
                           threadgroup T* As [[threadgroup(0)]],
                           uint3 tgid [[threadgroup_position_in_grid]],
                           ushort lid [[thread_index_in_threadgroup]],
                           ushort sgid [[simdgroup_index_in_threadgroup]],
                           ushort lane [[thread_index_in_simdgroup]]) {
  constexpr int BM = 32, BN = 32, BK = 16;
  constexpr short lda = BK + 4, ldb = BN + 4;
  threadgroup T Bs[BK * ldb];
  const int M = mnk.x, N = mnk.y, K = mnk.z;
  const int r0 = tgid.y * BM, c0 = tgid.x * BN;
  Mma<T, BM, BN, BK, 2, 2, lda, ldb> op(sgid, lane);
  for (int k0 = 0; k0 < K; k0 += BK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int e = lid; e < BM * BK; e += 128) {
      int r = e / BK, c = e % BK;
      As[r * lda + c] = r0 + r < M ? A[(r0 + r) * K + k0 + c] : T(0);
    }
    for (int e = lid; e < BK * BN; e += 128) {
      int r = e / BN, c = e % BN;
      Bs[r * ldb + c] = c0 + c < N ? B[(k0 + r) * N + c0 + c] : T(0);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    op.mma(As, Bs);
  }
  op.store_safe(C + r0 * N + c0, N, short2(min(BN, N - c0), min(BM, M - r0)));
}
template [[host_name("block_gemm_half")]] [[kernel]] decltype(block_gemm<half>) block_gemm<half>;
template [[host_name("block_gemm_float")]] [[kernel]] decltype(block_gemm<float>) block_gemm<float>;
