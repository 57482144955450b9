// The only Objective-C++ of torch_marlin: pipeline cache and command encoding
// of a metal::Plan (whose buffers run_plan.cpp resolved) onto PyTorch's current MPS stream, the way PyTorch's own
// MPS ops encode (aten/src/ATen/native/mps): getCurrentMPSStream(),
// a synchronous dispatch on its serial queue, its commandEncoder(),
// buffers bound with the tensors' storage offsets. No commit or wait here:
// the stream commits when PyTorch synchronizes. Decisions (supported Macs,
// threadgroup sizes) are C++ in csrc/core/metal_plan.cpp; this file only
// reads what Metal reports and encodes.
#include <ATen/mps/MPSStream.h>

#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>

#include "mps/metal_encode.h"
// Generated at build time by csrc/mps/embed_metal.py from metal/*.metal:
// kMarlinMetalSources (headers inlined) and, when the Xcode toolchain was
// available, the precompiled kMarlinMetallib.
#if __has_include("torch_marlin_metal_sources.h")
#include "torch_marlin_metal_sources.h"
#else
#error "torch_marlin_metal_sources.h missing: run python3 csrc/mps/embed_metal.py <dir> and add <dir> to the include path (setup.py does on macOS)"
#endif

namespace marlin {
namespace mps {
namespace {

id<MTLBuffer> buffer_of(const at::Tensor& t) {
  // Same as at::native::mps::getMTLBufferStorage: an MPS storage's data
  // pointer is its id<MTLBuffer>.
  return (__bridge id<MTLBuffer>)(t.storage().data());
}

std::string describe(NSError* error) {
  return error ? std::string([[error localizedDescription] UTF8String]) : std::string("unknown error");
}

// at::mps::dispatch_sync_with_rethrow exists only from torch 2.10 (the package
// admits 2.6): dispatch_sync, with a C++ exception thrown in the block
// rethrown on the calling thread instead of terminating the process.
void dispatch_sync_with_rethrow(dispatch_queue_t queue, void (^block)()) {
  __block std::exception_ptr error;
  dispatch_sync(queue, ^() {
    try {
      block();
    } catch (...) {
      error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

// The floor check at first use (metal::metal_support_problem decides).
void check_metal_support(id<MTLDevice> device) {
  static const std::string problem = [device] {
    const NSOperatingSystemVersion v = [[NSProcessInfo processInfo] operatingSystemVersion];
    return metal::metal_support_problem(v.majorVersion, v.minorVersion, [device supportsFamily:MTLGPUFamilyApple7]);
  }();
  TORCH_CHECK(problem.empty(), problem);
}

// Safe math, as the kernels and the tests assume: Metal compiles with fast
// math unless told otherwise, which may reassociate `(raw - 1024) - zero`
// (uint4) and flush the half subnormal that the fp4 decode makes of +-0.5.
// mathMode (macOS 15) replaces fastMathEnabled, which is deprecated from 15.
// mathMode exists only in the macOS 15 SDK and newer: @available is a run-time
// check, so building with an older SDK (Xcode 15, the macOS 14 Command Line
// Tools; fine for the macOS 14 floor) needs this compile-time guard too.
MTLCompileOptions* compile_options() {
  MTLCompileOptions* options = [MTLCompileOptions new];
  options.languageVersion = MTLLanguageVersion3_1;  // bfloat
#if defined(__MAC_15_0) && __MAC_OS_X_VERSION_MAX_ALLOWED >= __MAC_15_0
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    return options;
  }
#endif
  options.fastMathEnabled = NO;
  return options;
}

class PipelineCache {
 public:
  static PipelineCache& get() {
    static PipelineCache cache;
    return cache;
  }

  id<MTLComputePipelineState> pipeline(id<MTLDevice> device, const metal::Launch& launch) {
    std::string key = launch.kernel;
    for (const metal::Constant& c : launch.constants) key += "|" + std::to_string(c.index) + "=" + std::to_string(c.value);
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pipelines_.find(key);
    if (it != pipelines_.end()) return it->second;

    id<MTLLibrary> library = library_for(device, launch.source);
    id<MTLComputePipelineState> state = nil;
    std::string problem;
    // The caller (a Python thread) has no autorelease pool: drain what the
    // compile autoreleases (errors, strings) here, and throw after the pool.
    @autoreleasepool {
      MTLFunctionConstantValues* constants = [MTLFunctionConstantValues new];
      for (const metal::Constant& c : launch.constants) {
        const bool flag = c.value != 0;
        const uint32_t value = c.value;
        if (c.is_bool)
          [constants setConstantValue:&flag type:MTLDataTypeBool atIndex:(NSUInteger)c.index];
        else
          [constants setConstantValue:&value type:MTLDataTypeUInt atIndex:(NSUInteger)c.index];
      }
      NSError* error = nil;
      id<MTLFunction> function = [library newFunctionWithName:[NSString stringWithUTF8String:launch.kernel.c_str()]
                                               constantValues:constants
                                                        error:&error];
      if (!function) {
        problem = "torch_marlin: Metal function " + launch.kernel + " not found: " + describe(error);
      } else {
        MTLComputePipelineDescriptor* descriptor = [MTLComputePipelineDescriptor new];
        descriptor.label = [NSString stringWithUTF8String:key.c_str()];  // kernel|constants, for the profiler
        descriptor.computeFunction = function;
        state = [device newComputePipelineStateWithDescriptor:descriptor
                                                      options:MTLPipelineOptionNone
                                                   reflection:nil
                                                        error:&error];
        if (!state) problem = "torch_marlin: cannot build the pipeline of " + launch.kernel + ": " + describe(error);
      }
    }
    TORCH_CHECK(problem.empty(), problem);
    metal::check_simd_width(launch.kernel, int64_t([state threadExecutionWidth]));
    pipelines_.emplace(key, state);
    return state;
  }

 private:
  // One library for everything when a metallib was embedded and this Mac
  // loads it, else one compiled from source per metal/<source>.metal at
  // first use.
  id<MTLLibrary> library_for(id<MTLDevice> device, const std::string& source) {
    if (kMarlinMetallibSize > 0 && !metallib_failed_) {
      if (!metallib_) {
        std::string problem;
        @autoreleasepool {  // see pipeline()
          dispatch_data_t data = dispatch_data_create(kMarlinMetallib, kMarlinMetallibSize, nullptr,
                                                      DISPATCH_DATA_DESTRUCTOR_DEFAULT);
          NSError* error = nil;
          metallib_ = [device newLibraryWithData:data error:&error];
          if (!metallib_) problem = describe(error);
        }
        if (!metallib_) {
          metallib_failed_ = true;
          TORCH_WARN("torch_marlin: the embedded metallib does not load here (", problem,
                     "); compiling the Metal sources instead");
        }
      }
      if (metallib_) return metallib_;
    }
    auto it = libraries_.find(source);
    if (it != libraries_.end()) return it->second;
    const char* text = nullptr;
    for (const auto& s : kMarlinMetalSources)
      if (source == s.name) text = s.text;
    TORCH_CHECK(text, "torch_marlin: no embedded Metal source '", source, "'");
    id<MTLLibrary> library = nil;
    std::string problem;
    @autoreleasepool {  // see pipeline()
      NSError* error = nil;
      library = [device newLibraryWithSource:[NSString stringWithUTF8String:text]
                                     options:compile_options()
                                       error:&error];
      if (!library) problem = describe(error);
    }
    TORCH_CHECK(library, "torch_marlin: compiling metal/", source, ".metal failed: ", problem);
    libraries_.emplace(source, library);
    return library;
  }

  std::mutex mutex_;
  id<MTLLibrary> metallib_ = nil;
  bool metallib_failed_ = false;
  std::unordered_map<std::string, id<MTLLibrary>> libraries_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

}  // namespace

void encode_plan(const metal::Plan& plan, const LaunchBuffers& buffers) {
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  id<MTLDevice> device = stream->device();
  check_metal_support(device);
  // Pipelines first (may compile), outside the stream's queue; each launch
  // sized to what its pipeline allows.
  std::vector<id<MTLComputePipelineState>> states;
  std::vector<std::array<int64_t, 3>> threadgroups;
  for (const metal::Launch& l : plan.launches) {
    states.push_back(PipelineCache::get().pipeline(device, l));
    threadgroups.push_back(metal::fit_threadgroup(l, int64_t([states.back() maxTotalThreadsPerThreadgroup])));
  }

  const metal::Plan* p = &plan;
  const LaunchBuffers* t = &buffers;
  const std::vector<id<MTLComputePipelineState>>* s = &states;
  const std::vector<std::array<int64_t, 3>>* tg = &threadgroups;
  dispatch_sync_with_rethrow(stream->queue(), ^() {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      for (size_t i = 0; i < p->launches.size(); ++i) {
        const metal::Launch& l = p->launches[i];
        // Each dispatch in a debug group named after its kernel (Xcode's Metal
        // debugger and profiler); torch's encoder is shared, so not its label.
        [encoder pushDebugGroup:[NSString stringWithUTF8String:l.kernel.c_str()]];
        [encoder setComputePipelineState:(*s)[i]];
        for (size_t j = 0; j < l.bindings.size(); ++j) {
          const metal::Binding& b = l.bindings[j];
          if (b.source == metal::Source::kScalar) {
            const uint32_t value = b.value;
            [encoder setBytes:&value length:sizeof(value) atIndex:(NSUInteger)b.index];
          } else {
            const at::Tensor& x = (*t)[i][j];
            [encoder setBuffer:buffer_of(x)
                        offset:(NSUInteger)(x.storage_offset() * x.element_size())
                       atIndex:(NSUInteger)b.index];
          }
        }
        if (l.threadgroup_memory > 0)
          [encoder setThreadgroupMemoryLength:(NSUInteger)l.threadgroup_memory atIndex:0];
        const std::array<int64_t, 3>& threads = (*tg)[i];
        [encoder dispatchThreadgroups:MTLSizeMake(l.grid[0], l.grid[1], l.grid[2])
                threadsPerThreadgroup:MTLSizeMake(threads[0], threads[1], threads[2])];
        [encoder popDebugGroup];
      }
    }
  });
}

}  // namespace mps
}  // namespace marlin
