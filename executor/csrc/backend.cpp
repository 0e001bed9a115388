// The CPU Metal executor as mps_ext's CPU backend (backend/launch.h,
// CpuBackend): runs a Launch on CPU tensors by compiling the product's
// shader text (BackendSlot::shader_source) with mps_ext_executor._compiler
// (once per library and process, cached on disk) and dispatching it on the
// executor engine. install() registers it through the product's slot.
//
// It also holds the test hooks that make it behave as a Mac would: a Metal
// backend present, where CPU calls reach the executor only when asked for
// (request()); and the ways the Metal backend can fail (a library or
// pipeline that does not build, a pipeline that allows fewer threads than
// the kernel declares), so that what launch.cpp, the op layer's launch
// geometry and dispatch/registry.h decide then runs in CI.
#include "backend.h"

#include <pybind11/pybind11.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "engine.h"

namespace py = pybind11;

namespace mps_ext {
namespace {

std::atomic<const BackendSlot*> g_slot{nullptr};

std::mutex g_mutex;
std::map<std::string, std::shared_ptr<cpu_metal::Library>>& cache() {
  static auto* c = new std::map<std::string, std::shared_ptr<cpu_metal::Library>>();
  return *c;
}

// The library `kernel` of kernels_metal/<name>.metal runs from: the whole
// library in the mode the process started in, the kernel's variant (the
// text the Metal backend compiles for it alone) in another
// (_compiler.op_layer_library); kept under the name or under name:kernel.
std::shared_ptr<cpu_metal::Library> library(const std::string& name, const std::string& kernel) {
  const std::string one_kernel = name + ":" + kernel;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const std::string& key : {name, one_kernel}) {
      auto it = cache().find(key);
      if (it != cache().end()) return it->second;
    }
  }
  // Built without holding g_mutex: the build runs Python, which releases the
  // GIL while the compiler runs, and a thread waiting for g_mutex while it
  // held the GIL would then deadlock the process. Two threads may both build
  // on a first call; the build is cached on disk and safe to run at once.
  std::string path;
  bool whole = true;
  {
    py::gil_scoped_acquire gil;
    try {
      py::tuple built =
          py::module_::import("mps_ext_executor._compiler")
              .attr("op_layer_library")(name, slot().shader_source(name), slot().variant_source(name, kernel));
      path = py::str(built[0]);
      whole = built[1].cast<bool>();
    } catch (py::error_already_set& e) {
      TORCH_CHECK(false, "mps_ext: the CPU Metal executor could not build ", name, ".metal: ", e.what());
    }
  }
  auto lib = cpu_metal::Library::load(path);
  std::lock_guard<std::mutex> lock(g_mutex);
  auto& kept = cache()[whole ? name : one_kernel];
  if (!kept) kept = lib;
  return kept;
}

struct Simulated {
  std::string library, kernel;
  SimulatedFailure kind = SimulatedFailure::kNone;
  uint64_t max_threads = 0;
  uint64_t hits = 0;
};
std::mutex g_sim_mutex;
Simulated g_sim;

}  // namespace

void simulate_executor_failure(const std::string& library, const std::string& kernel, SimulatedFailure kind,
                               uint64_t max_threads) {
  std::lock_guard<std::mutex> lock(g_sim_mutex);
  g_sim = Simulated{library, kernel, kind, max_threads, 0};
}

void forget_executor_libraries() {
  // A dispatch running now keeps its library alive (shared_ptr).
  std::lock_guard<std::mutex> lock(g_mutex);
  cache().clear();
}

uint64_t simulated_failure_hits() {
  std::lock_guard<std::mutex> lock(g_sim_mutex);
  return g_sim.hits;
}

namespace {
std::atomic<int64_t> g_profile_cores{kLargestMacProfile.cores};
std::atomic<int64_t> g_profile_family{kLargestMacProfile.family};
}  // namespace

void set_executor_profile(const DeviceProfile& profile) {
  TORCH_CHECK(profile.cores >= 1, "mps_ext: a GPU profile needs at least 1 core, got ", profile.cores);
  TORCH_CHECK(profile.family >= 0, "mps_ext: a GPU family is 0 (unknown) or an Apple GPU family number, got ",
              profile.family);
  g_profile_cores = profile.cores;
  g_profile_family = profile.family;
}

