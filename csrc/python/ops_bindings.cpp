// Python access to the op families: switches, counters, overrides.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops/fp8.h"
#include "ops/ops.h"
#include "ops/registration.h"
#include "ops/registry.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace mps_ext {

void bind_ops(py::module_& m) {
  m.def("families", &families);
  m.def("family_aten_ops", &family_aten_ops, py::arg("family"));
  m.def("install_overrides", &install_overrides, py::arg("families"));
  m.def("set_enabled", [](const std::string& fam, bool on) { family(fam).enabled = on; });
  m.def("is_enabled", [](const std::string& fam) { return family(fam).enabled.load(); });
  m.def("stats", [] {
    py::dict out;
    for (const auto& name : families()) {
      Family& f = family(name);
      py::dict d;
      d["ran"] = f.ran();
      d["fallbacks"] = f.fallbacks();
      out[py::str(name)] = d;
    }
    return out;
  });
  m.def("set_linear_min_rows", &set_linear_min_rows, py::arg("rows"));
  m.def("set_fp8_e4m3_native", &set_fp8_e4m3_native, py::arg("native"));
  m.def("reset_stats", [] {
    for (const auto& name : families()) family(name).reset();
  });
}

}  // namespace mps_ext
