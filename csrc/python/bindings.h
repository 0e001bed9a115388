#pragma once
#include <pybind11/pybind11.h>

namespace mps_ext {
void bind_executor(pybind11::module_& m);
void bind_ops(pybind11::module_& m);
void bind_routing_probe(pybind11::module_& m);
}
