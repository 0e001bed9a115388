// Python binding of the CPU Metal executor (mps_ext_executor._C): its
// engine, its registration as mps_ext's CPU backend, and the test hooks of
// that backend. The Python-facing API lives in mps_ext_executor/__init__.py;
// this file only converts arguments and results.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include "backend.h"
#include "bindings.h"
#include "engine.h"

namespace py = pybind11;

namespace mps_ext {
namespace {

cpu_metal::Size3 size3(const std::vector<uint64_t>& v, const char* what) {
  if (v.empty() || v.size() > 3) throw py::value_error(std::string(what) + " must have 1 to 3 dimensions");
  cpu_metal::Size3 s{1, 1, 1};
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] > 0xffffffffull) throw py::value_error(std::string(what) + " is larger than 2^32 - 1");
    s[i] = static_cast<uint32_t>(v[i]);
  }
  return s;
}

SimulatedFailure failure_of(const std::string& kind) {
  if (kind == "none") return SimulatedFailure::kNone;
  if (kind == "library") return SimulatedFailure::kLibrary;
  if (kind == "pipeline") return SimulatedFailure::kPipeline;
  if (kind == "max_threads") return SimulatedFailure::kMaxThreads;
  throw py::value_error("mps_ext_executor: failure kind must be none, library, pipeline or max_threads, not '" + kind +
                        "'");
}

py::dict kernel_info_to_dict(const cpu_metal::KernelInfo& k) {
  py::dict d;
  d["registers"] = k.registers;
  d["uniform_registers"] = k.uniform_registers;
  d["private_bytes"] = k.private_bytes;
  d["loads_in_flight"] = k.loads_in_flight;
  d["hot_loop"] = k.hot_loop;
  d["loads_after_barrier"] = k.loads_after_barrier;
  return d;
}

py::dict stats_to_dict(const cpu_metal::Stats& s) {
  py::dict d;
  d["kernel"] = s.kernel;
  d["threadgroups"] = py::make_tuple(s.threadgroups[0], s.threadgroups[1], s.threadgroups[2]);
  d["threads_per_threadgroup"] =
      py::make_tuple(s.threads_per_threadgroup[0], s.threads_per_threadgroup[1], s.threads_per_threadgroup[2]);
  d["threads"] = s.threads;
  d["barriers"] = s.barriers;
  d["simdgroup_barriers"] = s.simdgroup_barriers;
  d["simd_operations"] = s.simd_operations;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["read_widths"] = s.read_widths;
  d["write_widths"] = s.write_widths;
  d["threadgroup_bytes_read"] = s.threadgroup_bytes_read;
  d["threadgroup_bytes_written"] = s.threadgroup_bytes_written;
  d["bound_from_bytes"] = s.bound_from_bytes;
  d["buffer_names"] = s.buffer_names;
  d["kernel_info"] = kernel_info_to_dict(s.kernel_info);
  d["int64_divisions"] = s.int64_divisions;
  d["int64_multiplications"] = s.int64_multiplications;
  d["max_int64_divisions"] = s.max_int64_divisions;
  d["max_int64_multiplications"] = s.max_int64_multiplications;
  d["counters"] = s.counters;
  d["cache_lines"] = s.cache_lines;
  d["cache_lines_minimum"] = s.cache_lines_minimum;
  d["threadgroup_memory_instructions"] = s.threadgroup_memory_instructions;
  d["bank_conflict_cycles"] = s.bank_conflict_cycles;
  d["int32_divisions"] = s.int32_divisions;
  d["float_divisions"] = s.float_divisions;
  d["max_int32_divisions"] = s.max_int32_divisions;
  d["max_float_divisions"] = s.max_float_divisions;
  d["threadgroup_memory"] = s.threadgroup_memory;
  d["threadgroup_bytes_read_distinct"] = s.threadgroup_bytes_read_distinct;
  d["unique_bytes_read"] = s.unique_bytes_read;
  d["instructions"] = s.instructions;
  d["max_instructions"] = s.max_instructions;
  d["simdgroup_mmas"] = s.simdgroup_mmas;
  d["simdgroup_mmas_32"] = s.simdgroup_mmas_32;
  d["matrix_loads_threadgroup"] = s.matrix_loads_threadgroup;
  d["matrix_loads_device"] = s.matrix_loads_device;
  d["matrix_stores_threadgroup"] = s.matrix_stores_threadgroup;
  d["matrix_stores_device"] = s.matrix_stores_device;
  return d;
}

}  // namespace

