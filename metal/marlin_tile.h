// Pieces shared by the GEMV and GEMM kernels: the output epilogue (bias,
// rounding, or the fp32 partial tile of a K split), the simdgroup_matrix
// fragment lane map, and the cooperative, padded x-tile loader.
#pragma once

#include <metal_simdgroup_matrix>
#include <metal_stdlib>

#include "marlin_dequant.h"

using namespace metal;

// The buffers of the GEMV and both GEMMs, one layout for all three (the planner
// binds them with one list): x [M, K], packed [K/8, N], scales and zeros
// [groups, N], bias [N], y [M, N], the K split's partial [splits, M, N], sizes,
// and the packed rows per K slice.
#define MARLIN_GEMM_BUFFERS(T)                                                          \
  const device T* x [[buffer(0)]], const device uint* packed [[buffer(1)]],             \
      const device half* scales [[buffer(2)]], const device half* zeros [[buffer(3)]],  \
      const device T* bias [[buffer(4)]], device T* y [[buffer(5)]],                    \
      device float* partial [[buffer(6)]], constant uint& M [[buffer(7)]],              \
      constant uint& N [[buffer(8)]], constant uint& K [[buffer(9)]],                   \
      constant uint& split_rows [[buffer(10)]]

// Where results go. With marlin_write_partial (K split) slice z stores fp32
// partial sums to partial[z][M][N] and marlin_reduce (metal/marlin_reduce.h)
// adds the slices and the bias; otherwise y[M][N] = T(v + bias[n]), rounded once.
template <typename T>
struct MarlinOutput {
  device T* y;
  device float* partial;
  const device T* bias;
  uint M, N, z;

  void store(uint m, uint n, float v) const {
    if (m >= M || n >= N) return;
    if (marlin_write_partial) {
      partial[(ulong(z) * M + m) * N + n] = v;
    } else {
      if (marlin_has_bias) v += float(bias[n]);
      y[ulong(m) * N + n] = T(v);
    }
  }
};

// Apple's simdgroup_matrix<T, 8, 8> layout: lane l holds row `row` and
// columns `col`, `col + 1` of the fragment.
struct MarlinLane {
  uint row, col;
};

inline MarlinLane marlin_lane(uint lane) {
  return MarlinLane{(lane / 4 & 4) + (lane / 2) % 4, (lane / 4 & 2) * 2 + (lane % 2) * 2};
}

// K inside an 8-deep block for fragment column c: columns (2i, 2i + 1) hold K
// values (i, i + 4), the nibble pair marlin_raw_pair(w, i) decodes.
inline uint marlin_fragment_k(uint c) { return (c >> 1) + 4 * (c & 1); }

// Stores this lane's two elements of an fp32 accumulator fragment whose
// element (r, c) is output (row0 + r, col0 + c), or with `transposed` output
// (col0 + c, row0 + r) (a fragment of C^T).
// `out` is a MarlinOutput or any type with the same store(m, n, v).
template <typename Out>
inline void marlin_store_fragment(const thread Out& out, thread simdgroup_matrix<float, 8, 8>& acc,
                                  MarlinLane l, uint row0, uint col0, bool transposed) {
  for (uint e = 0; e < 2; ++e) {
    const float v = acc.thread_elements()[e];
    if (transposed)
      out.store(col0 + l.col + e, row0 + l.row, v);
    else
      out.store(row0 + l.row, col0 + l.col + e, v);
  }
}

// Sets this lane's two elements of an 8x8 fragment (element-wise, the form
// Apple's compiler is known to accept for thread_elements()).
inline void marlin_set_elements(thread simdgroup_matrix<float, 8, 8>& m, float2 v) {
  m.thread_elements()[0] = v.x;
  m.thread_elements()[1] = v.y;
}

// Which x row each row of a tile reads. Dense: rows m0, m0 + 1, ... below M.
// The routed expert GEMM (metal/moe.metal) gathers its rows through a list of
// (token, expert) pairs instead.
struct MarlinDenseRows {
  uint m0, M;
  bool has(uint row) const { return m0 + row < M; }
  ulong x_row(uint row) const { return m0 + row; }
};

// Cooperative load (kGemmThreads threads) of x[rows.x_row(row), k0 .. k0 + kGemmTileK]
// for every tile row into a threadgroup tile with row stride
// x_tile_stride(sizeof(T)), zero for rows without a source and past k_end. k0
// and k_end are multiples of 8 (whole packed rows), so a 4-element chunk is
// entirely inside or outside [k0, k_end); with marlin_aligned every chunk is
// one vector load.
template <typename T, int TM, typename Rows>
inline void marlin_load_x_rows(threadgroup T* dst, const device T* x, thread const Rows& rows, uint k0, uint K,
                               uint k_end, uint tid) {
  constexpr uint S = x_tile_stride(sizeof(T));
  constexpr uint kChunks = kGemmTileK / 4;  // per row
  for (uint e = tid; e < uint(TM) * kChunks; e += kGemmThreads) {
    const uint row = e / kChunks, col = 4 * (e % kChunks);
    const uint k = k0 + col;
    vec<T, 4> v = vec<T, 4>(T(0.0f));
    if (rows.has(row) && k < k_end) {
      const device T* src = x + rows.x_row(row) * K + k;
      if (marlin_aligned)
        v = *(const device vec<T, 4>*)src;
      else
        v = vec<T, 4>(src[0], src[1], src[2], src[3]);
    }
    *(threadgroup vec<T, 4>*)(dst + row * S + col) = v;
  }
}

// The dense tile: x rows m0 .. m0 + TM, zero past M.
template <typename T, int TM>
inline void marlin_load_x_tile(threadgroup T* dst, const device T* x, uint m0, uint k0, uint M, uint K,
                               uint k_end, uint tid) {
  const MarlinDenseRows rows{m0, M};
  marlin_load_x_rows<T, TM>(dst, x, rows, k0, K, k_end, tid);
}
