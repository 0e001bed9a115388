// mps_ext's fused mixture-of-experts decode ops, for code that wants the
// fewest dispatches per layer rather than aten's op-by-op form (which the
// _grouped_mm override already serves). A layer is five dispatches:
//
//   logits = F.linear(x, router)                   (mps_ext's GEMV)
//   weights, offs, slot_of_row, row_of_slot = torch.ops.mps_ext.moe_route(logits, top_k, ...)
//   h = torch.ops.mps_ext.moe_experts(x, w_gate_up, s, offs, slot_of_row, slots, swiglu=True)
//   y = torch.ops.mps_ext.moe_experts(h, w_down, s, offs)
//   out = torch.ops.mps_ext.moe_combine(y, weights, row_of_slot)
//
// No step reads anything on the host; routing runs on the GPU. A shared
// expert (Qwen3.5/3.6) is expert E of the weight banks, chosen by every
// token with weight sigmoid(logits[:, E]) (the router's extra row).
// Kernels: kernels_metal/grouped_mm_moe.metal and gmm_decode_rows of
// kernels_metal/grouped_mm.metal.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "backend/launch.h"
#include "grouped_mm_moe_params.h"
#include "ops/moe.h"
#include "ops/ops.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

const char* float_name(c10::ScalarType t, const char* op) {
  switch (t) {
    case at::kFloat: return "f32";
    case at::kHalf: return "f16";
    case at::kBFloat16: return "bf16";
    default: TORCH_CHECK(false, op, ": float32, float16 or bfloat16 expected, got ", t);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k,
                                                                   bool renormalize, bool shared_expert,
                                                                   const c10::optional<at::Tensor>& expert_bias,
                                                                   bool sigmoid, double scale, double renorm_eps) {
  const char* types = float_name(logits.scalar_type(), "moe_route");
  TORCH_CHECK(!expert_bias || sigmoid, "moe_route: expert_bias is for sigmoid scoring");
  TORCH_CHECK(logits.dim() == 2, "moe_route: logits [tokens, experts] expected, got ", logits.sizes());
  const int64_t tokens = logits.size(0), experts = logits.size(1) - (shared_expert ? 1 : 0);
  const int64_t slots = top_k + (shared_expert ? 1 : 0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k must be in [1, ", experts, "], got ", top_k);
  TORCH_CHECK(experts + (shared_expert ? 1 : 0) <= MOE_MAX_EXPERTS, "moe_route: at most ", MOE_MAX_EXPERTS,
              " experts");
  TORCH_CHECK(tokens * slots <= MOE_MAX_SLOTS, "moe_route is for decode: at most ", MOE_MAX_SLOTS,
              " token slots (tokens x (top_k + shared)), got ", tokens * slots);
  if (expert_bias)
    TORCH_CHECK(expert_bias->scalar_type() == at::kFloat && expert_bias->dim() == 1 &&
                    expert_bias->size(0) == experts && expert_bias->is_contiguous(),
                "moe_route: expert_bias must be contiguous float32 [", experts, "], got ", expert_bias->sizes(), " ",
                expert_bias->scalar_type());
  auto i32 = logits.options().dtype(at::kInt);
  at::Tensor weights = at::empty({tokens, slots}, logits.options().dtype(at::kFloat));
  at::Tensor offs = at::empty({experts + (shared_expert ? 1 : 0)}, i32);
  at::Tensor slot_of_row = at::empty({tokens * slots}, i32), row_of_slot = at::empty({tokens * slots}, i32);
  if (tokens > 0 || offs.numel() > 0) {
    MoeRouteParams p{};
    p.tokens = static_cast<uint32_t>(tokens);
    p.experts = static_cast<uint32_t>(experts);
    p.top_k = static_cast<uint32_t>(top_k);
    p.shared = shared_expert ? 1 : 0;
    p.renormalize = renormalize ? 1 : 0;
    p.logits_t_stride = logits.stride(0);
    p.logits_e_stride = logits.stride(1);
    p.scoring = sigmoid ? MOE_SCORING_SIGMOID : MOE_SCORING_SOFTMAX;
    p.scale = static_cast<float>(scale);
    p.renorm_eps = static_cast<float>(renorm_eps);
    p.has_bias = expert_bias ? 1 : 0;
    // Without a bias the kernel reads none; the weights stand in for the buffer.
    launch(Launch{"grouped_mm_moe", std::string("moe_route_") + types,
                  {KernelArg::of(weights), KernelArg::of(offs), KernelArg::of(slot_of_row), KernelArg::of(row_of_slot),
                   KernelArg::of(logits), KernelArg::value(p), KernelArg::of(expert_bias ? *expert_bias : weights)},
                  {1, 1, 1}, {MOE_ROUTE_THREADS, 1, 1}});
  }
  return {weights, offs, slot_of_row, row_of_slot};
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& row_of_slot) {
  const char* types = float_name(y.scalar_type(), "moe_combine");
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1, "moe_combine: y [rows, hidden] with contiguous rows expected");
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_combine: weights must be contiguous float32 [tokens, slots]");
  TORCH_CHECK(row_of_slot.scalar_type() == at::kInt && row_of_slot.is_contiguous() &&
                  row_of_slot.numel() == weights.numel() && y.size(0) >= weights.numel(),
              "moe_combine: row_of_slot must be contiguous int32 [tokens * slots], and y hold every slot's row");
  const int64_t tokens = weights.size(0), hidden = y.size(1);
  at::Tensor out = at::empty({tokens, hidden}, y.options());
  if (out.numel() == 0) return out;
  MoeCombineParams p{};
  p.tokens = static_cast<uint32_t>(tokens);
  p.slots = static_cast<uint32_t>(weights.size(1));
  p.hidden = static_cast<uint32_t>(hidden);
  p.y_row_stride = y.stride(0);
  p.out_row_stride = out.stride(0);
  const int64_t threads = (hidden + MOE_COMBINE_OUTPUTS - 1) / MOE_COMBINE_OUTPUTS;
  launch(Launch{"grouped_mm_moe", std::string("moe_combine_") + types,
                {KernelArg::of(out), KernelArg::of(y), KernelArg::of(weights), KernelArg::of(row_of_slot),
                 KernelArg::value(p)},
                {static_cast<uint32_t>((threads + MOE_COMBINE_THREADS - 1) / MOE_COMBINE_THREADS),
                 static_cast<uint32_t>(tokens), 1},
                {MOE_COMBINE_THREADS, 1, 1}});
  return out;
}

namespace {

// Each op runs mps_ext's kernel (or says why it cannot: there is no torch
// kernel to fall back to) and counts as a grouped_mm call.
using c10::DispatchKey;

const RoutedOp kMoeRoute(FamilyId::grouped_mm, "mps_ext::moe_route"),
    kMoeExperts(FamilyId::grouped_mm, "mps_ext::moe_experts"), kMoeCombine(FamilyId::grouped_mm, "mps_ext::moe_combine");

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_impl(const at::Tensor& logits, int64_t top_k,
                                                                        bool renormalize, bool shared_expert,
                                                                        const c10::optional<at::Tensor>& expert_bias,
                                                                        bool sigmoid, double scale, double renorm_eps) {
  return run_own(kMoeRoute, K, [&] {
    return moe_route(logits, top_k, renormalize, shared_expert, expert_bias, sigmoid, scale, renorm_eps);
  });
}

template <DispatchKey K>
at::Tensor moe_experts_impl(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& weight_scale,
                            const at::Tensor& offs, const c10::optional<at::Tensor>& slot_of_row,
                            int64_t slots_per_token, bool swiglu) {
  return run_own(kMoeExperts, K, [&] {
    return moe_experts(x, weight, weight_scale, offs, slot_of_row, slots_per_token, swiglu);
  });
}

template <DispatchKey K>
at::Tensor moe_combine_impl(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& row_of_slot) {
  return run_own(kMoeCombine, K, [&] { return moe_combine(y, weights, row_of_slot); });
}

template <DispatchKey K>
void register_moe(torch::Library& m) {
  m.impl("moe_route", TORCH_FN(moe_route_impl<K>));
  m.impl("moe_experts", TORCH_FN(moe_experts_impl<K>));
  m.impl("moe_combine", TORCH_FN(moe_combine_impl<K>));
}

}  // namespace
}  // namespace mps_ext

