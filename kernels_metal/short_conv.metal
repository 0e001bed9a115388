// LFM2's short convolution at decode (transformers' Lfm2ShortConv and
// Lfm2MoeShortConv, with the cache): one new token per sequence, everything
// between in_proj and out_proj in one dispatch.
//   short_conv_decode  a thread per channel, SC_THREADS channels a threadgroup:
//     Bx = B * x; the channel's cached window moved one step on with Bx as
//     its last tap (in place); conv = the window times the weights, summed,
//     plus the bias; y = C * conv.
// transformers' torch code for it is a mul, causal_conv1d_update's fallback
// (cat, copy_ into the state, conv1d) and a mul: 5 host calls and
// dispatches.
//
// The cached windows [batch, hidden, conv_k] and the weights [hidden,
// conv_k] hold each channel's conv_k taps in a row: a thread reading its
// own channel's would put a simdgroup's lanes conv_k elements apart. So the
// threadgroup's block of each, one contiguous run, is staged through
// threadgroup memory with consecutive lanes on consecutive elements, and
// the windows written back the same way. In threadgroup memory a channel's
// taps stay conv_k floats apart (no index division): an odd conv_k puts a
// simdgroup's channels in 32 banks; 2 and 4 share banks 2 and 4 ways.
//
// Rounding follows torch's CPU ops, which keep the model's dtype T between
// its ops: B * x and C * conv are one float product rounded to T (the
// product of two T values is exact in float: torch's rounding); the
// convolution sums the taps in order in float with fused multiply-adds
// (oneDNN's f32 and bf16 kernels; f16's unfold-and-GEMM path sums exact
// products, the same chain), the bias first or last (p.bias_last), rounded
// to T once.
#include <metal_stdlib>
#include "short_conv_params.h"
using namespace metal;

template <typename T>
MPS_EXT_INLINE float round_to(float v) {
  return float(T(v));
}

template <typename T>
[[max_total_threads_per_threadgroup(SC_THREADS)]]
kernel void short_conv_decode(device T* out [[buffer(0)]],
                              device T* conv_state [[buffer(1)]],
                              const device T* bcx [[buffer(2)]],
                              const device T* weight [[buffer(3)]],
                              const device T* bias [[buffer(4)]],
                              constant ShortConvParams& p [[buffer(5)]],
                              uint2 tg [[threadgroup_position_in_grid]],
                              uint t [[thread_index_in_threadgroup]]) {
  threadgroup float windows[SC_THREADS * SC_MAX_K], weights[SC_THREADS * SC_MAX_K];
  const uint k = p.conv_k, seq = tg.y, c0 = tg.x * SC_THREADS;
  const uint run = min(uint(SC_THREADS), p.hidden - c0) * k;  // this group's elements of each
  device T* block = conv_state + (seq * p.hidden + c0) * k;
  const device T* w_block = weight + c0 * k;
  for (uint e = t; e < run; e += SC_THREADS) {
    windows[e] = float(block[e]);
    weights[e] = float(w_block[e]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  if (t * k < run) {
    const uint c = c0 + t;
    const device T* row = bcx + seq * p.bcx_stride;  // B, C, x: the row's thirds
    const float bx = round_to<T>(float(row[c]) * float(row[2 * p.hidden + c]));
    threadgroup float* win = windows + t * k;
    threadgroup const float* w = weights + t * k;
    float acc = p.has_bias != 0 && p.bias_last == 0 ? float(bias[c]) : 0.0f;
    for (uint tap = 0; tap + 1 < k; ++tap) {
      const float v = win[tap + 1];
      win[tap] = v;
      acc = fma(w[tap], v, acc);
    }
    win[k - 1] = bx;
    acc = fma(w[k - 1], bx, acc);
    if (p.has_bias != 0 && p.bias_last != 0) acc += float(bias[c]);
    out[seq * p.hidden + c] = T(float(row[p.hidden + c]) * round_to<T>(acc));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = t; e < run; e += SC_THREADS) block[e] = T(windows[e]);
}

// clang-format off
template [[host_name("short_conv_decode_f32")]] kernel decltype(short_conv_decode<float>) short_conv_decode<float>;
template [[host_name("short_conv_decode_f16")]] kernel decltype(short_conv_decode<half>) short_conv_decode<half>;
template [[host_name("short_conv_decode_bf16")]] kernel decltype(short_conv_decode<bfloat>)
    short_conv_decode<bfloat>;
// clang-format on