void bind_executor(py::module_& m) {
  using cpu_metal::Library;
  auto kernel_error = py::register_exception<cpu_metal::KernelError>(m, "KernelError", PyExc_RuntimeError);
  py::register_exception<cpu_metal::OutOfBoundsError>(m, "OutOfBoundsError", kernel_error.ptr());
  py::register_exception<cpu_metal::MisalignedAccessError>(m, "MisalignedAccessError", kernel_error.ptr());
  py::register_exception<cpu_metal::BarrierDivergenceError>(m, "BarrierDivergenceError", kernel_error.ptr());
  py::register_exception<cpu_metal::RaceError>(m, "RaceError", kernel_error.ptr());
  py::register_exception<cpu_metal::DispatchError>(m, "DispatchError", PyExc_ValueError);

  py::class_<Library, std::shared_ptr<Library>>(m, "ExecutorLibrary")
      .def_static("load", &Library::load, py::arg("path"))
      .def_property_readonly("function_names", &Library::function_names)
      .def_property_readonly("path", &Library::path)
      .def(
          "kernel_params",
          [](const Library& lib, const std::string& name) {
            const mx_kernel& k = lib.kernel(name);
            py::list out;
            for (uint32_t i = 0; i < k.param_count; ++i) {
              const mx_param& p = k.params[i];
              py::dict d;
              d["name"] = p.name;
              d["kind"] = p.kind == MX_PARAM_BUFFER        ? "buffer"
                          : p.kind == MX_PARAM_THREADGROUP ? "threadgroup"
                                                           : "builtin";
              d["index"] = p.index;
              d["address_space"] = p.address_space;
              d["reference"] = bool(p.flags & MX_PARAM_REFERENCE);
              d["readonly"] = bool(p.flags & MX_PARAM_READONLY);
              d["pointee_size"] = p.pointee_size;
              out.append(d);
            }
            return out;
          },
          py::arg("name"))
      .def(
          "kernel_info",
          [](const Library& lib, const std::string& name) { return kernel_info_to_dict(lib.kernel_info(name)); },
          py::arg("name"))
      .def(
          "dispatch",
          [](const Library& lib, const std::string& name, const py::list& buffers, std::vector<uint64_t> threadgroups,
             std::vector<uint64_t> threads, std::vector<uint64_t> threads_per_threadgroup,
             std::vector<uint64_t> threadgroup_memory, uint64_t seed, bool isolate, bool counters) {
            cpu_metal::Dispatch d;
            // Each entry: None, ("memory", address, size, origin) or ("bytes", bytes).
            for (const py::handle& h : buffers) {
              if (h.is_none()) {
                d.buffers.emplace_back();
                continue;
              }
              py::tuple t = py::reinterpret_borrow<py::tuple>(h);
              std::string kind = t[0].cast<std::string>();
              if (kind == "memory") {
                d.buffers.push_back(cpu_metal::Binding::memory(reinterpret_cast<void*>(t[1].cast<uintptr_t>()),
                                                               t[2].cast<uint64_t>(), t[3].cast<uint64_t>()));
              } else {
                std::string b = t[1].cast<py::bytes>();
                d.buffers.push_back(cpu_metal::Binding::constant_bytes(b.data(), b.size()));
              }
            }
            d.use_threads = !threads.empty();
            if (d.use_threads) d.threads = size3(threads, "threads");
            else d.threadgroups = size3(threadgroups, "threadgroups");
            d.threads_per_threadgroup = size3(threads_per_threadgroup, "threads_per_threadgroup");
            d.threadgroup_memory = threadgroup_memory;
            d.seed = seed;
            d.isolate = isolate;
            d.counters = counters;
            cpu_metal::Stats s;
            {
              py::gil_scoped_release nogil;
              s = lib.dispatch(name, d);
            }
            return stats_to_dict(s);
          },
          py::arg("name"), py::arg("buffers"), py::arg("threadgroups"), py::arg("threads"),
          py::arg("threads_per_threadgroup"), py::arg("threadgroup_memory"), py::arg("seed"), py::arg("isolate"),
          py::arg("counters"));

  py::class_<cpu_metal::Recorder, std::shared_ptr<cpu_metal::Recorder>>(m, "ExecutorRecorder")
      .def(py::init<>())
      .def(
          "start",
          [](const std::shared_ptr<cpu_metal::Recorder>& r, bool counters) {
            r->counters = counters;
            cpu_metal::start_recording(r);
          },
          py::arg("counters") = false)
      .def("stop", [](const std::shared_ptr<cpu_metal::Recorder>& r) { cpu_metal::stop_recording(r); })
      .def("take", [](cpu_metal::Recorder& r) {
        py::list out;
        for (const auto& s : r.dispatches) out.append(stats_to_dict(s));
        r.dispatches.clear();
        return out;
      });
  m.def("executor_worker_count", &cpu_metal::worker_count);
}

