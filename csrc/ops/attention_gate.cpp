// torch.ops.mps_ext.sigmoid_gate: the output gate of an attention layer
// (Qwen3.5/3.6, Qwen3-Next: out = x * sigmoid(gate)), one dispatch
// (kernels_metal/attention_gate.metal), for mps_ext.optimize's attention
// forward (mps_ext/passes/attention.py). Eager, the gate is three ops (a copy
// of q_proj's strided gate half, sigmoid, mul).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "attention_gate_params.h"
#include "backend/launch.h"
#include "dispatch/kernel_choice.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"
#include "ops/ops.h"

namespace mps_ext {
namespace {

// The stride between rows of the last dimension of `t` if its leading
// dimensions collapse into one (a view of rows: q_proj's gate half does), -1
// otherwise.
int64_t row_stride(const at::Tensor& t) {
  const int64_t n = t.size(-1);
  int64_t stride = -1, next = -1;  // the stride the next outer dimension must have
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (stride < 0) {
      stride = t.stride(d);
    } else if (t.stride(d) != next) {
      return -1;
    }
    next = t.stride(d) * t.size(d);
  }
  return stride < 0 ? n : stride;
}

}  // namespace

// out = x * sigmoid(gate): x and gate of one shape and dtype; gate may be a
// strided view whose last dimension is contiguous. out is contiguous.
at::Tensor sigmoid_gate(const at::Tensor& x, const at::Tensor& gate) {
  check_float(x, "sigmoid_gate", "x");
  TORCH_CHECK(gate.scalar_type() == x.scalar_type(), "mps_ext sigmoid_gate: gate must be in x's dtype (",
              x.scalar_type(), "), got ", gate.scalar_type());
  TORCH_CHECK(gate.sizes() == x.sizes(),
              "mps_ext sigmoid_gate: x and gate must have one shape (no broadcasting), "
              "got ",
              x.sizes(), " and ", gate.sizes());
  TORCH_CHECK(x.device() == gate.device(), "mps_ext sigmoid_gate: x is on ", x.device(), " and gate on ",
              gate.device());
  TORCH_CHECK(x.dim() >= 1, "mps_ext sigmoid_gate: x and gate must have a last dimension, got 0-d tensors");
  auto out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t n = x.size(-1);
  const at::Tensor xc = x.contiguous();
  // The kernel reads gate as rows of contiguous elements; a layout that is
  // not (rare: q_proj's gate half is) is copied first.
  at::Tensor g = gate;
  int64_t gs = (n == 1 || g.stride(-1) == 1) ? row_stride(g) : -1;
  if (gs < 0) g = g.contiguous(), gs = n;
  const int64_t rows = out.numel() / n;
  TORCH_CHECK(fits_32bit(out.numel()) && fits_32bit((rows - 1) * gs + n) && rows <= UINT32_MAX,
              "mps_ext sigmoid_gate: tensors past 2^31 elements are not supported, got ", rows, " rows of ", n);
  SigmoidGateParams p{};
  p.rows = static_cast<uint32_t>(rows);
  p.n = static_cast<uint32_t>(n);
  p.gate_row_stride = static_cast<uint32_t>(rows > 1 ? gs : n);
  // A thread per element: a lower pipeline limit means more column blocks.
  const std::string kernel = std::string("sigmoid_gate_") + kernel_type_name(x.scalar_type());
  const int64_t threads =
      std::min(thread_budget(x.device(), "attention_gate", kernel, SIGMOID_GATE_THREADS), ceil_div(n, 32) * 32);
  launch(Launch{"attention_gate",
                kernel,
                {KernelArg::of(out), KernelArg::of(xc), KernelArg::of(g), KernelArg::value(p)},
                {static_cast<uint32_t>(ceil_div(n, threads)), static_cast<uint32_t>(rows), 1},
                {static_cast<uint32_t>(threads), 1, 1}});
  return out;
}

namespace {

using c10::DispatchKey;

const RoutedOp kSigmoidGate(FamilyId::attention_gate, "mps_ext::sigmoid_gate");

template <DispatchKey K>
at::Tensor sigmoid_gate_impl(const at::Tensor& x, const at::Tensor& gate) {
  return run_own(kSigmoidGate, K, [&] { return sigmoid_gate(x, gate); });
}

// Its Meta (fake) kernel, for torch.compile, is in mps_ext/_meta.py.
template <DispatchKey K>
void register_attention_gate(FamilyOps& ops) {
  ops.own("sigmoid_gate(Tensor x, Tensor gate) -> Tensor", TORCH_FN(sigmoid_gate_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(attention_gate, mps_ext::register_attention_gate)
