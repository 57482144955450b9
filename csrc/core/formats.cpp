#include "core/formats.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace marlin {
namespace {

#define MARLIN_FORMAT_NAME(name, F, _) #name,
constexpr const char* kWeightFormatNames[kNumWeightFormats] = {MARLIN_FOR_EACH_FORMAT(MARLIN_FORMAT_NAME, )};
#undef MARLIN_FORMAT_NAME

// Python's repr of the allowed values, as torch_marlin/formats.py prints them.
std::string format_names() {
  std::ostringstream o;
  o << "(";
  for (int i = 0; i < kNumWeightFormats; ++i) o << (i ? ", '" : "'") << kWeightFormatNames[i] << "'";
  o << ")";
  return o.str();
}

std::string group_sizes() {
  std::ostringstream o;
  o << "(";
  for (int i = 0; i < kNumGroupSizes; ++i) o << (i ? ", " : "") << kGroupSizes[i];
  o << ")";
  return o.str();
}

}  // namespace

WeightFormat parse_weight_format(const std::string& weight_format) {
  for (int i = 0; i < kNumWeightFormats; ++i)
    if (weight_format == kWeightFormatNames[i]) return static_cast<WeightFormat>(i);
  TORCH_CHECK_VALUE(false, "weight_format must be one of ", format_names(), ", got '", weight_format, "'");
}

const char* weight_format_name(WeightFormat format) {
  TORCH_INTERNAL_ASSERT(format >= 0 && format < kNumWeightFormats, "bad WeightFormat ", int(format));
  return kWeightFormatNames[format];
}

void check_group_size(int64_t group_size) {
  for (int g : kGroupSizes)
    if (group_size == g) return;
  TORCH_CHECK_VALUE(false, "group_size must be one of ", group_sizes(), ", got ", group_size);
}

}  // namespace marlin

// Persisted in state_dicts and checkpoints (docs/FORMAT.md): never renumber.
static_assert(marlin::kFp4 == 0 && marlin::kUint4 == 1 && marlin::kInt4 == 2, "weight format numbers are persisted");
#define MARLIN_COUNT_FORMAT(name, F, _) +1
static_assert((0 MARLIN_FOR_EACH_FORMAT(MARLIN_COUNT_FORMAT, )) == marlin::kNumWeightFormats,
              "kNumWeightFormats must count MARLIN_FOR_EACH_FORMAT");
#undef MARLIN_COUNT_FORMAT
