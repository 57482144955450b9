// The dense layout's tiled GEMM kernels (more rows of x), part of one kernel
// build (see cpu/cpu_vec.h); the 2:4 GEMM runs its loops on tiles of its own.
#pragma once
#include "cpu/cpu_vec.h"
#include "cpu/format_decode.h"
#include "cpu/kernel_args.h"

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

constexpr int kTileCols = int(kGemmBlockCols);
constexpr int kTileRows = int(kGemmBlockRows);  // a 64 KiB fp32 tile: stays in L2

// Tiled GEMM (more rows): dequantize a cache-sized tile once, then a
// register-blocked micro-kernel reuses it for every row.

// Dequantizes rows [k0, k0 + rows) x columns [nb, nb + 64) of B into an
// fp32 tile with row stride 64 (columns past N are zero).
template <int F>
void dequant_tile(const GemmArgs& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(64) int32_t words[kTileCols];
  alignas(64) float scale[kTileCols], zero[kTileCols];
  int64_t group = -1;
  for (int64_t r = k0 / 8; r < (k0 + rows) / 8; ++r) {
    const int64_t g = r * 8 / a.group_rows;
    if (g != group) {  // groups span whole words: group_rows is a multiple of 8
      group = g;
      copy_halves(scale, a.scales + g * a.n + nb, cols, kTileCols);
      if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + nb, cols, kTileCols);
    }
    const int32_t* src = a.packed + r * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      src = words;
    }
    float* dst = tile + (r * 8 - k0) * kTileCols;
    for (int q = 0; q < kTileCols / kLanes; ++q) {
      const vi w = prepare_words<F>(load(src + kLanes * q));
      const vf s = load(scale + kLanes * q);
      const vf z = kHasZeros<F> ? load(zero + kLanes * q) : vf{};
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const vf v = decode_nibble<F>(w, j);
        store(dst + j * kTileCols + kLanes * q, group_weight<F>(v, s, z));
      }
    }
  }
}

