// Argument validation of the dense layout, shared by every backend (CPU, MPS,
// and the emulator path of the tests). Mirrors torch_marlin/formats.py:check_quantized.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>

#include "core/formats.h"

namespace marlin {

// Parsed and validated view of a packed weight (one matrix, or a stack of
// `experts` matrices of the same shape).
struct QuantizedShape {
  WeightFormat format;
  int64_t experts;     // leading dimension of an expert stack; 1 for the dense layout
  int64_t k;           // rows of B = W^T (multiple of 8 and of the group size)
  int64_t n;           // output features
  int64_t groups;      // rows of scales/zeros
  int64_t group_rows;  // K rows per group (K itself for group_size = -1)
};

// Checks packed/scales/zeros against docs/FORMAT.md and each other: the dense
// layout ([K/8, N], [G, N]) or, with `stacked`, an expert stack ([E, K/8, N], [E, G, N]).
QuantizedShape check_quantized(const at::Tensor& packed, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& zeros,
                               const std::string& weight_format, int64_t group_size, bool stacked = false);

// Checks x [..., K] and bias [N] for gemm against the weight's shape.
void check_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& packed, const QuantizedShape& shape);

// For every layout: the groups of K (K = `k_expr` in messages) and the
// scales/zeros [groups, N] (with `stacked`: [E, groups, N]) against `weight`
// (the layout's [*, N] or [E, *, N] tensor called `weight_name`: same E and
// N, same device).
QuantizedShape check_groups(WeightFormat format, int64_t k, const at::Tensor& weight, const char* weight_name,
                            const char* k_expr, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            const std::string& weight_format, int64_t group_size, bool stacked = false);

// check_gemm_inputs for any layout: `weight_name` and `k_expr` for messages.
void check_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                       const QuantizedShape& shape, const char* weight_name, const char* k_expr);

}  // namespace marlin
