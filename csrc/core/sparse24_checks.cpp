#include "core/sparse24_checks.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace marlin {

QuantizedShape check_sparse24(const at::Tensor& values, const at::Tensor& metadata, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, const std::string& weight_format,
                              int64_t group_size) {
  const WeightFormat format = parse_weight_format(weight_format);
  check_group_size(group_size);
  TORCH_CHECK(values.scalar_type() == at::kInt, "values must be int32, got ", values.scalar_type());
  TORCH_CHECK(values.dim() == 2, "values must be 2-D [K/16, N], got shape ", values.sizes());
  TORCH_CHECK(values.is_contiguous(), "values must be contiguous");
  TORCH_CHECK(values.size(0) > 0 && values.size(1) > 0, "values must not be empty, got shape ", values.sizes());
  const int64_t k = values.size(0) * kSparseValueRows, n = values.size(1);
  TORCH_CHECK_VALUE(k % kSparseMetadataRows == 0, "K = 16 * values.size(0) = ", k, " must be a multiple of ",
                    kSparseMetadataRows);
  TORCH_CHECK(metadata.scalar_type() == at::kInt, "metadata must be int32, got ", metadata.scalar_type());
  TORCH_CHECK_VALUE(metadata.dim() == 2 && metadata.size(0) == k / kSparseMetadataRows && metadata.size(1) == n,
                    "metadata must have shape [K/32, N] = [", k / kSparseMetadataRows, ", ", n,
                    "] for values of shape ", values.sizes(), ", got ", metadata.sizes());
  TORCH_CHECK(metadata.device() == values.device(), "metadata must be on the same device as values (",
              values.device(), "), got ", metadata.device());
  TORCH_CHECK(metadata.is_contiguous(), "metadata must be contiguous");
  return check_groups(format, k, values, "values", "16 * values.size(0)", scales, zeros, weight_format,
                      group_size);
}

void check_sparse24_gemm_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                const at::Tensor& values, const QuantizedShape& shape) {
  check_gemm_inputs(x, bias, values, shape, "values", "16 * values.size(0)");
}

void throw_invalid_metadata(const at::Tensor& metadata) {
  const at::Tensor words = metadata.cpu().contiguous();
  const int32_t* w = words.data_ptr<int32_t>();
  const int64_t n = words.size(1);
  for (int64_t i = 0; i < words.numel(); ++i) {
    for (int j = 0; j < 8; ++j) {
      const int nibble = (uint32_t(w[i]) >> (4 * j)) & 0xF;
      if ((nibble & 3) < (nibble >> 2)) continue;
      const int64_t block = (i / n) * 8 + j, col = i % n;
      // The same text as torch_marlin/layouts/sparse24.py invalid_metadata_message.
      TORCH_CHECK_VALUE(false, "metadata has an invalid 2:4 pattern: word [", i / n, ", ", col, "] nibble ", j,
                        " (K rows ", 4 * block, "..", 4 * block + 3, ") is ", nibble, " = positions (",
                        nibble & 3, ", ", nibble >> 2,
                        "); a block keeps two different positions pos0 < pos1 in 0..3 (nibble pos0 | pos1 << 2, "
                        "one of [4, 8, 9, 12, 13, 14])");
    }
  }
  TORCH_CHECK(false, "internal error: the kernels reported invalid metadata that does not exist");
}

}  // namespace marlin
