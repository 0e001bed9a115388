#include "backend/launch.h"

#include <c10/util/Exception.h>

#include "backend/shaders.h"

namespace mps_ext {

const char* shader_source(const std::string& name) {
  for (int i = 0; i < kShaderSourceCount; ++i)
    if (name == kShaderSources[i].name) return kShaderSources[i].text;
  TORCH_CHECK(false, "mps_ext: no shader library named '", name, "' was built in");
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
  if (device->is_cpu()) return executor_launch(l);
#ifdef __APPLE__
  if (device->is_mps()) return metal_launch(l);
#endif
  TORCH_CHECK(false, "mps_ext: kernels run on MPS tensors, or on CPU tensors through the CPU Metal executor; got ",
              *device);
}

}  // namespace mps_ext
