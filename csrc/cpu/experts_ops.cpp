// CPU implementation of marlin::moe_gemm, the routed matmul of the expert-stack
// layout (schema in csrc/registration.cpp, docs/FORMAT.md).
//
// The (token, expert) pairs are counting-sorted by expert and their x rows
// gathered (fp32) so that each expert's rows are contiguous. Then each expert
// runs the dense kernels on its own matrix of the stack: the GEMV (each weight
// word decoded once in registers for up to 8 rows) when few rows chose it,
// the tiled GEMM otherwise. Work items (expert x column block x row block) are
// handed out to the threads dynamically, largest first: experts receive very
// different numbers of rows. No expert weight is ever dequantized to memory
// beyond the GEMM's cache-sized tile. The epilogue adds the expert's bias,
// applies the top-k weights and sums a token's experts in fp32, then rounds
// once to x's dtype.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "core/experts_checks.h"
#include "cpu/ops.h"

namespace marlin {
namespace cpu {
namespace {

// GEMM work items split an expert's rows into blocks of at most this many:
// each block dequantizes the expert's column tile once, so this bounds
// repeated decoding against load balance when one expert gets most rows.
constexpr int64_t kRowsPerItem = 128;

struct WorkItem {
  int64_t expert;
  int64_t m0, m1;  // rows of the expert-sorted problem (absolute)
  int64_t n0, n1;  // output columns
  bool gemv;
};

// Pairs sorted by expert (stable): order[i] is the pair at sorted position i,
// start[e]..start[e+1] are expert e's positions.
struct Routing {
  std::vector<int64_t> order, position, start;
};

Routing sort_by_expert(const at::Tensor& ids, int64_t experts) {
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t pairs = ids.numel();
  Routing r;
  r.start.assign(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++r.start[id[p] + 1];
  for (int64_t e = 0; e < experts; ++e) r.start[e + 1] += r.start[e];
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  r.order.resize(pairs);
  r.position.resize(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t i = fill[id[p]]++;
    r.order[i] = p;
    r.position[p] = i;
  }
  return r;
}

std::vector<WorkItem> plan_items(const Routing& r, int64_t experts, int64_t n) {
  std::vector<WorkItem> gemm, gemv;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m0 = r.start[e], m1 = r.start[e + 1];
    if (m1 - m0 == 0) continue;
    if (m1 - m0 <= kGemvMaxRows) {
      for (int64_t n0 = 0; n0 < n; n0 += kGemvBlockCols)
        gemv.push_back({e, m0, m1, n0, std::min(n, n0 + kGemvBlockCols), true});
      continue;
    }
    for (int64_t r0 = m0; r0 < m1; r0 += kRowsPerItem)
      for (int64_t n0 = 0; n0 < n; n0 += kGemmBlockCols)
        gemm.push_back({e, r0, std::min(m1, r0 + kRowsPerItem), n0, std::min(n, n0 + kGemmBlockCols), false});
  }
  // Largest first, so the dynamic hand-out ends with small items on every thread.
  std::stable_sort(gemm.begin(), gemm.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.m1 - a.m0 > b.m1 - b.m0; });
  gemm.insert(gemm.end(), gemv.begin(), gemv.end());
  return gemm;
}

at::Tensor moe_gemm_cpu(const at::Tensor& x, const at::Tensor& expert_ids, const c10::optional<at::Tensor>& topk_weights,
                        const at::Tensor& packed, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                        const c10::optional<at::Tensor>& bias, c10::string_view weight_format, int64_t group_size) {
  const QuantizedShape s =
      check_quantized(packed, scales, zeros, std::string(weight_format), group_size, /*stacked=*/true);
  const MoeShape m = check_moe_inputs(x, expert_ids, topk_weights, bias, packed, s);
  check_cpu(packed, "packed");
  check_expert_id_values(expert_ids, s.experts);

  const std::vector<int64_t> out_sizes =
      m.weighted ? std::vector<int64_t>{m.tokens, s.n} : std::vector<int64_t>{m.tokens, m.top_k, s.n};
  if (m.pairs == 0) return at::zeros(out_sizes, x.options());

  const at::Tensor ids = expert_ids.reshape({-1}).to(at::kLong).contiguous();
  const Routing r = sort_by_expert(ids, s.experts);
  const int64_t* id = ids.data_ptr<int64_t>();

  // x rows in expert order, fp32: a token's row once per expert that chose it.
  at::Tensor rows = at::from_blob(const_cast<int64_t*>(r.order.data()), {m.pairs}, at::kLong);
  if (m.shared_x) rows = rows.div(m.top_k, "trunc");
  const at::Tensor xg = x.reshape({-1, s.k}).index_select(0, rows).to(at::kFloat).contiguous();
  at::Tensor xsum;  // uint4's GEMV applies the zero point as zero * (sum of x over the group)
  if (has_zeros(s.format)) xsum = xg.view({m.pairs, s.groups, s.group_rows}).sum(-1).contiguous();
  at::Tensor yg = at::empty({m.pairs, s.n}, x.options().dtype(at::kFloat));

  GemmArgs base = make_args(packed, scales, zeros, s);
  const int64_t words = s.k / kPackFactor * s.n, group_values = s.groups * s.n;
  const std::vector<WorkItem> items = plan_items(r, s.experts, s.n);
  const CpuKernels& kern = kernels();
  // The GEMV items (few rows of an expert) take int8 x where that is on (ops.h).
  const bool q8 = use_gemv_q8(kern, s, 1) &&
                  std::any_of(items.begin(), items.end(), [](const WorkItem& w) { return w.gemv; });
  const Q8Activations xq = q8 ? quantize_activations_q8(xg, s, Q8Order::kQuads, base) : Q8Activations{};
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const Scratch scratch = aligned_scratch(gemm_scratch_floats(kRowsPerItem));
    for (int64_t i = next++; i < int64_t(items.size()); i = next++) {
      const WorkItem& w = items[i];
      const int64_t first = r.start[w.expert];  // the expert's rows start here in xg / yg
      GemmArgs a = base;
      a.packed += w.expert * words;
      a.scales += w.expert * group_values;
      if (a.zeros) a.zeros += w.expert * group_values;
      a.x = xg.data_ptr<float>() + first * s.k;
      a.out = yg.data_ptr<float>() + first * s.n;
      a.xsum = xsum.defined() ? xsum.data_ptr<float>() + first * s.groups : nullptr;
      a.m = r.start[w.expert + 1] - first;
      if (w.gemv && q8) {
        a.q8_x += first * (s.k / 4);
        a.q8_scale += first * (s.k / kQ8Block);
        a.q8_gsum += first * s.groups;
        q8_kernels().gemv_q8(a, w.m0 - first, w.m1 - first, w.n0, w.n1);
      } else if (w.gemv)
        kern.gemv(a, w.m0 - first, w.m1 - first, w.n0, w.n1);
      else
        kern.gemm_tile(a, w.m0 - first, w.m1 - first, w.n0, scratch.get());
    }
  });

