// Argument validation of the entropy-coded ("rans") layout (docs/FORMAT.md,
// issue 23), shared by the CPU ops and the Metal planner so every backend
// fails alike. The stream format: 32 lanes per column block, chunks of
// chunk_k along K, 32-bit rANS states, 16-bit words handed out in lane order.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>

#include "core/checks.h"

namespace marlin {

// Lanes of a column block: 32 consecutive output columns (N is padded to a multiple).
constexpr int64_t kRansLanes = 32;
// A rANS state lives in [2^16, 2^32); a well-formed chunk ends with every lane at 2^16.
constexpr uint32_t kRansStateLow = 1u << 16;
constexpr int64_t kRansMinProbBits = 10, kRansMaxProbBits = 15;
// Alphabet sizes: a lossless format's 4-bit codes, or the grid's symbols s (value s - 128).
constexpr int64_t kRansLosslessSymbols = 16, kRansGridSymbols = 256;
// QuantizedShape::format of weight_format "grid" and "tcq": not value formats (no zeros;
// the kernels' kinds kRansGrid and kRansTcq, csrc/cpu/rans_kernel_args.h). "tcq" is the
// grid's symbols read through a 4-state trellis (docs/FORMAT.md, "Entropy-coded layout").
constexpr WeightFormat kRansGridFormat = WeightFormat(100);
constexpr WeightFormat kRansTcqFormat = WeightFormat(101);

// What the tensor shapes and parameters say (after check_rans_streams).
struct RansShape {
  int64_t k, n;        // in_features, out_features (unpadded)
  int64_t chunk_k;     // K rows per chunk (multiple of 32)
  int64_t kchunks;     // ceil(K / chunk_k)
  int64_t blocks;      // ceil(N / 32) column blocks
  int64_t chunks;      // blocks * kchunks; chunk index = block * kchunks + kchunk
  int64_t prob_bits;   // frequencies sum to 2^prob_bits
  int64_t symbols;     // freqs.numel(): 16 or 256
};

// words int16 [W], word_offsets int32 [chunks + 1], states int32 [chunks, 32],
// freqs int16 [16 or 256] on one device, contiguous; K, N, chunk_k, prob_bits in range.
RansShape check_rans_streams(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                             const at::Tensor& freqs, int64_t K, int64_t N, int64_t chunk_k, int64_t prob_bits);

// The contents (CPU tensors, or copied to the CPU): freqs sum to 2^prob_bits,
// offsets start at 0, never decrease and end at most at words.numel(), every state in [2^16, 2^32).
void check_rans_contents(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                         const at::Tensor& freqs, const RansShape& shape);

// rans_gemm's weight: the streams plus the value kind. weight_format is a
// value format name (lossless: 16 symbols, scales/zeros as the dense layout's
// [ceil(K/group_size), N]: the last group may be short) or "grid" / "tcq" (256 symbols, scales [1, N] = the
// step per column, zeros None, group_size K or -1).
struct RansGemmShape {
  RansShape streams;
  bool grid;  // "grid" or "tcq": 256 symbols, one step per column
  QuantizedShape groups;  // k = K, format (kRansGridFormat, kRansTcqFormat or a value format), groups, group_rows
};

RansGemmShape check_rans_gemm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& word_offsets,
                              const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                              const std::string& weight_format, int64_t K, int64_t chunk_k, int64_t prob_bits,
                              int64_t group_size);

// A ValueError naming the first chunk whose stream is not well formed (decoded
// here one symbol at a time, never reading outside the chunk's words): the
// CPU kernels detect that one exists while decoding. Contents already checked.
[[noreturn]] void throw_bad_rans_chunk(const at::Tensor& words, const at::Tensor& word_offsets,
                                       const at::Tensor& states, const at::Tensor& freqs, const RansShape& shape);

}  // namespace marlin
