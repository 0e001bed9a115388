// The routing and combine of a mixture-of-experts layer at decode
// (moe.cpp; the down product fused with the combine:
// grouped_mm.cpp), for the whole-layer op (moe.cpp). One dispatch
// each.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace mps_ext {

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

}  // namespace mps_ext