  // Epilogue, in fp32: + bias[e], then either scatter back to pair order or
  // sum a token's experts weighted by topk_weights.
  const at::Tensor bias32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor w32 = m.weighted ? topk_weights->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t out_rows = m.weighted ? m.tokens : m.pairs;
  at::Tensor out = at::empty({out_rows, s.n}, x.options().dtype(at::kFloat));
  const float* y = yg.data_ptr<float>();
  const float* b = bias ? bias32.data_ptr<float>() : nullptr;
  const float* tw = m.weighted ? w32.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int64_t n = s.n, top_k = m.top_k;
  at::parallel_for(0, out_rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      float* dst = o + row * n;
      const int64_t p0 = m.weighted ? row * top_k : row, p1 = m.weighted ? p0 + top_k : p0 + 1;
      for (int64_t c = 0; c < n; ++c) dst[c] = 0.f;
      for (int64_t p = p0; p < p1; ++p) {
        const float* src = y + r.position[p] * n;
        const float* be = b ? b + id[p] * n : nullptr;
        const float weight = tw ? tw[p] : 1.f;
        if (be)
          for (int64_t c = 0; c < n; ++c) dst[c] += weight * (src[c] + be[c]);
        else
          for (int64_t c = 0; c < n; ++c) dst[c] += weight * src[c];
      }
    }
  });
  return out.to(x.scalar_type()).view(out_sizes);
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CPU, m) { m.impl("moe_gemm", &moe_gemm_cpu); }

}  // namespace cpu
}  // namespace marlin
