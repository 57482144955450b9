// Interface between the plan runner (run_plan.cpp, plain C++) and the thin
// Objective-C++ layer that talks to Metal (metal_encode.mm). No Objective-C
// types here.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "core/metal_plan.h"

namespace marlin {
namespace mps {

// The tensor bound at each binding of each launch (plan.launches[i].bindings[j]
// -> buffers[i][j]; undefined for scalar bindings). All on the MPS device.
using LaunchBuffers = std::vector<std::vector<at::Tensor>>;

// Encodes plan.launches onto PyTorch's current MPS stream (no commit, no wait).
// metal_encode.mm on macOS; elsewhere an error (no Metal).
void encode_plan(const metal::Plan& plan, const LaunchBuffers& buffers);

}  // namespace mps
}  // namespace marlin
