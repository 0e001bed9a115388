// The launch interface between the op layer (csrc/ops) and the backends:
// "run kernel K of library L with these buffers on this grid". The Metal
// backend (metal.mm) runs it on the GPU for MPS tensors; the CPU Metal
// executor backend (executor.cpp) runs the same kernel on CPU tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace mps_ext {

// One [[buffer(i)]]: a tensor, bound from its storage offset (as a Metal
// buffer with an offset), or constant bytes (setBytes).
struct KernelArg {
  at::Tensor tensor;
  std::vector<uint8_t> bytes;

  static KernelArg of(const at::Tensor& t) { return KernelArg{t, {}}; }
  template <class T>
  static KernelArg value(const T& v) {
    KernelArg a;
    a.bytes.resize(sizeof(T));
    std::memcpy(a.bytes.data(), &v, sizeof(T));
    return a;
  }
};

struct Launch {
  std::string library;  // kernels_metal/<library>.metal
  std::string kernel;   // host name of the kernel
  std::vector<KernelArg> args;
  std::array<uint32_t, 3> threadgroups{1, 1, 1};
  std::array<uint32_t, 3> threads_per_threadgroup{1, 1, 1};
  std::vector<uint32_t> threadgroup_memory;  // bytes of [[threadgroup(i)]]
};

// Runs the launch on the device its tensors live on (all must agree).
void launch(const Launch& launch);

// Backends. metal_launch exists on macOS only (metal.mm).
void executor_launch(const Launch& launch);
void metal_launch(const Launch& launch);

}  // namespace mps_ext
