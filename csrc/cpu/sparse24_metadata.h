// The 2:4 layout's position metadata (docs/FORMAT.md) as the kernels read it:
// padding and validity checks, shared by the float kernels
// (cpu/sparse24_kernels_impl.h) and the int8-x GEMV (cpu/sparse24_gemv_q8.h).
#pragma once
#include "cpu/cpu_vec.h"

namespace marlin {
namespace cpu {
namespace MARLIN_ISA_NS {
namespace {

constexpr int32_t kFillMetadata = 0x44444444;  // (0, 1) in every block: pads tail columns

inline void copy_metadata(int32_t* dst, const int32_t* src, int64_t count, int width, int32_t fill) {
  memcpy(dst, src, count * sizeof(int32_t));
  for (int64_t i = count; i < width; ++i) dst[i] = fill;
}

// Nonzero lanes: a nibble of the metadata word is not pos0 < pos1.
inline vu metadata_invalid(vi m) {
  const vu a = (vu)m & 0x33333333u, b = ((vu)m >> 2) & 0x33333333u;
  // Per nibble 4 + pos1 - pos0 - 1, in 0..6, so no borrows: bit 2 set iff pos1 > pos0.
  return ~((b | 0x44444444u) - a - 0x11111111u) & 0x44444444u;
}

inline uint32_t any_lane(vu v) {
  uint32_t r = 0;
  for (int i = 0; i < kLanes; ++i) r |= v[i];
  return r;
}

}  // namespace
}  // namespace MARLIN_ISA_NS
}  // namespace cpu
}  // namespace marlin