// acc[0:MR, col:col+2*kLanes] += x[0:MR, k0:k0+rows] @ tile[:, col:col+2*kLanes]
// (acc row stride kTileCols, x row stride K).
// Never inlined: inlined into a large caller (the rans tile GEMM on AVX2) it
// kept its accumulators in memory, 1.5x slower.
template <int MR>
[[gnu::noinline]] void micro_kernel(const float* x, int64_t ldx, int64_t rows, const float* tile, int col, float* acc) {
  vf c[MR][2];
  for (int i = 0; i < MR; ++i) {
    c[i][0] = load(acc + i * kTileCols + col);
    c[i][1] = load(acc + i * kTileCols + col + kLanes);
  }
  for (int64_t k = 0; k < rows; ++k) {
    const vf b0 = load(tile + k * kTileCols + col), b1 = load(tile + k * kTileCols + col + kLanes);
    for (int i = 0; i < MR; ++i) {
      const vf xs = splat(x[i * ldx + k]);
      c[i][0] = fmadd(xs, b0, c[i][0]);
      c[i][1] = fmadd(xs, b1, c[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    store(acc + i * kTileCols + col, c[i][0]);
    store(acc + i * kTileCols + col + kLanes, c[i][1]);
  }
}

// Rows per micro-kernel call: 6 x 2 vectors use 12 of AVX2's 16 registers,
// 12 x 2 use 24 of AVX-512's 32.
constexpr int kMicroRows = MARLIN_KERNEL_AVX512 ? 12 : 6;

// Calls body.template operator()<MR>() for MR = rows (1..Max <= 12).
#define MARLIN_ROWS_CASE(MR) \
  case MR: body.template operator()<(MR <= Max ? MR : 1)>(); break;
template <int Max = kMicroRows, class Body>
inline void with_rows(int rows, Body&& body) {
  switch (rows) {
    MARLIN_ROWS_CASE(1) MARLIN_ROWS_CASE(2) MARLIN_ROWS_CASE(3) MARLIN_ROWS_CASE(4) MARLIN_ROWS_CASE(5)
    MARLIN_ROWS_CASE(6) MARLIN_ROWS_CASE(7) MARLIN_ROWS_CASE(8) MARLIN_ROWS_CASE(9) MARLIN_ROWS_CASE(10)
    MARLIN_ROWS_CASE(11) MARLIN_ROWS_CASE(12)
    default: break;
  }
}
#undef MARLIN_ROWS_CASE

// Tiles (of a Tiles-tile fill) inside N: the others are neither computed nor stored.
template <int Tiles>
inline int tiles_inside(const GemmArgs& a, int64_t nb) {
  if constexpr (Tiles == 1) return 1;  // nb < N
  const int64_t inside = (a.n - nb + kTileCols - 1) / kTileCols;
  return int(inside < Tiles ? inside : Tiles);
}

// out[m0:m1, nb:nb+64 tiles] from the accumulators of tiles side by side (row
// stride 64, (m1 - m0) rows per tile), the columns inside N; times column_scale
// (64 per tile) where the fill left the one scale of each column out.
inline void store_tiles(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, int tiles, const float* acc,
                        const float* column_scale = nullptr) {
  for (int t = 0; t < tiles; ++t) {
    const int64_t n0 = nb + t * kTileCols, cols = (a.n - n0 < kTileCols) ? a.n - n0 : kTileCols;
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = acc + (t * (m1 - m0) + m - m0) * kTileCols;
      if (!column_scale) {
        memcpy(a.out + m * a.n + n0, row, cols * sizeof(float));
        continue;
      }
      for (int64_t c = 0; c < cols; ++c) a.out[m * a.n + n0 + c] = row[c] * column_scale[t * kTileCols + c];
    }
  }
}

// out[m0:m1, nb:nb+64 Tiles] through fp32 tiles of B that fill(k0, rows, tile)
// writes (the dense dequant_tile, or the 2:4 one; Tiles > 1: the rans fill,
// tile t of columns nb + 64 t at tile + t * kTileRows * kTileCols); scratch as
// Tiles * gemm_scratch_floats(m1 - m0). column_scale: see store_tiles (read
// after the last fill).
template <int Tiles = 1, class Fill>
void gemm_tiles(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch, Fill&& fill,
                const float* column_scale = nullptr) {
  constexpr int64_t kTileFloats = kTileRows * kTileCols;
  const int tiles = tiles_inside<Tiles>(a, nb);
  const int64_t acc_floats = (m1 - m0) * kTileCols;  // per tile
  float* tile = scratch;
  float* acc = scratch + Tiles * kTileFloats;
  memset(acc, 0, tiles * acc_floats * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    fill(k0, rows, tile);
    // Column slices outer: one slice of the tile (16 or 32 KiB) stays in L1
    // while every row block streams past it. (Copying x's block to a
    // stride without L1 set aliasing was measured 1.1x slower.)
    for (int t = 0; t < tiles; ++t) {
      for (int col = 0; col < kTileCols; col += 2 * kLanes) {
        for (int64_t m = m0; m < m1;) {
          const int mr = even_rows(m1 - m, kMicroRows);
          const float* x = a.x + m * a.k + k0;
          float* c = acc + t * acc_floats + (m - m0) * kTileCols;
          with_rows(mr, [&]<int MR>() { micro_kernel<MR>(x, a.k, rows, tile + t * kTileFloats, col, c); });
          m += mr;
        }
      }
    }
  }
  store_tiles(a, m0, m1, nb, tiles, acc, column_scale);
}

template <int F>
void gemm_tile_impl(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  gemm_tiles(a, m0, m1, nb, scratch, [&](int64_t k0, int64_t rows, float* tile) { dequant_tile<F>(a, k0, rows, nb, tile); });
}

#if MARLIN_KERNEL_BF16_DOT
// bf16 x: the tile holds bf16 pairs of the codes' values (no scale), pair
// row q = K rows 2q, 2q + 1; the micro-kernel sums one group segment in
// registers and applies the scale (and zero) once per segment.

constexpr int kDotCols = MARLIN_KERNEL_AVX512 ? 64 : 16;  // columns per micro-kernel call
constexpr int kDotVectors = kDotCols / kLanes;
constexpr int kDotRows = MARLIN_KERNEL_AVX512 ? 6 : 4;

// Tile rows [k0, k0 + rows) x 64 columns: (rows / 2) x 64 pairs.
template <int F>
void dequant_pairs_tile(const GemmArgs& a, int64_t k0, int64_t rows, int64_t nb, float* tile) {
  const int64_t cols = (a.n - nb < kTileCols) ? a.n - nb : kTileCols;
  alignas(64) int32_t words[kTileCols];
  for (int64_t r = k0 / 8; r < (k0 + rows) / 8; ++r) {
    const int32_t* src = a.packed + r * a.n + nb;
    if (cols < kTileCols) {
      copy_words(words, src, cols, kTileCols);
      src = words;
    }
    float* dst = tile + (r * 8 - k0) / 2 * kTileCols;
    for (int q = 0; q < kTileCols / kLanes; ++q) {
      const vi w = prepare_words<F>(load(src + kLanes * q));
      for (int p = 0; p < 4; ++p) store(dst + p * kTileCols + kLanes * q, decode_pair<F>(w, p));
    }
  }
}

// acc[0:MR, col:col+kDotCols] += scale * (x[0:MR, segment] @ tile[pairs, col:...]), and for
// formats with zeros once per group (xsum set: x's sums over the group, row stride ldxsum)
// the zero point's or the bias's term (group_dot).
template <int F, int MR>
inline void micro_dot(const uint16_t* x, int64_t ldx, int64_t pairs, const float* tile, int col,
                      const float* scale, const float* zero, const float* xsum, int64_t ldxsum, float* acc) {
  vf p[MR][kDotVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kDotVectors; ++v) p[i][v] = vf{};
  for (int64_t q = 0; q < pairs; ++q) {
    vf b[kDotVectors];
    for (int v = 0; v < kDotVectors; ++v) b[v] = load(tile + q * kTileCols + col + kLanes * v);
    for (int i = 0; i < MR; ++i) {
      const vf xs = splat_bits(x + i * ldx + 2 * q);
      for (int v = 0; v < kDotVectors; ++v) p[i][v] = dot_pairs(p[i][v], b[v], xs);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < kDotVectors; ++v) {
      const int o = col + kLanes * v;
      vf sum = p[i][v];
      const vf a = load(acc + i * kTileCols + o), s = load(scale + o);
      store(acc + i * kTileCols + o, kHasZeros<F> && xsum ? group_dot<F>(a, sum, splat(xsum[i * ldxsum]), s, load(zero + o))
                                                          : fmadd(s, sum, a));
    }
  }
}

// out[m0:m1, nb:nb+64 Tiles] through pair tiles that fill(k0, rows, tile)
// writes (the dense dequant_pairs_tile, or the 2:4 one; Tiles as gemm_tiles).
template <int F, int Tiles = 1, class Fill>
void gemm_tiles_dot(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch, Fill&& fill) {
  constexpr int64_t kTileFloats = kTileRows * kTileCols;
  const int tiles = tiles_inside<Tiles>(a, nb);
  const int64_t acc_floats = (m1 - m0) * kTileCols;  // per tile
  float* tile = scratch;
  float* acc = scratch + Tiles * kTileFloats;
  alignas(64) float scale[kTileCols], zero[kTileCols];
  memset(acc, 0, tiles * acc_floats * sizeof(float));
  for (int64_t k0 = 0; k0 < a.k; k0 += kTileRows) {
    const int64_t rows = (a.k - k0 < kTileRows) ? a.k - k0 : kTileRows;
    fill(k0, rows, tile);
    for (int t = 0; t < tiles; ++t) {
      const int64_t n0 = nb + t * kTileCols, cols = (a.n - n0 < kTileCols) ? a.n - n0 : kTileCols;
      for (int64_t s0 = k0; s0 < k0 + rows;) {
        const int64_t g = s0 / a.group_rows;
        const int64_t s1 = (g + 1) * a.group_rows < k0 + rows ? (g + 1) * a.group_rows : k0 + rows;
        copy_halves(scale, a.scales + g * a.n + n0, cols, kTileCols);
        if (kHasZeros<F>) copy_halves(zero, a.zeros + g * a.n + n0, cols, kTileCols);
        const float* pairs = tile + t * kTileFloats + (s0 - k0) / 2 * kTileCols;
        for (int64_t m = m0; m < m1;) {
          const int mr = even_rows(m1 - m, kDotRows);
          const uint16_t* x = a.x_bf16 + m * a.k + s0;
          const float* xsum = kHasZeros<F> && s0 == g * a.group_rows ? a.xsum + m * a.groups + g : nullptr;
          float* c = acc + t * acc_floats + (m - m0) * kTileCols;
          for (int col = 0; col < kTileCols; col += kDotCols) {
            switch (mr) {
#define MARLIN_MICRO_DOT(MR) micro_dot<F, MR>(x, a.k, (s1 - s0) / 2, pairs, col, scale, zero, xsum, a.groups, c)
              case 1: MARLIN_MICRO_DOT(1); break;
              case 2: MARLIN_MICRO_DOT(2); break;
              case 3: MARLIN_MICRO_DOT(3); break;
              case 4: MARLIN_MICRO_DOT(4); break;
              case 5: MARLIN_MICRO_DOT(5); break;
              default: MARLIN_MICRO_DOT(6); break;
#undef MARLIN_MICRO_DOT
            }
          }
          m += mr;
        }
        s0 = s1;
      }
    }
  }
  store_tiles(a, m0, m1, nb, tiles, acc);
}

template <int F>
void gemm_tile_dot(const GemmArgs& a, int64_t m0, int64_t m1, int64_t nb, float* scratch) {
  gemm_tiles_dot<F>(a, m0, m1, nb, scratch,
                    [&](int64_t k0, int64_t rows, float* tile) { dequant_pairs_tile<F>(a, k0, rows, nb, tile); });
}
#endif  // MARLIN_KERNEL_BF16_DOT

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
