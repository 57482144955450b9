// Stub of Apple's <sys/sysctl.h> for the macOS syntax check: only what
// csrc/cpu/kernel_builds.cpp uses (the hw.optional.arm.FEAT_BF16 query).
#pragma once
#include <stddef.h>

extern "C" int sysctlbyname(const char* name, void* oldp, size_t* oldlenp, void* newp, size_t newlen);
