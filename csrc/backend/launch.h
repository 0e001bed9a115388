// The launch interface between the op layer (csrc/ops) and the backends:
// "run kernel K of library L with these buffers on this grid". The Metal
// backend (metal.mm) runs it on the GPU for MPS tensors; the CPU Metal
// executor backend (executor.cpp) runs the same kernel on CPU tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
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

// The kernel cannot run here, for a reason of the machine rather than of the
// inputs: its library or pipeline failed to build, or the pipeline cannot
// run the threads the launch asks. Never reaches the user: route()
// (ops/registry.h) sends the call to the stock kernel and turns the family
// off on that device, with one warning naming `cause`.
struct BackendUnavailable : std::runtime_error {
  BackendUnavailable(std::string library_, std::string kernel_, std::string cause_)
      : std::runtime_error(cause_), library(std::move(library_)), kernel(std::move(kernel_)),
        cause(std::move(cause_)) {}
  std::string library, kernel, cause;
};

// What a backend reports of a kernel's pipeline once it is built.
struct PipelineInfo {
  uint64_t max_threads_per_threadgroup;
};

// The GPU a launch runs on, as far as the op layer's launch geometry needs
// it (ops/kernel_choice.h). The Metal backend reads its GPU's once per
// process; the executor's stands for whichever Mac a test chooses (default:
// the largest, kExecutorDefaultProfile), so that CI runs the geometry of a
// small and of a large GPU.
struct DeviceProfile {
  int64_t cores;   // GPU cores
  int64_t family;  // Apple GPU family (MTLGPUFamilyApple<N>): 7 (M1), 8 (M2), 9 (M3, M4); 0 if unknown
};
// An M3 Ultra: the most cores of any Mac, and the geometry every decode
// kernel had before it took a profile.
constexpr DeviceProfile kExecutorDefaultProfile{80, 9};
// The profile of the GPU that runs launches on `device` (MPS: the Mac's;
// CPU: the executor's).
DeviceProfile device_profile(const c10::Device& device);
// Test hook: the GPU the executor stands for. Cores must be at least 1.
void set_executor_profile(const DeviceProfile& profile);
DeviceProfile executor_profile();
DeviceProfile metal_profile();  // macOS only (metal.mm)

// Runs the launch on the device its tensors live on (all must agree).
// Throws BackendUnavailable as described above.
void launch(const Launch& launch);

// Commits the command buffer of the stream `device`'s launches are encoded
// on, so that the GPU starts the work encoded so far while the host encodes
// the rest (torch.ops.mps_ext.commit, mps_ext/stream.py). MPS: the current
// MPS stream's (metal_commit); CPU: nothing, as the executor runs each launch
// to completion when it is encoded. Other devices are refused.
void commit(const c10::Device& device);

// Backends. Each builds a kernel's pipeline once (pipeline(), which throws
// BackendUnavailable if it cannot) and encodes launches of it (encode()).
// The metal_* functions exist on macOS only (metal.mm).
PipelineInfo executor_pipeline(const std::string& library, const std::string& kernel);
void executor_encode(const Launch& launch);
PipelineInfo metal_pipeline(const std::string& library, const std::string& kernel);
void metal_encode(const Launch& launch);
void metal_commit();

// Test hook: a shader library compiled from `source` under `name` (not a
// built-in one's), which launch() then runs like the built-in libraries: on
// a Mac with the same compile options (metal.mm), so that kernels can be
// checked against Metal as mps_ext ships it.
void register_shader_source(const std::string& name, const std::string& source);

// Test hook: the executor backend fails the way a Mac can (see
// executor.cpp), so that the fallback path runs in CI.
enum class SimulatedFailure { kNone, kLibrary, kPipeline, kMaxThreads };
void simulate_executor_failure(const std::string& library, const std::string& kernel, SimulatedFailure kind,
                               uint64_t max_threads);
// How often a simulated failure was hit since it was set.
uint64_t simulated_failure_hits();

}  // namespace mps_ext
