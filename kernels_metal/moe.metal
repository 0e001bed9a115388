// Routing and combine of a mixture-of-experts layer at decode, as single
// dispatches, around the grouped products of grouped_mm.metal:
//   moe_route    router logits -> top-k weights, per-expert offsets and the
//                slot <-> expert-sorted row maps (one threadgroup: at decode
//                a few tokens, so one GPU core does it in a few microseconds
//                and nothing goes to the CPU).
//   moe_combine  each token's expert outputs summed with its weights.
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
  threadgroup int start[MOE_MAX_EXPERTS + 1];
  const uint slots = p.top_k + p.shared;
  const uint threads = simdgroups * 32;

  for (uint t = 0; t < p.tokens; ++t) {
    const device T* lt = logits + ulong(t) * ulong(p.logits_t_stride);
    const bool by_sigmoid = p.scoring == MOE_SCORING_SIGMOID;
    float l[PER];
    float r[PER];  // what ranks the experts: the logit, or the sigmoid score plus the bias
    bool taken[PER];
    for (uint j = 0; j < PER; ++j) {
      taken[j] = false;
      const uint e = tid + j * threads;
      l[j] = e < p.experts ? float(lt[ulong(e) * ulong(p.logits_e_stride)]) : -INFINITY;
      r[j] = l[j];
      if (by_sigmoid && e < p.experts) r[j] = float(T(sigmoid(l[j]))) + (p.has_bias ? expert_bias[e] : 0.0f);
    }
    // The shared expert's gate, loaded now so that it does not wait behind
    // the barriers below.
    const float shared_gate = p.shared && tid == 0 ? float(lt[ulong(p.experts) * ulong(p.logits_e_stride)]) : 0.0f;
    // Softmax denominators: the max (NaN if a logit is, so that every
    // weight is NaN, as torch's softmax gives), then the sum of exponentials.
    uint mk = rank_key(l[0]);
    for (uint j = 1; j < PER; ++j) mk = max(mk, rank_key(l[j]));
    uint unused = 0;
    float no_value = 0.0f;
    best_of_threadgroup(mk, unused, no_value, sg, lane, simdgroups, keys, idxs, vals);
    const float mx = key_value(mk);
    float sum = 0.0f;
    for (uint j = 0; j < PER; ++j) sum += l[j] == -INFINITY ? 0.0f : exp(l[j] - mx);
    sum = simd_sum(sum);
    if (lane == 0) sums[sg] = sum;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    sum = 0.0f;
    for (uint s = 0; s < simdgroups; ++s) sum += sums[s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Top-k, one winner at a time; its owner drops it from its candidates.
    float chosen_sum = 0.0f;
    for (uint k = 0; k < p.top_k; ++k) {
      // The winner carries its logit: its score is then known without a
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
      float prob;
      if (by_sigmoid) {  // the chosen expert's score without its bias
        prob = float(T(sigmoid(logit)));
      } else {
        prob = exp(key_value(key) - mx) / sum;
      }
      chosen_sum += prob;
      if (tid == 0) {
        ids[t * slots + k] = int(at);
        weights[t * slots + k] = prob;
      }
    }
    if (tid == 0) {
      if (p.renormalize)
        for (uint k = 0; k < p.top_k; ++k) weights[t * slots + k] /= chosen_sum + p.renorm_eps;
      for (uint k = 0; k < p.top_k; ++k) weights[t * slots + k] *= p.scale;
      if (p.shared) {
        ids[t * slots + p.top_k] = int(p.experts);
        weights[t * slots + p.top_k] = sigmoid(shared_gate);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Counting sort of the slots by expert.
  const uint total = p.tokens * slots, experts = p.experts + p.shared;
  for (uint e = tid; e < experts; e += threads) {
    int count = 0;
    for (uint i = 0; i < total; ++i) count += ids[i] == int(e) ? 1 : 0;
    start[e + 1] = count;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    start[0] = 0;
    for (uint e = 0; e < experts; ++e) {
      start[e + 1] += start[e];
      offs[e] = start[e + 1];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // A slot's row: the slots of lower experts, then those of its own before
  // it. Counted over `ids`, which every lane reads at one address at a time
  // (a broadcast), not looked up in `start` at a per-lane expert (which
  // would put lanes on one bank at experts 32 apart).
  for (uint i = tid; i < total; i += threads) {
    const int e = ids[i];
    int row = 0;
    for (uint j = 0; j < total; ++j) row += ids[j] < e || (ids[j] == e && j < i) ? 1 : 0;
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
