// Dispatch plans of the Metal kernels (metal/*.metal): for one op call, which
// kernels to launch, with which function constants, grid, threadgroup size,
// threadgroup memory and buffer bindings, and which output and workspace
// buffers to allocate. Pure C++ (no Metal): the same planner drives the MPS
// ops (csrc/mps/) and the emulator path of the tests
// (torch.ops.marlin._metal_plan_<op> -> torch_marlin.testing.run_metal).
//
// A layout's planners live in csrc/core/metal_plan_<layout>.cpp: one typed
// function per op, taking the op's own arguments, validating them like the
// CPU op and returning a Plan; MARLIN_REGISTER_METAL_OP(op, planner) there
// registers both `_metal_plan_<op>` and the op's MPS kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/checks.h"  // QuantizedShape
#include "core/formats.h"

namespace marlin {
namespace metal {

// What a kernel's [[buffer(index)]] is bound to.
enum class Source : uint8_t {
  kArg,        // the op's argument number `slot` (a Tensor; None binds a dummy never read)
  kOutput,     // Plan::outputs[slot]
  kWorkspace,  // Plan::workspaces[slot]
  kScalar,     // a 32-bit unsigned constant (setBytes): `value`
};

struct Binding {
  int index;
  Source source;
  int slot = 0;
  uint32_t value = 0;
};

// A buffer the runner allocates (contiguous, uninitialized).
struct Buffer {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType dtype;
};

// A function constant's value (MARLIN_FOR_EACH_FUNCTION_CONSTANT): bool or uint.
struct Constant {
  int index;
  bool is_bool;
  uint32_t value;
};

struct Launch {
  std::string source;  // metal/<source>.metal
  std::string kernel;  // [[host_name]]
  std::vector<Constant> constants;  // every function constant the kernel reads
  std::array<int64_t, 3> grid{1, 1, 1};              // threadgroups per grid
  std::array<int64_t, 3> threadgroup{1, 1, 1};       // threads per threadgroup
  int64_t threadgroup_memory = 0;  // bytes for [[threadgroup(0)]] (multiple of 16)
  // Fewest threads along x the kernel is written for (it reads its simdgroup
  // count at run time; threadgroup memory stays sized for `threadgroup`, an
  // upper bound). 0: it needs exactly `threadgroup`. See fit_threadgroup.
  int64_t min_threads_x = 0;
  std::vector<Binding> bindings;

