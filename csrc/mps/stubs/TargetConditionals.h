// Stub of <TargetConditionals.h> (torch's c10 headers include it on Apple
// platforms): a macOS target. See README.md.
#pragma once
#define TARGET_OS_MAC 1
#define TARGET_OS_OSX 1
#define TARGET_OS_IPHONE 0
#define TARGET_OS_IOS 0
#define TARGET_OS_TV 0
#define TARGET_OS_WATCH 0
#define TARGET_OS_VISION 0
#define TARGET_OS_MACCATALYST 0
#define TARGET_OS_SIMULATOR 0
#define TARGET_IPHONE_SIMULATOR 0
#define TARGET_CPU_ARM64 1
#define TARGET_RT_64_BIT 1
