// The RMSNorm's arithmetic, shared by the norm kernels (norm.metal) and the
// GEMV that norms its activation rows itself (linear.metal,
// rms_norm_gemv_rows): both must give the same normed values to the bit,
// so both add a row's squares in this order and round as here.
//
// A row of n elements is a team's of `team` threads (a power of two, at
// least 32: csrc/ops/norm.cpp's rms_norm_params). Thread t of the team
// holds elements c * team + t, c < RMS_NORM_PER_THREAD (rms_norm_element),
// and adds their squares in c's order (rms_norm_squares); its simdgroup
// adds the 32 threads' sums with simd_sum; a team of more than one
// simdgroup adds its simdgroups' sums in simdgroup order
// (rms_norm_team_total). A kernel with fewer threads than the team (the
// GEMV) runs the team's simdgroups one after another on its own: the same
// lanes hold the same elements, so the same sums come out.
#pragma once
#include "norm_params.h"

// The element of a row that slot c of team thread t holds.
MPS_EXT_INLINE uint rms_norm_element(int c, uint t, uint team) { return uint(c) * team + t; }

// A thread's sum of the squares of its slots, in slot order. torch rounds
// the squares (pow) before summing them (mean): no fused multiply-add.
MPS_EXT_INLINE float rms_norm_squares(thread const float* v) {
  float ss = 0.0f;
  MPS_EXT_UNROLL
  for (int c = 0; c < RMS_NORM_PER_THREAD; ++c) {
    const float sq = v[c] * v[c];
    ss += sq;
  }
  return ss;
}

// A team's sum from its `count` simdgroups' sums (each a simd_sum), in
// simdgroup order; one simdgroup's is its own.
MPS_EXT_INLINE float rms_norm_team_total(const threadgroup float* sums, uint count, float own) {
  if (count == 1) return own;
  float ss = 0.0f;
  for (uint s = 0; s < count; ++s) ss += sums[s];
  return ss;
}

// 1 / sqrt(mean(x^2) + eps), float32 as torch's rsqrt.
MPS_EXT_INLINE float rms_norm_inverse(float ss, uint n, float eps) { return 1.0f / sqrt(ss / float(n) + eps); }

// The normed value times the weight, rounded where the models round
// (norm.metal's variants), returned in float.
template <typename T>
inline float rms_norm_out(float normed, float w, uint zero_centred) {
  return zero_centred ? float(T(normed * (1.0f + w))) : float(T(w * float(T(normed))));
}
