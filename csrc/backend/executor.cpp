// The CPU Metal executor backend: runs a Launch on CPU tensors by compiling
// the embedded shader with mps_ext.cpu_metal (once per library and process,
// cached on disk) and dispatching it on the executor engine.
#include <pybind11/pybind11.h>

#include <map>
#include <memory>
#include <mutex>

#include "backend/launch.h"
#include "backend/shaders.h"
#include "cpu_metal/engine.h"

namespace py = pybind11;

namespace mps_ext {
namespace {

std::shared_ptr<cpu_metal::Library> library(const std::string& name) {
  // The GIL first, then the cache lock: a thread holding the lock never
  // waits for the GIL.
  py::gil_scoped_acquire gil;
  static std::mutex mutex;
  static std::map<std::string, std::shared_ptr<cpu_metal::Library>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  std::string path;
  try {
    py::object built = py::module_::import("mps_ext.cpu_metal._compiler")
                           .attr("build")(shader_source(name), py::none(), name + ".metal");
    path = py::str(built.attr("path"));
  } catch (py::error_already_set& e) {
    TORCH_CHECK(false, "mps_ext: the CPU Metal executor could not build ", name, ".metal: ", e.what());
  }
  auto lib = cpu_metal::Library::load(path);
  cache[name] = lib;
  return lib;
}

}  // namespace

void executor_launch(const Launch& l) {
  auto lib = library(l.library);
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

}  // namespace mps_ext
