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

// Element i of the row a norm reads: x's, or with ADD (add_rms_norm, the
// GEMV's residual-add form) the sum x + residual rounded to T as torch's
// add rounds it: float holds the sum of two halves or bfloats closely
// enough (24 >= 2 * 11 + 2 bits) that rounding it again to T gives the
// correctly rounded sum. Without ADD, residual is not read.
template <typename T, bool ADD>
MPS_EXT_INLINE float rms_norm_input(const device T* x, const device T* residual, uint i) {
  return ADD ? float(T(float(x[i]) + float(residual[i]))) : float(x[i]);
}

// 1 / sqrt(mean(x^2) + eps), float32 as torch's rsqrt.
MPS_EXT_INLINE float rms_norm_inverse(float ss, uint n, float eps) { return 1.0f / sqrt(ss / float(n) + eps); }

// The normed value times the weight, rounded where the models round
// (norm.metal's variants), returned in float.
template <typename T>
inline float rms_norm_out(float normed, float w, uint zero_centred) {
  return zero_centred ? float(T(normed * (1.0f + w))) : float(T(w * float(T(normed))));
}

// ------------------------------------------- the norm in a decode GEMV --
// A GEMV that norms its activation rows itself (linear.metal's
// rms_norm_gemv_rows, scaled_mm.metal's rms_norm_fp8_gemv): every
// threadgroup norms the rows (at decode one row of the hidden size, read
// from the caches after the first threadgroup) into threadgroup memory,
// `normed`, rows of n, as rms_norm's team of 1 << np.team_shift threads
// would (the same elements per lane, the same simd_sum and the same order
// of the team's simdgroups, run here one after another by this
// threadgroup's simdgroups), so that the normed values are rms_norm's to
// the bit; then decode.h's decode_rows reads them through the job's
// DecodeRowLoads, rms_normed_piece and rms_normed_one. `sums`: at least
// RMS_NORM_MAX_THREADS / 32 floats; x's rows np.row_stride apart. With ADD
// the rows normed are x + residual (rms_norm_input; residual's rows
// np.residual_row_stride apart), as add_rms_norm's; without, residual is
// not read.
template <typename T, bool ADD>
MPS_EXT_INLINE void rms_norm_rows_into(threadgroup T* normed,
                                       const device T* x,
                                       const device T* residual,
                                       const device T* norm_w,
                                       constant RmsNormParams& np,
                                       threadgroup float* sums,
                                       uint tid,
                                       uint threads,
                                       uint sg,
                                       uint simdgroups,
                                       uint lane) {
  const uint team = 1u << np.team_shift, team_sgs = team / 32, n = np.n;
  for (uint r = 0; r < np.rows; ++r) {
    const device T* xr = x + r * np.row_stride;
    const device T* rr = residual + r * np.residual_row_stride;
    for (uint s = sg; s < team_sgs; s += simdgroups) {  // the team's simdgroups, each by one of ours
      const uint t = s * 32 + lane;
      float v[RMS_NORM_PER_THREAD];
      MPS_EXT_UNROLL
      for (int c = 0; c < RMS_NORM_PER_THREAD; ++c) {
        const uint i = rms_norm_element(c, t, team);
        v[c] = i < n ? rms_norm_input<T, ADD>(xr, rr, i) : 0.0f;
      }
      const float ss = simd_sum(rms_norm_squares(v));
      if (lane == 0) sums[s] = ss;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // (A team of one simdgroup: its simd_sum, sums[0], is the total.)
    const float inv = rms_norm_inverse(rms_norm_team_total(sums, team_sgs, sums[0]), n, np.eps);
    for (uint i = tid; i < n; i += threads)
      normed[r * n + i] =
          T(rms_norm_out<T>(rms_norm_input<T, ADD>(xr, rr, i) * inv, float(norm_w[i]), np.zero_centred));
    threadgroup_barrier(mem_flags::mem_threadgroup);  // sums are the next row's; normed complete
  }
}

// Threadgroup 0 writes the normed rows out too (the model's forward passes
// them on to the attention, which reads their shape).
template <typename T>
MPS_EXT_INLINE void rms_norm_rows_out(
    device T* normed_out, const threadgroup T* normed, constant RmsNormParams& np, uint group, uint tid, uint threads) {
  if (group == 0)
    for (uint i = tid; i < np.rows * np.n; i += threads) normed_out[i] = normed[i];
}

// With ADD, threadgroup 0 writes the rows' sums x + residual too, sum_out
// [rows, n] contiguous: the decoder layer's new residual stream h, which
// the rest of the layer reads (the MoE's down product adds it to its
// output). Recomputed from x and residual (from the caches: threadgroup 0
// has just read them) rather than kept: threadgroup memory holds the
// normed rows only.
template <typename T>
MPS_EXT_INLINE void rms_norm_sums_out(device T* sum_out,
                                      const device T* x,
                                      const device T* residual,
                                      constant RmsNormParams& np,
                                      uint group,
                                      uint tid,
                                      uint threads) {
  if (group != 0) return;
  for (uint r = 0; r < np.rows; ++r)
    for (uint i = tid; i < np.n; i += threads)
      sum_out[r * np.n + i] =
          T(rms_norm_input<T, true>(x + r * np.row_stride, residual + r * np.residual_row_stride, i));
}

// A decode job's loads of normed rows of k: 16 bytes at element k of row r
// (16-byte aligned: the caller's buffer is, and the host takes k * sizeof(T)
// a multiple of 16 for its VEC variants), and one element.
template <typename T>
MPS_EXT_INLINE uint4 rms_normed_piece(const threadgroup T* normed, int k_row, int r, int k) {
  return *(const threadgroup uint4*)(normed + r * k_row + k);
}
template <typename T>
MPS_EXT_INLINE float rms_normed_one(const threadgroup T* normed, int k_row, int r, int k) {
  return float(normed[r * k_row + k]);
}
