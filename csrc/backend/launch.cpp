#include "backend/launch.h"

#include <c10/util/Exception.h>

#include <map>
#include <mutex>

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

// Decided here rather than in a backend, so that CI runs it: a pipeline that
// cannot run the threads the op asks for is a machine limit, not an error.
void check_threads(const Launch& l, const PipelineInfo& p) {
  const auto& t = l.threads_per_threadgroup;
  const uint64_t threads = uint64_t(t[0]) * t[1] * t[2];
  if (threads > p.max_threads_per_threadgroup)
    throw BackendUnavailable(l.library, l.kernel,
                             "the pipeline of kernel " + l.kernel + " runs at most " +
                                 std::to_string(p.max_threads_per_threadgroup) +
                                 " threads per threadgroup on this GPU; it needs " + std::to_string(threads));
}

}  // namespace

DeviceProfile device_profile(const c10::Device& device) {
#ifdef __APPLE__
  if (device.is_mps()) return metal_profile();
#endif
  return executor_profile();
}

void launch(const Launch& l) {
  c10::optional<c10::Device> device;
  for (const auto& a : l.args) {
    if (!a.tensor.defined()) continue;
    if (!device) device = a.tensor.device();
    TORCH_CHECK(*device == a.tensor.device(), "Expected all tensors to be on the same device, but found at least "
                "two devices, ", *device, " and ", a.tensor.device(), "!");
  }
  TORCH_CHECK(device, "mps_ext: kernel ", l.kernel, " has no tensor argument");
  if (device->is_cpu()) {
    check_threads(l, executor_pipeline(l.library, l.kernel));
    return executor_encode(l);
  }
#ifdef __APPLE__
  if (device->is_mps()) {
    check_threads(l, metal_pipeline(l.library, l.kernel));
    return metal_encode(l);
  }
#endif
  TORCH_CHECK(false, "mps_ext: kernels run on MPS tensors, or on CPU tensors through the CPU Metal executor; got ",
              *device);
}

void commit(const c10::Device& device) {
  if (device.is_cpu()) return;
#ifdef __APPLE__
  if (device.is_mps()) return metal_commit();
#endif
  TORCH_CHECK(false, "mps_ext commit: commits the MPS stream (a no-op on CPU tensors, which the CPU Metal executor "
              "runs); got a tensor on ", device);
}

}  // namespace mps_ext
