// RMSNorm of the last dimension, as transformers' models write it, in one
// dispatch (add_rms_norm: of x + residual, the sum written too) (eager, it is 6 to 8 aten ops: to(float32), pow, mean,
// add, rsqrt, mul, to, mul). Every step is float32 and rounds where the model's code rounds:
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
#include "rms_norm.h"

// The rows of x normed into out; with ADD (add_rms_norm) the rows of x + r
// are, and that sum, rounded to T as torch's add rounds it, is also written
// to sum_out: the decoder layer's residual add before its post-attention
// norm, in the same dispatch. Without ADD, r and sum_out are never read.
template <typename T, bool ADD>
MPS_EXT_INLINE void rms_norm_rows(device T* out,
                                  device T* sum_out,
                                  const device T* x,
                                  const device T* r,
                                  const device T* w,
                                  constant RmsNormParams& p,
                                  threadgroup float* partial,
                                  uint group,
                                  uint tid,
                                  uint threads,
                                  uint sg,
                                  uint lane) {
  // Two sets of partial sums (partial[0 .. RMS_NORM_MAX_THREADS / 32) and
  // the next as many), alternating per row: a team's threads read a row's
  // before the next row's barrier, so the row after next may reuse it with
  // no second barrier.
  constexpr int PER = RMS_NORM_PER_THREAD;
  constexpr uint SET = RMS_NORM_MAX_THREADS / 32;
  const uint team = 1u << p.team_shift;
  const uint team_index = group * (threads >> p.team_shift) + (tid >> p.team_shift);
  const uint t = tid & (team - 1);
  const uint first_sg = (tid >> p.team_shift) * (team / 32);  // the team's simdgroups in the threadgroup
  const bool team_live = team_index < p.teams;
  float wv[PER];
  MPS_EXT_UNROLL
  for (int c = 0; c < PER; ++c) {
    const uint i = rms_norm_element(c, t, team);
    wv[c] = team_live && i < p.n ? float(w[i]) : 0.0f;
  }
  for (uint j = 0; j < p.iterations; ++j) {
    const uint row = team_index + j * p.teams;
    const bool live = team_live && row < p.rows;
    const device T* xr = x + row * p.row_stride;
    float v[PER];
    MPS_EXT_UNROLL
    for (int c = 0; c < PER; ++c) {
      const uint i = rms_norm_element(c, t, team);
      float e = 0.0f;
      if (live && i < p.n) {
        e = rms_norm_input<T, ADD>(xr, r + row * p.residual_row_stride, i);  // (one rounding to T, as torch's add)
        if (ADD) sum_out[row * p.n + i] = T(e);
      }
      v[c] = e;
    }
    float ss = simd_sum(rms_norm_squares(v));
    if (team > 32) {  // the same for every thread: a uniform barrier
      threadgroup float* set = partial + (j & 1) * SET;
      if (lane == 0) set[sg] = ss;
      threadgroup_barrier(mem_flags::mem_threadgroup);
      ss = rms_norm_team_total(set + first_sg, team / 32, ss);
    }
    if (!live) continue;
    const float inv = rms_norm_inverse(ss, p.n, p.eps);
    device T* o = out + row * p.n;
    MPS_EXT_UNROLL
    for (int c = 0; c < PER; ++c) {
      const uint i = rms_norm_element(c, t, team);
      if (i < p.n) {
        const float normed = v[c] * inv;
        o[i] = T(rms_norm_out<T>(normed, wv[c], p.zero_centred));
      }
    }
  }
}

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
  threadgroup float partial[2 * (RMS_NORM_MAX_THREADS / 32)];
  rms_norm_rows<T, false>(out, out, x, x, w, p, partial, group, tid, threads, sg, lane);
}

