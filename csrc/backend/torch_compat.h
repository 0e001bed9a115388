// What differs between the torch releases mps_ext supports (2.9 to 2.15) in
// the host API it uses, in one place. Checked against the headers of each
// release's macOS arm64 wheel; everything else mps_ext uses
// (c10::SafeKernelFunction, OperatorHandle::getComputedKernelForDispatchKey,
// c10::WarningHandler and WarningHandlerGuard, torch::CppFunction::
// makeFromBoxedFunction, at::mps::MPSStream) has the same declaration in all
// of them.
#pragma once

#include <torch/version.h>

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