  void set(FunctionConstant c, bool value) { constants.push_back({c, true, value ? 1u : 0u}); }
  void set(FunctionConstant c, uint32_t value) { constants.push_back({c, false, value}); }
};

struct Plan {
  std::string op;                      // "gemm", "dequantize", ...
  std::vector<Buffer> outputs;         // outputs[0] is the op's result
  std::vector<int64_t> result_shape;   // ... returned viewed as this shape
  std::vector<Buffer> workspaces;
  std::vector<Launch> launches;        // in order, on one command encoder
  std::string details;                 // JSON object members describing the problem (tests, benchmarks)
  // outputs[status_output] (-1: none): a status the kernels write for what they
  // cannot raise (a corrupt stream); after the launches the op waits for the
  // GPU and its check (MARLIN_REGISTER_CHECKED_METAL_OP) raises if it is bad.
  int status_output = -1;
};

// marlin_aligned: rows of packed words (N % 4 == 0), scales, zeros and x may
// be read as 16-byte vectors (an expert's slice of a stack too: its offset is
// a multiple of N words or halves). Metal requires a bound buffer's offset to
// be aligned to what the kernel reads; PyTorch tensors may start anywhere.
bool vector_loads(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& zeros, int64_t n);

int64_t ceil_div(int64_t a, int64_t b);

// Bindings of [[buffer(index)]]: the op's argument `slot`, an output, a workspace, a scalar.
inline Binding arg(int index, int slot) { return {index, Source::kArg, slot, 0}; }
inline Binding output(int index, int slot = 0) { return {index, Source::kOutput, slot, 0}; }
inline Binding workspace(int index, int slot = 0) { return {index, Source::kWorkspace, slot, 0}; }
uint32_t u32(int64_t v, const char* what);  // checked narrowing for scalar bindings
inline Binding scalar(int index, int64_t value, const char* what) {
  return {index, Source::kScalar, 0, u32(value, what)};
}

// K split (stripe-partitioned K-parallel, summed by marlin_reduce, docs/KERNELS.md):
// the number of K slices of whole `unit_rows` rows (of `kr`), at least `min_rows`
// each and at most kSplitMax, so that `tiles` output tiles make about `target`
// threadgroups. Returns {splits, rows per slice}.
inline constexpr int64_t kSplitTargetThreadgroups = 128;  // GEMMs: K-split when fewer output tiles
inline constexpr int64_t kSplitMinK = 512;                // GEMMs: at least this much K per slice
inline constexpr int64_t kSplitMax = 16;
std::pair<int64_t, int64_t> k_slices(int64_t tiles, int64_t kr, int64_t target, int64_t min_rows,
                                     int64_t unit_rows);
// The GEMVs (dense, routed experts, 2:4): split when their threadgroups are below
// 2 x 64 (about twice the GPU cores of an M1 Ultra; M2/M3 Ultra have 76/80),
// each slice at least one block per planned simdgroup. N = 4096 is not split:
// the dependent reduce dispatch would cost more than the imbalance it removes
// (to be tuned on hardware with benchmarks/bench_mps.py).
inline constexpr int64_t kGemvMinThreadgroups = 128;
inline constexpr int64_t kGemvMinSplitRows = int64_t(kGemvSimdgroups) * kGemvBlockRows;

// The K split's second launch: marlin_reduce (metal/marlin_reduce.h) sums the
// fp32 partials [splits, m, n] (workspace 0) into the output, adding the bias
// (the op's argument `bias_arg`).
Launch reduce_launch(int64_t m, int64_t n, int64_t splits, at::ScalarType dtype, bool has_bias, int bias_arg);

// The marlin_group_rows function constant: packed rows (8 K) per group, 0 for one group over all of K.
uint32_t group_rows_constant(int64_t group_size);

// Whether a tensor's data starts on a 16-byte boundary (Metal: a bound buffer's
// offset must suit the vector loads a kernel makes; PyTorch tensors may start anywhere).
bool aligned16(const at::Tensor& t);

// A dequantize op's plan without bindings: out [K, N] in `dtype` (default
// float16) and one launch of `<kernel_prefix><format>_<dtype>` over tiles of
// kDequantColumns x kDequantRows of the layout's `word_rows` rows; the caller
// binds the launch's buffers.
Plan dequantize_plan(const char* op, const char* source, const char* kernel_prefix, const QuantizedShape& s,
                     int64_t group_size, int64_t word_rows, c10::optional<at::ScalarType> dtype);

// Plan::details of a GEMM or dequantize plan (the problem, for tests and benchmarks).
std::string gemm_details(int64_t m, int64_t n, int64_t k, int64_t group_rows, int64_t splits, at::ScalarType dtype,
                         WeightFormat format, int64_t partial_floats);
const char* dtype_name(at::ScalarType t);  // "f16", "bf16", "f32": kernel-name suffixes
int64_t dtype_size(at::ScalarType t);
void check_launch(const Launch& launch);    // internal limits (threadgroup memory, threads, grid)

// The threadgroup to dispatch `launch` with on a pipeline that allows at most
// `max_threads` threads per threadgroup (Metal's maxTotalThreadsPerThreadgroup,
// which shrinks with a kernel's register use): the planned one if it fits,
// else, for a kernel written for it (min_threads_x > 0), x reduced to whole
// simdgroups down to min_threads_x; otherwise an error naming the kernel.
// The MPS bridge and run_metal(..., max_threads_per_threadgroup=) both use it.
std::array<int64_t, 3> fit_threadgroup(const Launch& launch, int64_t max_threads);

// Every kernel assumes 32-lane simdgroups (kSimdWidth): an error naming the
// kernel if a pipeline reports another threadExecutionWidth.
void check_simd_width(const std::string& kernel, int64_t thread_execution_width);

// The Macs the kernels are built for: macOS kMinMacOS (Metal Shading
// Language 3.1, for bfloat; the bridge compiles with MTLLanguageVersion3_1)
// and an Apple-silicon GPU (MTLGPUFamilyApple7: simdgroup_matrix, 32-lane
// simdgroups). Empty if this one qualifies, else the error to raise. The MPS
// bridge reads the OS version and the GPU family and raises this at first use.
inline constexpr int64_t kMinMacOSMajor = 14, kMinMacOSMinor = 0;
std::string metal_support_problem(int64_t macos_major, int64_t macos_minor, bool apple7_gpu);

// The plan as JSON, arguments named as in the op's schema.
std::string to_json(const Plan& plan);

}  // namespace metal

namespace mps {
// Runs a plan on PyTorch's MPS stream (csrc/mps/run_plan.cpp): allocates the
// outputs and workspaces, binds `args` (the op's arguments in schema order,
// undefined for non-tensors and None) and encodes the launches. Returns the
// outputs, outputs[0] viewed as plan.result_shape.
std::vector<at::Tensor> run_plan(const metal::Plan& plan, const std::vector<at::Tensor>& args);
}  // namespace mps

namespace metal {
namespace detail {

inline void collect(std::vector<at::Tensor>& out, const at::Tensor& t) { out.push_back(t); }
inline void collect(std::vector<at::Tensor>& out, const c10::optional<at::Tensor>& t) {
  out.push_back(t.has_value() ? *t : at::Tensor());
}
template <typename T>
void collect(std::vector<at::Tensor>& out, const T&) {
  out.emplace_back();  // not a tensor argument
}

template <auto Planner>
struct Registered;

// Planner: Plan (Args...) with the op's arguments. `json` implements
// _metal_plan_<op>; `mps` implements the op on the MPS device, `checked_mps`
// an op whose plan has a status output: Check(status, args...) raises if the
// kernels reported bad input (it reads the status: the op waits for the GPU).
template <typename... Args, Plan (*Planner)(Args...)>
struct Registered<Planner> {
  static std::string json(Args... args) { return to_json(Planner(args...)); }
  static std::vector<at::Tensor> run(const Plan& plan, Args... args) {
    std::vector<at::Tensor> tensors;
    (collect(tensors, args), ...);
    return mps::run_plan(plan, tensors);
  }
  static at::Tensor mps(Args... args) {
    const Plan plan = Planner(args...);
    TORCH_CHECK(plan.status_output < 0, "internal error: ", plan.op, "'s plan has a status output but no check");
    return run(plan, args...)[0];
  }
  template <void (*Check)(const at::Tensor&, Args...)>
  static at::Tensor checked_mps(Args... args) {
    const Plan plan = Planner(args...);
    const std::vector<at::Tensor> outputs = run(plan, args...);
    if (plan.status_output >= 0) Check(outputs.at(plan.status_output), args...);
    return outputs[0];
  }
};

}  // namespace detail
}  // namespace metal
}  // namespace marlin

