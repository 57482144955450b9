// Stub of <Metal/Metal.h>: see ../README.md. Declarations as in Apple's
// MTLDevice.h, MTLLibrary.h, MTLComputePipeline.h, MTLComputeCommandEncoder.h,
// MTLCommandQueue.h, MTLArgument.h (MTLDataType), MTLTypes.h (MTLSize), with
// their availability attributes (macOS 15 SDK) where one matters above the
// package's macOS floor.
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
    MTLLanguageVersion3_2 API_AVAILABLE(macos(15.0), ios(18.0)) = (3 << 16) + 2,
} API_AVAILABLE(macos(10.11), ios(9.0));

typedef NS_ENUM(NSInteger, MTLMathMode){
    MTLMathModeSafe = 0,
    MTLMathModeRelaxed = 1,
    MTLMathModeFast = 2,
};

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
@property(readwrite, nonatomic) BOOL fastMathEnabled
    API_DEPRECATED("Use mathMode instead", macos(10.11, 15.0), ios(8.0, 18.0));
@property(readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0), ios(18.0));
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

@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
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
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction> _Nonnull)computeFunction
                                                                      error:(__autoreleasing NSError* _Nullable* _Nullable)error;
@end
