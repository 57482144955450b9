#include "core/experts_checks.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace marlin {
namespace {

bool is_activation_dtype(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat; }

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& packed) {
  TORCH_CHECK(t.device() == packed.device(), name, " must be on the same device as packed (", packed.device(),
              "), got ", t.device());
}

}  // namespace

MoeShape check_moe_inputs(const at::Tensor& x, const at::Tensor& expert_ids,
                          const c10::optional<at::Tensor>& topk_weights, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& packed, const QuantizedShape& s) {
  MoeShape m{};
  TORCH_CHECK(is_activation_dtype(x.scalar_type()), "x must be float16, bfloat16 or float32, got ", x.scalar_type());
  check_same_device(x, "x", packed);
  TORCH_CHECK(expert_ids.scalar_type() == at::kInt || expert_ids.scalar_type() == at::kLong,
              "expert_ids must be int32 or int64, got ", expert_ids.scalar_type());
  TORCH_CHECK(expert_ids.dim() == 2, "expert_ids must have shape [T, top_k], got ", expert_ids.sizes());
  check_same_device(expert_ids, "expert_ids", packed);
  m.tokens = expert_ids.size(0);
  m.top_k = expert_ids.size(1);
  m.pairs = m.tokens * m.top_k;
  TORCH_CHECK(m.top_k > 0, "expert_ids must select at least one expert per token (top_k >= 1), got shape ",
              expert_ids.sizes());
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [T, K] or [T, top_k, K], got shape ", x.sizes());
  m.shared_x = x.dim() == 2;
  const bool rows_ok = x.size(0) == m.tokens && (m.shared_x || x.size(1) == m.top_k);
  TORCH_CHECK(rows_ok, "x must be [T, K] or [T, top_k, K] with [T, top_k] = ", expert_ids.sizes(),
              " from expert_ids, got shape ", x.sizes());
  TORCH_CHECK(x.size(-1) == s.k, "x.size(-1) must equal K = 8 * packed.size(1) = ", s.k, ", got x of shape ",
              x.sizes());
  if (topk_weights.has_value()) {
    TORCH_CHECK(is_activation_dtype(topk_weights->scalar_type()),
                "topk_weights must be float16, bfloat16 or float32, got ", topk_weights->scalar_type());
    TORCH_CHECK(topk_weights->sizes() == expert_ids.sizes(), "topk_weights must have expert_ids' shape [T, top_k] = ",
                expert_ids.sizes(), ", got ", topk_weights->sizes());
    check_same_device(*topk_weights, "topk_weights", packed);
    m.weighted = true;
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == s.experts && bias->size(1) == s.n,
                "bias must have shape [E, N] = [", s.experts, ", ", s.n, "], got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == x.scalar_type(), "bias must have x's dtype ", x.scalar_type(), ", got ",
                bias->scalar_type());
    check_same_device(*bias, "bias", packed);
  }
  return m;
}

void check_expert_id_values(const at::Tensor& expert_ids, int64_t experts) {
  TORCH_INTERNAL_ASSERT(expert_ids.device().is_cpu());
  if (expert_ids.numel() == 0) return;
  const at::Tensor bad = expert_ids.lt(0).logical_or(expert_ids.ge(experts));
  if (!bad.any().item<bool>()) return;
  const at::Tensor where = bad.nonzero()[0];
  const int64_t t = where[0].item<int64_t>(), j = where[1].item<int64_t>();
  TORCH_CHECK_INDEX(false, "expert_ids must lie in [0, E) = [0, ", experts, "), got expert_ids[", t, ", ", j,
                    "] = ", expert_ids[t][j].item<int64_t>());
}

}  // namespace marlin
