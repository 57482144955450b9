// Metal dispatch of the entropy-coded layout (rans_gemm, rans_decode): which
// kernels of metal/rans.metal to launch, how (docs/KERNELS.md, "Entropy-coded
// layout"). Argument checks are the CPU ops' (core/rans_checks.h); the stream
// contents are not read here (they live on the GPU): rans_gemm's kernels turn
// a bad chunk into NaN outputs instead, and rans_decode's flag it in a status
// output that check_rans_decode turns into the CPU op's error after the
// decode (no uint8 symbol could mark it: the grid's alphabet is 1..255, the
// lossless formats' 0..15). K chunks (GEMV) and K slices of whole chunks
// (GEMM) are summed in order by marlin_reduce, as the dense GEMMs' K split.
#include <torch/library.h>

#include <algorithm>
#include <sstream>

#include "core/metal_plan.h"
#include "core/rans_checks.h"
#include "rans_common.h"

namespace marlin {
namespace metal {
namespace {

// The kernels' copy of the stream facts (metal/rans_common.h) is the checks'.
static_assert(rans::kLanes == kRansLanes && rans::kStateLow == kRansStateLow, "rans stream constants");
static_assert(rans::kMinProbBits == kRansMinProbBits && rans::kMaxProbBits == kRansMaxProbBits, "rans prob_bits");
static_assert(rans::kLosslessSymbols == kRansLosslessSymbols && rans::kGridSymbols == kRansGridSymbols,
              "rans alphabets");

// Argument numbers in the schemas (csrc/registration.cpp).
enum GemmArg { kX = 0, kWords, kOffsets, kStates, kFreqs, kScales, kZeros, kBias };
enum DecodeArg { kDecodeWords = 0, kDecodeOffsets, kDecodeStates, kDecodeFreqs };

int64_t round16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

std::string rans_details(int64_t m, const RansShape& s, int64_t splits, const char* dtype, const std::string& format,
                         int64_t partial_floats) {
  std::ostringstream o;
  o << "\"M\":" << m << ",\"N\":" << s.n << ",\"K\":" << s.k << ",\"chunk_k\":" << s.chunk_k
    << ",\"kchunks\":" << s.kchunks << ",\"chunks\":" << s.chunks << ",\"prob_bits\":" << s.prob_bits
    << ",\"symbols\":" << s.symbols << ",\"splits\":" << splits << ",\"dtype\":\"" << dtype
    << "\",\"format\":\"" << format << "\",\"partial_floats\":" << partial_floats;
  return o.str();
}

// Launches with one chunk per simdgroup (decode, GEMV): rans::kChunkSimdgroups
// chunks per threadgroup, fewer simdgroups loop over them.
Launch chunk_launch(const char* kernel_prefix, const std::string& name, const RansShape& s) {
  Launch l;
  l.source = "rans";
  l.kernel = kernel_prefix + name;
  l.threadgroup = {kSimdWidth * rans::kChunkSimdgroups, 1, 1};
  l.min_threads_x = kSimdWidth;
  l.grid = {ceil_div(s.chunks, rans::kChunkSimdgroups), 1, 1};
  l.threadgroup_memory = round16(rans::table_bytes(static_cast<int>(s.symbols)));
  return l;
}

Plan plan_rans_gemm(const at::Tensor& x, const at::Tensor& words, const at::Tensor& word_offsets,
                    const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                    c10::string_view weight_format, int64_t K, int64_t chunk_k, int64_t prob_bits,
                    int64_t group_size) {
  const std::string format(weight_format);
  const RansGemmShape g = check_rans_gemm(x, words, word_offsets, states, freqs, scales, zeros, bias, format, K,
                                          chunk_k, prob_bits, group_size);
  const RansShape& s = g.streams;
  const int64_t m = x.numel() / s.k, n = s.n;
  const at::ScalarType dtype = x.scalar_type();
  const bool has_bias = bias.has_value();
  Plan p;
  p.op = "rans_gemm";
  p.outputs = {{"out", {m, n}, dtype}};
  p.result_shape = x.sizes().vec();
  p.result_shape.back() = n;
  p.details = rans_details(m, s, 1, dtype_name(dtype), format, 0);
  if (m == 0) return p;
  u32(m, "M");
  u32(words.numel(), "words.numel()");
  const std::string name = format + "_" + dtype_name(dtype);
  // One group over K (grid, per channel, or group_size == K): scaled once per chunk.
  const bool one_group = g.grid || group_size == -1 || group_size >= s.k;
  const uint32_t group_rows = group_rows_constant(one_group ? -1 : group_size);

  Launch l;
  int64_t splits;
  Binding last;  // buffer 16: the GEMV's chunk count, the GEMM's K chunks per slice
  if (m <= rans::kGemvMaxRows) {
    // Fused decode + GEMV: each K chunk's partial sums are a slice of the K split.
    l = chunk_launch("rans_gemv_", name, s);
    splits = s.kchunks;
    last = scalar(16, s.chunks, "chunks");
  } else {
    // Each tile decoded once, the simdgroup-matrix GEMM on it; K split in whole chunks.
    const int64_t tiles = ceil_div(n, rans::kGemmTileN) * ceil_div(m, rans::kGemmTileM);
    const int64_t min_chunks = std::max<int64_t>(1, ceil_div(kSplitMinK, s.chunk_k));
    const auto [slices, split_chunks] = k_slices(tiles, s.kchunks, kSplitTargetThreadgroups, min_chunks, 1);
    splits = slices;
    l.source = "rans";
    l.kernel = "rans_gemm_" + name;
    l.threadgroup = {kGemmThreads, 1, 1};
    l.grid = {ceil_div(n, rans::kGemmTileN), ceil_div(m, rans::kGemmTileM), splits};
    l.threadgroup_memory =
        round16(rans::gemm_threadgroup_memory(static_cast<int>(s.symbols), static_cast<int>(dtype_size(dtype))));
    last = scalar(16, split_chunks, "K chunks per slice");
  }
  l.set(kFcHasBias, has_bias && splits == 1);
  l.set(kFcWritePartial, splits > 1);
  l.set(kFcGroupRows, group_rows);
  l.bindings = {arg(0, kX),         arg(1, kWords),           arg(2, kOffsets),          arg(3, kStates),
                arg(4, kFreqs),     arg(5, kScales),          arg(6, kZeros),            arg(7, kBias),
                output(8),          workspace(9),             scalar(10, m, "M"),        scalar(11, n, "N"),
                scalar(12, s.k, "K"), scalar(13, s.chunk_k, "chunk_k"), scalar(14, s.prob_bits, "prob_bits"),
                scalar(15, words.numel(), "words.numel()"), last};
  check_launch(l);
  p.launches.push_back(std::move(l));

  const int64_t partial_floats = splits > 1 ? splits * m * n : 0;
  p.workspaces = {{"partial", {std::max<int64_t>(partial_floats, 4)}, at::kFloat}};
  p.details = rans_details(m, s, splits, dtype_name(dtype), format, partial_floats);
  if (splits > 1) p.launches.push_back(reduce_launch(m, n, splits, dtype, has_bias, kBias));
  return p;
}

Plan plan_rans_decode(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                      const at::Tensor& freqs, int64_t K, int64_t N, int64_t chunk_k, int64_t prob_bits) {
  const RansShape s = check_rans_streams(words, word_offsets, states, freqs, K, N, chunk_k, prob_bits);
  u32(words.numel(), "words.numel()");
  u32(s.k * s.n, "K * N");
  Plan p;
  p.op = "rans_decode";
  p.outputs = {{"out", {s.k, s.n}, at::kByte}, {"status", {s.chunks}, at::kInt}};  // status: 1 = bad chunk
  p.status_output = 1;
  p.result_shape = {s.k, s.n};
  p.details = rans_details(0, s, 1, "u8", s.symbols == kRansGridSymbols ? "s256" : "s16", 0);
  Launch l = chunk_launch("rans_decode_s", std::to_string(s.symbols), s);
  l.bindings = {arg(0, kDecodeWords),   arg(1, kDecodeOffsets),          arg(2, kDecodeStates),
                arg(3, kDecodeFreqs),   output(4),                       output(5, 1),
                scalar(6, s.n, "N"),    scalar(7, s.k, "K"),             scalar(8, s.chunk_k, "chunk_k"),
                scalar(9, s.prob_bits, "prob_bits"), scalar(10, words.numel(), "words.numel()"),
                scalar(11, s.chunks, "chunks")};
  check_launch(l);
  p.launches.push_back(std::move(l));
  return p;
}

// After the decode (reading `status` waits for it): the CPU op's checks of the
// contents (small tensors, copied), then, if the kernel flagged a chunk, the
// CPU op's error naming the first bad chunk and why (the words are copied
// only then). A corrupt stream raises on every device, whatever the format.
void check_rans_decode(const at::Tensor& status, const at::Tensor& words, const at::Tensor& word_offsets,
                       const at::Tensor& states, const at::Tensor& freqs, int64_t K, int64_t N, int64_t chunk_k,
                       int64_t prob_bits) {
  const RansShape s = check_rans_streams(words, word_offsets, states, freqs, K, N, chunk_k, prob_bits);
  TORCH_CHECK(status.scalar_type() == at::kInt && status.numel() == s.chunks,
              "internal error: rans_decode's status must be int32 [chunks]");
  check_rans_contents(words, word_offsets, states, freqs, s);
  const at::Tensor flags = status.cpu().contiguous();
  const int32_t* f = flags.data_ptr<int32_t>();
  if (std::any_of(f, f + s.chunks, [](int32_t v) { return v != 0; }))
    throw_bad_rans_chunk(words, word_offsets, states, freqs, s);
}

}  // namespace

MARLIN_REGISTER_METAL_OP(rans_gemm, plan_rans_gemm)
MARLIN_REGISTER_CHECKED_METAL_OP(rans_decode, plan_rans_decode, check_rans_decode)

}  // namespace metal
}  // namespace marlin
