// Argument validation of the 2:4 sparse layout (docs/FORMAT.md, "2:4 sparse
// layout"; torch_marlin/layouts/sparse24.py mirrors it), shared by the CPU op
// and the Metal planner so every backend fails alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <string>

#include "core/checks.h"

namespace marlin {

// values int32 [K/16, N], metadata int32 [K/32, N], scales/zeros [K/group_size, N].
QuantizedShape check_sparse24(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, const std::string& weight_format,
                              int64_t group_size);

// x [..., K] and bias [N] against the weight.
void check_sparse24_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                const at::Tensor& values, const QuantizedShape& shape);

// A ValueError naming the first metadata nibble that is not one of the 6
// valid patterns (the CPU kernels detect that one exists while decoding).
[[noreturn]] void throw_invalid_metadata(const at::Tensor& metadata);

}  // namespace marlin
