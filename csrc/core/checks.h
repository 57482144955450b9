// Argument validation shared by every backend (CPU, MPS, and the emulator
// path of the tests). Mirrors torch_marlin/formats.py:check_quantized.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>

namespace marlin {

enum class WeightFormat { kFp4 = 0, kUint4 = 1, kInt4 = 2 };

constexpr int64_t kPackFactor = 8;  // 4-bit codes per int32 word, along K
constexpr int64_t kInt4Offset = 8;  // int4 is offset-binary: q - 8

// Parsed and validated view of a packed weight.
struct QuantizedShape {
  WeightFormat format;
  int64_t k;           // rows of B = W^T (multiple of 8 and of the group size)
  int64_t n;           // output features
  int64_t groups;      // rows of scales/zeros
  int64_t group_rows;  // K rows per group (K itself for group_size = -1)
};

WeightFormat parse_weight_format(const std::string& weight_format);
void check_group_size(int64_t group_size);

// Checks packed/scales/zeros against docs/FORMAT.md and each other.
QuantizedShape check_quantized(const at::Tensor& packed, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& zeros,
                               const std::string& weight_format, int64_t group_size);

// Checks x [..., K] and bias [N] for gemm against the weight's shape.
void check_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& packed, const QuantizedShape& shape);

}  // namespace marlin
