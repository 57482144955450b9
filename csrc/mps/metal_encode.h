// Interface between the MPS ops (ops.mm, plain C++ in effect) and the thin
// Objective-C++ layer that talks to Metal (metal_encode.mm). No Objective-C
// types here.
#pragma once

#include <ATen/core/Tensor.h>

#include "core/metal_plan.h"

namespace marlin {
namespace mps {

// Tensors for the plan's Arg roles (every one defined: unused roles get a
// dummy buffer that the kernels never read). All on the MPS device.
struct PlanTensors {
  at::Tensor x, packed, scales, zeros, bias, out, partial;
};

// Encodes plan.launches onto PyTorch's current MPS stream (no commit, no wait).
void encode_plan(const metal::Plan& plan, const PlanTensors& tensors);

}  // namespace mps
}  // namespace marlin
