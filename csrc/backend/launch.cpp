#include "backend/launch.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "backend/shaders.h"

namespace mps_ext {

namespace {
// Libraries registered at run time (register_shader_source). Never erased,
// so the text a name points at stays put.
std::mutex g_sources_mutex;
std::map<std::string, std::string>& registered_sources() {
  static auto* m = new std::map<std::string, std::string>();
  return *m;
}
}  // namespace

const char* shader_source(const std::string& name) {
  for (int i = 0; i < kShaderSourceCount; ++i)
    if (name == kShaderSources[i].name) return kShaderSources[i].text;
  {
    std::lock_guard<std::mutex> lock(g_sources_mutex);
    auto it = registered_sources().find(name);
    if (it != registered_sources().end()) return it->second.c_str();
  }
  TORCH_CHECK(false, "mps_ext: no shader library named '", name, "' was built in or registered");
}

std::string variant_source(const std::string& name, const std::string& kernel) {
  const ShaderSource* library = nullptr;
  for (int i = 0; i < kShaderSourceCount; ++i)
    if (name == kShaderSources[i].name) library = &kShaderSources[i];
  if (library == nullptr) return {};
  const ShaderVariant* wanted = nullptr;
  for (int i = 0; i < library->variant_count; ++i)
    if (kernel == library->variants[i].kernel) wanted = &library->variants[i];
  if (wanted == nullptr) return {};
  std::string out(library->text);
  // Sites in decreasing order of position, so earlier offsets stay valid; a
  // site (one macro call) holds several variants and is edited once.
  int edited = static_cast<int>(out.size());
  for (int i = library->variant_count - 1; i >= 0; --i) {
    const ShaderVariant& v = library->variants[i];
    if (v.site_begin >= edited) continue;
    edited = v.site_begin;
    std::string kept = v.site_begin == wanted->site_begin ? wanted->statement : "";
    // The site's newlines stay, after the statement, so later lines keep their numbers.
    for (int c = v.site_begin; c < v.site_end; ++c)
      if (out[c] == '\n') kept += '\n';
    out.replace(v.site_begin, v.site_end - v.site_begin, kept);
  }
  return out;
}

void register_shader_source(const std::string& name, const std::string& source) {
  for (int i = 0; i < kShaderSourceCount; ++i)
    TORCH_CHECK(name != kShaderSources[i].name, "mps_ext: '", name,
                "' is a built-in shader library; register other source under another name");
  std::lock_guard<std::mutex> lock(g_sources_mutex);
  auto it = registered_sources().emplace(name, source).first;
  // Both backends compile a library once per name and keep it.
  TORCH_CHECK(it->second == source, "mps_ext: shader library '", name,
              "' is registered already with other source; use a new name");
}

namespace {

// Kernels that cannot run, per device type: a whole library under kernel
// "". Remembered so that a call after a failure goes to torch's kernel at
// the cost of a lookup, not of a build (Metal remembers its failed builds
// too, but not the pipelines whose thread limit is too low; the simulated
// failures of a test's CPU backend count every ask).
using KernelKey = std::tuple<c10::DeviceType, std::string, std::string>;
std::mutex g_unavailable_mutex;
std::atomic<bool> g_any_unavailable{false};  // the fast path: nothing failed
std::map<KernelKey, BackendUnavailable>& unavailable() {
  static auto* m = new std::map<KernelKey, BackendUnavailable>();
  return *m;
}

void rethrow_if_remembered(c10::DeviceType device, const std::string& library, const std::string& kernel) {
  if (!g_any_unavailable.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(g_unavailable_mutex);
  for (const std::string& k : {std::string(), kernel}) {
    auto it = unavailable().find(KernelKey{device, library, k});
    if (it != unavailable().end()) throw it->second;
  }
}

// Decided here rather than in a backend, so that CI runs it: a pipeline that
// cannot run the threads the op asks for is a machine limit, not an error.
// The op layer sizes the launches that can adapt from the pipeline's limit
// (dispatch/kernel_choice.h, thread_budget), so this fails only for a launch of
// fixed size (the kernel's minimum: docs/dev/contributing.md, "Threadgroup
// sizes"): the kernel cannot run here at all.
void check_threads(const Launch& l, const PipelineInfo& p) {
  const auto& t = l.threads_per_threadgroup;
  const uint64_t threads = uint64_t(t[0]) * t[1] * t[2];
  if (threads > p.max_threads_per_threadgroup)
    throw too_few_threads(l.library, l.kernel, p.max_threads_per_threadgroup, std::to_string(threads));
}

c10::Device device_of(const Launch& l) {
  c10::optional<c10::Device> device;
  for (const auto& a : l.args) {
    if (!a.tensor.defined()) continue;
    if (!device) device = a.tensor.device();
    TORCH_CHECK(*device == a.tensor.device(),
                "Expected all tensors to be on the same device, but found at least "
                "two devices, ",
                *device, " and ", a.tensor.device(), "!");
  }
  TORCH_CHECK(device, "mps_ext: kernel ", l.kernel, " has no tensor argument");
  return *device;
}

std::atomic<CpuBackend*> g_cpu_backend{nullptr};

void register_cpu_backend(CpuBackend* backend) { g_cpu_backend.store(backend, std::memory_order_release); }

// A CPU tensor's launch, here when route() let it through, or straight from
// BackendSlot::launch (a backend's test hook, which no route() precedes):
// with no backend registered it says so rather than crash.
CpuBackend& cpu_backend_or_throw() {
  CpuBackend* b = cpu_backend();
  TORCH_CHECK(b, "mps_ext: no backend runs kernels on CPU tensors here (mps_ext runs its kernels on MPS tensors; "
                 "a test registers a CPU backend through mps_ext._C._backend_slot())");
  return *b;
}

[[noreturn]] void no_backend(const c10::Device& device) {
  TORCH_CHECK(false, "mps_ext: kernels run on MPS tensors, or on CPU tensors through a registered CPU backend; got ",
              device);
}

const char* shader_source_of(const std::string& name) { return shader_source(name); }

}  // namespace

CpuBackend* cpu_backend() { return g_cpu_backend.load(std::memory_order_acquire); }

const BackendSlot& backend_slot() {
  static const BackendSlot slot{kBackendSlotVersion, sizeof(BackendSlot),     &register_cpu_backend,
                                &shader_source_of,   &register_shader_source, &launch,
                                &variant_source};
  return slot;
}

void remember_unavailable(c10::DeviceType device, const BackendUnavailable& e) {
  std::lock_guard<std::mutex> lock(g_unavailable_mutex);
  unavailable().emplace(KernelKey{device, e.library, e.whole_library ? std::string() : e.kernel}, e);
  g_any_unavailable.store(true, std::memory_order_release);
}

void forget_unavailable() {
  std::lock_guard<std::mutex> lock(g_unavailable_mutex);
  unavailable().clear();
  g_any_unavailable.store(false, std::memory_order_release);
}

DeviceProfile device_profile(const c10::Device& device) {
#ifdef __APPLE__
  if (device.is_mps()) return metal_profile();
#endif
  if (device.is_cpu()) {
    if (CpuBackend* b = cpu_backend()) return b->profile();
  }
  return kLargestMacProfile;
}

PipelineInfo pipeline(const c10::Device& device, const std::string& library, const std::string& kernel) {
  rethrow_if_remembered(device.type(), library, kernel);
  if (device.is_cpu()) return cpu_backend_or_throw().pipeline(library, kernel);
#ifdef __APPLE__
  if (device.is_mps()) return metal_pipeline(library, kernel);
#endif
  no_backend(device);
}

void launch(const Launch& l) {
  const c10::Device device = device_of(l);
  check_threads(l, pipeline(device, l.library, l.kernel));
  if (device.is_cpu()) return cpu_backend_or_throw().encode(l);
#ifdef __APPLE__
  if (device.is_mps()) return metal_encode(l);
#endif
  no_backend(device);
}

void commit(const c10::Device& device) {
  if (device.is_cpu()) return;
#ifdef __APPLE__
  if (device.is_mps()) return metal_commit();
#endif
  TORCH_CHECK(false,
              "mps_ext commit: commits the MPS stream (a no-op on CPU tensors, whose backend runs each "
              "launch when it is encoded); got a tensor on ",
              device);
}

}  // namespace mps_ext
