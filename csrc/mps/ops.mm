// MPS implementations of torch.ops.marlin.* (schemas in csrc/registration.cpp).
// Validation and planning are the same C++ as the CPU op and the tests
// (core/checks.h through core/metal_plan.h); only metal_encode.mm touches
// Objective-C and Metal.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "core/checks.h"
#include "core/metal_plan.h"
#include "mps/metal_encode.h"

namespace marlin {
namespace mps {
namespace {

void check_mps(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_mps(), name, " must be an MPS tensor for the MPS kernel, got ", t.device());
}

at::Tensor gemm_mps(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                    const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& bias,
                    c10::string_view weight_format, int64_t group_size) {
  // check_quantized + check_gemm_inputs, then the launches.
  const metal::Plan plan = metal::plan_for_tensors("gemm", packed, scales, zeros, x, bias,
                                                   std::string(weight_format), group_size, c10::nullopt);
  check_mps(packed, "packed");
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = plan.n;
  at::Tensor out = at::empty({plan.m, plan.n}, x.options());
  if (plan.launches.empty()) return out.view(out_sizes);

  PlanTensors t;
  t.x = x.reshape({plan.m, plan.k}).contiguous();
  t.packed = packed;
  t.scales = scales;
  t.out = out;
  t.zeros = zeros ? *zeros : out;             // never read for fp4 / int4
  t.bias = bias ? bias->contiguous() : out;   // never read without bias
  t.partial = plan.partial_floats ? at::empty({plan.partial_floats}, x.options().dtype(at::kFloat)) : out;
  encode_plan(plan, t);
  return out.view(out_sizes);
}

at::Tensor dequantize_mps(const at::Tensor& packed, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& zeros, c10::string_view weight_format,
                          int64_t group_size, c10::optional<at::ScalarType> dtype) {
  const metal::Plan plan = metal::plan_for_tensors("dequantize", packed, scales, zeros, c10::nullopt,
                                                   c10::nullopt, std::string(weight_format), group_size,
                                                   dtype);
  check_mps(packed, "packed");
  at::Tensor out = at::empty({plan.k, plan.n}, packed.options().dtype(plan.dtype));
  PlanTensors t;
  t.packed = packed;
  t.scales = scales;
  t.out = out;
  t.x = out;
  t.zeros = zeros ? *zeros : out;
  t.bias = out;
  t.partial = out;
  encode_plan(plan, t);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, MPS, m) {
  m.impl("gemm", &gemm_mps);
  m.impl("dequantize", &dequantize_mps);
}

}  // namespace mps
}  // namespace marlin
