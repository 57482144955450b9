// torch.ops.marlin._quantize_weight on CPU: the built-in quantizers of
// torch_marlin/quantize.py for a whole weight [N, K], multithreaded over
// blocks of rows, straight to the packed layout (docs/FORMAT.md);
// _quantize_weight_sparse24 prunes each row to 2:4 first (torch_marlin/sparsity.py)
// and writes the 2:4 layout.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/checks.h"
#include "cpu/quantize_args.h"

namespace marlin {
namespace cpu {
namespace {

enum class QuantizeIsa { kGeneric, kAvx2, kAvx512 };

// The best build this CPU runs. TORCH_MARLIN_CPU_KERNELS=generic or =avx2
// caps it; read on every call, so the tests can compare the builds.
QuantizeIsa quantize_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  const char* forced = std::getenv("TORCH_MARLIN_CPU_KERNELS");
  const std::string cap = forced ? forced : "";
  if (cap == "generic") return QuantizeIsa::kGeneric;
  if (cap != "avx2" && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return QuantizeIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) return QuantizeIsa::kAvx2;
#endif
  return QuantizeIsa::kGeneric;
}

int source_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return kSourceFloat32;
    case at::kBFloat16: return kSourceBFloat16;
    case at::kHalf: return kSourceFloat16;
    default:
      TORCH_CHECK_VALUE(false, "weight must be float32, bfloat16 or float16, got ", dtype);
  }
}

// The checks and arguments both ops share; `ratios` backs a.ratios. K is padded
// to a multiple of k_multiple and of group_size; a 2:4 row quantizes half of it.
at::Tensor prepare(QuantizeArgs& a, std::vector<float>& ratios, const at::Tensor& weight,
                   c10::string_view weight_format, int64_t group_size, at::ArrayRef<double> clip_ratios,
                   int64_t rounds, int64_t k_multiple, bool sparse24) {
  const WeightFormat format = parse_weight_format(std::string(weight_format));
  check_group_size(group_size);
  TORCH_CHECK_VALUE(weight.dim() == 2, "weight must be a 2-D tensor [N, K], got shape ", weight.sizes());
  TORCH_CHECK_VALUE(weight.device().is_cpu(), "weight must be a CPU tensor, got ", weight.device());
  TORCH_CHECK_VALUE(weight.numel() > 0, "weight must not be empty, got shape ", weight.sizes());
  const int source = source_type(weight.scalar_type());
  TORCH_CHECK_VALUE(!clip_ratios.empty(), "clip_ratios must not be empty");
  for (double r : clip_ratios) {
    TORCH_CHECK_VALUE(std::isfinite(r) && r > 0 && r <= 1, "clip_ratios must lie in (0, 1], got ", r);
    ratios.push_back(float(r));
  }
  TORCH_CHECK_VALUE(rounds >= 1 && rounds * int64_t(ratios.size()) <= kMaxQuantizeCandidates,
                    "rounds must be at least 1 and len(clip_ratios) * rounds at most ", kMaxQuantizeCandidates,
                    ", got rounds=", rounds, " and ", ratios.size(), " clip ratios");

  at::Tensor w = weight.stride(1) == 1 ? weight : weight.contiguous();
  const int64_t multiple = group_size == -1 ? k_multiple : std::max<int64_t>(k_multiple, group_size);
  a = QuantizeArgs{};
  a.weight = w.data_ptr();
  a.row_stride = w.stride(0);
  a.n = w.size(0);
  a.k = w.size(1);
  a.padded_k = (a.k + multiple - 1) / multiple * multiple;
  a.group_len = (group_size == -1 ? a.padded_k : group_size) / (sparse24 ? 2 : 1);
  a.source = source;
  a.format = static_cast<int>(format);
  a.ratios = ratios.data();
  a.num_ratios = int64_t(ratios.size());
  a.rounds = rounds;
  return w;
}

// Scales [G, N] and zeros [G, N] (formats with zeros; else empty) fp16 for `a`, set in it.
std::tuple<at::Tensor, at::Tensor> group_outputs(QuantizeArgs& a, const at::Tensor& w, int64_t groups) {
  const auto half = w.options().dtype(at::kHalf);
  at::Tensor scales = at::empty({groups, a.n}, half);
  const bool with_zeros = has_zeros(static_cast<WeightFormat>(a.format));
  at::Tensor zeros = with_zeros ? at::empty({groups, a.n}, half) : at::empty({0}, half);
  a.scales = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  a.zeros = with_zeros ? reinterpret_cast<uint16_t*>(zeros.data_ptr<at::Half>()) : nullptr;
  return {scales, zeros};
}

