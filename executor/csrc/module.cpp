// mps_ext_executor._C: the CPU Metal executor's extension. Compiled against
// the product's launch interface (csrc/backend/launch.h) and registered with
// the product at run time (mps_ext_executor.install()); the product's _C
// never links or names it.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mps_ext's CPU Metal executor: Metal kernels on CPU tensors, for tests and contributors";
  mps_ext::bind_executor(m);
  mps_ext::bind_backend(m);
  mps_ext::bind_routing_probe(m);
}
