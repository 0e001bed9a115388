// Routing and combine of a mixture-of-experts layer at decode, as single
// dispatches, around the grouped products of grouped_mm.metal:
//   moe_route    router logits -> top-k weights, per-expert offsets and the
//                slot <-> expert-sorted row maps (one threadgroup: at decode
//                a few tokens, so one GPU core does it in a few microseconds
//                and nothing goes to the CPU).
//   moe_combine  each token's expert outputs summed with its weights.
#include <metal_stdlib>
#include "moe_route.h"
using namespace metal;

template <typename T>
[[max_total_threads_per_threadgroup(MOE_ROUTE_THREADS)]]
kernel void moe_route(device float* weights [[buffer(0)]],
                      device int* offs [[buffer(1)]],
                      device int* slot_of_row [[buffer(2)]],
                      device int* row_of_slot [[buffer(3)]],
                      const device T* logits [[buffer(4)]],
                      constant MoeRouteParams& p [[buffer(5)]],
                      const device float* expert_bias [[buffer(6)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint PER = MOE_MAX_EXPERTS / MOE_ROUTE_THREADS;  // experts per thread
  threadgroup uint keys[MOE_ROUTE_THREADS / 32];
  threadgroup uint idxs[MOE_ROUTE_THREADS / 32];
  threadgroup float vals[MOE_ROUTE_THREADS / 32];
  threadgroup float sums[MOE_ROUTE_THREADS / 32];
  threadgroup int ids[MOE_MAX_SLOTS];
  const uint slots = p.top_k + p.shared;
  const uint threads = simdgroups * 32;

  for (uint t = 0; t < p.tokens; ++t) {
    const RouteLogits<T> lt{logits + ulong(t) * ulong(p.logits_t_stride), p.logits_e_stride};
    float l[PER];
    float r[PER];  // what ranks the experts: the logit, or the sigmoid score plus the bias
    bool taken[PER];
    for (uint j = 0; j < PER; ++j) {
      taken[j] = false;
      const uint e = tid + j * threads;
      l[j] = e < p.experts ? lt.at(e) : -INFINITY;
      r[j] = e < p.experts ? route_rank_value(lt, e, l[j], p, expert_bias) : l[j];
    }
    // The shared expert's gate, loaded now so that it does not wait behind
    // the barriers below.
    const float shared_gate = p.shared && tid == 0 ? lt.at(p.experts) : 0.0f;
    // Softmax denominators: the max (NaN if a logit is, so that every
    // weight is NaN, as torch's softmax gives), then the sum of exponentials.
    uint mk = rank_key(l[0]);
    for (uint j = 1; j < PER; ++j) mk = max(mk, rank_key(l[j]));
    uint unused = 0;
    float no_value = 0.0f;
    best_of_threadgroup(mk, unused, no_value, sg, lane, simdgroups, keys, idxs, vals);
    const float mx = key_value(mk);
    const float sum = route_softmax_sum(lt, p.experts, mx, sg, lane, simdgroups, sums);
    // Top-k, one winner at a time; its owner drops it from its candidates.
    float chosen_sum = 0.0f;
    for (uint k = 0; k < p.top_k; ++k) {
      // The winner carries its logit: its weight is then known without a
      // load after the barriers.
      uint key = 0, at = 0xffffffffu;
      float logit = 0.0f;
      for (uint j = 0; j < PER; ++j) {
        const uint e = tid + j * threads;
        if (e < p.experts && !taken[j] && (rank_key(r[j]) > key || at == 0xffffffffu)) {
          key = rank_key(r[j]);
          at = e;
          logit = l[j];
        }
      }
      best_of_threadgroup(key, at, logit, sg, lane, simdgroups, keys, idxs, vals);
      for (uint j = 0; j < PER; ++j)
        if (tid + j * threads == at) taken[j] = true;
      const float prob = route_weight(lt, logit, mx, sum, p);
      chosen_sum += prob;
      if (tid == 0) {
        ids[t * slots + k] = int(at);
        weights[t * slots + k] = prob;
      }
    }
    if (tid == 0) {
      if (p.shared) ids[t * slots + p.top_k] = int(p.experts);
      route_finish(chosen_sum, shared_gate, p, weights + t * slots);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Counting sort of the slots by expert.
  const uint total = p.tokens * slots;
  route_offsets(ids, total, p.experts + p.shared, tid, threads, offs);
  for (uint i = tid; i < total; i += threads) {
    const int row = route_row(ids, total, i);
    slot_of_row[row] = int(i);
    row_of_slot[i] = row;
  }
}

// A threadgroup owns MOE_COMBINE_THREADS * MOE_COMBINE_OUTPUTS consecutive
// outputs of one token; thread t takes every MOE_COMBINE_THREADS-th from
// its t-th, so that each load and store instruction of a simdgroup covers
// 32 consecutive elements (one or two cache lines). Each slot's weight *
// y is added with one fma, in slot order: the rounding moe_down_combine
// repeats and the tests state (fma() written out: Safe math lets a compiler
// contract `acc += w * y`, it does not make it).
template <typename T>
[[max_total_threads_per_threadgroup(MOE_COMBINE_THREADS)]]
kernel void moe_combine(device T* out [[buffer(0)]],
                        const device T* y [[buffer(1)]],
                        const device float* weights [[buffer(2)]],
                        const device int* row_of_slot [[buffer(3)]],
                        constant MoeCombineParams& p [[buffer(4)]],
                        uint2 tg [[threadgroup_position_in_grid]],
                        uint2 tpos [[thread_position_in_threadgroup]]) {
  const uint t = tg.y, h0 = tg.x * (MOE_COMBINE_THREADS * MOE_COMBINE_OUTPUTS) + tpos.x;
  float acc[MOE_COMBINE_OUTPUTS];
  for (int i = 0; i < MOE_COMBINE_OUTPUTS; ++i) acc[i] = 0.0f;
  for (uint j = 0; j < p.slots; ++j) {
    const uint slot = t * p.slots + j;
    const float w = weights[slot];
    const device T* yr = y + ulong(row_of_slot[slot]) * ulong(p.y_row_stride);
    for (uint i = 0; i < MOE_COMBINE_OUTPUTS; ++i) {
      const uint h = h0 + i * MOE_COMBINE_THREADS;
      if (h < p.hidden) acc[i] = fma(w, float(yr[h]), acc[i]);
    }
  }
  device T* o = out + ulong(t) * ulong(p.out_row_stride);
  for (uint i = 0; i < MOE_COMBINE_OUTPUTS; ++i) {
    const uint h = h0 + i * MOE_COMBINE_THREADS;
    if (h < p.hidden) o[h] = T(acc[i]);
  }
}

// clang-format off
template [[host_name("moe_route_f32")]] kernel decltype(moe_route<float>) moe_route<float>;
template [[host_name("moe_route_f16")]] kernel decltype(moe_route<half>) moe_route<half>;
template [[host_name("moe_route_bf16")]] kernel decltype(moe_route<bfloat>) moe_route<bfloat>;
template [[host_name("moe_combine_f32")]] kernel decltype(moe_combine<float>) moe_combine<float>;
template [[host_name("moe_combine_f16")]] kernel decltype(moe_combine<half>) moe_combine<half>;
template [[host_name("moe_combine_bf16")]] kernel decltype(moe_combine<bfloat>) moe_combine<bfloat>;
// clang-format on