void bind_backend(py::module_& m) {
  m.def(
      "_install",
      [](const py::capsule& slot) {
        if (std::string(slot.name() ? slot.name() : "") != kBackendSlotName)
          throw py::type_error(std::string("mps_ext_executor: install takes mps_ext._C._backend_slot(), a capsule "
                                           "named ") +
                               kBackendSlotName);
        install(slot.get_pointer<const BackendSlot>());
      },
      py::arg("slot"), "Registers the executor as mps_ext's CPU backend (mps_ext_executor.install()).");
  // request() (mps_ext_executor/__init__.py): on a Mac, CPU calls reach the
  // executor only inside it (this thread).
  m.def("_set_requested", &set_executor_requested, py::arg("requested"));
  m.def("_requested", &executor_requested);
  m.def("_simulate_metal_backend", &set_metal_backend_present, py::arg("present"),
        "Test hook: 1 behaves as if a Metal GPU backend were present (a Mac: CPU tensors reach the executor only "
        "when it is asked for), 0 as if not, -1 as built.");
  m.def("_metal_backend_present", &metal_backend_present);
  m.def(
      "_simulate_failure",
      [](const std::string& library, const std::string& kernel, const std::string& kind, uint64_t max_threads) {
        simulate_executor_failure(library, kernel, failure_of(kind), max_threads);
      },
      py::arg("library"), py::arg("kernel") = "", py::arg("kind") = "none", py::arg("max_threads") = 0);
  m.def("_simulated_failure_hits", &simulated_failure_hits);
  m.def("_forget_libraries", &forget_executor_libraries);
  m.def(
      "_set_profile", [](int64_t cores, int64_t family) { set_executor_profile(DeviceProfile{cores, family}); },
      py::arg("cores"), py::arg("family"),
      "The GPU the executor stands for in the ops' launch geometry (mps_ext_executor.set_gpu).");
  m.def("_profile", [] {
    const DeviceProfile p = executor_profile();
    return std::make_pair(p.cores, p.family);
  });
  m.def(
      "_register_shader_source",
      [](const std::string& name, const std::string& source) { slot().register_shader_source(name, source); },
      py::arg("name"), py::arg("source"),
      "A shader library compiled from `source` under `name`, which _launch (and on a Mac the Metal backend) runs.");
  m.def(
      "_launch",
      [](const std::string& library, const std::string& kernel, const std::vector<at::Tensor>& buffers,
         std::array<uint32_t, 3> threadgroups, std::array<uint32_t, 3> threads_per_threadgroup) {
        Launch l{library, kernel, {}, threadgroups, threads_per_threadgroup, {}};
        for (const auto& t : buffers) l.args.push_back(KernelArg::of(t));
        slot().launch(l);
      },
      py::arg("library"), py::arg("kernel"), py::arg("buffers"), py::arg("threadgroups"),
      py::arg("threads_per_threadgroup"),
      "Test hook: kernel `kernel` of `library` with `buffers` as [[buffer(0)]], [[buffer(1)]], ..., through "
      "mps_ext's backend of the tensors' device, as the ops launch theirs.");
}

}  // namespace mps_ext
