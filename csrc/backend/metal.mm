// The Metal backend (macOS): runs a Launch on MPS tensors, on PyTorch's own
// MPS stream. Kept thin on purpose: everything decided per call lives in the
// op layer and launch.cpp, which CI runs through the CPU Metal executor; this
// file is only compile-checked on Linux (tests/test_mac_host_code.py).
//
// - The embedded shader source is compiled at run time (newLibraryWithSource:
//   no Xcode needed on the user's Mac), one kernel variant at a time: the
//   library's code with only that kernel's explicit instantiation
//   (variant_source, backend/shaders.h), since Metal compiles a template only
//   where it is instantiated and a first call should not pay for the ~60
//   variants of `linear` it does not use. Libraries registered at run time
//   have no variant table and compile whole. Each library and pipeline state
//   is cached by kernel name. Nothing depends on shapes. Across processes,
//   Metal's own shader cache is relied on (docs/dev/first_call.md).
// - A library or pipeline that does not build is reported as
//   BackendUnavailable (saying which: the library or one kernel), never as
//   an error: launch.cpp and route() decide what happens (the stock kernel
//   for the calls that need it, one warning). A failed build is remembered,
//   so it is not retried. The pipeline's maxTotalThreadsPerThreadgroup is
//   reported as it is; the op layer sizes its launches from it.
// - Encoding shares PyTorch's compute encoder on the current MPS stream,
//   inside dispatch_sync on the stream's queue, and never commits or waits:
//   PyTorch commits when it needs the results. The one exception is asked
//   for: metal_commit (torch.ops.mps_ext.commit, mps_ext/stream.py).
// - Every build and every encode runs in an @autoreleasepool, as PyTorch's
//   own do: the Objective-C objects they create are released there.
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>
#include <c10/util/Exception.h>

#include <map>
#include <mutex>
#include <string>

#include "backend/launch.h"
#include "backend/shaders.h"
#include "backend/torch_compat.h"

namespace mps_ext {
namespace {

std::string describe(NSError* error) {
  return error ? std::string(error.localizedDescription.UTF8String) : std::string("no error description");
}

std::mutex g_mutex;
// Per "library/kernel" variant (or per library, for one compiled whole): the
// compiled library, or why it did not compile.
std::map<std::string, id<MTLLibrary>> g_libraries;
std::map<std::string, std::string> g_library_errors;
// Per "library/kernel": the pipeline, or why it did not build.
std::map<std::string, id<MTLComputePipelineState>> g_pipelines;
std::map<std::string, std::string> g_pipeline_errors;

// Safe math (docs/dev/contributing.md, "Math mode"): IEEE inf and NaN, as torch's
// CPU results have them, correctly rounded division, precise functions, no
// reassociation; a*b + c within one statement may still become one fma,
// which the CPU executor does too. macOS 15 sets it through mathMode, which
// replaces the deprecated fastMathEnabled; macOS 14 has only the latter
// (NO is Safe with precise functions there). The SDK decides whether the
// new API can be named at all.
void set_safe_math(MTLCompileOptions* options) {
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
    return;
  }
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"  // macOS 15's SDK deprecates it; 14 has nothing else
  options.fastMathEnabled = NO;
#pragma clang diagnostic pop
}

// The library that defines `kernel` (its variant's source, or the whole
// library's when it has no variant table), or nil with `error` set;
// `whole` says which. Called with g_mutex held.
id<MTLLibrary> library(id<MTLDevice> device, const std::string& name, const std::string& kernel, bool& whole,
                       std::string& error) {
  std::string source = variant_source(name, kernel);
  whole = source.empty();
  const std::string key = whole ? name : name + "/" + kernel;
  auto found = g_libraries.find(key);
  if (found != g_libraries.end()) return found->second;
  auto failed = g_library_errors.find(key);
  if (failed == g_library_errors.end()) {
    @autoreleasepool {
      MTLCompileOptions* options = [MTLCompileOptions new];
      options.languageVersion = MTLLanguageVersion3_1;  // bfloat; macOS 14 and later
      set_safe_math(options);
      NSError* ns_error = nil;
      NSString* text = [NSString stringWithUTF8String:whole ? shader_source(name) : source.c_str()];
      id<MTLLibrary> lib = [device newLibraryWithSource:text options:options error:&ns_error];
      if (lib != nil) {
        g_libraries[key] = lib;
        return lib;
      }
      g_library_errors[key] = name + ".metal" + (whole ? "" : " (the variant " + kernel + ")") +
                              " failed to compile: " + describe(ns_error);
    }
    failed = g_library_errors.find(key);
  }
  error = failed->second;
  return nil;
}

}  // namespace