// sum = x + residual (rounded to T), out = rms_norm(sum): a decoder layer's
// `h = residual + attention(...)` and `post_attention_layernorm(h)`.
template <typename T>
[[max_total_threads_per_threadgroup(RMS_NORM_MAX_THREADS)]]
kernel void add_rms_norm(device T* out [[buffer(0)]],
                         device T* sum [[buffer(1)]],
                         const device T* x [[buffer(2)]],
                         const device T* residual [[buffer(3)]],
                         const device T* w [[buffer(4)]],
                         constant RmsNormParams& p [[buffer(5)]],
                         uint group [[threadgroup_position_in_grid]],
                         uint tid [[thread_position_in_threadgroup]],
                         uint threads [[threads_per_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float partial[2 * (RMS_NORM_MAX_THREADS / 32)];
  rms_norm_rows<T, true>(out, sum, x, residual, w, p, partial, group, tid, threads, sg, lane);
}

// clang-format off
template [[host_name("rms_norm_f32")]] kernel decltype(rms_norm<float>) rms_norm<float>;
template [[host_name("rms_norm_f16")]] kernel decltype(rms_norm<half>) rms_norm<half>;
template [[host_name("rms_norm_bf16")]] kernel decltype(rms_norm<bfloat>) rms_norm<bfloat>;
template [[host_name("add_rms_norm_f32")]] kernel decltype(add_rms_norm<float>) add_rms_norm<float>;
template [[host_name("add_rms_norm_f16")]] kernel decltype(add_rms_norm<half>) add_rms_norm<half>;
template [[host_name("add_rms_norm_bf16")]] kernel decltype(add_rms_norm<bfloat>) add_rms_norm<bfloat>;
// clang-format on

// The attention's q_norm, k_norm and rotary embedding (transformers'
// apply_rotary_pos_emb, rotate_half convention) in one dispatch; eager they
// are 2 RMSNorms of 6 to 8 ops and 10 ops of RoPE a layer. Each step rounds
// where the model's code rounds: the norm as rms_norm above (its output in
// T), then in T as torch computes q * cos + rotate_half(q) * sin:
//   out[p]       = T(T(y[p] * cos[p])             + T(-y[p + R/2] * sin[p]))
//   out[p + R/2] = T(T(y[p + R/2] * cos[p + R/2]) + T(y[p] * sin[p + R/2]))
// for p < R/2, out[i] = y[i] for i >= R (Qwen3.5's partial rotary). Each
// product is its own statement: Metal's Safe math contracts a * b + c * d
// in one statement into an fma, which rounds once where torch rounds twice.
// The products of two halves or bfloats are exact in float32, so the
// rounding to T is torch's one rounding.
// The element of a head row that slot c of a lane holds (norm_params.h):
// pairs' first halves, their second halves, then the passed elements; D
// (none) where the slot is idle.
inline uint qk_rope_element(uint c, uint lane, uint np, uint half_r, uint R, uint D) {
  if (c < np) {
    const uint i = c * 32 + lane;
    return i < half_r ? i : D;
  }
  if (c < 2 * np) {
    const uint i = (c - np) * 32 + lane;
    return i < half_r ? i + half_r : D;
  }
  const uint i = R + (c - 2 * np) * 32 + lane;
  return min(i, D);
}

// The body of qk_norm_rope and qk_norm_rope_append: heads 0 .. q_heads-1
// are q's, the next k_heads k's, and the next v_heads (qk_norm_rope_append:
// k_heads; qk_norm_rope: none) v's rows, copied as they are into v_out
// beside k's in k_out: the KV cache append in this dispatch, where
// kv_append would be one more after it. k_out's (and v_out's) rows are
// [batch, k_heads, k_capacity, D], this call's written at k_start .. (a
// cache with spare capacity; qk_norm_rope: k_capacity = tokens, k_start = 0).
template <typename T>
MPS_EXT_INLINE void qk_norm_rope_heads(device T* q_out,
                                       device T* k_out,
                                       device T* v_out,
                                       const device T* q,
                                       const device T* k,
                                       const device T* v,
                                       const device T* cos_,
                                       const device T* sin_,
                                       const device T* q_w,
                                       const device T* k_w,
                                       constant QkNormRopeParams& p,
                                       threadgroup float (*cs)[QK_ROPE_MAX_HEAD_DIM],
                                       threadgroup float (*wt)[QK_ROPE_MAX_HEAD_DIM],
                                       uint3 group,
                                       uint tid,
                                       uint threads,
                                       uint sg,
                                       uint simdgroups,
                                       uint lane) {
  const uint t = group.x, b = group.y;
  const uint qk_heads = p.q_heads + p.k_heads;
  const uint heads = qk_heads + p.v_heads;
  const uint h0 = group.z * p.heads_per_group;
  const uint h1 = min(h0 + p.heads_per_group, heads);
  const uint R = p.rotary_dim, half_r = R >> 1, D = p.head_dim;
  const uint cs_off = b * p.cs_stride_b + t * p.cs_stride_t;
  for (uint i = tid; i < R; i += threads) {
    cs[0][i] = float(cos_[cs_off + i]);
    cs[1][i] = float(sin_[cs_off + i]);
  }
  // Only the weights of the tensors the group's heads belong to.
  const bool use_q = p.q_norm != 0 && h0 < p.q_heads, use_k = p.k_norm != 0 && h0 < qk_heads && h1 > p.q_heads;
  for (uint i = tid; i < D; i += threads) {
    if (use_q) wt[0][i] = float(q_w[i]);
    if (use_k) wt[1][i] = float(k_w[i]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint np = (half_r + 31) / 32;  // slots of pairs' first halves (norm_params.h)
  for (uint j = 0; j < p.iterations; ++j) {
    const uint h = h0 + sg + j * simdgroups;
    if (h >= h1) break;   // no barrier below: simdgroups may stop at different heads
    if (h >= qk_heads) {  // a value row: neither normed nor rotated, copied beside its key
      const uint hv = h - qk_heads;
      const device T* x = v + b * p.v_stride_b + t * p.v_stride_t + hv * p.v_stride_h;
      device T* o = v_out + ((b * p.k_heads + hv) * p.k_capacity + p.k_start + t) * D;
      for (uint i = lane; i < D; i += 32) o[i] = x[i];
      continue;
    }
    const bool is_q = h < p.q_heads;
    const uint hh = is_q ? h : h - p.q_heads;
    const device T* x = is_q ? q + b * p.q_stride_b + t * p.q_stride_t + hh * p.q_stride_h
                             : k + b * p.k_stride_b + t * p.k_stride_t + hh * p.k_stride_h;
    const uint H = is_q ? p.q_heads : p.k_heads;
    const uint rows = is_q ? p.tokens : p.k_capacity, first = is_q ? 0u : p.k_start;
    device T* o = (is_q ? q_out : k_out) + ((b * H + hh) * rows + first + t) * D;
    const bool norm = is_q ? p.q_norm != 0 : p.k_norm != 0;
    const uint wi = is_q ? 0u : 1u;
    float v[QK_ROPE_SLOTS];
    float ss = 0.0f;
    MPS_EXT_UNROLL
    for (int c = 0; c < QK_ROPE_SLOTS; ++c) {
      const uint i = qk_rope_element(uint(c), lane, np, half_r, R, D);
      v[c] = i < D ? float(x[i]) : 0.0f;
      // torch rounds the squares (pow) before summing them (mean): no fused multiply-add.
      const float sq = v[c] * v[c];
      ss += sq;
    }
    if (norm) {  // uniform in the simdgroup: simd_sum sees every lane
      ss = simd_sum(ss);
      const float inv = rms_norm_inverse(ss, D, p.eps);
      MPS_EXT_UNROLL
      for (int c = 0; c < QK_ROPE_SLOTS; ++c) {
        const uint i = qk_rope_element(uint(c), lane, np, half_r, R, D);
        if (i < D) v[c] = rms_norm_out<T>(v[c] * inv, wt[wi][i], p.zero_centred);
      }
    }
    // Pair slot c's second half is slot c + np: a static index per value of
    // np (1 to 4, uniform), so the values stay in registers.
    MPS_EXT_UNROLL
    for (int np_ = 1; np_ <= QK_ROPE_SLOTS / 2; ++np_) {
      if (uint(np_) != np) continue;
      MPS_EXT_UNROLL
      for (int c = 0; c < np_; ++c) {
        const uint i = uint(c) * 32 + lane;
        if (i < half_r) {
          const float lo = v[c], hi = v[c + np_];
          const float a = float(T(lo * cs[0][i]));
          const float bb = float(T(-hi * cs[1][i]));
          const float e = float(T(hi * cs[0][i + half_r]));
          const float f = float(T(lo * cs[1][i + half_r]));
          v[c] = float(T(a + bb));
          v[c + np_] = float(T(e + f));
        }
      }
    }
    MPS_EXT_UNROLL
    for (int c = 0; c < QK_ROPE_SLOTS; ++c) {
      const uint i = qk_rope_element(uint(c), lane, np, half_r, R, D);
      if (i < D) o[i] = T(v[c]);
    }
  }
}

// The token's cos and sin and the two weights, read once for all the
// group's heads (a thread's elements are at other lanes' for the next head,
// so registers would not do once heads loop). Metal wants the position
// attributes all of one width: the grid's is 3-D.
template <typename T>
[[max_total_threads_per_threadgroup(QK_ROPE_MAX_SIMDGROUPS * 32)]]
kernel void qk_norm_rope(device T* q_out [[buffer(0)]],
                         device T* k_out [[buffer(1)]],
                         const device T* q [[buffer(2)]],
                         const device T* k [[buffer(3)]],
                         const device T* cos_ [[buffer(4)]],
                         const device T* sin_ [[buffer(5)]],
                         const device T* q_w [[buffer(6)]],
                         const device T* k_w [[buffer(7)]],
                         constant QkNormRopeParams& p [[buffer(8)]],
                         uint3 group [[threadgroup_position_in_grid]],
                         uint3 tid3 [[thread_position_in_threadgroup]],
                         uint3 threads3 [[threads_per_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint simdgroups [[simdgroups_per_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float cs[2][QK_ROPE_MAX_HEAD_DIM];
  threadgroup float wt[2][QK_ROPE_MAX_HEAD_DIM];
  // No value rows (p.v_heads is 0): k and k_out stand in for v and v_out, never read or written.
  qk_norm_rope_heads<T>(q_out, k_out, k_out, q, k, k, cos_, sin_, q_w, k_w, p, cs, wt, group, tid3.x, threads3.x, sg,
                        simdgroups, lane);
}

// qk_norm_rope with the KV cache append: k's rows normed and rotated into
// k_cache, v's copied into v_cache (both [batch, k_heads, capacity, D]) at
// rows k_start .., q's into q_out as qk_norm_rope's.
template <typename T>
[[max_total_threads_per_threadgroup(QK_ROPE_MAX_SIMDGROUPS * 32)]]
kernel void qk_norm_rope_append(device T* q_out [[buffer(0)]],
                                device T* k_cache [[buffer(1)]],
                                device T* v_cache [[buffer(2)]],
                                const device T* q [[buffer(3)]],
                                const device T* k [[buffer(4)]],
                                const device T* v [[buffer(5)]],
                                const device T* cos_ [[buffer(6)]],
                                const device T* sin_ [[buffer(7)]],
                                const device T* q_w [[buffer(8)]],
                                const device T* k_w [[buffer(9)]],
                                constant QkNormRopeParams& p [[buffer(10)]],
                                uint3 group [[threadgroup_position_in_grid]],
                                uint3 tid3 [[thread_position_in_threadgroup]],
                                uint3 threads3 [[threads_per_threadgroup]],
                                uint sg [[simdgroup_index_in_threadgroup]],
                                uint simdgroups [[simdgroups_per_threadgroup]],
                                uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float cs[2][QK_ROPE_MAX_HEAD_DIM];
  threadgroup float wt[2][QK_ROPE_MAX_HEAD_DIM];
  qk_norm_rope_heads<T>(q_out, k_cache, v_cache, q, k, v, cos_, sin_, q_w, k_w, p, cs, wt, group, tid3.x, threads3.x,
                        sg, simdgroups, lane);
}

// clang-format off
template [[host_name("qk_norm_rope_f32")]] kernel decltype(qk_norm_rope<float>) qk_norm_rope<float>;
template [[host_name("qk_norm_rope_f16")]] kernel decltype(qk_norm_rope<half>) qk_norm_rope<half>;
template [[host_name("qk_norm_rope_bf16")]] kernel decltype(qk_norm_rope<bfloat>) qk_norm_rope<bfloat>;
template [[host_name("qk_norm_rope_append_f32")]] kernel decltype(qk_norm_rope_append<float>) qk_norm_rope_append<float>;
template [[host_name("qk_norm_rope_append_f16")]] kernel decltype(qk_norm_rope_append<half>) qk_norm_rope_append<half>;
template [[host_name("qk_norm_rope_append_bf16")]] kernel decltype(qk_norm_rope_append<bfloat>) qk_norm_rope_append<bfloat>;
// clang-format on
