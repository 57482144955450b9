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
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
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

// The lookup tables of one freqs table (rans_kernel_args.h): the slot table,
// and the register table with its byte tables where they serve.
struct RansTables {
  std::vector<uint32_t> slot;
  RansRegisterTable registers;
  RansByteLayout bytes;
};

// Built per distinct freqs, kept across calls: building them took 16 us of the
// 51-53 us a 32 x 32 call took (docs/CPU.md). Keyed by prob_bits and the
// bytes of freqs themselves, so a freqs changed in place or a new tensor at a
// freed one's address can never meet stale tables; least recently used out
// past kTableCacheBytes (a 12-bit table is about 18 KB: a 70B model's 560
// layers fit).
constexpr size_t kTableCacheBytes = size_t(16) << 20;

std::shared_ptr<const RansTables> rans_tables(const at::Tensor& freqs, const RansShape& s) {
  const uint16_t* f = reinterpret_cast<const uint16_t*>(freqs.data_ptr<int16_t>());
  std::string key(1, char(s.prob_bits));
  key.append(reinterpret_cast<const char*>(f), size_t(s.symbols) * sizeof(uint16_t));

  using Entry = std::pair<std::string, std::shared_ptr<const RansTables>>;
  static std::mutex mutex;
  static std::list<Entry> recent;  // most recently used first
  static std::unordered_map<std::string_view, std::list<Entry>::iterator> index;  // views of recent's keys
  static size_t bytes = 0;
  auto entry_bytes = [](const Entry& e) { return e.first.size() + e.second->slot.size() * 4 + sizeof(RansTables); };
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = index.find(key);
    if (it != index.end()) {
      recent.splice(recent.begin(), recent, it->second);
      return it->second->second;
    }
  }
  auto t = std::make_shared<RansTables>();
  t->slot.resize(rans_slot_table_size(int(s.prob_bits)));
  build_rans_slot_table(f, int(s.symbols), int(s.prob_bits), t->slot.data());
  t->registers = build_rans_register_table(f, int(s.symbols), int(s.prob_bits));
  t->bytes = RansByteLayout(t->registers, int(s.prob_bits));

  std::lock_guard<std::mutex> lock(mutex);
  if (index.find(key) == index.end()) {  // another thread may have built them meanwhile
    recent.emplace_front(std::move(key), t);
    index.emplace(recent.front().first, recent.begin());
    bytes += entry_bytes(recent.front());
    while (bytes > kTableCacheBytes && recent.size() > 1) {
      bytes -= entry_bytes(recent.back());
      index.erase(recent.back().first);
      recent.pop_back();
    }
  }
  return t;
}

RansArgs make_rans_args(const at::Tensor& words, const at::Tensor& word_offsets, const at::Tensor& states,
                        const RansTables& tables, const RansShape& s) {
  RansArgs a{};
  a.registers = tables.registers;
  a.bytes = tables.bytes;
  a.words = reinterpret_cast<const uint16_t*>(words.data_ptr<int16_t>());
  a.word_offsets = word_offsets.data_ptr<int32_t>();
  a.states = reinterpret_cast<const uint32_t*>(states.data_ptr<int32_t>());
  a.table = tables.slot.data();
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
  const std::shared_ptr<const RansTables> tables = rans_tables(freqs, s);
  const RansArgs a = make_rans_args(words, word_offsets, states, *tables, s);
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
  const std::shared_ptr<const RansTables> tables = rans_tables(freqs, s);
  RansArgs a = make_rans_args(words, word_offsets, states, *tables, s);
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
