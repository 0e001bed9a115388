#pragma once
#include <pybind11/pybind11.h>

namespace mps_ext {
void bind_executor(pybind11::module_& m);  // the engine (bindings.cpp)
void bind_backend(pybind11::module_& m);   // the CPU backend and its test hooks (bindings.cpp)
void bind_routing_probe(pybind11::module_& m);
}  // namespace mps_ext
