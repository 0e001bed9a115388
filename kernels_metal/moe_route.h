// The routing of a mixture-of-experts layer at decode (MoeRouteParams,
// moe_params.h), in pieces shared by moe.metal's moe_route (one
// threadgroup, its own dispatch) and grouped_mm.metal's moe_gate_up_routed
// (the experts' gate/up product, each threadgroup routing the tokens
// itself from the router's logits): both give the same ids, weights,
// offsets and row maps, bit for bit.
#pragma once
#include <metal_stdlib>
#include "moe_params.h"
#include "activations.h"
using namespace metal;

// Logits ranked as torch.topk ranks them: NaN above every number. A uint
// key in that order (a float's bits with the sign flipped, or all bits for
// a negative number; every NaN the largest key) lets one uint simd_max
// rank them, where a float max would drop a NaN. Keys of equal values are
// equal (but -0 ranks below +0), and ties go to the smallest index.
inline uint rank_key(float v) {
  const uint b = as_type<uint>(v);
  return isnan(v) ? 0xffffffffu : (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
inline float key_value(uint k) {
  return k == 0xffffffffu ? NAN : as_type<float>((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

// The best (largest key, then smallest index) of every thread's candidate,
// with the value the candidate carries, known to all threads. Two barriers;
// `keys`, `idxs`, `vals` hold one entry per simdgroup.
inline void best_of_threadgroup(thread uint& key,
                                thread uint& i,
                                thread float& val,
                                uint sg,
                                uint lane,
                                uint simdgroups,
                                threadgroup uint* keys,
                                threadgroup uint* idxs,
                                threadgroup float* vals) {
  const uint best = simd_max(key);
  const uint at = simd_min(key == best ? i : 0xffffffffu);
  const float v = simd_shuffle(val, ushort(simd_min(key == best && i == at ? lane : 31u)));
  if (lane == 0) {
    keys[sg] = best;
    idxs[sg] = at;
    vals[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  key = keys[0];
  i = idxs[0];
  val = vals[0];
  for (uint s = 1; s < simdgroups; ++s)
    if (keys[s] > key || (keys[s] == key && idxs[s] < i)) {
      key = keys[s];
      i = idxs[s];
      val = vals[s];
    }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before the arrays are written again
}

// One token's router logits, in the logits' type T (moe_route's template
// argument), as floats; `round` rounds a float to T, as the model computes
// its sigmoid scores.
template <typename T>
struct RouteLogits {
  const device T* p;
  long stride;
  MPS_EXT_INLINE float at(uint e) const { return float(p[ulong(e) * ulong(stride)]); }
  MPS_EXT_INLINE float round(float v) const { return float(T(v)); }
};

// The same in a type chosen at run time (MoeRouteParams.logits_type): the
// gate/up kernel's activations are bfloat16 under fp8 experts whatever the
// router's dtype, so its type does not name the logits'.
struct RouteLogitsAny {
  const device uchar* p;
  long stride;
  uint type;
  MPS_EXT_INLINE float at(uint e) const {
    const ulong i = ulong(e) * ulong(stride);
    return type == MOE_LOGITS_F16    ? float(((const device half*)p)[i])
           : type == MOE_LOGITS_BF16 ? float(((const device bfloat*)p)[i])
                                     : ((const device float*)p)[i];
  }
  MPS_EXT_INLINE float round(float v) const {
    return type == MOE_LOGITS_F16 ? float(half(v)) : type == MOE_LOGITS_BF16 ? float(bfloat(v)) : v;
  }
};

// What ranks expert e: its logit, or (sigmoid scoring) its score rounded to
// the logits' type plus its bias.
template <typename L>
inline float route_rank_value(L lt, uint e, float l, constant MoeRouteParams& p, const device float* expert_bias) {
  return p.scoring == MOE_SCORING_SIGMOID ? lt.round(sigmoid(l)) + (p.has_bias ? expert_bias[e] : 0.0f) : l;
}

// The softmax denominator of one token: sum over the experts of exp(l -
// mx), added in moe_route's order whatever the threadgroup's size: as
// MOE_ROUTE_THREADS threads each summing its experts tid + j *
// MOE_ROUTE_THREADS in j order, then simd_sum per simdgroup of 32 such
// threads, then the MOE_ROUTE_THREADS / 32 partial sums in order. A
// simdgroup of a smaller threadgroup plays each 32 of them in turn
// (simdgroups divides nothing: the loop is uniform per simdgroup). Two
// barriers; `sums` holds MOE_ROUTE_THREADS / 32 floats. Every thread of
// the threadgroup calls it.
template <typename L>
inline float route_softmax_sum(
    L lt, uint experts, float mx, uint sg, uint lane, uint simdgroups, threadgroup float* sums) {
  constexpr uint PER = MOE_MAX_EXPERTS / MOE_ROUTE_THREADS;
  for (uint vs = sg; vs < MOE_ROUTE_THREADS / 32; vs += simdgroups) {
    float sum = 0.0f;
    for (uint j = 0; j < PER; ++j) {
      const uint e = vs * 32 + lane + j * MOE_ROUTE_THREADS;
      const float l = e < experts ? lt.at(e) : -INFINITY;
      sum += l == -INFINITY ? 0.0f : exp(l - mx);
    }
    sum = simd_sum(sum);
    if (lane == 0) sums[vs] = sum;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float sum = 0.0f;
  for (uint s = 0; s < MOE_ROUTE_THREADS / 32; ++s) sum += sums[s];
  threadgroup_barrier(mem_flags::mem_threadgroup);  // before `sums` is written again
  return sum;
}

// The weight of a chosen expert of logit l: its score without its bias
// (sigmoid), or its softmax probability from the max logit mx and the
// denominator sum, exp taken of the logit's key as the ranking carried it.
template <typename L>
inline float route_weight(L lt, float l, float mx, float sum, constant MoeRouteParams& p) {
  return p.scoring == MOE_SCORING_SIGMOID ? lt.round(sigmoid(l)) : exp(key_value(rank_key(l)) - mx) / sum;
}

// One token's weights[0, top_k) once each holds its route_weight and
// chosen_sum their sum (added in rank order): renormalised by it if asked,
// times the scale; then the shared expert's, sigmoid of its logit
// shared_gate, after them. One thread.
inline void route_finish(float chosen_sum, float shared_gate, constant MoeRouteParams& p, device float* weights) {
  if (p.renormalize)
    for (uint k = 0; k < p.top_k; ++k) weights[k] /= chosen_sum + p.renorm_eps;
  for (uint k = 0; k < p.top_k; ++k) weights[k] *= p.scale;
  if (p.shared) weights[p.top_k] = sigmoid(shared_gate);
}

// The counting sort of the slots by expert, from every slot's expert
// ids[0, total): offs[e] the slots of experts <= e, for e < experts (the
// shared one included); a slot's row the slots of lower experts, then
// those of its own before it. Counted over `ids`, which every lane reads
// at one address at a time (a broadcast), not through per-lane lookups
// (which would put lanes on one bank at experts 32 apart). No barrier.
inline void route_offsets(
    threadgroup const int* ids, uint total, uint experts, uint tid, uint threads, device int* offs) {
  for (uint e = tid; e < experts; e += threads) {
    int count = 0;
    for (uint i = 0; i < total; ++i) count += ids[i] <= int(e) ? 1 : 0;
    offs[e] = count;
  }
}
inline int route_row(threadgroup const int* ids, uint total, uint i) {
  const int e = ids[i];
  int row = 0;
  for (uint j = 0; j < total; ++j) row += ids[j] < e || (ids[j] == e && j < i) ? 1 : 0;
  return row;
}