// mps_ext's own ops (not aten's): defined here, with kernels for CPU tensors
// (the executor) and, on macOS, MPS tensors. Their Meta (fake) kernels, for
// torch.compile, are in mps_ext/_meta.py.
TORCH_LIBRARY_FRAGMENT(mps_ext, m) {
  m.def("moe_route(Tensor logits, int top_k, bool renormalize=True, bool shared_expert=False, "
        "Tensor? expert_bias=None, bool sigmoid=False, float scale=1.0, float renorm_eps=0.0) -> "
        "(Tensor weights, Tensor offs, Tensor slot_of_row, Tensor row_of_slot)");
  m.def("moe_experts(Tensor x, Tensor weight, Tensor? weight_scale, Tensor offs, Tensor? slot_of_row=None, "
        "int slots_per_token=1, bool swiglu=False) -> Tensor");
  m.def("moe_combine(Tensor y, Tensor weights, Tensor row_of_slot) -> Tensor");
}

TORCH_LIBRARY_IMPL(mps_ext, CPU, m) { mps_ext::register_moe<c10::DispatchKey::CPU>(m); }

#ifdef __APPLE__
TORCH_LIBRARY_IMPL(mps_ext, MPS, m) { mps_ext::register_moe<c10::DispatchKey::MPS>(m); }
#endif
