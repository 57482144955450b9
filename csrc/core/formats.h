// Value formats and group sizes on the host: names <-> WeightFormat, checks.
// The facts themselves (enum values, group sizes, which formats have zero
// points) are in metal/marlin_common.h, shared with the Metal kernels.
#pragma once

#include <cstdint>
#include <string>

#include "marlin_common.h"

namespace marlin {

// "fp4" -> kFp4; a ValueError naming the allowed names otherwise.
WeightFormat parse_weight_format(const std::string& weight_format);
const char* weight_format_name(WeightFormat format);

// group_size must be one of kGroupSizes; a ValueError naming them otherwise.
void check_group_size(int64_t group_size);

}  // namespace marlin
