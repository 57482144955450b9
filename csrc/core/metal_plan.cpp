#include "core/metal_plan.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <sstream>

namespace marlin {
namespace metal {

bool vector_loads(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  const c10::optional<at::Tensor>& zeros, int64_t n) {
  return n % 4 == 0 && aligned16(x) && aligned16(packed) && aligned16(scales) &&
         (!zeros.has_value() || aligned16(*zeros));
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

const char* dtype_name(at::ScalarType t) {
#define MARLIN_DTYPE_NAME(name, T, scalar_type, _) \
  if (t == at::ScalarType::scalar_type) return #name;
  MARLIN_FOR_EACH_DTYPE(MARLIN_DTYPE_NAME, )
#undef MARLIN_DTYPE_NAME
  TORCH_CHECK(false, "Metal kernels support float16, bfloat16 and float32, got ", t);
}

int64_t dtype_size(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

uint32_t u32(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= int64_t(UINT32_MAX), what, " = ", v, " does not fit the Metal kernels' 32-bit sizes");
  return static_cast<uint32_t>(v);
}

void check_launch(const Launch& l) {
  TORCH_INTERNAL_ASSERT(l.threadgroup_memory % 16 == 0 && l.threadgroup_memory <= kMaxThreadgroupMemory,
                        l.kernel, ": threadgroup memory ", l.threadgroup_memory);
  const int64_t threads = l.threadgroup[0] * l.threadgroup[1] * l.threadgroup[2];
  TORCH_INTERNAL_ASSERT(threads <= 1024, l.kernel);
  TORCH_INTERNAL_ASSERT(l.min_threads_x == 0 || (l.min_threads_x % kSimdWidth == 0 && l.min_threads_x <= l.threadgroup[0]),
                        l.kernel, ": min_threads_x ", l.min_threads_x);
  // At most kThreadgroupMemoryBudget per 128 threads: two threadgroups fit a core.
  TORCH_INTERNAL_ASSERT(l.threadgroup_memory * 128 <= kThreadgroupMemoryBudget * threads, l.kernel,
                        ": threadgroup memory ", l.threadgroup_memory, " for ", threads, " threads");
  for (int64_t g : l.grid) TORCH_INTERNAL_ASSERT(g >= 1 && g <= int64_t(UINT32_MAX), l.kernel, ": grid");
}

std::string gemm_details(int64_t m, int64_t n, int64_t k, int64_t group_rows, int64_t splits, at::ScalarType dtype,
                         WeightFormat format, int64_t partial_floats) {
  std::ostringstream o;
  o << "\"M\":" << m << ",\"N\":" << n << ",\"K\":" << k << ",\"group_rows\":" << group_rows
    << ",\"splits\":" << splits << ",\"dtype\":\"" << dtype_name(dtype) << "\",\"format\":\""
    << weight_format_name(format) << "\",\"partial_floats\":" << partial_floats;
  return o.str();
}

Plan dequantize_plan(const char* op, const char* source, const char* kernel_prefix, const QuantizedShape& s,
                     int64_t group_size, int64_t word_rows, c10::optional<at::ScalarType> dtype) {
  const at::ScalarType out = dtype.value_or(at::kHalf);
  TORCH_CHECK(out == at::kHalf || out == at::kBFloat16 || out == at::kFloat,
              "dtype must be float16, bfloat16 or float32, got ", out);
  Plan p;
  p.op = op;
  p.outputs = {{"out", {s.k, s.n}, out}};
  p.result_shape = {s.k, s.n};
  p.details = gemm_details(0, s.n, s.k, s.group_rows, 1, out, s.format, 0);
  Launch l;
  l.source = source;
  l.kernel = std::string(kernel_prefix) + weight_format_name(s.format) + "_" + dtype_name(out);
  l.threadgroup = {kDequantColumns, kDequantRows, 1};
  l.grid = {ceil_div(s.n, kDequantColumns), ceil_div(word_rows, kDequantRows), 1};
  l.set(kFcGroupRows, group_rows_constant(group_size));
  check_launch(l);
  p.launches.push_back(std::move(l));
  return p;
}

std::pair<int64_t, int64_t> k_slices(int64_t tiles, int64_t kr, int64_t target, int64_t min_rows,
                                     int64_t unit_rows) {
  int64_t splits = 1;
  if (tiles < target) splits = std::max<int64_t>(1, std::min({ceil_div(target, tiles), kr / min_rows, kSplitMax}));
  const int64_t rows = ceil_div(ceil_div(kr, splits), unit_rows) * unit_rows;
  return {ceil_div(kr, rows), rows};
}

Launch reduce_launch(int64_t m, int64_t n, int64_t splits, at::ScalarType dtype, bool has_bias, int bias_arg) {
  u32(splits * m * n, "workspace size");
  Launch r;
  r.source = "reduce";
  r.kernel = std::string("marlin_reduce_") + dtype_name(dtype);
  r.set(kFcHasBias, has_bias);
  r.threadgroup = {kReduceOutputs, 1, 1};
  r.min_threads_x = kSimdWidth;  // loops over its outputs with the threads it gets
  r.grid = {ceil_div(m * n, kReduceOutputs), 1, 1};
  r.bindings = {workspace(0), arg(1, bias_arg), output(2), scalar(3, m, "M"), scalar(4, n, "N"),
                scalar(5, splits, "splits")};
  check_launch(r);
  return r;
}

uint32_t group_rows_constant(int64_t group_size) {
  return group_size == -1 ? 0u : static_cast<uint32_t>(group_size / kPackFactor);
}

bool aligned16(const at::Tensor& t) { return t.storage_offset() * t.element_size() % 16 == 0; }

std::array<int64_t, 3> fit_threadgroup(const Launch& l, int64_t max_threads) {
  const int64_t planned = l.threadgroup[0] * l.threadgroup[1] * l.threadgroup[2];
  TORCH_CHECK(max_threads > 0, "torch_marlin: ", l.kernel, ": a pipeline limit of ", max_threads,
              " threads per threadgroup");
  if (planned <= max_threads) return l.threadgroup;
  const int64_t rows = l.threadgroup[1] * l.threadgroup[2];
  // Whole simdgroups along x, as many as the limit allows.
  const int64_t x = max_threads / rows / kSimdWidth * kSimdWidth;
  TORCH_CHECK(l.min_threads_x > 0 && x >= l.min_threads_x, "torch_marlin: kernel ", l.kernel, " needs ",
              l.min_threads_x > 0 ? l.min_threads_x * rows : planned,
              " threads per threadgroup, but this GPU's pipeline allows only ", max_threads,
              " (maxTotalThreadsPerThreadgroup)");
  return {x, l.threadgroup[1], l.threadgroup[2]};
}

void check_simd_width(const std::string& kernel, int64_t width) {
  TORCH_CHECK(width == kSimdWidth, "torch_marlin: kernel ", kernel, " is written for ", kSimdWidth,
              "-lane simdgroups, but this GPU runs ", width,
              " threads per SIMD group (threadExecutionWidth); only Apple-silicon GPUs are supported");
}

std::string metal_support_problem(int64_t major, int64_t minor, bool apple7_gpu) {
  std::ostringstream o;
  if (major < kMinMacOSMajor || (major == kMinMacOSMajor && minor < kMinMacOSMinor))
    o << "torch_marlin's Metal kernels need macOS " << kMinMacOSMajor << "." << kMinMacOSMinor
      << " or newer (Metal Shading Language 3.1, for bfloat), this is macOS " << major << "." << minor
      << "; use the CPU device, or update macOS";
  else if (!apple7_gpu)
    o << "torch_marlin's Metal kernels need an Apple-silicon GPU (MTLGPUFamilyApple7: M1 or newer); "
         "this GPU is not one; use the CPU device";
  return o.str();
}

namespace {

// torch dtype names, as torch_marlin.testing.run_metal reads them (getattr(torch, name)).
const char* torch_dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kByte: return "uint8";
    default: TORCH_INTERNAL_ASSERT(false, "plan buffer of dtype ", t);
  }
}

void write_shape(std::ostringstream& o, const std::vector<int64_t>& shape) {
  o << "[";
  for (size_t i = 0; i < shape.size(); ++i) o << (i ? "," : "") << shape[i];
  o << "]";
}

void write_buffers(std::ostringstream& o, const char* key, const std::vector<Buffer>& buffers) {
  o << ",\"" << key << "\":[";
  for (size_t i = 0; i < buffers.size(); ++i) {
    o << (i ? "," : "") << "{\"name\":\"" << buffers[i].name << "\",\"shape\":";
    write_shape(o, buffers[i].shape);
    o << ",\"dtype\":\"" << torch_dtype_name(buffers[i].dtype) << "\"}";
  }
  o << "]";
}

// Name of what a binding refers to: the op's argument name, a buffer name, or "scalar".
std::string binding_name(const Plan& p, const c10::FunctionSchema& schema, const Binding& b) {
  switch (b.source) {
    case Source::kArg: return schema.arguments().at(b.slot).name();
    case Source::kOutput: return p.outputs.at(b.slot).name;
    case Source::kWorkspace: return p.workspaces.at(b.slot).name;
    case Source::kScalar: return "scalar";
  }
  return "?";
}

}  // namespace

std::string to_json(const Plan& p) {
  const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(("marlin::" + p.op).c_str(), "");
  const c10::FunctionSchema& schema = op.schema();
  std::ostringstream o;
  o << "{\"op\":\"" << p.op << "\"" << (p.details.empty() ? "" : ",") << p.details;
  write_buffers(o, "outputs", p.outputs);
  write_buffers(o, "workspaces", p.workspaces);
  o << ",\"result_shape\":";
  write_shape(o, p.result_shape);
  o << ",\"status_output\":";
  if (p.status_output < 0)
    o << "null";
  else
    o << "\"" << p.outputs.at(p.status_output).name << "\"";
  o << ",\"launches\":[";
  for (size_t i = 0; i < p.launches.size(); ++i) {
    const Launch& l = p.launches[i];
    o << (i ? "," : "") << "{\"source\":\"" << l.source << "\",\"kernel\":\"" << l.kernel
      << "\",\"grid\":[" << l.grid[0] << "," << l.grid[1] << "," << l.grid[2] << "],\"threadgroup\":["
      << l.threadgroup[0] << "," << l.threadgroup[1] << "," << l.threadgroup[2]
      << "],\"threadgroup_memory\":" << l.threadgroup_memory << ",\"min_threads_x\":" << l.min_threads_x
      << ",\"constants\":{";
    for (size_t c = 0; c < l.constants.size(); ++c) {
      const Constant& k = l.constants[c];
      o << (c ? "," : "") << "\"" << k.index << "\":";
      if (k.is_bool)
        o << (k.value ? "true" : "false");
      else
        o << k.value;
    }
    o << "},\"bindings\":[";
    for (size_t b = 0; b < l.bindings.size(); ++b) {
      const Binding& bd = l.bindings[b];
      o << (b ? "," : "") << "[" << bd.index << ",\"" << binding_name(p, schema, bd) << "\"," << bd.value << "]";
    }
    o << "]}";
  }
  o << "]}";
  return o.str();
}

namespace {

// What the MPS bridge decides from a pipeline's limits, for run_metal and the
// tests (the bridge itself calls check_simd_width and fit_threadgroup).
std::vector<int64_t> fit_threadgroup_op(c10::string_view kernel, at::IntArrayRef threadgroup, int64_t min_threads_x,
                                        int64_t max_threads, int64_t thread_execution_width) {
  TORCH_CHECK(threadgroup.size() == 3, "threadgroup must have 3 sizes, got ", threadgroup.size());
  Launch l;
  l.kernel = std::string(kernel);
  l.threadgroup = {threadgroup[0], threadgroup[1], threadgroup[2]};
  l.min_threads_x = min_threads_x;
  check_simd_width(l.kernel, thread_execution_width);
  const std::array<int64_t, 3> tg = fit_threadgroup(l, max_threads);
  return {tg.begin(), tg.end()};
}

}  // namespace

TORCH_LIBRARY_IMPL(marlin, CompositeExplicitAutograd, m) {
  m.impl("_metal_fit_threadgroup", &fit_threadgroup_op);
  m.impl("_metal_support_problem", &metal_support_problem);
}

}  // namespace metal
}  // namespace marlin
