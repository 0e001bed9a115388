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
// Kernels: kernels_metal/moe.metal and gmm_decode_rows of
// kernels_metal/grouped_mm.metal.
//
// torch.ops.mps_ext.moe_layer, the family's fifth op: a whole
// mixture-of-experts layer at decode from one host call (mps_ext.optimize
// puts transformers' MoE blocks on it).
// Eager PyTorch on a Mac pays about 20 us of CPU per op it encodes, and a
// MoE block written op by op (router, softmax, top-k, renormalisation, the
// per-expert loop or grouped products with their sorting, combine, shared
// expert) is dozens of ops; here the same layer is three dispatches encoded
// by one call:
//
//   logits  = router GEMV of x                        (linear.cpp's kernels)
//   h, weights, offs, slot_of_row, row_of_slot = moe_gate_up_routed(x, gate_up, logits)
//   out     = moe_down_combine(h, down, weights, row_of_slot[, residual])
//
// The second is moe_route(logits) then moe_experts(x, gate_up, offs,
// slot_of_row, swiglu) in one kernel with the same bits (grouped_mm.metal:
// every threadgroup routes the tokens itself; threadgroup (0, 0) writes
// moe_route's outputs for the next dispatch). Where it does not take the
// shapes (past MOE_FUSED_MAX_EXPERTS experts or MOE_FUSED_MAX_SLOTS token
// slots, rows not 16-byte aligned: routed_gate_up below), those two
// dispatches: four a layer.
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
// torch.ops.mps_ext.add_rms_norm_moe_layer: the decoder layer's residual add
// and post-attention norm before the layer (add_rms_norm's), in the router
// GEMV's dispatch: three dispatches where add_rms_norm and moe_layer take
// four (below).
//
// A shared expert (Qwen3-Next, Qwen3.5/3.6-MoE) is expert E of the banks and
// row E of the router (its sigmoid gate), as moe_route defines it, so it
// costs no dispatch of its own. Prefill beyond moe_route's limit takes the
// block's own forward (mps_ext/passes/moe.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "backend/launch.h"
#include "moe_params.h"
#include "ops/moe.h"
#include "ops/norm.h"
#include "ops/ops.h"
#include "dispatch/registration.h"
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

