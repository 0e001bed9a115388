// What differs between the torch releases mps_ext supports (2.9 to 2.15) in
// the host API it uses, in one place. Checked against the headers of each
// release's macOS arm64 wheel; everything else mps_ext uses
// (c10::SafeKernelFunction, OperatorHandle::getComputedKernelForDispatchKey,
// c10::WarningHandler and WarningHandlerGuard, torch::CppFunction::
// makeFromBoxedFunction, at::mps::MPSStream) has the same declaration in all
// of them.
#pragma once

#include <ATen/core/boxing/KernelFunction.h>
#include <torch/version.h>

// kernel_function: the KernelFunction a c10::SafeKernelFunction (a captured
// stock kernel) wraps, whose typed call() is unboxed (PassThrough in
// dispatch/registry.h). torch 2.14 and later expose it (kernelFunction()); 2.9 to
// 2.13 hold it in the same private member, kernel_, which an explicit
// instantiation may name (access checks do not apply to the names in one:
// [temp.spec.general]); the 2.9-2.13 headers of tools/torch_matrix.py all
// declare it `KernelFunction kernel_`.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 14
namespace mps_ext::compat {
struct SafeKernelFunctionKernel {
  using type = c10::KernelFunction c10::SafeKernelFunction::*;
  friend type member(SafeKernelFunctionKernel);
};
template <class Tag, typename Tag::type M>
struct Expose {
  friend typename Tag::type member(Tag) { return M; }
};
template struct Expose<SafeKernelFunctionKernel, &c10::SafeKernelFunction::kernel_>;
inline const c10::KernelFunction& kernel_function(const c10::SafeKernelFunction& k) {
  return k.*member(SafeKernelFunctionKernel());
}
}  // namespace mps_ext::compat
#else
namespace mps_ext::compat {
inline const c10::KernelFunction& kernel_function(const c10::SafeKernelFunction& k) { return k.kernelFunction(); }
}  // namespace mps_ext::compat
#endif

#if defined(__OBJC__)
#include <dispatch/dispatch.h>

#include <ATen/mps/MPSStream.h>

// dispatch_sync_with_rethrow: runs a block on a queue and rethrows a C++
// exception it raised. torch 2.10 and later declare it in ATen/mps/MPSStream.h
// (at::mps); 2.9 declares it in ATen/native/mps/OperationUtils.h
// (at::native::mps), a header that pulls in MPSGraph, so it is declared
// here with 2.9's exact signature instead (libtorch_cpu exports it).
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 10
namespace at::native::mps {
void dispatch_sync_with_rethrow(dispatch_queue_t queue, void (^block)());
}
namespace mps_ext::compat {
using at::native::mps::dispatch_sync_with_rethrow;
}
#else
namespace mps_ext::compat {
using at::mps::dispatch_sync_with_rethrow;
}
#endif
#endif  // __OBJC__
