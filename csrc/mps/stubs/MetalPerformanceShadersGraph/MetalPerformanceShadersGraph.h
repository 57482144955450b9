// Stub of <MetalPerformanceShadersGraph/MetalPerformanceShadersGraph.h>: only
// the types torch's ATen/mps/MPSStream.h names. See ../README.md.
#pragma once
#include <MetalPerformanceShaders/MetalPerformanceShaders.h>

@interface MPSGraph : NSObject
@end
@interface MPSGraphExecutionDescriptor : NSObject
@end
@interface MPSGraphCompilationDescriptor : NSObject
@end
