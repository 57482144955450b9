// Stub of <Availability.h> of the macOS 15 SDK (Xcode 16): see ../README.md.
// As in Apple's: a __MAC_<version> per release this SDK knows, and the SDK
// version as __MAC_OS_X_VERSION_MAX_ALLOWED.
#pragma once
#define __MAC_13_0 130000
#define __MAC_14_0 140000
#define __MAC_14_5 140500
#define __MAC_15_0 150000
#define __MAC_OS_X_VERSION_MIN_REQUIRED __ENVIRONMENT_MAC_OS_X_VERSION_MIN_REQUIRED__
#define __MAC_OS_X_VERSION_MAX_ALLOWED __MAC_15_0
