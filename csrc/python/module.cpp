// mps_ext._C: the native extension. Ops register themselves with torch's
// dispatcher from their own files (TORCH_LIBRARY); this file adds the Python
// functions of the package. (Only pybind11 here: torch/extension.h would
// triple this file's compile time and nothing below needs it.)
#include <pybind11/pybind11.h>

#include "python/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "mps_ext native extension";
  mps_ext::bind_ops(m);
}
