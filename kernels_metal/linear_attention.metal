// Gated DeltaNet decode (Qwen3-Next, Qwen3.5/3.6-MoE linear-attention layers):
// one new token per sequence, everything between the layer's input
// projections and its output projection in one dispatch.
//   linear_attention_decode  a threadgroup per (key head, sequence):
//     1. the depthwise causal convolution of its channels (its key head's
//        query and key channels, its value heads' value channels) over the
//        cached window and the new input, SiLU; the window shifted in place;
//     2. the gates of its value heads: decay = exp(-exp(A_log) *
//        softplus(a + dt_bias)), beta = sigmoid(b);
//     3. L2 norms of the query and key (the query then divided by sqrt(dk));
//     4. the delta rule on each value head's [dk, dv] float32 state, read
//        and written in place once: S *= decay; S += k (beta (v - S^T k))^T;
//        o = S^T q;
//     5. the gated RMSNorm over each value head's dv outputs, times SiLU(z).
// Owning a key head's channels whole is what lets one dispatch shift the
// convolution window in place: every threadgroup that reads a channel's
// window is the one that writes it.
//
// Rounding follows transformers' torch code, which keeps activations in the
// model's dtype T between its ops: the convolution's and SiLU's outputs, beta
// and the recurrence's output are rounded to T; the recurrence itself, the
// gates, the norms and their sums are float32.
#include <metal_stdlib>
#include "linear_attention_params.h"
#include "activations.h"
using namespace metal;

template <typename T>
MPS_EXT_INLINE float round_to(float v) {
  return float(T(v));
}

// The sum of `v` over the threadgroup's columns' row parts: each thread
// leaves its part in partial[part][col]; every thread of a column reads the
// column's parts in the same order, so they agree to the bit. Two barriers:
// the parts are written, then free again.
MPS_EXT_INLINE float column_sum(float v, uint part, uint col, uint parts, uint cols, threadgroup float* partial) {
  partial[part * cols + col] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float s = 0.0f;
  for (uint p = 0; p < parts; ++p) s += partial[p * cols + col];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return s;
}

