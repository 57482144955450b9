// The kernel harnesses' float64 reference of the value formats (check_kernels.cpp,
// check_rans_kernels.cpp), written from docs/FORMAT.md without the kernels' code.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "marlin_common.h"

namespace {

// fp16 bits -> double, from the field definitions (no shared code with the kernels).
double half_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
  const double magnitude = exp == 0 ? ldexp(mant, -24) : ldexp(1024 + mant, exp - 25);
  return sign ? -magnitude : magnitude;
}

// The value of a code before the scale: E2M1 from its bit fields, int4 q - 8, uint4 q - zero,
// nf4 its table value, affine q (its bias is added after the scale: weight_value).
double code_value(int format, int code, double zero) {
  switch (format) {
    case marlin::kAffine: return code;
    case marlin::kFp4: {
      const int e = (code >> 1) & 3, m = code & 1;
      const double magnitude = e == 0 ? m * 0.5 : ldexp(1.0 + m / 2.0, e - 1);
      return code & 8 ? -magnitude : magnitude;
    }
    case marlin::kInt4: return code - 8.0;
    case marlin::kUint4: return code - zero;
    case marlin::kNf4: {
      // bitsandbytes' NF4 values rounded to fp16, as fp16 bits (docs/FORMAT.md).
      const uint16_t nf4[16] = {0xbc00, 0xb992, 0xb833, 0xb652, 0xb48d, 0xb1ea, 0xadd4, 0x0000,
                                0x2d18, 0x3126, 0x33e0, 0x3568, 0x370d, 0x3880, 0x39c9, 0x3c00};
      return half_value(nf4[code]);
    }
  }
  printf("FAIL no reference decode for format %d\n", format);
  exit(1);
}

// The weight of a code with its group's scale and zero (for affine the bias).
double weight_value(int format, int code, double scale, double zero) {
  const double v = code_value(format, code, zero) * scale;
  return marlin::zeros_are_bias(marlin::WeightFormat(format)) ? v + zero : v;
}

}  // namespace
