// The host-time probe of benchmarks/bench_routing.py: the same call made
// many times in a C++ loop through torch's dispatcher, once to an mps_ext op
// (torch.ops.mps_ext.<op> on CPU tensors: route, then the kernel or torch's)
// and once to the aten op it stands for. The difference is what mps_ext's
// routing adds per call; a loop in C++ keeps Python's own per-call cost
// (several microseconds, and noisy) out of it. Uses nothing but the
// dispatcher, so it measures any version of the op layer alike.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <utility>

#include "bindings.h"

namespace py = pybind11;

namespace mps_ext {
namespace {

template <class Sig>
c10::TypedOperatorHandle<Sig> typed(const char* ns, const char* name, const char* overload) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((std::string(ns) + "::" + name).c_str(), overload).typed<Sig>();
}

// Nanoseconds per call of f, over `n` calls.
double ns_per_call(const std::function<void()>& f, int64_t n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) f();
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
}

// (mps_ext op, aten op) as two callables, for case `which`.
std::pair<std::function<void()>, std::function<void()>> calls(const std::string& which) {
  static const at::Tensor a = at::ones({4}), b = at::zeros({4}), x1 = at::randn({1, 4}), x9 = at::randn({9, 4}),
                          w = at::randn({4, 4}), w9 = at::randn({4, 16});
  auto both = [](auto make) { return std::make_pair(make("mps_ext"), make("aten")); };
  if (which == "copy_")
    return both([](const char* ns) {
      auto op = typed<at::Tensor&(at::Tensor&, const at::Tensor&, bool)>(ns, "copy_", "");
      return std::function<void()>([op] {
        at::Tensor d = a;
        op.call(d, b, false);
      });
    });
  if (which == "eq")
    return both([](const char* ns) {
      auto op = typed<at::Tensor(const at::Tensor&, const at::Tensor&)>(ns, "eq", "Tensor");
      return std::function<void()>([op] { op.call(a, b); });
    });
  if (which == "mm")
    return both([](const char* ns) {
      auto op = typed<at::Tensor(const at::Tensor&, const at::Tensor&)>(ns, "mm", "");
      return std::function<void()>([op] { op.call(x9, w9); });
    });
  if (which == "linear")
    return both([](const char* ns) {
      auto op =
          typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(ns, "linear", "");
      return std::function<void()>([op] { op.call(x1, w, std::nullopt); });
    });
  if (which == "constant_pad_nd")
    return both([](const char* ns) {
      auto op =
          typed<at::Tensor(const at::Tensor&, c10::SymIntArrayRef, const c10::Scalar&)>(ns, "constant_pad_nd", "");
      return std::function<void()>([op] {
        const c10::SymInt pad[2] = {1, 1};
        op.call(a, c10::SymIntArrayRef(pad, 2), 0);
      });
    });
  throw py::value_error("mps_ext: no routing probe case '" + which + "' (copy_, eq, mm, linear, constant_pad_nd)");
}

}  // namespace

void bind_routing_probe(py::module_& m) {
  m.def(
      "_routing_probe",
      [](const std::string& which, int64_t n, int64_t repeat) {
        auto [ours, theirs] = calls(which);
        py::gil_scoped_release release;
        ours(), theirs();  // the first calls capture stock kernels
        // The fastest of `repeat` runs of each, interleaved so that both see
        // the same load (the machine may be shared).
        double best_ours = 1e300, best_theirs = 1e300;
        for (int64_t r = 0; r < repeat; ++r) {
          best_ours = std::min(best_ours, ns_per_call(ours, n));
          best_theirs = std::min(best_theirs, ns_per_call(theirs, n));
        }
        return std::make_pair(best_ours, best_theirs);
      },
      py::arg("case"), py::arg("n") = 20000, py::arg("repeat") = 7,
      "Benchmark hook: ns per call of the mps_ext op and of the aten op of a case, in a C++ loop.");
}

}  // namespace mps_ext
