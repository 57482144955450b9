// Argument checks of the expert-stack layout's op (marlin::moe_gemm, docs/FORMAT.md),
// shared by every backend: the CPU op and the Metal planner fail alike. The
// stack itself is checked by check_quantized(..., stacked = true) (core/checks.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "core/checks.h"

namespace marlin {

// A routed problem: T tokens, each sent to top_k experts.
struct MoeShape {
  int64_t tokens;  // T
  int64_t top_k;
  int64_t pairs;   // T * top_k (token, expert) rows
  bool shared_x;   // x is [T, K]: a token's row feeds all its experts; else x is [T, top_k, K]
  bool weighted;   // topk_weights given: result [T, N] = sum over the top_k; else [T, top_k, N]
};

// Checks x, expert_ids, topk_weights and bias against each other and the stack.
MoeShape check_moe_inputs(const at::Tensor& x, const at::Tensor& expert_ids,
                          const c10::optional<at::Tensor>& topk_weights, const c10::optional<at::Tensor>& bias,
                          const at::Tensor& packed, const QuantizedShape& stack);

// Every id in [0, E). Reads the ids: only for CPU tensors (a device tensor would need a sync).
void check_expert_id_values(const at::Tensor& expert_ids, int64_t experts);

}  // namespace marlin
