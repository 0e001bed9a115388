// torch.ops.mps_ext.moe_layer: a whole mixture-of-experts layer at decode
// from one host call (mps_ext.optimize puts transformers' MoE blocks on it).
// Eager PyTorch on a Mac pays about 20 us of CPU per op it encodes, and a
// MoE block written op by op (router, softmax, top-k, renormalisation, the
// per-expert loop or grouped products with their sorting, combine, shared
// expert) is dozens of ops; here the same layer is four dispatches encoded
// by one call:
//
//   logits  = router GEMV of x                        (linear.cpp's kernels)
//   weights, offs, slot_of_row, row_of_slot = moe_route(logits)
//   h       = moe_experts(x, gate_up, swiglu)          (each chosen expert's rows read once)
//   out     = moe_down_combine(h, down, weights, row_of_slot[, residual])
//
// The last is moe_experts(h, down) and moe_combine in one kernel with the
// same bits (grouped_mm.cpp): a threadgroup owns a block of hidden columns,
// takes each chosen expert's down rows of it once and sums each token's
// slots in moe_combine's order. The separate ops stay for FP8Experts'
// grouped paths (mps_ext/fp8.py).
//
// `residual` (the decoder layer's `residual + mlp(x)`, which would be one
// more host call and dispatch per layer) is added in moe_down_combine's
// store, after the layer's output is rounded to its dtype: torch's bits.
// Where the output is converted after the kernel (fp8 banks under float32
// or float16 x), torch adds it to the converted output.
//
// A shared expert (Qwen3-Next, Qwen3.5/3.6-MoE) is expert E of the banks and
// row E of the router (its sigmoid gate), as moe_route defines it, so it
// costs no dispatch of its own. Prefill beyond moe_route's limit takes the
// block's own forward (mps_ext/passes/moe.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/moe.h"
#include "ops/ops.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

bool is_fp8(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn; }

at::Tensor moe_layer(const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                     const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                     const c10::optional<at::Tensor>& down_scale, int64_t top_k, bool renormalize,
                     bool shared_expert, const c10::optional<at::Tensor>& expert_bias, bool sigmoid, double scale,
                     double renorm_eps, const c10::optional<at::Tensor>& residual) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16,
              "moe_layer: x must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(x.dim() == 2, "moe_layer: x [tokens, hidden] expected, got ", x.sizes());
  TORCH_CHECK(router.dim() == 2 && router.size(1) == x.size(1) && router.scalar_type() == dt,
              "moe_layer: router must be [experts (+1 shared), hidden] in x's dtype, got ", router.sizes(), " ",
              router.scalar_type(), " for x ", x.sizes(), " ", dt);
  const int64_t experts = router.size(0);
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == experts && down.size(0) == experts &&
                  gate_up.size(2) == x.size(1) && down.size(1) == x.size(1) && gate_up.size(1) == 2 * down.size(2),
              "moe_layer: gate_up [E, 2I, H] and down [E, H, I] with E the router's rows expected, got ",
              gate_up.sizes(), " and ", down.sizes(), " for a router of ", experts, " rows");
  const bool fp8 = is_fp8(gate_up);
  TORCH_CHECK(fp8 == is_fp8(down) && (fp8 || (gate_up.scalar_type() == dt && down.scalar_type() == dt)),
              "moe_layer: banks must both be float8_e4m3fn (with scales) or both in x's dtype; got ",
              gate_up.scalar_type(), " and ", down.scalar_type(), " for x ", dt);
  if (residual)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == dt && residual->device() == x.device() &&
                    residual->is_contiguous(),
                "moe_layer: residual must be a contiguous tensor of x's shape, dtype and device (", x.sizes(), " ", dt,
                " on ", x.device(), "), got ", residual->sizes(), " ", residual->scalar_type(), " on ",
                residual->device(), residual->is_contiguous() ? "" : ", not contiguous");
  if (x.size(0) == 0) return at::empty({0, x.size(1)}, x.options());
  // The router's logits in the model's dtype, as the model computes them.
  const c10::optional<at::Tensor> no_bias;
  const at::Tensor logits = !linear_unsupported(x, router, no_bias) ? mps_ext::linear(x, router, no_bias)
                                                                            : at::linear(x, router);
  auto [weights, offs, slot_of_row, row_of_slot] = moe_route(logits, top_k, renormalize, shared_expert, expert_bias, sigmoid,
                                                                  scale, renorm_eps);
  // The fp8 grouped kernels take bfloat16 activations.
  const at::Tensor xe = fp8 && dt != at::kBFloat16 ? x.to(at::kBFloat16) : x;
  const int64_t slots = top_k + (shared_expert ? 1 : 0);
  const at::Tensor h = moe_experts(xe, gate_up, gate_up_scale, offs, slot_of_row, slots, true);
  const bool fused = h.scalar_type() == dt;  // the kernel's output is x's dtype: it adds the residual
  const at::Tensor out = moe_down_combine(h, down, down_scale, offs, weights, row_of_slot,
                                          fused ? residual : c10::nullopt);
  if (fused) return out;
  return residual ? at::add(*residual, out.to(dt)) : out.to(dt);
}

using c10::DispatchKey;

const RoutedOp kMoeLayer(FamilyId::grouped_mm, "mps_ext::moe_layer");

template <DispatchKey K>
at::Tensor moe_layer_impl(const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                          const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                          const c10::optional<at::Tensor>& down_scale, int64_t top_k, bool renormalize,
                          bool shared_expert, const c10::optional<at::Tensor>& expert_bias, bool sigmoid,
                          double scale, double renorm_eps, const c10::optional<at::Tensor>& residual) {
  return run_own(kMoeLayer, K, [&] {
    return moe_layer(x, router, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared_expert,
                     expert_bias, sigmoid, scale, renorm_eps, residual);
  });
}

}  // namespace
}  // namespace mps_ext

// Its Meta (fake) kernel, for torch.compile, is in mps_ext/_meta.py.
TORCH_LIBRARY_FRAGMENT(mps_ext, m) {
  m.def("moe_layer(Tensor x, Tensor router, Tensor gate_up, Tensor? gate_up_scale, Tensor down, "
        "Tensor? down_scale, int top_k, bool renormalize=True, bool shared_expert=False, "
        "Tensor? expert_bias=None, bool sigmoid=False, float scale=1.0, float renorm_eps=0.0, "
        "Tensor? residual=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mps_ext, CPU, m) { m.impl("moe_layer", TORCH_FN(mps_ext::moe_layer_impl<c10::DispatchKey::CPU>)); }

#ifdef __APPLE__
TORCH_LIBRARY_IMPL(mps_ext, MPS, m) { m.impl("moe_layer", TORCH_FN(mps_ext::moe_layer_impl<c10::DispatchKey::MPS>)); }
#endif