namespace {

// moe_route's checked arguments, parameters and outputs (moe_route launches
// them; moe_layer's experts_of hands them to the gate/up kernel that routes
// itself).
struct Routing {
  MoeRouteParams p{};
  at::Tensor weights, offs, slot_of_row, row_of_slot;
};

Routing routing(const at::Tensor& logits, int64_t top_k, bool renormalize, bool shared_expert,
                const c10::optional<at::Tensor>& expert_bias, bool sigmoid, double scale, double renorm_eps) {
  float_name(logits.scalar_type(), "moe_route");
  TORCH_CHECK(!expert_bias || sigmoid, "moe_route: expert_bias is for sigmoid scoring");
  TORCH_CHECK(logits.dim() == 2, "moe_route: logits [tokens, experts] expected, got ", logits.sizes());
  const int64_t tokens = logits.size(0), experts = logits.size(1) - (shared_expert ? 1 : 0);
  const int64_t slots = top_k + (shared_expert ? 1 : 0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "moe_route: top_k must be in [1, ", experts, "], got ", top_k);
  TORCH_CHECK(experts + (shared_expert ? 1 : 0) <= MOE_MAX_EXPERTS, "moe_route: at most ", MOE_MAX_EXPERTS, " experts");
  TORCH_CHECK(tokens * slots <= MOE_MAX_SLOTS, "moe_route is for decode: at most ", MOE_MAX_SLOTS,
              " token slots (tokens x (top_k + shared)), got ", tokens * slots);
  if (expert_bias)
    TORCH_CHECK(expert_bias->scalar_type() == at::kFloat && expert_bias->dim() == 1 &&
                    expert_bias->size(0) == experts && expert_bias->is_contiguous(),
                "moe_route: expert_bias must be contiguous float32 [", experts, "], got ", expert_bias->sizes(), " ",
                expert_bias->scalar_type());
  Routing r;
  auto i32 = logits.options().dtype(at::kInt);
  r.weights = at::empty({tokens, slots}, logits.options().dtype(at::kFloat));
  r.offs = at::empty({experts + (shared_expert ? 1 : 0)}, i32);
  r.slot_of_row = at::empty({tokens * slots}, i32), r.row_of_slot = at::empty({tokens * slots}, i32);
  MoeRouteParams& p = r.p;
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
  const auto dt = logits.scalar_type();
  p.logits_type = dt == at::kHalf ? MOE_LOGITS_F16 : dt == at::kBFloat16 ? MOE_LOGITS_BF16 : MOE_LOGITS_F32;
  return r;
}

void launch_route(const Routing& r, const at::Tensor& logits, const c10::optional<at::Tensor>& expert_bias) {
  if (r.p.tokens == 0 && r.offs.numel() == 0) return;
  // Without a bias the kernel reads none; the weights stand in for the buffer.
  launch(Launch{
      "moe",
      std::string("moe_route_") + float_name(logits.scalar_type(), "moe_route"),
      {KernelArg::of(r.weights), KernelArg::of(r.offs), KernelArg::of(r.slot_of_row), KernelArg::of(r.row_of_slot),
       KernelArg::of(logits), KernelArg::value(r.p), KernelArg::of(expert_bias ? *expert_bias : r.weights)},
      {1, 1, 1},
      {MOE_ROUTE_THREADS, 1, 1}});
}

// The layer's gate/up product with r's routing in its dispatch
// (moe_gate_up_routed: r's outputs written there), where its threadgroups
// hold the routing (a decode step's slots and experts) and its one variant
// takes the operands: three dispatches a layer. nullopt, nothing launched:
// moe_route's dispatch, then moe_experts.
c10::optional<at::Tensor> routed_gate_up(const at::Tensor& xe, const at::Tensor& gate_up,
                                         const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& logits,
                                         const Routing& r, const c10::optional<at::Tensor>& expert_bias) {
  if (r.p.experts > MOE_FUSED_MAX_EXPERTS || r.slot_of_row.numel() > MOE_FUSED_MAX_SLOTS) return c10::nullopt;
  return moe_experts_routed(
      xe, gate_up, gate_up_scale, logits, r.p.top_k + r.p.shared, r.slot_of_row.numel(),
      {KernelArg::value(r.p), KernelArg::of(expert_bias ? *expert_bias : r.weights), KernelArg::of(r.weights),
       KernelArg::of(r.offs), KernelArg::of(r.slot_of_row), KernelArg::of(r.row_of_slot)});
}

}  // namespace

#ifdef MPS_EXT_TEST_HOOKS
std::vector<at::Tensor> moe_routed_gate_up_for_tests(const at::Tensor& xe, const at::Tensor& gate_up,
                                                     const c10::optional<at::Tensor>& gate_up_scale,
                                                     const at::Tensor& logits, int64_t top_k, bool renormalize,
                                                     bool shared_expert, const c10::optional<at::Tensor>& expert_bias,
                                                     bool sigmoid, double scale, double renorm_eps) {
  const Routing r = routing(logits, top_k, renormalize, shared_expert, expert_bias, sigmoid, scale, renorm_eps);
  const c10::optional<at::Tensor> h = routed_gate_up(xe, gate_up, gate_up_scale, logits, r, expert_bias);
  if (!h) return {};
  return {*h, r.weights, r.offs, r.slot_of_row, r.row_of_slot};
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k,
                                                                     bool renormalize, bool shared_expert,
                                                                     const c10::optional<at::Tensor>& expert_bias,
                                                                     bool sigmoid, double scale, double renorm_eps) {
  const Routing r = routing(logits, top_k, renormalize, shared_expert, expert_bias, sigmoid, scale, renorm_eps);
  launch_route(r, logits, expert_bias);
  return {r.weights, r.offs, r.slot_of_row, r.row_of_slot};
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
  launch(Launch{
      "moe",
      std::string("moe_combine_") + types,
      {KernelArg::of(out), KernelArg::of(y), KernelArg::of(weights), KernelArg::of(row_of_slot), KernelArg::value(p)},
      {static_cast<uint32_t>((threads + MOE_COMBINE_THREADS - 1) / MOE_COMBINE_THREADS), static_cast<uint32_t>(tokens),
       1},
      {MOE_COMBINE_THREADS, 1, 1}});
  return out;
}

