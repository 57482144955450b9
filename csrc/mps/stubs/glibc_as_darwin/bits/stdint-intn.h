// Not an Apple header: the syntax check borrows the aarch64 Linux C and C++
// headers, whose int64_t is `long`; on macOS it is `long long`, and torch's
// headers static_assert that on Apple targets. These two replace glibc's
// exact-width typedefs with Darwin's. See ../../README.md.
#ifndef _BITS_STDINT_INTN_H
#define _BITS_STDINT_INTN_H 1
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
#endif