// In a planner file: the plan op for every device and the op's MPS kernel.
#define MARLIN_REGISTER_METAL_OP(op, planner)                                              \
  TORCH_LIBRARY_IMPL(marlin, CompositeExplicitAutograd, m) {                               \
    m.impl("_metal_plan_" #op, &::marlin::metal::detail::Registered<&planner>::json);    \
  }                                                                                        \
  TORCH_LIBRARY_IMPL(marlin, MPS, m) {                                                     \
    m.impl(#op, &::marlin::metal::detail::Registered<&planner>::mps);                     \
  }

// An op whose plan has a status output (def_metal_op(..., checked = true)):
// check(status, op args...) also implements `_metal_check_<op>`, which the
// emulator runner (torch_marlin.testing.run_metal) calls after the launches.
#define MARLIN_REGISTER_CHECKED_METAL_OP(op, planner, check)                                           \
  TORCH_LIBRARY_IMPL(marlin, CompositeExplicitAutograd, m) {                                           \
    m.impl("_metal_plan_" #op, &::marlin::metal::detail::Registered<&planner>::json);                \
    m.impl("_metal_check_" #op, &check);                                                               \
  }                                                                                                    \
  TORCH_LIBRARY_IMPL(marlin, MPS, m) {                                                                 \
    m.impl(#op, &::marlin::metal::detail::Registered<&planner>::template checked_mps<&check>);       \
  }
