// Registration with torch's dispatcher.
//
// On every platform each op is torch.ops.mps_ext.<aten name>, with the aten
// schema, for CPU tensors (run by the CPU Metal executor) and, on macOS, MPS
// tensors. On a Mac, install_overrides() also puts the ops on the MPS key of
// the aten ops themselves, after capturing the kernel each replaces; which
// families to install is decided in Python (mps_ext/_policy.py).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <set>

#include "ops/ops.h"
#include "ops/registration.h"
#include "ops/registry.h"

namespace mps_ext {
namespace {

using c10::DispatchKey;

template <DispatchKey K>
at::Tensor softmax_impl(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return route(family("softmax"), "aten::_softmax", K, softmax_unsupported(self),
               [&] { return softmax_forward(self, dim, half_to_float, false); }, self, dim, half_to_float);
}

template <DispatchKey K>
at::Tensor log_softmax_impl(const at::Tensor& self, int64_t dim, bool half_to_float) {
  return route(family("softmax"), "aten::_log_softmax", K, softmax_unsupported(self),
               [&] { return softmax_forward(self, dim, half_to_float, true); }, self, dim, half_to_float);
}

template <DispatchKey K>
at::Tensor softmax_backward_impl(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                 c10::ScalarType input_dtype) {
  return route(family("softmax"), "aten::_softmax_backward_data", K,
               softmax_backward_unsupported(grad, output, input_dtype),
               [&] { return softmax_backward(grad, output, dim, input_dtype, false); }, grad, output, dim,
               input_dtype);
}

template <DispatchKey K>
at::Tensor log_softmax_backward_impl(const at::Tensor& grad, const at::Tensor& output, int64_t dim,
                                     c10::ScalarType input_dtype) {
  return route(family("softmax"), "aten::_log_softmax_backward_data", K,
               softmax_backward_unsupported(grad, output, input_dtype),
               [&] { return softmax_backward(grad, output, dim, input_dtype, true); }, grad, output, dim,
               input_dtype);
}

template <DispatchKey K>
at::Tensor constant_pad_impl(const at::Tensor& self, c10::SymIntArrayRef pad, const c10::Scalar& value) {
  c10::IntArrayRef p = C10_AS_INTARRAYREF_SLOW(pad);
  return route(family("pad"), "aten::constant_pad_nd", K, pad_unsupported(self, p),
               [&] { return constant_pad(self, p, value); }, self, pad, value);
}

template <DispatchKey K>
at::Tensor linear_impl(const at::Tensor& input, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  return route(family("linear"), "aten::linear", K, linear_unsupported(input, weight, bias),
               [&] { return linear(input, weight, bias); }, input, weight, bias);
}

template <DispatchKey K>
at::Tensor mm_impl(const at::Tensor& self, const at::Tensor& mat2) {
  return route(family("linear"), "aten::mm", K, mm_unsupported(self, mat2, nullptr), [&] { return mm(self, mat2); },
               self, mat2);
}

template <DispatchKey K>
at::Tensor addmm_impl(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                      const c10::Scalar& beta, const c10::Scalar& alpha) {
  return route(family("linear"), "aten::addmm", K, mm_unsupported(mat1, mat2, &self),
               [&] { return addmm(self, mat1, mat2, beta, alpha); }, self, mat1, mat2, beta, alpha);
}

// Family -> the aten ops it overrides, for install_overrides.
template <DispatchKey K>
void register_family(torch::Library& m, const std::string& fam) {
  if (fam == "softmax") {
    m.impl("_softmax", TORCH_FN(softmax_impl<K>));
    m.impl("_log_softmax", TORCH_FN(log_softmax_impl<K>));
    m.impl("_softmax_backward_data", TORCH_FN(softmax_backward_impl<K>));
    m.impl("_log_softmax_backward_data", TORCH_FN(log_softmax_backward_impl<K>));
  } else if (fam == "pad") {
    m.impl("constant_pad_nd", TORCH_FN(constant_pad_impl<K>));
  } else if (fam == "linear") {
    m.impl("linear", TORCH_FN(linear_impl<K>));
    m.impl("mm", TORCH_FN(mm_impl<K>));
    m.impl("addmm", TORCH_FN(addmm_impl<K>));
  }
}

const std::map<std::string, std::vector<std::string>>& family_ops() {
  static const std::map<std::string, std::vector<std::string>> ops = {
      {"softmax", {"aten::_softmax", "aten::_log_softmax", "aten::_softmax_backward_data",
                   "aten::_log_softmax_backward_data"}},
      {"pad", {"aten::constant_pad_nd"}},
      {"linear", {"aten::linear", "aten::mm", "aten::addmm"}},
  };
  return ops;
}

}  // namespace

std::vector<std::string> families() {
  std::vector<std::string> names;
  for (const auto& kv : family_ops()) {
    names.push_back(kv.first);
    family(kv.first);  // create its switch and counters
  }
  return names;
}

std::vector<std::string> family_aten_ops(const std::string& fam) { return family_ops().at(fam); }

// Override the aten ops of these families on the MPS key. Each op's current
// MPS kernel is captured first: it is where unsupported inputs go.
std::vector<std::string> install_overrides(const std::vector<std::string>& fams) {
  static std::unique_ptr<torch::Library> lib;
  static std::set<std::string> installed;
  if (!lib) lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", DispatchKey::MPS, __FILE__, __LINE__);
  std::vector<std::string> done;
  for (const auto& fam : fams) {
    TORCH_CHECK(family_ops().count(fam), "mps_ext: no op family named '", fam, "'");
    if (!installed.count(fam)) {
      for (const auto& op : family_ops().at(fam)) capture_stock_kernel(op, DispatchKey::MPS);
      register_family<DispatchKey::MPS>(*lib, fam);
      installed.insert(fam);
    }
    done.push_back(fam);
  }
  return done;
}

}  // namespace mps_ext

TORCH_LIBRARY(mps_ext, m) {
  m.def("_softmax(Tensor self, int dim, bool half_to_float) -> Tensor");
  m.def("_log_softmax(Tensor self, int dim, bool half_to_float) -> Tensor");
  m.def("_softmax_backward_data(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype) -> Tensor");
  m.def("_log_softmax_backward_data(Tensor grad_output, Tensor output, int dim, ScalarType input_dtype) -> Tensor");
  m.def("constant_pad_nd(Tensor self, SymInt[] pad, Scalar value=0) -> Tensor");
  m.def("linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("mm(Tensor self, Tensor mat2) -> Tensor");
  m.def("addmm(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(mps_ext, CPU, m) {
  for (const char* fam : {"softmax", "pad", "linear"}) mps_ext::register_family<c10::DispatchKey::CPU>(m, fam);
}

#ifdef __APPLE__
TORCH_LIBRARY_IMPL(mps_ext, MPS, m) {
  for (const char* fam : {"softmax", "pad", "linear"}) mps_ext::register_family<c10::DispatchKey::MPS>(m, fam);
}
#endif
