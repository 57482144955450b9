// Test-only measurement kernel (not shipped): the two ways of feeding the
// dequantized B fragment of the fused GEMM, instrumented with load / barrier
// counters so tests/metal/test_metal_fused_variants.py can compare them in
// the emulator's terms.
//   STAGING = false: dequantize straight into the fragment (thread_elements),
//                    what metal/marlin_gemm_fused.h does.
//   STAGING = true:  the staging alternative: lanes 0-7 of each simdgroup dequantize
//                    an 8x8 B tile into a per-simdgroup threadgroup staging
//                    buffer, simdgroup_barrier, simdgroup_load, per (m, n)
//                    fragment (plus the barrier protecting the buffer before
//                    it is overwritten, which the note omits).
// fp4 weights, fp32 activations, one 32 x 64 tile per threadgroup (4
// simdgroups x 16 columns), K a multiple of 32, no bias. counters[0]: packed
// word loads (per lane), counters[1]: simdgroup barriers (per simdgroup).
#include <metal_atomic>
#include <metal_simdgroup>
#include <metal_stdlib>

#include "marlin_tile.h"

using namespace metal;

template <bool STAGING>
[[kernel]] void fused_b_variant(const device float* x [[buffer(0)]],
                                const device uint* packed [[buffer(1)]],
                                const device half* scales [[buffer(2)]],
                                device float* y [[buffer(3)]],
                                device atomic_uint* counters [[buffer(4)]],
                                constant uint& M [[buffer(5)]],
                                constant uint& N [[buffer(6)]],
                                constant uint& K [[buffer(7)]],
                                constant uint& group_rows [[buffer(8)]],
                                uint3 tgid [[threadgroup_position_in_grid]],
                                uint tid [[thread_index_in_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float xs[32 * 32];
  threadgroup float stage[STAGING ? 4 * 64 : 1];
  const MarlinLane l = marlin_lane(lane);
  const uint fr = l.row, fc = l.col;
  const uint m0 = tgid.y * 32, nb = tgid.x * 64 + sg * 16;

  simdgroup_matrix<float, 8, 8> acc[4][2];  // [m fragment][n fragment], C = x B
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (uint k0 = 0; k0 < K; k0 += 32) {
    for (uint e = tid; e < 32 * 32; e += 128) {
      const uint m = m0 + e / 32;
      xs[e] = m < M ? x[m * K + k0 + e % 32] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint kk = 0; kk < 4; ++kk) {
      const uint r = k0 / 8 + kk;
      if (!STAGING) {
        // B^T fragment per lane: row = column n, cols = consecutive K pair.
        simdgroup_matrix<float, 8, 8> wt[2];
        for (int j = 0; j < 2; ++j) {
          const uint n = nb + 8 * j + fr;
          uint w = 0;
          MarlinParams p = {0.0f, 0.0f};
          if (n < N) {
            w = packed[r * N + n];
            atomic_fetch_add_explicit(&counters[0], 1u, memory_order_relaxed);
            p = marlin_load_params<kFp4>(scales, scales, 8 * r / group_rows, n, N);
          }
          // fragment columns (fc, fc + 1) are K values (fc / 2, fc / 2 + 4)
          marlin_set_elements(wt[j], marlin_dequant_pair<kFp4>(w, fc / 2, p));
        }
        for (int i = 0; i < 4; ++i) {
          simdgroup_matrix<float, 8, 8> xt;
          const uint row = 8 * i + fc, col = 8 * kk + marlin_fragment_k(fr);
          marlin_set_elements(xt, float2(xs[row * 32 + col], xs[(row + 1) * 32 + col]));
          // acc holds C^T here: (n, m)
          for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i][j], wt[j], xt, acc[i][j]);
        }
      } else {
        for (int i = 0; i < 4; ++i) {
          simdgroup_matrix<float, 8, 8> a;
          simdgroup_load(a, xs + (8 * i) * 32 + 8 * kk, 32);
          for (int j = 0; j < 2; ++j) {
            threadgroup float* st = stage + sg * 64;
            if (lane < 8) {
              const uint n = nb + 8 * j + lane;
              uint w = 0;
              MarlinParams p = {0.0f, 0.0f};
              if (n < N) {
                w = packed[r * N + n];
                atomic_fetch_add_explicit(&counters[0], 1u, memory_order_relaxed);
                p = marlin_load_params<kFp4>(scales, scales, 8 * r / group_rows, n, N);
              }
              for (uint q = 0; q < 4; ++q) {
                const float2 v = marlin_dequant_pair<kFp4>(w, q, p);
                st[q * 8 + lane] = v.x;
                st[(q + 4) * 8 + lane] = v.y;
              }
            }
            simdgroup_barrier(mem_flags::mem_threadgroup);
            simdgroup_matrix<float, 8, 8> b;
            simdgroup_load(b, st, 8);
            simdgroup_barrier(mem_flags::mem_threadgroup);  // stage free again
            if (lane == 0) atomic_fetch_add_explicit(&counters[1], 2u, memory_order_relaxed);
            simdgroup_multiply_accumulate(acc[i][j], a, b, acc[i][j]);
          }
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 2; ++j) {
      const float2 v = float2(acc[i][j].thread_elements()[0], acc[i][j].thread_elements()[1]);
      for (uint e = 0; e < 2; ++e) {
        // thread_elements: (C^T)[n = fr][m = fc + e]; staging: C[m = fr][n = fc + e]
        const uint m = m0 + 8 * i + (STAGING ? fr : fc + e);
        const uint n = nb + 8 * j + (STAGING ? fc + e : fr);
        if (m < M && n < N) y[m * N + n] = v[e];
      }
    }
}

template [[host_name("fused_b_thread_elements")]] [[kernel]] decltype(fused_b_variant<false>) fused_b_variant<false>;
template [[host_name("fused_b_staging")]] [[kernel]] decltype(fused_b_variant<true>) fused_b_variant<true>;
