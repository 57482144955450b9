// Decode of the 2:4 sparse layout (docs/FORMAT.md, "2:4 sparse layout"),
// shared by metal/sparse24_*.metal. A values word [r, n] holds the kept codes
// of K rows 16r .. 16r + 15: block b's pair is the nibbles (b, b + 4),
// exactly what marlin_dequant_pair decodes in one step. Its
// positions are nibble b of the metadata half r % 2 (16 bits) of metadata
// word [r / 2, n]: pos0 | pos1 << 2, 0 <= pos0 < pos1 <= 3.
//
// The metadata is validated where it is loaded (MarlinLinear's load check,
// SparseQuantizedWeight.check_contents; the CPU ops raise a ValueError naming
// the nibble), not per block in the kernels: an invalid pattern (pos0 >= pos1)
// gives a defined, finite result, and positions are 2-bit, so nothing is read
// outside the block.
#pragma once

#include "marlin_dequant.h"

// The buffers of the 2:4 GEMV and GEMM, one layout for both (the planner binds
// them with one list): x [M, K], values [K/16, N], metadata [K/32, N], scales
// and zeros [groups, N], bias [N], y [M, N], the K split's partial [splits, M,
// N], sizes, and the values rows per K slice.
#define MARLIN_SPARSE24_BUFFERS(T)                                                             \
  const device T* x [[buffer(0)]], const device uint* values [[buffer(1)]],                    \
      const device uint* metadata [[buffer(2)]], const device half* scales [[buffer(3)]],      \
      const device half* zeros [[buffer(4)]], const device T* bias [[buffer(5)]],              \
      device T* y [[buffer(6)]], device float* partial [[buffer(7)]], constant uint& M [[buffer(8)]], \
      constant uint& N [[buffer(9)]], constant uint& K [[buffer(10)]], constant uint& split_rows [[buffer(11)]]

// Metadata of values row r (16 bits: its 4 blocks) from metadata word [r / 2, n].
inline uint marlin_sparse_meta(uint word, uint r) { return word >> (16u * (r & 1u)); }

// Group params of column n for values row r (16 K: inside one group, the
// smallest group being 16 K), with the marlin_group_rows function constant
// (packed rows of 8 K per group) as the dense kernels.
template <WeightFormat F>
inline MarlinParams marlin_sparse_params(const device half* scales, const device half* zeros, uint r, uint n,
                                         uint N) {
  return marlin_load_params<F>(scales, zeros, marlin_group_of(2u * r), n, N);
}

// (pos0, pos1) of block b of a values row from its metadata.
inline uint2 marlin_sparse_positions(uint meta, uint b) {
  const uint nibble = (meta >> (4u * b)) & 0xFu;
  return uint2(nibble & 3u, nibble >> 2);
}

// Dense value at position q of a block whose kept pair v sits at positions pos.
inline float marlin_sparse_at(float2 v, uint2 pos, uint q) {
  return q == pos.x ? v.x : (q == pos.y ? v.y : 0.0f);  // -0.0 of a kept fp4 code stays -0.0
}

// The 4 dense weights of block b (standalone dequantize).
template <WeightFormat F>
inline float4 marlin_sparse_block(uint w, uint meta, uint b, MarlinParams p) {
  const float2 v = marlin_dequant_pair<F>(w, b, p);
  const uint2 pos = marlin_sparse_positions(meta, b);
  return float4(marlin_sparse_at(v, pos, 0u), marlin_sparse_at(v, pos, 1u), marlin_sparse_at(v, pos, 2u),
                marlin_sparse_at(v, pos, 3u));
}

// Dense weights at positions (q, q + 1) of block b, q even: the two elements a
// simdgroup_matrix fragment lane owns (two consecutive K rows of one column).
template <WeightFormat F>
inline float2 marlin_sparse_pair(uint w, uint meta, uint b, uint q, MarlinParams p) {
  const float2 v = marlin_dequant_pair<F>(w, b, p);
  const uint2 pos = marlin_sparse_positions(meta, b);
  return float2(marlin_sparse_at(v, pos, q), marlin_sparse_at(v, pos, q + 1u));
}
