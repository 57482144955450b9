// Dispatch plan of the Metal kernels (metal/*.metal): for one op call, which
// kernels to launch, with which function constants, grid, threadgroup size,
// threadgroup memory and buffer bindings. Pure C++ (no Metal), so the same
// function drives the MPS bridge (csrc/mps/*.mm) and the emulator path of the
// tests (torch.ops.marlin._metal_plan -> torch_marlin.testing.run_metal).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/checks.h"

namespace marlin {
namespace metal {

constexpr int64_t kMaxThreadgroupMemory = 32 * 1024;  // bytes, every Apple GPU
constexpr int64_t kGemvMaxRows = 8;                   // M <= 8: GEMV
constexpr int64_t kFusedMaxRows = 64;                 // 8 < M <= 64: fused GEMM, else tiled
constexpr int64_t kGemmTileN = 64;                    // GEMM tiles: TM x 64
constexpr int64_t kGemmTileK = 32;                    // K per pipeline stage
constexpr int64_t kGemvSimdgroups = 8;                // GEMV threadgroup: 8 x 32 threads
constexpr int64_t kSplitTargetThreadgroups = 128;     // K-split when fewer output tiles
constexpr int64_t kSplitMinK = 512;                   // at least this much K per split
constexpr int64_t kSplitMax = 16;

// What a buffer index is bound to.
enum class Arg {
  kX,        // activations [M, K] (x dtype), contiguous
  kPacked,   // int32 [K/8, N]
  kScales,   // fp16 [G, N]
  kZeros,    // fp16 [G, N] (uint4), else any small dummy buffer (never read)
  kBias,     // [N] x dtype, else any small dummy buffer (never read)
  kOut,      // result: [M, N] (gemm) or [K, N] (dequantize), output dtype
  kPartial,  // fp32 workspace [splits, M, N]
  kScalar,   // 32-bit unsigned scalar (setBytes), value in `value`
};

struct Binding {
  int index;
  Arg arg;
  uint32_t value = 0;  // kScalar only
};

struct Launch {
  std::string source;  // metal/<source>.metal
  std::string kernel;  // [[host_name]]
  std::vector<std::pair<int, bool>> bool_constants;  // function_constant index -> value
  std::array<int64_t, 3> grid{1, 1, 1};         // threadgroups per grid
  std::array<int64_t, 3> threadgroup{1, 1, 1};  // threads per threadgroup
  int64_t threadgroup_memory = 0;  // bytes for [[threadgroup(0)]] (multiple of 16)
  std::vector<Binding> bindings;
};

struct Plan {
  std::string op;  // "gemm" or "dequantize"
  int64_t m = 0, n = 0, k = 0, group_rows = 0, splits = 1;
  at::ScalarType dtype = at::kHalf;  // activation (gemm) or output (dequantize) dtype
  WeightFormat format = WeightFormat::kFp4;
  int64_t partial_floats = 0;  // fp32 workspace elements (0: none)
  std::vector<Launch> launches;  // in order, on one command encoder
};

// Shape-only planners (no tensors).
Plan plan_gemm(int64_t m, int64_t n, int64_t k, WeightFormat format, at::ScalarType dtype,
               int64_t group_rows, bool has_bias);
Plan plan_dequantize(int64_t n, int64_t k, WeightFormat format, at::ScalarType dtype,
                     int64_t group_rows);

// Validate like the CPU op (core/checks.h) and plan. `x`/`bias` for gemm,
// `dtype` for dequantize.
Plan plan_for_tensors(const std::string& op, const at::Tensor& packed, const at::Tensor& scales,
                      const c10::optional<at::Tensor>& zeros, const c10::optional<at::Tensor>& x,
                      const c10::optional<at::Tensor>& bias, const std::string& weight_format,
                      int64_t group_size, c10::optional<at::ScalarType> dtype);

std::string to_json(const Plan& plan);
const char* arg_name(Arg arg);

}  // namespace metal
}  // namespace marlin
