// The Metal backend (macOS): runs a Launch on MPS tensors, on PyTorch's own
// MPS stream. Kept thin on purpose: everything decided per call lives in the
// op layer, which CI runs through the CPU Metal executor; this file is only
// compile-checked on Linux (tests/test_mac_host_code.py).
//
// - The embedded shader source is compiled once per library at run time
//   (newLibraryWithSource: no Xcode needed on the user's Mac) and each
//   pipeline state is cached by kernel name. Nothing depends on shapes.
// - Encoding shares PyTorch's compute encoder on the current MPS stream,
//   inside dispatch_sync on the stream's queue, and never commits or waits:
//   PyTorch commits when it needs the results.
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

namespace mps_ext {
namespace {

id<MTLLibrary> compile_library(id<MTLDevice> device, const std::string& name) {
  MTLCompileOptions* options = [MTLCompileOptions new];
  options.languageVersion = MTLLanguageVersion3_1;  // bfloat; macOS 14 and later
  // IEEE semantics for inf and NaN, as torch's CPU results have them.
  options.fastMathEnabled = NO;
  NSError* error = nil;
  id<MTLLibrary> library = [device newLibraryWithSource:[NSString stringWithUTF8String:shader_source(name)]
                                                options:options
                                                  error:&error];
  TORCH_CHECK(library != nil, "mps_ext: compiling ", name, ".metal failed: ",
              error ? error.localizedDescription.UTF8String : "unknown error");
  return library;
}

id<MTLComputePipelineState> pipeline(const std::string& library_name, const std::string& kernel) {
  static std::mutex mutex;
  static std::map<std::string, id<MTLLibrary>> libraries;
  static std::map<std::string, id<MTLComputePipelineState>> pipelines;
  std::lock_guard<std::mutex> lock(mutex);
  const std::string key = library_name + "/" + kernel;
  auto found = pipelines.find(key);
  if (found != pipelines.end()) return found->second;

  id<MTLDevice> device = at::mps::MPSDevice::getInstance()->device();
  id<MTLLibrary> library = libraries[library_name];
  if (library == nil) {
    library = compile_library(device, library_name);
    libraries[library_name] = library;
  }
  id<MTLFunction> function = [library newFunctionWithName:[NSString stringWithUTF8String:kernel.c_str()]];
  TORCH_CHECK(function != nil, "mps_ext: ", library_name, ".metal has no kernel ", kernel);
  NSError* error = nil;
  id<MTLComputePipelineState> state = [device newComputePipelineStateWithFunction:function error:&error];
  TORCH_CHECK(state != nil, "mps_ext: cannot build the pipeline of ", kernel, ": ",
              error ? error.localizedDescription.UTF8String : "unknown error");
  pipelines[key] = state;
  return state;
}

}  // namespace

void metal_launch(const Launch& l) {
  id<MTLComputePipelineState> state = pipeline(l.library, l.kernel);
  const auto& t = l.threads_per_threadgroup;
  const NSUInteger threads = NSUInteger(t[0]) * t[1] * t[2];
  TORCH_CHECK(threads <= state.maxTotalThreadsPerThreadgroup, "mps_ext: kernel ", l.kernel, " runs at most ",
              state.maxTotalThreadsPerThreadgroup, " threads per threadgroup on this GPU, ", threads, " asked");
  at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
  at::mps::dispatch_sync_with_rethrow(stream->queue(), ^() {
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
  });
}

}  // namespace mps_ext
