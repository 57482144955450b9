// CPU implementations of the entropy-coded layout's ops torch.ops.marlin.rans_*
// (schemas in csrc/registration.cpp, stream format in docs/FORMAT.md). Kernels
// in csrc/cpu/rans_kernels_impl.h, one build per instruction set: the one
// the dense op runs (TORCH_MARLIN_CPU_KERNELS included).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "core/rans_checks.h"
#include "cpu/ops.h"
#include "cpu/rans_kernel_args.h"

static_assert(int(marlin::kRansGridFormat) == marlin::cpu::kRansGrid, "one number for the grid");
static_assert(int(marlin::kRansTcqFormat) == marlin::cpu::kRansTcq, "one number for tcq");

namespace marlin {
namespace cpu {
namespace {

// The rans kernels of the build the dense ops run.
const RansKernels& rans_kernels() {
  const char* name = kernels().name;
  for (const RansKernels* k : {&avx512_bf16::rans_kernels, &avx512::rans_kernels, &avx2::rans_kernels,
                               &neon_bf16::rans_kernels, &generic::rans_kernels})
    if (k->name && std::strcmp(k->name, name) == 0) return *k;
  TORCH_CHECK(false, "internal error: no rans kernels in the CPU kernel build ", name);
}

// The slot table of rans_kernel_args.h from freqs (checked: they sum to 2^prob_bits).
std::vector<uint32_t> slot_table(const at::Tensor& freqs, const RansShape& s) {
  std::vector<uint32_t> table(rans_slot_table_size(int(s.prob_bits)));
  build_rans_slot_table(reinterpret_cast<const uint16_t*>(freqs.data_ptr<int16_t>()), int(s.symbols),
                        int(s.prob_bits), table.data());
  return table;
}

RansArgs make_rans_args(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                        const at::Tensor& freqs, const std::vector<uint32_t>& table, const RansShape& s) {
  RansArgs a{};
  a.registers = build_rans_register_table(reinterpret_cast<const uint16_t*>(freqs.data_ptr<int16_t>()),
                                          int(s.symbols), int(s.prob_bits));
  a.bytes = RansByteLayout(a.registers, int(s.prob_bits));
  a.words = reinterpret_cast<const uint16_t*>(words.data_ptr<int16_t>());
  a.word_offsets = word_offsets.data_ptr<int32_t>();
  a.states = reinterpret_cast<const uint32_t*>(states.data_ptr<int32_t>());
  a.table = table.data();
  a.prob_bits = int(s.prob_bits);
  a.k = s.k;
  a.n = s.n;
  a.chunk_k = s.chunk_k;
  a.kchunks = s.kchunks;
  a.blocks = s.blocks;
  return a;
}

at::Tensor rans_decode_cpu(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                           const at::Tensor& freqs, int64_t K, int64_t N, int64_t chunk_k, int64_t prob_bits) {
  const RansShape s = check_rans_streams(words, word_offsets, states, freqs, K, N, chunk_k, prob_bits);
  check_cpu(words, "words");
  check_rans_contents(words, word_offsets, states, freqs, s);
  const std::vector<uint32_t> table = slot_table(freqs, s);
  const RansArgs a = make_rans_args(words, word_offsets, states, freqs, table, s);
  const RansKernels& kern = rans_kernels();
  at::Tensor out = at::empty({K, N}, words.options().dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, s.chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c / s.kchunks * kRansLanes, k0 = c % s.kchunks * s.chunk_k;
      bad |= kern.decode_chunk(a, c, o + k0 * N + n0, N, std::min<int64_t>(kRansLanes, N - n0));
    }
  });
  if (bad) throw_bad_rans_chunk(words, word_offsets, states, freqs, s);
  return out;
}

// The fused GEMV for m <= kGemvMaxRows rows into out [m, N]: work items are
// kRansGemvItemBlocks column blocks. For the grid and tcq (r.grid), when there
// are fewer items than threads, also ranges of K chunks, whose partial sums are
// added in order (deterministic for a thread count; tcq's trellis starts at
// state 0 in every chunk, so a range of chunks decodes alone). Lossless formats
// never split K: their sums keep the dense op's order, so the results equal its results.
uint32_t rans_gemv_all(const RansKernels& kern, const RansArgs& a, const RansGemmShape& r, int64_t m, float* out) {
  const RansShape& s = r.streams;
  const int64_t threads = at::get_num_threads();
  const int64_t items = (s.blocks + kRansGemvItemBlocks - 1) / kRansGemvItemBlocks;
  const int64_t parts = r.grid && items < threads ? std::min(s.kchunks, (threads + items - 1) / items) : 1;
  const int64_t ld = s.blocks * kRansLanes;  // padded columns
  std::vector<float> partial(parts * m * ld);
  std::atomic<uint32_t> bad{0};
  at::parallel_for(0, items * parts, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b0 = i / parts * kRansGemvItemBlocks, b1 = std::min(s.blocks, b0 + kRansGemvItemBlocks);
      const int64_t p = i % parts, c0 = s.kchunks * p / parts, c1 = s.kchunks * (p + 1) / parts;
      bad |= kern.gemv(a, 0, m, b0, b1, c0, c1, partial.data() + p * m * ld + b0 * kRansLanes, ld);
    }
  });
  for (int64_t i = 0; i < m; ++i) {
    float* o = out + i * s.n;
    std::memcpy(o, partial.data() + i * ld, s.n * sizeof(float));
    for (int64_t p = 1; p < parts; ++p) {
      const float* q = partial.data() + (p * m + i) * ld;
      for (int64_t j = 0; j < s.n; ++j) o[j] += q[j];
    }
  }
  return bad;
}