PipelineInfo metal_pipeline(const std::string& library_name, const std::string& kernel) {
  std::string error;
  // The whole library did not compile: none of its kernels can run. A
  // variant that does not compile is that kernel's failure alone.
  bool whole_library = false;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const std::string key = library_name + "/" + kernel;
    auto found = g_pipelines.find(key);
    if (found != g_pipelines.end()) return PipelineInfo{found->second.maxTotalThreadsPerThreadgroup};
    auto failed = g_pipeline_errors.find(key);
    if (failed != g_pipeline_errors.end()) {
      error = failed->second;
    } else {
      id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
      bool whole = false;
      id<MTLLibrary> lib = library(device, library_name, kernel, whole, error);
      whole_library = lib == nil && whole;
      if (lib != nil) {
        @autoreleasepool {
          id<MTLFunction> function = [lib newFunctionWithName:[NSString stringWithUTF8String:kernel.c_str()]];
          if (function == nil) {
            error = library_name + ".metal has no kernel " + kernel;
          } else {
            NSError* ns_error = nil;
            id<MTLComputePipelineState> state = [device newComputePipelineStateWithFunction:function error:&ns_error];
            if (state != nil) {
              g_pipelines[key] = state;
              return PipelineInfo{state.maxTotalThreadsPerThreadgroup};
            }
            error = "cannot build the pipeline of " + kernel + ": " + describe(ns_error);
          }
        }
        g_pipeline_errors[key] = error;
      }
    }
  }
  // Thrown outside the autorelease pools and the lock.
  throw BackendUnavailable(library_name, kernel, error, whole_library);
}

// Read once: the core count through torch's MPSDevice::getCoreCount (the
// IORegistry's "gpu-core-count" of the AGXAccelerator service, which Metal's
// API does not expose; 0 when the registry has no such entry, as in a
// virtual machine), the family through supportsFamily. Unknown core counts
// take the default profile's: geometry for more cores than a GPU has costs
// a few more threadgroups, for fewer it would leave cores idle.
DeviceProfile metal_profile() {
  static const DeviceProfile profile = [] {
    DeviceProfile p{0, 0};
    at::mps::MPSDevice* mps = at::mps::MPSDevice::getInstance();
    try {
      p.cores = static_cast<int64_t>(mps->getCoreCount());
    } catch (const c10::Error&) {
      p.cores = 0;  // the registry lookup failed
    }
    if (p.cores <= 0) p.cores = kLargestMacProfile.cores;
    @autoreleasepool {
      id<MTLDevice> device = mps->device();
      const MTLGPUFamily families[] = {MTLGPUFamilyApple9, MTLGPUFamilyApple8, MTLGPUFamilyApple7};
      for (MTLGPUFamily f : families) {
        if ([device supportsFamily:f]) {
          p.family = static_cast<int64_t>(f) - static_cast<int64_t>(MTLGPUFamilyApple1) + 1;
          break;
        }
      }
    }
    return p;
  }();
  return profile;
}

void metal_encode(const Launch& l) {
  id<MTLComputePipelineState> state;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto found = g_pipelines.find(l.library + "/" + l.kernel);
    TORCH_CHECK(found != g_pipelines.end(), "mps_ext: no pipeline built for ", l.kernel);
    state = found->second;
  }
  const auto& t = l.threads_per_threadgroup;
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  compat::dispatch_sync_with_rethrow(stream->queue(), ^() {
    @autoreleasepool {
      id<MTLComputeCommandEncoder> encoder = stream->commandEncoder();
      [encoder setComputePipelineState:state];
      for (NSUInteger i = 0; i < l.args.size(); ++i) {
        const KernelArg& a = l.args[i];
        if (a.tensor.defined()) {
          // An MPS tensor's storage pointer is its MTLBuffer.
          id<MTLBuffer> buffer = (__bridge id<MTLBuffer>)const_cast<void*>(a.tensor.storage().data());
          [encoder setBuffer:buffer offset:NSUInteger(a.tensor.storage_offset()) * a.tensor.itemsize() atIndex:i];
        } else {
          [encoder setBytes:a.bytes.data() length:a.bytes.size() atIndex:i];
        }
      }
      for (NSUInteger i = 0; i < l.threadgroup_memory.size(); ++i)
        [encoder setThreadgroupMemoryLength:l.threadgroup_memory[i] atIndex:i];
      [encoder dispatchThreadgroups:MTLSizeMake(l.threadgroups[0], l.threadgroups[1], l.threadgroups[2])
              threadsPerThreadgroup:MTLSizeMake(t[0], t[1], t[2])];
    }
  });
}

// The stream's synchronize(SyncType::COMMIT) ends PyTorch's open compute
// encoder and commits the command buffer; with commitAndContinue enabled (the
// stream's default) the stream then encodes into a fresh one, otherwise it
// opens one at the next encode. It is the call torch's own
// MPSHooks::commitStream makes (declared the same in the headers of 2.9 to
// 2.15), run here on the stream's queue as every encode is. It does not wait.
void metal_commit() {
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  compat::dispatch_sync_with_rethrow(stream->queue(), ^() {
    @autoreleasepool {
      stream->synchronize(at::mps::SyncType::COMMIT);
    }
  });
}

}  // namespace mps_ext
