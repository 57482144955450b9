// The kernels for any CPU the compiler targets by default.
#define MARLIN_KERNEL_NS generic
#include "cpu/kernels_impl.h"
#include "cpu/sparse24_kernels_impl.h"