at::Tensor rans_gemm_cpu(const at::Tensor& x, const at::Tensor& words, const at::Tensor& word_offsets,
                         const at::Tensor& states, const at::Tensor& freqs, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                         c10::string_view weight_format, int64_t K, int64_t chunk_k, int64_t prob_bits,
                         int64_t group_size) {
  const RansGemmShape r = check_rans_gemm(x, words, word_offsets, states, freqs, scales, zeros, bias,
                                          std::string(weight_format), K, chunk_k, prob_bits, group_size);
  const RansShape& s = r.streams;
  check_cpu(words, "words");
  check_rans_contents(words, word_offsets, states, freqs, s);
  const std::vector<uint32_t> table = slot_table(freqs, s);
  RansArgs a = make_rans_args(words, word_offsets, states, freqs, table, s);
  a.kind = int(r.groups.format);  // kRansGrid / kRansTcq for the grid / tcq

  const RansKernels& kern = rans_kernels();
  // As the dense op: builds with bf16 dot products take bf16 x as it is, for
  // values exact in bf16 (the grid's s - 128 and tcq's levels are); pairs of K rows need an even K.
  const bool bf16_x =
      kernels().bf16_x && x.scalar_type() == at::kBFloat16 && values_exact_in_bf16(r.groups.format) && K % 2 == 0;
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = s.n;
  const at::Tensor x2 = bf16_x ? x.reshape({-1, K}).contiguous() : x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t m = x2.size(0);
  at::Tensor out = at::empty({m, s.n}, x.options().dtype(at::kFloat));
  uint32_t bad = 0;
  if (m > 0) {
    GemmArgs& g = a.gemm;
    if (bf16_x)
      g.x_bf16 = reinterpret_cast<const uint16_t*>(x2.data_ptr<at::BFloat16>());
    else
      g.x = x2.data_ptr<float>();
    g.scales = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
    g.zeros = zeros ? reinterpret_cast<const uint16_t*>(zeros->data_ptr<at::Half>()) : nullptr;
    g.out = out.data_ptr<float>();
    g.m = m;
    g.k = K;
    g.n = s.n;
    g.groups = r.groups.groups;
    g.group_rows = r.groups.group_rows;
    g.format = int(r.groups.format);
    at::Tensor xsum;  // the zero point's (or bias's) term per group, as the dense op sums it
    if (has_zeros(r.groups.format)) {
      // x padded with zeros as the dense layout pads it (to whole groups, or to a
      // multiple of 8 for one group), so that these sums equal the dense op's.
      const int64_t k_dense = group_size == -1 ? (K + kPackFactor - 1) / kPackFactor * kPackFactor
                                               : g.groups * g.group_rows;
      at::Tensor xg = x2;
      if (K != k_dense) {
        xg = at::zeros({m, k_dense}, x2.options());
        xg.narrow(1, 0, K).copy_(x2);
      }
      xsum = xg.view({m, g.groups, k_dense / g.groups}).sum(-1, false, at::kFloat).contiguous();
      g.xsum = xsum.data_ptr<float>();
    }
    if (m <= kGemvMaxRows) {
      bad = rans_gemv_all(kern, a, r, m, g.out);
    } else {
      std::atomic<uint32_t> tile_bad{0};
      parallel_gemm<kRansGemmCols>(
          m, s.n, [](int64_t, int64_t) {},  // m > kGemvMaxRows: only tiles
          [&](int64_t m0, int64_t m1, int64_t nb, float* scratch) { tile_bad |= kern.gemm_tile(a, m0, m1, nb, scratch); });
      bad = tile_bad;
    }
  }
  if (bad) throw_bad_rans_chunk(words, word_offsets, states, freqs, s);
  if (bias) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).view(out_sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("rans_decode", &rans_decode_cpu);
  m.impl("rans_gemm", &rans_gemm_cpu);
}

}  // namespace cpu
}  // namespace marlin
