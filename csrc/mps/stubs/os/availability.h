// Stub of <os/availability.h>: see ../README.md. API_AVAILABLE and
// API_DEPRECATED expand to clang availability attributes as in Apple's SDK, so
// that the syntax check (which targets the package's macOS floor) rejects an
// API used without an @available guard where the floor lacks it.
#pragma once

#define __MARLIN_API_PICK(_1, _2, _3, _4, NAME, ...) NAME
#define __MARLIN_API_MAP1(m, a) m(a)
#define __MARLIN_API_MAP2(m, a, b) m(a) m(b)
#define __MARLIN_API_MAP3(m, a, b, c) m(a) m(b) m(c)
#define __MARLIN_API_MAP4(m, a, b, c, d) m(a) m(b) m(c) m(d)
#define __MARLIN_API_MAP(m, ...)                                                                  \
  __MARLIN_API_PICK(__VA_ARGS__, __MARLIN_API_MAP4, __MARLIN_API_MAP3, __MARLIN_API_MAP2, \
                    __MARLIN_API_MAP1)(m, __VA_ARGS__)

// API_AVAILABLE(macos(15.0), ios(18.0))
#define __MARLIN_API_A_macos(v) __attribute__((availability(macos, introduced = v)))
#define __MARLIN_API_A_ios(v) __attribute__((availability(ios, introduced = v)))
#define __MARLIN_API_A_tvos(v) __attribute__((availability(tvos, introduced = v)))
#define __MARLIN_API_A_watchos(v) __attribute__((availability(watchos, introduced = v)))
#define __MARLIN_API_A(platform) __MARLIN_API_A_##platform
#define API_AVAILABLE(...) __MARLIN_API_MAP(__MARLIN_API_A, __VA_ARGS__)

// API_DEPRECATED("message", macos(10.11, 15.0), ios(8.0, 18.0))
#define __MARLIN_API_D_macos(a, d) __attribute__((availability(macos, introduced = a, deprecated = d)))
#define __MARLIN_API_D_ios(a, d) __attribute__((availability(ios, introduced = a, deprecated = d)))
#define __MARLIN_API_D_tvos(a, d) __attribute__((availability(tvos, introduced = a, deprecated = d)))
#define __MARLIN_API_D_watchos(a, d) __attribute__((availability(watchos, introduced = a, deprecated = d)))
#define __MARLIN_API_D(platform) __MARLIN_API_D_##platform
#define API_DEPRECATED(message, ...) __MARLIN_API_MAP(__MARLIN_API_D, __VA_ARGS__)
