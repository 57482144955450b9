// The kernels for any CPU the compiler targets by default (on aarch64: NEON).
#define MARLIN_KERNEL_NS generic
#define MARLIN_KERNEL_NAME "generic"
#include "cpu/kernels_impl.h"