namespace {

bool is_fp8(const at::Tensor& t) { return t.scalar_type() == at::kFloat8_e4m3fn; }

// moe_layer's checks of x, the router, the banks and the residual (`op`
// names the op called).
void check_layer(const char* op, const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                 const at::Tensor& down, const c10::optional<at::Tensor>& residual) {
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
              ": x must be float32, float16 or bfloat16, got ", dt);
  TORCH_CHECK(x.dim() == 2, op, ": x [tokens, hidden] expected, got ", x.sizes());
  TORCH_CHECK(router.dim() == 2 && router.size(1) == x.size(1) && router.scalar_type() == dt, op,
              ": router must be [experts (+1 shared), hidden] in x's dtype, got ", router.sizes(), " ",
              router.scalar_type(), " for x ", x.sizes(), " ", dt);
  const int64_t experts = router.size(0);
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == experts && down.size(0) == experts &&
                  gate_up.size(2) == x.size(1) && down.size(1) == x.size(1) && gate_up.size(1) == 2 * down.size(2),
              op, ": gate_up [E, 2I, H] and down [E, H, I] with E the router's rows expected, got ", gate_up.sizes(),
              " and ", down.sizes(), " for a router of ", experts, " rows");
  const bool fp8 = is_fp8(gate_up);
  TORCH_CHECK(fp8 == is_fp8(down) && (fp8 || (gate_up.scalar_type() == dt && down.scalar_type() == dt)), op,
              ": banks must both be float8_e4m3fn (with scales) or both in x's dtype; got ", gate_up.scalar_type(),
              " and ", down.scalar_type(), " for x ", dt);
  if (residual)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == dt && residual->device() == x.device() &&
                    residual->is_contiguous(),
                op, ": residual must be a contiguous tensor of x's shape, dtype and device (", x.sizes(), " ", dt,
                " on ", x.device(), "), got ", residual->sizes(), " ", residual->scalar_type(), " on ",
                residual->device(), residual->is_contiguous() ? "" : ", not contiguous");
}

// The layer from its router's logits on (checked arguments, x with rows):
// moe_route, the gate/up product of x, the down product with the combine
// (and the residual's add).
at::Tensor experts_of(const at::Tensor& x, const at::Tensor& logits, const at::Tensor& gate_up,
                      const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                      const c10::optional<at::Tensor>& down_scale, int64_t top_k, bool renormalize, bool shared_expert,
                      const c10::optional<at::Tensor>& expert_bias, bool sigmoid, double scale, double renorm_eps,
                      const c10::optional<at::Tensor>& residual) {
  const auto dt = x.scalar_type();
  // The fp8 grouped kernels take bfloat16 activations.
  const at::Tensor xe = is_fp8(gate_up) && dt != at::kBFloat16 ? x.to(at::kBFloat16) : x;
  const int64_t slots = top_k + (shared_expert ? 1 : 0);
  const Routing r = routing(logits, top_k, renormalize, shared_expert, expert_bias, sigmoid, scale, renorm_eps);
  const c10::optional<at::Tensor> routed = routed_gate_up(xe, gate_up, gate_up_scale, logits, r, expert_bias);
  if (!routed) launch_route(r, logits, expert_bias);
  const at::Tensor& weights = r.weights;
  const at::Tensor& offs = r.offs;
  const at::Tensor& row_of_slot = r.row_of_slot;
  const at::Tensor h = routed ? *routed : moe_experts(xe, gate_up, gate_up_scale, offs, r.slot_of_row, slots, true);
  const bool fused = h.scalar_type() == dt;  // the kernel's output is x's dtype: it adds the residual
  const at::Tensor out =
      moe_down_combine(h, down, down_scale, offs, weights, row_of_slot, fused ? residual : c10::nullopt);
  if (fused) return out;
  return residual ? at::add(*residual, out.to(dt)) : out.to(dt);
}