template <typename T>
[[max_total_threads_per_threadgroup(LA_MAX_THREADS)]]
kernel void linear_attention_decode(device T* out [[buffer(0)]],
                                    device T* conv_state [[buffer(1)]],
                                    device float* state [[buffer(2)]],
                                    const device T* qkv [[buffer(3)]],
                                    const device T* z [[buffer(4)]],
                                    const device T* b_proj [[buffer(5)]],
                                    const device T* a_proj [[buffer(6)]],
                                    const device T* conv_weight [[buffer(7)]],
                                    const device T* a_log [[buffer(8)]],
                                    const device T* dt_bias [[buffer(9)]],
                                    const device T* norm_weight [[buffer(10)]],
                                    constant LinearAttentionParams& p [[buffer(11)]],
                                    uint2 tg [[threadgroup_position_in_grid]],
                                    uint t [[thread_index_in_threadgroup]],
                                    uint2 group_size [[threads_per_threadgroup]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float qs[LA_MAX_DK], ks[LA_MAX_DK], vs[LA_MAX_COLS], os[LA_MAX_COLS], partial[LA_MAX_THREADS];
  threadgroup float decay[LA_MAX_RATIO], beta[LA_MAX_RATIO], inv_rms[LA_MAX_RATIO], inv_l2[2];
  const uint kh = tg.x, seq = tg.y, threads = group_size.x;
  const uint dk = p.dk, dv = p.dv, ratio = p.ratio, cols_total = ratio * dv, key_dim = p.k_heads * dk;
  const uint first_v = kh * ratio;  // this key head's first value head

  // 1. Convolution and SiLU of the threadgroup's channels: local channel l
  // is query l, key l - dk, or value l - 2 dk of its value heads. A lane
  // per tap of a channel's window (conv_k lanes a channel, conv_k a power
  // of two up to 32), so that consecutive lanes read and write consecutive
  // elements of the cached windows. The window moves one step on: tap i
  // takes tap i + 1's value (the next lane's), the last tap the new input;
  // the output is the moved window times the weights, summed over the
  // channel's lanes. Every lane takes every step (shuffles need them all).
  const device T* x = qkv + seq * p.qkv_stride;
  const uint k = p.conv_k, channels = 2 * dk + cols_total;
  for (uint base = 0; base < channels * k; base += threads) {
    const uint e = base + t, l = e / k, tap = e % k;
    const bool active = l < channels;
    const uint c = !active      ? 0u
                   : l < dk     ? kh * dk + l
                   : l < 2 * dk ? key_dim + kh * dk + (l - dk)
                                : 2 * key_dim + first_v * dv + (l - 2 * dk);
    device T* window = conv_state + (seq * p.conv_dim + c) * k;
    // Shuffled as float (exact for T): Metal's shuffles take no bfloat.
    const float old = active ? float(window[tap]) : 0.0f;
    const float next = simd_shuffle_down(old, ushort(1));
    const T moved = tap + 1 == k ? (active ? x[c] : T(0)) : T(next);
    float acc = active ? float(conv_weight[c * k + tap]) * float(moved) : 0.0f;
    for (uint off = k / 2; off > 0; off /= 2) acc += simd_shuffle_xor(acc, ushort(off));
    if (active) {
      window[tap] = moved;
      if (tap == 0) {
        const float y = round_to<T>(silu(round_to<T>(acc)));
        if (l < dk) qs[l] = y;
        else if (l < 2 * dk) ks[l - dk] = y;
        else vs[l - 2 * dk] = y;
      }
    }
  }
  // 2. Gates of the value heads.
  for (uint r = t; r < ratio; r += threads) {
    const uint h = first_v + r;
    const float sp_in = float(a_proj[seq * p.a_stride + h]) + float(dt_bias[h]);
    decay[r] = exp(-exp(float(a_log[h])) * softplus(sp_in, LA_SOFTPLUS_THRESHOLD));
    beta[r] = round_to<T>(sigmoid(float(b_proj[seq * p.b_stride + h])));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. L2 norms of the query and key: simdgroup 0 sums the query's squares,
  // the last simdgroup the key's (the same one when there is one).
  if (sg == 0 || sg == simdgroups - 1) {
    for (uint which = sg == 0 ? 0u : 1u; which < 2; which += (simdgroups == 1 ? 1u : 2u)) {
      threadgroup const float* v = which == 0 ? qs : ks;
      float s = 0.0f;
      for (uint i = lane; i < dk; i += 32) s += v[i] * v[i];
      s = simd_sum(s);
      if (lane == 0) inv_l2[which] = rsqrt(s + LA_L2_EPS);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint i = t; i < dk; i += threads) {
    qs[i] = qs[i] * inv_l2[0] / p.q_scale;
    ks[i] = ks[i] * inv_l2[1];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 4. The delta rule, a column of a value head's state at a time: thread
  // (part, col) keeps rows part * LA_ROWS to part * LA_ROWS + LA_ROWS - 1 of
  // column c0 + col in registers, read once and written once; a simdgroup's
  // lanes are consecutive columns, so each row's access is contiguous.
  const uint cols = p.cols, parts = p.row_parts, col = t % cols, part = t / cols;
  for (uint c0 = 0; c0 < cols_total; c0 += cols) {
    const uint j = c0 + col;
    const bool active = j < cols_total && part < parts;
    const uint r = active ? j / dv : 0;
    device float* column = state + ((seq * p.v_heads + first_v + r) * dk) * dv + (active ? j % dv : 0);
    const float d = active ? decay[r] : 0.0f;
    float s[LA_ROWS];
    float kv = 0.0f;
    MPS_EXT_UNROLL
    for (uint m = 0; m < LA_ROWS; ++m) {
      const uint i = part * LA_ROWS + m;
      s[m] = active && i < dk ? column[i * dv] * d : 0.0f;
      kv += s[m] * (i < dk ? ks[i] : 0.0f);
    }
    kv = column_sum(kv, part, col, parts, cols, partial);
    const float delta = active ? (vs[j] - kv) * beta[r] : 0.0f;
    float o = 0.0f;
    MPS_EXT_UNROLL
    for (uint m = 0; m < LA_ROWS; ++m) {
      const uint i = part * LA_ROWS + m;
      if (active && i < dk) {
        s[m] += ks[i] * delta;
        column[i * dv] = s[m];
        o += s[m] * qs[i];
      }
    }
    o = column_sum(o, part, col, parts, cols, partial);
    if (active && part == 0) os[j] = round_to<T>(o);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 5. Gated RMSNorm of each value head's outputs, times SiLU(z).
  for (uint r = sg; r < ratio; r += simdgroups) {
    float s = 0.0f;
    for (uint i = lane; i < dv; i += 32) s += os[r * dv + i] * os[r * dv + i];
    s = simd_sum(s);
    if (lane == 0) inv_rms[r] = rsqrt(s / float(dv) + p.norm_eps);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const device T* zr = z + seq * p.z_stride + first_v * dv;
  device T* o_row = out + seq * p.out_stride + first_v * dv;
  for (uint l = t; l < cols_total; l += threads) {
    const float normed = round_to<T>(os[l] * inv_rms[l / dv]);
    const float weighted = round_to<T>(float(norm_weight[l % dv]) * normed);
    o_row[l] = T(weighted * silu(float(zr[l])));
  }
}

// clang-format off
template [[host_name("linear_attention_decode_f32")]] kernel decltype(linear_attention_decode<float>)
    linear_attention_decode<float>;
template [[host_name("linear_attention_decode_f16")]] kernel decltype(linear_attention_decode<half>)
    linear_attention_decode<half>;
template [[host_name("linear_attention_decode_bf16")]] kernel decltype(linear_attention_decode<bfloat>)
    linear_attention_decode<bfloat>;
// clang-format on
