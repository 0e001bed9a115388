#pragma once
#include <pybind11/pybind11.h>

namespace mps_ext {
void bind_ops(pybind11::module_& m);
}