at::Tensor moe_layer(const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                     const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                     const c10::optional<at::Tensor>& down_scale, int64_t top_k, bool renormalize, bool shared_expert,
                     const c10::optional<at::Tensor>& expert_bias, bool sigmoid, double scale, double renorm_eps,
                     const c10::optional<at::Tensor>& residual) {
  check_layer("moe_layer", x, router, gate_up, down, residual);
  if (x.size(0) == 0) return at::empty({0, x.size(1)}, x.options());
  // The router's logits in the model's dtype, as the model computes them.
  const c10::optional<at::Tensor> no_bias;
  const at::Tensor logits =
      !linear_unsupported(x, router, no_bias) ? mps_ext::linear(x, router, no_bias) : at::linear(x, router);
  return experts_of(x, logits, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared_expert, expert_bias,
                    sigmoid, scale, renorm_eps, residual);
}

// torch.ops.mps_ext.add_rms_norm_moe_layer: a decoder layer's `h = residual
// + x`, `normed = post_norm(h)` and `h + moe(normed)` (mps_ext/passes/decoder.py),
// add_rms_norm then moe_layer(normed, ..., residual=h) bit for bit, with the
// add and the norm in the router GEMV's dispatch (linear.cpp's
// add_rms_norm_gemv: every threadgroup adds and norms the rows itself,
// threadgroup 0 writes h and normed for the rest of the layer): three
// dispatches a decode step where the two ops take four. Where that kernel
// does not take the rows (more than 8, normed rows past its threadgroup
// memory, a router not contiguous along K), the two ops. Returns (h,
// normed, out).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_moe_layer(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    c10::string_view variant, const at::Tensor& router, const at::Tensor& gate_up,
    const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down, const c10::optional<at::Tensor>& down_scale,
    int64_t top_k, bool renormalize, bool shared_expert, const c10::optional<at::Tensor>& expert_bias, bool sigmoid,
    double scale, double renorm_eps) {
  const char* op = "add_rms_norm_moe_layer";
  check_layer(op, x, router, gate_up, down, c10::nullopt);  // (h, its residual, is made here: x's shape, contiguous)
  if (auto fused = add_rms_norm_gemv(x, residual, norm_weight, eps, variant, router)) {
    auto [h, normed, logits] = *fused;
    return {h, normed,
            experts_of(normed, logits, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared_expert,
                       expert_bias, sigmoid, scale, renorm_eps, h)};
  }
  auto [h, normed] = add_rms_norm(x, residual, norm_weight, eps, variant);
  return {h, normed,
          moe_layer(normed, router, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared_expert,
                    expert_bias, sigmoid, scale, renorm_eps, h)};
}

// Each op runs mps_ext's kernel (or says why it cannot: there is no torch
// kernel to fall back to) and counts as a moe call.
using c10::DispatchKey;

const RoutedOp kMoeRoute(FamilyId::moe, "mps_ext::moe_route"), kMoeExperts(FamilyId::moe, "mps_ext::moe_experts"),
    kMoeCombine(FamilyId::moe, "mps_ext::moe_combine"), kMoeLayer(FamilyId::moe, "mps_ext::moe_layer"),
    kAddRmsNormMoeLayer(FamilyId::moe, "mps_ext::add_rms_norm_moe_layer");

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_impl(const at::Tensor& logits, int64_t top_k,
                                                                          bool renormalize, bool shared_expert,
                                                                          const c10::optional<at::Tensor>& expert_bias,
                                                                          bool sigmoid, double scale,
                                                                          double renorm_eps) {
  return run_own(kMoeRoute, K, [&] {
    return moe_route(logits, top_k, renormalize, shared_expert, expert_bias, sigmoid, scale, renorm_eps);
  });
}

