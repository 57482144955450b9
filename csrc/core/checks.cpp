#include "core/checks.h"

#include <c10/util/Exception.h>

namespace marlin {
namespace {

// Shapes in messages: "[E, " prefix for expert stacks.
const char* lead(bool stacked) { return stacked ? "[E, " : "["; }

void check_group_tensor(const at::Tensor& t, const char* name, const at::Tensor& weight, const char* weight_name,
                        const QuantizedShape& s, bool stacked) {
  TORCH_CHECK(t.scalar_type() == at::kHalf, name, " must be float16, got ", t.scalar_type());
  const bool shape_ok = stacked ? t.dim() == 3 && t.size(0) == s.experts && t.size(1) == s.groups && t.size(2) == s.n
                                : t.dim() == 2 && t.size(0) == s.groups && t.size(1) == s.n;
  TORCH_CHECK(shape_ok, name, " must have shape ", lead(stacked), "K/group_size, N] = [",
              stacked ? std::to_string(s.experts) + ", " : std::string(), s.groups, ", ", s.n, "], got ",
              t.sizes());
  TORCH_CHECK(t.device() == weight.device(), name, " must be on the same device as ", weight_name, " (",
              weight.device(), "), got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

}  // namespace

QuantizedShape check_quantized(const at::Tensor& packed, const at::Tensor& scales,
                               const c10::optional<at::Tensor>& zeros,
                               const std::string& weight_format, int64_t group_size, bool stacked) {
  const WeightFormat format = parse_weight_format(weight_format);
  check_group_size(group_size);
  TORCH_CHECK(packed.scalar_type() == at::kInt, "packed must be int32, got ", packed.scalar_type());
  const int64_t dims = stacked ? 3 : 2;
  TORCH_CHECK(packed.dim() == dims, "packed must be ", dims, "-D ", lead(stacked), "K/8, N], got shape ",
              packed.sizes());
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  for (int64_t d = 0; d < dims; ++d)
    TORCH_CHECK(packed.size(d) > 0, "packed must not be empty, got shape ", packed.sizes());
  return check_groups(format, packed.size(dims - 2) * kPackFactor, packed, "packed",
                      stacked ? "8 * packed.size(1)" : "8 * packed.size(0)", scales, zeros, weight_format,
                      group_size, stacked);
}

QuantizedShape check_groups(WeightFormat format, int64_t k, const at::Tensor& weight, const char* weight_name,
                            const char* k_expr, const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                            const std::string& weight_format, int64_t group_size, bool stacked) {
  QuantizedShape s{};
  s.format = format;
  s.experts = stacked ? weight.size(0) : 1;
  s.k = k;
  s.n = weight.size(-1);
  if (group_size == -1) {
    s.groups = 1;
    s.group_rows = s.k;
  } else {
    TORCH_CHECK_VALUE(s.k % group_size == 0, "K = ", k_expr, " = ", s.k, " must be a multiple of group_size = ",
                      group_size);
    s.groups = s.k / group_size;
    s.group_rows = group_size;
  }
  check_group_tensor(scales, "scales", weight, weight_name, s, stacked);
  if (has_zeros(s.format)) {
    TORCH_CHECK_VALUE(zeros.has_value(), "zeros is required for weight_format='", weight_format, "'");
    check_group_tensor(*zeros, "zeros", weight, weight_name, s, stacked);
  } else {
    TORCH_CHECK_VALUE(!zeros.has_value(), "zeros must be None for weight_format='", weight_format,
                      "'");
  }
  return s;
}

void check_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& packed, const QuantizedShape& shape) {
  check_gemm_inputs(x, bias, packed, shape, "packed", "8 * packed.size(0)");
}

void check_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias, const at::Tensor& weight,
                       const QuantizedShape& shape, const char* weight_name, const char* k_expr) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "x must be float16, bfloat16 or float32, got ", dtype);
  TORCH_CHECK(x.dim() >= 1, "x must have shape [..., K], got a 0-d tensor");
  TORCH_CHECK(x.size(-1) == shape.k, "x.size(-1) must equal K = ", k_expr, " = ", shape.k,
              ", got x of shape ", x.sizes());
  TORCH_CHECK(x.device() == weight.device(), "x must be on the same device as ", weight_name, " (",
              weight.device(), "), got ", x.device());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == shape.n, "bias must have shape [N] = [",
                shape.n, "], got ", bias->sizes());
    TORCH_CHECK(bias->scalar_type() == dtype, "bias must have x's dtype ", dtype, ", got ",
                bias->scalar_type());
    TORCH_CHECK(bias->device() == weight.device(), "bias must be on the same device as ", weight_name, " (",
                weight.device(), "), got ", bias->device());
  }
}

}  // namespace marlin
