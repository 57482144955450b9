// Runs a metal::Plan on the MPS device: allocates its outputs and workspaces,
// resolves every binding to a tensor and hands the launches to the encoder.
// Plain C++, compiled on every platform (only encode_plan needs Metal), so the
// MPS ops of every layout (registered by MARLIN_REGISTER_METAL_OP) build and
// are type-checked in CI on Linux too.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "core/metal_plan.h"
#include "mps/metal_encode.h"

namespace marlin {
namespace mps {
namespace {

at::Tensor allocate(const metal::Buffer& b, const at::TensorOptions& on_device) {
  return at::empty(b.shape, on_device.dtype(b.dtype));
}

}  // namespace

std::vector<at::Tensor> run_plan(const metal::Plan& plan, const std::vector<at::Tensor>& args) {
  at::TensorOptions on_device;
  for (const at::Tensor& t : args)
    if (t.defined()) {
      TORCH_CHECK(t.device().is_mps(), "torch.ops.marlin.", plan.op, ": every tensor must be on the MPS device, got ",
                  t.device());
      on_device = t.options();
    }
  std::vector<at::Tensor> outputs, workspaces, bound(args.size());
  for (const metal::Buffer& b : plan.outputs) outputs.push_back(allocate(b, on_device));
  for (const metal::Buffer& b : plan.workspaces) workspaces.push_back(allocate(b, on_device));
  at::Tensor dummy;  // bound for None arguments, which the kernels never read
  LaunchBuffers buffers;
  for (const metal::Launch& l : plan.launches) {
    std::vector<at::Tensor> launch_buffers;
    for (const metal::Binding& b : l.bindings) {
      at::Tensor t;
      switch (b.source) {
        case metal::Source::kArg:
          if (!args.at(b.slot).defined()) {
            if (!dummy.defined()) dummy = at::empty({16}, on_device.dtype(at::kByte));
            t = dummy;
          } else {
            if (!bound[b.slot].defined()) bound[b.slot] = args[b.slot].contiguous();
            t = bound[b.slot];
          }
          break;
        case metal::Source::kOutput: t = outputs.at(b.slot); break;
        case metal::Source::kWorkspace: t = workspaces.at(b.slot); break;
        case metal::Source::kScalar: break;
      }
      launch_buffers.push_back(t);
    }
    buffers.push_back(std::move(launch_buffers));
  }
  if (!plan.launches.empty()) encode_plan(plan, buffers);
  outputs.at(0) = outputs[0].view(plan.result_shape);
  return outputs;
}

#ifndef __APPLE__
void encode_plan(const metal::Plan& plan, const LaunchBuffers&) {
  TORCH_CHECK(false, "torch.ops.marlin.", plan.op, ": this torch_marlin was built without Metal (macOS only)");
}
#endif

}  // namespace mps
}  // namespace marlin