// Quantizes every row of `a`; returns sums = [squared error, squared weights] float64.
at::Tensor run(const QuantizeArgs& a) {
  const QuantizeIsa isa = quantize_isa();
  const auto scratch_floats = isa == QuantizeIsa::kAvx512 ? avx512::quantize_scratch_floats
                              : isa == QuantizeIsa::kAvx2 ? avx2::quantize_scratch_floats
                                                          : generic::quantize_scratch_floats;
  const auto quantize_rows = isa == QuantizeIsa::kAvx512 ? avx512::quantize_rows
                             : isa == QuantizeIsa::kAvx2 ? avx2::quantize_rows
                                                         : generic::quantize_rows;
  const int64_t n = a.n;
  const int64_t blocks = (n + kQuantizeBlockRows - 1) / kQuantizeBlockRows;
  std::vector<QuantizeSums> partial(blocks, QuantizeSums{0.0, 0.0, -1});
  // Threads take the next block as they finish one: the cores are often shared,
  // and a static split would wait for the slowest thread.
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buffer(scratch_floats(a) + 16);
    float* scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    for (int64_t b; !failed.load(std::memory_order_relaxed) && (b = next.fetch_add(1)) < blocks;) {
      const int64_t n0 = b * kQuantizeBlockRows;
      partial[b] = quantize_rows(a, n0, std::min(n, n0 + kQuantizeBlockRows), scratch);
      if (partial[b].bad_row >= 0) failed = true;
    }
  });
  double err2 = 0, norm2 = 0;
  for (const QuantizeSums& s : partial) {
    TORCH_CHECK_VALUE(s.bad_row < 0, "weight contains NaN or Inf (row ", s.bad_row, ")");
    err2 += s.err2;
    norm2 += s.norm2;
  }
  return at::tensor({err2, norm2}, at::dtype(at::kDouble));
}

// Returns packed [K'/8, N] int32, scales [G, N] fp16, zeros [G, N] fp16 (uint4;
// else empty) and sums = [squared error, squared weights] float64, K' being K
// padded as quantize.py pads it.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_weight_cpu(
    const at::Tensor& weight, c10::string_view weight_format, int64_t group_size,
    at::ArrayRef<double> clip_ratios, int64_t rounds) {
  QuantizeArgs a;
  std::vector<float> ratios;
  const at::Tensor w = prepare(a, ratios, weight, weight_format, group_size, clip_ratios, rounds, kPackFactor, false);
  at::Tensor packed = at::empty({a.padded_k / kPackFactor, a.n}, w.options().dtype(at::kInt));
  a.packed = packed.data_ptr<int32_t>();
  auto [scales, zeros] = group_outputs(a, w, a.padded_k / a.group_len);
  at::Tensor sums = run(a);
  return {packed, scales, zeros, sums};
}

// The 2:4 layout (torch_marlin/sparsity.py): values [K'/16, N] int32, metadata
// [K'/32, N] int32, scales and zeros as above and sums (squared weights
// including the pruned ones, whose squares are also in the error). `scores`
// [N, K] float32 choose the kept pair instead of |w|.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_weight_sparse24_cpu(
    const at::Tensor& weight, c10::string_view weight_format, int64_t group_size,
    at::ArrayRef<double> clip_ratios, int64_t rounds, const std::optional<at::Tensor>& scores) {
  QuantizeArgs a;
  std::vector<float> ratios;
  const at::Tensor w =
      prepare(a, ratios, weight, weight_format, group_size, clip_ratios, rounds, kSparseMetadataRows, true);
  at::Tensor s;
  if (scores.has_value()) {
    s = *scores;
    TORCH_CHECK_VALUE(s.device().is_cpu() && s.scalar_type() == at::kFloat && s.dim() == 2 &&
                          s.size(0) == a.n && s.size(1) == a.k,
                      "scores must be a float32 CPU tensor of the weight's shape [", a.n, ", ", a.k, "], got ",
                      s.scalar_type(), " ", s.sizes(), " on ", s.device());
    TORCH_CHECK_VALUE(at::isfinite(s).all().item<bool>(), "scores contain NaN or Inf");
    if (s.stride(1) != 1) s = s.contiguous();
    a.scores = s.data_ptr<float>();
    a.scores_stride = s.stride(0);
  }
  const auto options = w.options().dtype(at::kInt);
  at::Tensor values = at::empty({a.padded_k / kSparseValueRows, a.n}, options);
  at::Tensor metadata = at::empty({a.padded_k / kSparseMetadataRows, a.n}, options);
  a.packed = values.data_ptr<int32_t>();
  a.metadata = metadata.data_ptr<int32_t>();
  auto [scales, zeros] = group_outputs(a, w, a.padded_k / 2 / a.group_len);
  at::Tensor sums = run(a);
  return {values, metadata, scales, zeros, sums};
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) {
  m.impl("_quantize_weight", &quantize_weight_cpu);
  m.impl("_quantize_weight_sparse24", &quantize_weight_sparse24_cpu);
}

}  // namespace cpu
}  // namespace marlin
