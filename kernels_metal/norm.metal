// RMSNorm of the last dimension, as transformers' models write it, in one
// dispatch (eager, it is 6 to 8 aten ops: to(float32), pow, mean, add,
// rsqrt, mul, to, mul). Every step is float32 and rounds where the model's
// code rounds:
//   normed = x * (1 / sqrt(mean(x^2) + eps))        (float32, as torch's rsqrt: 1 / sqrt)
//   weight variant (Llama, Qwen3, LFM2):       out = w * T(normed)   (product of two T, rounded to T)
//   zero-centred (Qwen3-Next, Qwen3.5, Gemma): out = T(normed * (1 + float(w)))
// Only the order of mean's sum differs from torch's (a tree here): float32
// results may differ in the last bit, and rarely a rounded T.
//
// A thread keeps its elements in registers between the reduction and the
// write, so x is read once; a team's threads read its weight elements once
// for all its rows. Element i of a row is thread i % team's, so each load
// and store instruction of a simdgroup covers consecutive addresses.
#include <metal_stdlib>
#include "norm_params.h"
using namespace metal;

template <typename T>
[[max_total_threads_per_threadgroup(RMS_NORM_MAX_THREADS)]]
kernel void rms_norm(device T* out [[buffer(0)]],
                     const device T* x [[buffer(1)]],
                     const device T* w [[buffer(2)]],
                     constant RmsNormParams& p [[buffer(3)]],
                     uint group [[threadgroup_position_in_grid]],
                     uint tid [[thread_position_in_threadgroup]],
                     uint threads [[threads_per_threadgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  // Two sets of partial sums, alternating per row: a team's threads read a
  // row's before the next row's barrier, so the row after next may reuse it
  // with no second barrier.
  threadgroup float partial[2][RMS_NORM_MAX_THREADS / 32];
  constexpr int PER = RMS_NORM_PER_THREAD;
  const uint team = 1u << p.team_shift;
  const uint team_index = group * (threads >> p.team_shift) + (tid >> p.team_shift);
  const uint t = tid & (team - 1);
  const uint first_sg = (tid >> p.team_shift) * (team / 32);  // the team's simdgroups in the threadgroup
  const bool team_live = team_index < p.teams;
  float wv[PER];
  MPS_EXT_UNROLL for (int c = 0; c < PER; ++c) {
    const uint i = uint(c) * team + t;
    wv[c] = team_live && i < p.n ? float(w[i]) : 0.0f;
  }
  const float n = float(p.n);
  for (uint j = 0; j < p.iterations; ++j) {
    const uint row = team_index + j * p.teams;
    const bool live = team_live && row < p.rows;
    const device T* xr = x + row * p.row_stride;
    float v[PER];
    float ss = 0.0f;
    MPS_EXT_UNROLL for (int c = 0; c < PER; ++c) {
      const uint i = uint(c) * team + t;
      v[c] = live && i < p.n ? float(xr[i]) : 0.0f;
      // torch rounds the squares (pow) before summing them (mean): no fused multiply-add.
      const float sq = v[c] * v[c];
      ss += sq;
    }
    ss = simd_sum(ss);
    if (team > 32) {  // the same for every thread: a uniform barrier
      if (lane == 0) partial[j & 1][sg] = ss;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      ss = 0.0f;
      for (uint s = 0; s < team / 32; ++s) ss += partial[j & 1][first_sg + s];
    }
    if (!live) continue;
    const float inv = 1.0f / sqrt(ss / n + p.eps);
    device T* o = out + row * p.n;
    MPS_EXT_UNROLL for (int c = 0; c < PER; ++c) {
      const uint i = uint(c) * team + t;
      if (i < p.n) {
        const float normed = v[c] * inv;
        o[i] = p.zero_centred ? T(normed * (1.0f + wv[c])) : T(wv[c] * float(T(normed)));
      }
    }
  }
}

template [[host_name("rms_norm_f32")]] kernel decltype(rms_norm<float>) rms_norm<float>;
template [[host_name("rms_norm_f16")]] kernel decltype(rms_norm<half>) rms_norm<half>;
template [[host_name("rms_norm_bf16")]] kernel decltype(rms_norm<bfloat>) rms_norm<bfloat>;
