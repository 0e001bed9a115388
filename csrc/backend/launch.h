// The launch interface between the op layer (csrc/ops) and the backends:
// "run kernel K of library L with these buffers on this grid". The Metal
// backend (metal.mm) runs it on the GPU for MPS tensors. CPU tensors have no
// backend in the product: a test or a contributor registers one through the
// registration point below (BackendSlot), which the op layer then routes
// the CPU dispatch key's launches to, without knowing what it is.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

// Types that cross from the product's extension into a registered
// backend's (another shared object): exported, so that an exception thrown
// there is caught here by type and a vtable is the same on both sides.
#define MPS_EXT_API __attribute__((visibility("default")))

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
// run the least threads its launch needs. Never reaches the user: route()
// (dispatch/registry.h) sends the call to the stock kernel, remembers the failure
// (remember_unavailable: the kernel's, or its whole library's when
// `whole_library`) so that later launches of it fail at once, and warns once
// naming `cause`. Other kernels, of the same family too, keep running.
struct MPS_EXT_API BackendUnavailable : std::runtime_error {
  BackendUnavailable(std::string library_, std::string kernel_, std::string cause_, bool whole_library_ = false)
      : std::runtime_error(cause_),
        library(std::move(library_)),
        kernel(std::move(kernel_)),
        cause(std::move(cause_)),
        whole_library(whole_library_) {}
  std::string library, kernel, cause;
  bool whole_library;  // the library failed to compile: none of its kernels can run
};

// What a backend reports of a kernel's pipeline once it is built.
struct PipelineInfo {
  uint64_t max_threads_per_threadgroup;
};

// The failure of a kernel whose pipeline allows `limit` threads per
// threadgroup where its launch needs `needs` (at least, for a launch that
// adapts to the limit).
inline BackendUnavailable too_few_threads(const std::string& library, const std::string& kernel, uint64_t limit,
                                          const std::string& needs) {
  return BackendUnavailable(library, kernel,
                            "the pipeline of kernel " + kernel + " runs at most " + std::to_string(limit) +
                                " threads per threadgroup on this GPU; it needs " + needs);
}

// The GPU a launch runs on, as far as the op layer's launch geometry needs
// it (dispatch/kernel_choice.h). The Metal backend reads its GPU's once per
// process; a CPU backend reports the GPU it stands for (CpuBackend::profile).
struct DeviceProfile {
  int64_t cores;   // GPU cores
  int64_t family;  // Apple GPU family (MTLGPUFamilyApple<N>): 7 (M1), 8 (M2), 9 (M3, M4); 0 if unknown
};
// An M3 Ultra: the most cores of any Mac, and the geometry every decode
// kernel had before it took a profile. What the Metal backend assumes when
// it cannot read its GPU's core count.
constexpr DeviceProfile kLargestMacProfile{80, 9};
// The profile of the GPU that runs launches on `device` (MPS: the Mac's;
// CPU: the registered CPU backend's, kLargestMacProfile without one).
DeviceProfile device_profile(const c10::Device& device);
DeviceProfile metal_profile();  // macOS only (metal.mm)

// A backend of the CPU dispatch key's launches, registered at run time
// (BackendSlot::register_cpu_backend). It builds a kernel's pipeline once
// (pipeline(), which throws BackendUnavailable if it cannot) and encodes
// launches of it (encode(), which runs them to completion).
class MPS_EXT_API CpuBackend {
 public:
  virtual ~CpuBackend() = default;
  // Whether the backend takes this thread's calls now. route() sends a call
  // it does not take to torch's kernel (because::cpu_backend_not_asked).
  virtual bool accepts() const = 0;
  virtual PipelineInfo pipeline(const std::string& library, const std::string& kernel) = 0;
  virtual void encode(const Launch& launch) = 0;
  virtual DeviceProfile profile() const = 0;
};
// The registered CPU backend, or nullptr (the product as shipped).
CpuBackend* cpu_backend();

// Runs the launch on the device its tensors live on (all must agree).
// Throws BackendUnavailable as described above.
void launch(const Launch& launch);

// The pipeline of `kernel` of `library` on `device`, built once by the
// device's backend: what the op layer sizes a launch from before it makes
// one (dispatch/kernel_choice.h, thread_budget). Throws BackendUnavailable if the
// kernel cannot run there: a failure remembered for the device's type
// (without asking the backend again), or the backend's own.
PipelineInfo pipeline(const c10::Device& device, const std::string& library, const std::string& kernel);

// Remembers that the kernel of `e` (its whole library if e.whole_library)
// cannot run on devices of type `device` in this process: pipeline() and
// launch() throw `e` again for it from now on. route() calls this for each
// BackendUnavailable it catches; a failure does not heal.
void remember_unavailable(c10::DeviceType device, const BackendUnavailable& e);
// Test hook: forgets every remembered failure.
void forget_unavailable();

// Commits the command buffer of the stream `device`'s launches are encoded
// on, so that the GPU starts the work encoded so far while the host encodes
// the rest (torch.ops.mps_ext.commit, mps_ext/stream.py). MPS: the current
// MPS stream's (metal_commit); CPU: nothing, as a CPU backend runs each
// launch to completion when it is encoded. Other devices are refused.
void commit(const c10::Device& device);

// The Metal backend (metal.mm, macOS only).
PipelineInfo metal_pipeline(const std::string& library, const std::string& kernel);
void metal_encode(const Launch& launch);
void metal_commit();

// A shader library compiled from `source` under `name` (not a built-in
// one's), which launch() then runs like the built-in libraries: on a Mac
// with the same compile options (metal.mm), so that kernels can be checked
// against Metal as mps_ext ships it. Reached through BackendSlot only.
void register_shader_source(const std::string& name, const std::string& source);

// The registration point: what mps_ext._C._backend_slot() hands out, as a
// PyCapsule named kBackendSlotName holding a `const BackendSlot*`. A CPU
// backend is another extension compiled against these headers; it checks
// `version` and `size` before it calls anything (a product and a backend
// built from different checkouts refuse each other).
struct BackendSlot {
  uint32_t version;  // kBackendSlotVersion
  uint32_t size;     // sizeof(BackendSlot)
  // Makes `backend` (nullptr: none) serve the CPU key's launches. The
  // backend must outlive the process's last launch (register a static).
  void (*register_cpu_backend)(CpuBackend* backend);
  // The flattened text of built-in or registered shader library `name`;
  // throws (c10::Error) if there is none.
  const char* (*shader_source)(const std::string& name);
  void (*register_shader_source)(const std::string& name, const std::string& source);
  // launch() as the op layer calls it (route's BackendUnavailable aside).
  void (*launch)(const Launch& launch);
  // The text the Metal backend compiles for `kernel` of built-in library
  // `name` alone (backend/shaders.h); empty when the library has no variant
  // table.
  std::string (*variant_source)(const std::string& name, const std::string& kernel);
};
constexpr uint32_t kBackendSlotVersion = 2;
constexpr const char* kBackendSlotName = "mps_ext.backend_slot";
const BackendSlot& backend_slot();

}  // namespace mps_ext
