// The quantizer for any CPU the compiler targets by default.
#define MARLIN_QUANT_NS generic
#include "cpu/quantize_impl.h"
