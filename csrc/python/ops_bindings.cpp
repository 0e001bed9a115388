// Python access to the op families: switches, counters, overrides, policy,
// and the registration point of a CPU backend (_backend_slot).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <c10/util/Exception.h>
#include <torch/csrc/utils/pybind.h>  // torch.dtype <-> at::ScalarType

#include "backend/launch.h"
#include "backend/shaders.h"
#include "ops/fp8.h"
#include "ops/moe.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace mps_ext {
namespace {

c10::DispatchKey key_of(const std::string& device) {
  if (device == "MPS") return c10::DispatchKey::MPS;
  if (device == "CPU") return c10::DispatchKey::CPU;
  throw py::value_error("mps_ext: device must be 'MPS' or 'CPU', not '" + device + "'");
}

}  // namespace

#ifdef MPS_EXT_TEST_HOOKS
// Hooks the tests reach into the op layer with. Only a build with
// MPS_EXT_TEST_HOOKS=1 in the environment has them (scripts/setup.sh builds
// so; tools/build_config.py): the product a user installs exports none.
void bind_test_hooks(py::module_& m) {
  // The family table's check: its verdict for given definition counts, and
  // a second definition of a real family (which leaves the first in force).
  m.def("_family_table_problem",
        [](const std::vector<std::pair<std::string, int>>& d) { return family_table_problem(d); });
  m.def("_define_family_again", [](const std::string& name) {
    Family& f = family(name);
    f.define(f.def());
    return family_table_problem();
  });
  m.def("_set_index_limit", &set_index_limit, py::arg("limit"),
        "Largest index the 32-bit kernel variants may compute; <= 0 restores 2^31 - 1 (tests run the 64-bit "
        "variants on small tensors with it).");
  // The family's record of failures, and the kernels launch.cpp
  // remembers as failed (on every device), are forgotten.
  m.def(
      "_clear_unavailable",
      [](const std::string& fam) {
        family(fam).clear_unavailable();
        forget_unavailable();
      },
      py::arg("family"));
  // What the Metal backend compiles for one kernel (backend/shaders.h):
  // tests compile it on the executor, since Linux has no Metal compiler.
  m.def("_variant_source", &variant_source, py::arg("library"), py::arg("kernel"),
        "The embedded library's source that defines `kernel` alone; empty when it has no such variant.");
  m.def("_boxed_fallbacks", &detail::boxed_fallbacks,
        "How many of route's fallbacks to torch's kernel went through a boxed call (tests: none should).");
  m.def("_moe_routed_gate_up", &moe_routed_gate_up_for_tests, py::arg("x"), py::arg("gate_up"),
        py::arg("gate_up_scale"), py::arg("logits"), py::arg("top_k"), py::arg("renormalize"), py::arg("shared_expert"),
        py::arg("expert_bias"), py::arg("sigmoid"), py::arg("scale"), py::arg("renorm_eps"),
        "moe_layer's gate/up dispatch with the routing folded in: [h, weights, offs, slot_of_row, row_of_slot], or "
        "[] where the layer runs moe_route's dispatch instead.");
  m.def(
      "_warn_without_override_warning",
      [](const std::string& message) { without_override_warning([&] { TORCH_WARN(message); }); }, py::arg("message"));
}
#endif

void bind_ops(py::module_& m) {
  // A family table that does not match the families' files fails the
  // import of mps_ext._C (mps_ext reports it as its load error).
  const std::string problem = family_table_problem();
  if (!problem.empty()) throw std::runtime_error("mps_ext: " + problem);
  m.def("families", &family_names, "The op families (dispatch/families.h), sorted.");
  m.def("family_aten_ops", &family_aten_ops, py::arg("family"));
  m.def("family_own_ops", &family_own_ops, py::arg("family"));
  m.def(
      "install_overrides",
      [](const std::vector<std::string>& fams, const std::string& device) {
        return install_overrides(fams, key_of(device));
      },
      py::arg("families"), py::arg("device") = "MPS");
  // Whether torch has a kernel of its own for aten op `op` on `device` (the
  // one captured before mps_ext's override, if any).
  m.def(
      "has_stock_kernel",
      [](const std::string& op, const std::string& device) { return has_stock_kernel(op, key_of(device)); },
      py::arg("op"), py::arg("device"));
  // Name float8 errors of every op on `device` (mps_ext/__init__.py does it
  // for MPS at import; tests for CPU). Without the GIL: other threads keep
  // running ops while it registers, as they may on a Mac.
  m.def(
      "name_float8_errors", [](const std::string& device) { return name_float8_errors(key_of(device)); },
      py::arg("device"), py::call_guard<py::gil_scoped_release>());
  m.def("set_enabled", [](const std::string& fam, bool on) { family(fam).enabled = on; });
  m.def("is_enabled", [](const std::string& fam) { return family(fam).enabled.load(); });
  m.def("stats", [] {
    py::dict out;
    for (const auto& name : family_names()) {
      Family& f = family(name);
      py::dict d;
      d["ran"] = f.ran();
      d["fallbacks"] = f.fallbacks();
      py::dict unavailable;
      for (const auto& kv : f.unavailable_all())
        unavailable[py::str(c10::DeviceTypeName(detail::device_of(kv.first)))] = kv.second;
      d["unavailable"] = unavailable;
      out[py::str(name)] = d;
    }
    return out;
  });
  m.def(
      "leave_to_torch",
      [](const std::string& fam, const std::string& op, const std::string& device, const std::string& why,
         const std::vector<at::ScalarType>& kept_dtypes, const std::vector<std::pair<std::string, bool>>& kept_args,
         const std::string& calls) {
        family(fam).leave_to_torch(op, key_of(device), why, kept_dtypes, kept_args, condition_named(calls));
      },
      py::arg("family"), py::arg("op"), py::arg("device"), py::arg("why"),
      py::arg("kept_dtypes") = std::vector<at::ScalarType>{},
      py::arg("kept_args") = std::vector<std::pair<std::string, bool>>{}, py::arg("calls") = "");
  m.def("policy_conditions", &condition_names,
        "The named conditions a policy rule's `calls` may be (csrc/dispatch/registry.h; mps_ext/_policy.py's "
        "Condition).");
  m.def("reset_stats", [] {
    for (const auto& name : family_names()) family(name).reset();
  });
  // The registration point of a CPU backend (backend/launch.h, BackendSlot):
  // the product runs kernels on MPS tensors only; a test or a contributor
  // passes this capsule to a backend's extension, which registers itself.
  m.def("_backend_slot", [] { return py::capsule(static_cast<const void*>(&backend_slot()), kBackendSlotName); });
  m.def(
      "_device_profile",
      [](const std::string& device) {
        const DeviceProfile p = device_profile(c10::Device(device));
        return std::make_pair(p.cores, p.family);
      },
      py::arg("device"), "(cores, family) of the GPU the ops' launch geometry assumes on `device` ('cpu', 'mps').");
#ifdef MPS_EXT_TEST_HOOKS
  bind_test_hooks(m);
#endif
}

}  // namespace mps_ext
