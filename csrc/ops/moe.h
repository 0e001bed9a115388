// The routing and combine of a mixture-of-experts layer at decode
// (moe.cpp; the down product fused with the combine:
// grouped_mm.cpp), for the whole-layer op (moe.cpp). One dispatch
// each.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>
#include <vector>

namespace mps_ext {

struct KernelArg;  // backend/launch.h

// Router logits [tokens, experts (+1 shared)] -> (weights [tokens, slots]
// float32, offs [experts (+1)] int32, slot_of_row, row_of_slot) int32.
// Sigmoid scoring, expert_bias, scale and renorm_eps: MoeRouteParams.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k,
                                                                     bool renormalize, bool shared_expert,
                                                                     const c10::optional<at::Tensor>& expert_bias,
                                                                     bool sigmoid, double scale, double renorm_eps);
// out[t] = sum_j weights[t, j] * y[row_of_slot[t * slots + j]].
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& weights, const at::Tensor& row_of_slot);
// moe_experts(h, down, down_scale, offs) then moe_combine in one dispatch,
// bit for bit (moe_layer's decode; grouped_mm.cpp): out[t] = sum_j
// weights[t, j] * (down h)[row_of_slot[t * slots + j]], rounded to h's
// dtype, then + residual[t] (rounded again) where one is given.
at::Tensor moe_down_combine(const at::Tensor& h, const at::Tensor& down, const c10::optional<at::Tensor>& down_scale,
                            const at::Tensor& offs, const at::Tensor& weights, const at::Tensor& row_of_slot,
                            const c10::optional<at::Tensor>& residual);

// moe_experts(x, weight, weight_scale, offs, slot_of_row, slots, swiglu=true)
// for `rows` = tokens * slots routed rows, with the routing that makes offs
// and slot_of_row in the same dispatch (grouped_mm.cpp: the kernel
// moe_gate_up_routed routes from the router's `logits`; `route` its
// buffers 7-12, moe.cpp's). nullopt, nothing launched, where that kernel
// does not take the operands.
c10::optional<at::Tensor> moe_experts_routed(const at::Tensor& x, const at::Tensor& weight,
                                             const c10::optional<at::Tensor>& weight_scale, const at::Tensor& logits,
                                             int64_t slots, int64_t rows, const std::vector<KernelArg>& route);

#ifdef MPS_EXT_TEST_HOOKS
// Test hook (_C._moe_routed_gate_up): moe_layer's gate/up dispatch with its
// routing, as experts_of launches it, returning (h, weights, offs,
// slot_of_row, row_of_slot); empty where the layer takes moe_route instead.
std::vector<at::Tensor> moe_routed_gate_up_for_tests(const at::Tensor& xe, const at::Tensor& gate_up,
                                                     const c10::optional<at::Tensor>& gate_up_scale,
                                                     const at::Tensor& logits, int64_t top_k, bool renormalize,
                                                     bool shared_expert, const c10::optional<at::Tensor>& expert_bias,
                                                     bool sigmoid, double scale, double renorm_eps);
#endif

}  // namespace mps_ext