template <DispatchKey K>
at::Tensor moe_experts_impl(const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& weight_scale, const at::Tensor& offs,
                            const c10::optional<at::Tensor>& slot_of_row, int64_t slots_per_token, bool swiglu) {
  return run_own(kMoeExperts, K,
                 [&] { return moe_experts(x, weight, weight_scale, offs, slot_of_row, slots_per_token, swiglu); });
}

template <DispatchKey K>
at::Tensor moe_combine_impl(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& row_of_slot) {
  return run_own(kMoeCombine, K, [&] { return moe_combine(y, weights, row_of_slot); });
}

template <DispatchKey K>
at::Tensor moe_layer_impl(const at::Tensor& x, const at::Tensor& router, const at::Tensor& gate_up,
                          const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                          const c10::optional<at::Tensor>& down_scale, int64_t top_k, bool renormalize,
                          bool shared_expert, const c10::optional<at::Tensor>& expert_bias, bool sigmoid, double scale,
                          double renorm_eps, const c10::optional<at::Tensor>& residual) {
  return run_own(kMoeLayer, K, [&] {
    return moe_layer(x, router, gate_up, gate_up_scale, down, down_scale, top_k, renormalize, shared_expert,
                     expert_bias, sigmoid, scale, renorm_eps, residual);
  });
}

template <DispatchKey K>
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm_moe_layer_impl(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    c10::string_view variant, const at::Tensor& router, const at::Tensor& gate_up,
    const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down, const c10::optional<at::Tensor>& down_scale,
    int64_t top_k, bool renormalize, bool shared_expert, const c10::optional<at::Tensor>& expert_bias, bool sigmoid,
    double scale, double renorm_eps) {
  return run_own(kAddRmsNormMoeLayer, K, [&] {
    return add_rms_norm_moe_layer(x, residual, norm_weight, eps, variant, router, gate_up, gate_up_scale, down,
                                  down_scale, top_k, renormalize, shared_expert, expert_bias, sigmoid, scale,
                                  renorm_eps);
  });
}

// Their Meta (fake) kernels, for torch.compile, are in mps_ext/_meta.py.
template <DispatchKey K>
void register_moe(FamilyOps& ops) {
  ops.own("moe_route(Tensor logits, int top_k, bool renormalize=True, bool shared_expert=False, "
          "Tensor? expert_bias=None, bool sigmoid=False, float scale=1.0, float renorm_eps=0.0) -> "
          "(Tensor weights, Tensor offs, Tensor slot_of_row, Tensor row_of_slot)",
          TORCH_FN(moe_route_impl<K>));
  ops.own("moe_experts(Tensor x, Tensor weight, Tensor? weight_scale, Tensor offs, Tensor? slot_of_row=None, "
          "int slots_per_token=1, bool swiglu=False) -> Tensor",
          TORCH_FN(moe_experts_impl<K>));
  ops.own("moe_combine(Tensor y, Tensor weights, Tensor row_of_slot) -> Tensor", TORCH_FN(moe_combine_impl<K>));
  ops.own("moe_layer(Tensor x, Tensor router, Tensor gate_up, Tensor? gate_up_scale, Tensor down, "
          "Tensor? down_scale, int top_k, bool renormalize=True, bool shared_expert=False, "
          "Tensor? expert_bias=None, bool sigmoid=False, float scale=1.0, float renorm_eps=0.0, "
          "Tensor? residual=None) -> Tensor",
          TORCH_FN(moe_layer_impl<K>));
  ops.own("add_rms_norm_moe_layer(Tensor x, Tensor residual, Tensor norm_weight, float eps, str variant, "
          "Tensor router, Tensor gate_up, Tensor? gate_up_scale, Tensor down, Tensor? down_scale, int top_k, "
          "bool renormalize=True, bool shared_expert=False, Tensor? expert_bias=None, bool sigmoid=False, "
          "float scale=1.0, float renorm_eps=0.0) -> (Tensor h, Tensor normed, Tensor out)",
          TORCH_FN(add_rms_norm_moe_layer_impl<K>));
}

}  // namespace
}  // namespace mps_ext

MPS_EXT_FAMILY(moe, mps_ext::register_moe)
