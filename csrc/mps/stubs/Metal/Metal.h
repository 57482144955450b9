// Stub of <Metal/Metal.h>: see ../README.md. Declarations as in Apple's
// MTLDevice.h, MTLLibrary.h, MTLComputePipeline.h, MTLCommandEncoder.h,
// MTLComputeCommandEncoder.h, MTLCommandQueue.h, MTLArgument.h (MTLDataType),
// MTLTypes.h (MTLSize), with their availability attributes where one matters
// above the package's macOS floor. Two SDK generations: what the macOS 15 SDK
// (Xcode 16) added is declared only when <Availability.h> is the 15 one
// (MacOSX15.sdk/), as the macOS 14 SDK (Xcode 15) has none of it.
#pragma once
#include <Foundation/Foundation.h>

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

typedef NS_ENUM(NSUInteger, MTLDataType){
    MTLDataTypeNone = 0,
    MTLDataTypeBool = 53,
    MTLDataTypeUInt = 33,
    MTLDataTypeInt = 29,
};

typedef NS_ENUM(NSUInteger, MTLLanguageVersion){
    MTLLanguageVersion3_0 API_AVAILABLE(macos(13.0), ios(16.0)) = (3 << 16),
    MTLLanguageVersion3_1 API_AVAILABLE(macos(14.0), ios(17.0)) = (3 << 16) + 1,
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
    MTLLanguageVersion3_2 API_AVAILABLE(macos(15.0), ios(18.0)) = (3 << 16) + 2,
#endif
} API_AVAILABLE(macos(10.11), ios(9.0));

#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
// MTLLibrary.h of the 15 SDK: both enums without an availability attribute,
// the properties that take them macOS 15.
typedef NS_ENUM(NSInteger, MTLMathMode){
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
};

typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions){
    MTLMathFloatingPointFunctionsFast = 0,
    MTLMathFloatingPointFunctionsPrecise = 1,
};
#endif

typedef NS_ENUM(NSInteger, MTLGPUFamily){
    MTLGPUFamilyApple7 = 1007,
    MTLGPUFamilyApple8 = 1008,
    MTLGPUFamilyApple9 = 1009,
    MTLGPUFamilyMetal3 = 5001,
} API_AVAILABLE(macos(10.15), ios(13.0));

@protocol MTLDevice;
@protocol MTLFunction;
@protocol MTLLibrary;
@protocol MTLCommandBuffer;

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
@property(readonly) NSUInteger length;
- (void* _Nonnull)contents;
@end

@protocol MTLFunction <NSObject>
@end

@interface MTLFunctionConstantValues : NSObject
- (void)setConstantValue:(const void* _Nonnull)value type:(MTLDataType)type atIndex:(NSUInteger)index;
@end

@interface MTLCompileOptions : NSObject
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
@property(readwrite, nonatomic) BOOL fastMathEnabled
    API_DEPRECATED("Use mathMode instead", macos(10.11, 15.0), ios(8.0, 18.0));
@property(readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0), ios(18.0));
@property(nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions API_AVAILABLE(macos(15.0), ios(18.0));
@property(readwrite, nonatomic) BOOL enableLogging API_AVAILABLE(macos(15.0), ios(18.0));
#else
@property(readwrite, nonatomic) BOOL fastMathEnabled;
#endif
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion API_AVAILABLE(macos(10.11), ios(9.0));
@end

@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString* _Nonnull)name;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString* _Nonnull)name
                                 constantValues:(MTLFunctionConstantValues* _Nonnull)constantValues
                                          error:(__autoreleasing NSError* _Nullable* _Nullable)error;
@end

@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@end

// A pipeline's label names it in Xcode's Metal debugger and profiler.
@interface MTLComputePipelineDescriptor : NSObject
@property(nullable, copy, nonatomic) NSString* label;
@property(nullable, readwrite, nonatomic, strong) id<MTLFunction> computeFunction;
@end

@interface MTLComputePipelineReflection : NSObject
@end
typedef __autoreleasing MTLComputePipelineReflection* _Nullable MTLAutoreleasedComputePipelineReflection;

typedef NS_OPTIONS(NSUInteger, MTLPipelineOption){
    MTLPipelineOptionNone = 0,
} API_AVAILABLE(macos(10.11), ios(8.0));

@protocol MTLCommandEncoder <NSObject>
@property(nullable, copy, atomic) NSString* label;
- (void)endEncoding;
- (void)pushDebugGroup:(NSString* _Nonnull)string;
- (void)popDebugGroup;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState> _Nonnull)state;
- (void)setBytes:(const void* _Nonnull)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer> _Nonnull);

@protocol MTLCommandBuffer <NSObject>
@end

@protocol MTLCommandQueue <NSObject>
@property(readonly) id<MTLDevice> _Nonnull device;
@end

@protocol MTLEvent <NSObject>
@end

@protocol MTLSharedEvent <MTLEvent>
@end

@protocol MTLDevice <NSObject>
@property(nonnull, readonly) NSString* name;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily API_AVAILABLE(macos(10.15), ios(13.0));
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString* _Nonnull)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError* _Nullable* _Nullable)error;
- (nullable id<MTLLibrary>)newLibraryWithData:(dispatch_data_t _Nonnull)data
                                        error:(__autoreleasing NSError* _Nullable* _Nullable)error;
- (nullable id<MTLComputePipelineState>)
    newComputePipelineStateWithDescriptor:(MTLComputePipelineDescriptor* _Nonnull)descriptor
                                  options:(MTLPipelineOption)options
                               reflection:(MTLAutoreleasedComputePipelineReflection* _Nullable)reflection
                                    error:(__autoreleasing NSError* _Nullable* _Nullable)error
    API_AVAILABLE(macos(10.11), ios(9.0));
@end
