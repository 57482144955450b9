// The quantizer for any CPU the compiler targets by default, on vectors of
// one 128-bit register (SSE2, NEON).
#define MARLIN_QUANT_NS generic
#define MARLIN_VECTOR_BYTES 16
#include "cpu/quantize_impl.h"
