// Stub of <MetalPerformanceShaders/MetalPerformanceShaders.h>: only the type
// torch's ATen/mps/MPSStream.h names. See ../README.md.
#pragma once
#include <Metal/Metal.h>

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end