DeviceProfile executor_profile() { return DeviceProfile{g_profile_cores.load(), g_profile_family.load()}; }

PipelineInfo executor_pipeline(const std::string& library_name, const std::string& kernel) {
  {
    std::lock_guard<std::mutex> lock(g_sim_mutex);
    const bool this_library = g_sim.kind != SimulatedFailure::kNone && g_sim.library == library_name;
    if (this_library && g_sim.kind == SimulatedFailure::kLibrary) {
      ++g_sim.hits;
      throw BackendUnavailable(library_name, kernel, library_name + ".metal failed to compile (simulated)", true);
    }
    if (this_library && g_sim.kernel == kernel) {
      ++g_sim.hits;
      if (g_sim.kind == SimulatedFailure::kPipeline)
        throw BackendUnavailable(library_name, kernel, "cannot build the pipeline of " + kernel + " (simulated)");
      return PipelineInfo{g_sim.max_threads};
    }
  }
  library(library_name, kernel);
  // The executor runs any threadgroup size Metal allows; it checks the
  // dispatch itself (DispatchError).
  return PipelineInfo{UINT64_MAX};
}

void executor_encode(const Launch& l) {
  auto lib = library(l.library, l.kernel);
  cpu_metal::Dispatch d;
  for (const auto& a : l.args) {
    if (a.tensor.defined()) {
      const at::Tensor& t = a.tensor;
      const auto& storage = t.storage();
      uint64_t offset = static_cast<uint64_t>(t.storage_offset()) * t.itemsize();
      uint64_t size = storage.nbytes() > offset ? storage.nbytes() - offset : 0;
      char* base = static_cast<char*>(const_cast<void*>(storage.data()));
      d.buffers.push_back(cpu_metal::Binding::memory(base ? base + offset : nullptr, size, offset));
    } else {
      d.buffers.push_back(cpu_metal::Binding::constant_bytes(a.bytes.data(), a.bytes.size()));
    }
  }
  d.threadgroups = l.threadgroups;
  d.threads_per_threadgroup = l.threads_per_threadgroup;
  d.threadgroup_memory.assign(l.threadgroup_memory.begin(), l.threadgroup_memory.end());
  if (PyGILState_Check()) {  // let Python threads run while the CPU works
    py::gil_scoped_release nogil;
    lib->dispatch(l.kernel, d);
  } else {
    lib->dispatch(l.kernel, d);
  }
}

const BackendSlot& slot() {
  const BackendSlot* s = g_slot.load(std::memory_order_acquire);
  TORCH_CHECK(s, "mps_ext_executor: not installed (mps_ext_executor.install() registers it with mps_ext)");
  return *s;
}

// ------------------------------------------------------ requests, a Mac --
namespace {
// request() (mps_ext_executor/__init__.py) of this thread, nested as a count.
thread_local int t_requests = 0;
std::atomic<int> g_metal_simulated{-1};

struct ExecutorBackend final : CpuBackend {
  bool accepts() const override { return !metal_backend_present() || executor_requested(); }
  PipelineInfo pipeline(const std::string& library, const std::string& kernel) override {
    return executor_pipeline(library, kernel);
  }
  void encode(const Launch& l) override { executor_encode(l); }
  DeviceProfile profile() const override { return executor_profile(); }
};
}  // namespace

void set_executor_requested(bool requested) {
  t_requests += requested ? 1 : -1;
  if (t_requests < 0) t_requests = 0;
}
bool executor_requested() { return t_requests > 0; }

bool metal_backend_present() {
  const int simulated = g_metal_simulated.load(std::memory_order_relaxed);
#ifdef __APPLE__
  return simulated != 0;
#else
  return simulated == 1;
#endif
}
void set_metal_backend_present(int present) { g_metal_simulated = present < 0 ? -1 : present > 0; }

void install(const BackendSlot* s) {
  TORCH_CHECK(s->version == kBackendSlotVersion && s->size == sizeof(BackendSlot),
              "mps_ext_executor: mps_ext's backend slot is version ", s->version, " (", s->size,
              " bytes); this executor was built for version ", kBackendSlotVersion, " (", sizeof(BackendSlot),
              " bytes): build both from the same checkout");
  static ExecutorBackend backend;  // never destroyed before the product's last launch
  g_slot.store(s, std::memory_order_release);
  s->register_cpu_backend(&backend);
}

}  // namespace mps_ext
