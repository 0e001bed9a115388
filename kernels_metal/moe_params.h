// Parameters of mps_ext's fused mixture-of-experts decode ops
// (moe.metal, csrc/ops/moe.cpp): routing and combine
// around the grouped products of grouped_mm.metal.
#pragma once
#include "shared_types.h"

// Routing of `tokens` tokens over `experts` experts, top_k each, plus (if
// `shared`) one shared expert with index `experts` that every token uses,
// weighted by sigmoid of its logit (logits column `experts`). Slot i = t *
// slots + j (slots = top_k + shared) of token t is sorted by expert into
// row rows_of_slot[i]; slot_of_row is its inverse.
//
// Scoring MOE_SCORING_SOFTMAX: experts ranked by logit, weights softmax.
// MOE_SCORING_SIGMOID (LFM2-MoE): scores sigmoid(logit) rounded to the
// logits' dtype (as the model computes them); experts ranked by score plus
// expert_bias[e] (if has_bias), weights the scores. Then, if renormalize,
// weights / (their sum + renorm_eps); then times scale.
struct MoeRouteParams {
  uint32_t tokens, experts, top_k, shared;
  uint32_t renormalize;  // top-k weights divided by their sum (Qwen3's norm_topk_prob)
  uint32_t scoring;
  int64_t logits_t_stride, logits_e_stride;
  float scale, renorm_eps;
  uint32_t has_bias;
  uint32_t logits_type;  // MOE_LOGITS_*: the logits' dtype (read by moe_gate_up_routed; moe_route's is its T)
};
#define MOE_LOGITS_F32 0
#define MOE_LOGITS_F16 1
#define MOE_LOGITS_BF16 2
#define MOE_SCORING_SOFTMAX 0
#define MOE_SCORING_SIGMOID 1

// out[t, h] = sum_j weights[t, j] * y[rows_of_slot[t * slots + j], h]
struct MoeCombineParams {
  uint32_t tokens, slots, hidden, pad;
  int64_t y_row_stride, out_row_stride;
};

// One routing threadgroup holds every slot and every expert count.
#define MOE_ROUTE_THREADS 256
#define MOE_MAX_SLOTS 1024
#define MOE_MAX_EXPERTS 1024
// A combine thread computes this many outputs of a token, MOE_COMBINE_THREADS apart.
#define MOE_COMBINE_OUTPUTS 8
#define MOE_COMBINE_THREADS 64
// moe_gate_up_routed (grouped_mm.metal): the routing its threadgroups do
// themselves, kept in the threadgroup memory of their activation tile
// before it is staged: one token's keys, one per expert, then every
// slot's expert, then the softmax's partial sums. The host takes the
// 4-dispatch path (moe_route) past these.
#define MOE_FUSED_MAX_EXPERTS 512
#define MOE_FUSED_MAX_SLOTS 128
