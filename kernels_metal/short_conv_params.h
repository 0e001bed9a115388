// Parameters of the short-convolution decode kernel (short_conv.metal,
// csrc/ops/short_conv.cpp): one new token per sequence of an LFM2 conv layer
// (transformers' Lfm2ShortConv / Lfm2MoeShortConv), from the in_proj output
// to the out_proj input.
#pragma once
#include "shared_types.h"

// `hidden` channels, a window of `conv_k` taps (the cached state holds
// conv_k inputs a channel, transformers' [batch, hidden, conv_k]).
// bcx_stride: elements between two sequences' in_proj rows (B, C and x are
// the row's thirds, each contiguous). bias_last: the bias is added after the
// taps' sum, else it starts it (the order of torch's CPU kernels, which the
// host picks by dtype: see short_conv.cpp).
struct ShortConvParams {
  uint32_t batch, hidden, conv_k, bcx_stride;
  uint32_t has_bias, bias_last, pad0, pad1;
};

// Channels a threadgroup takes, a thread each. 128: a core holds 8 such
// groups at full occupancy, each staging its windows and weights in
// 2 * SC_THREADS * SC_MAX_K floats (4 KiB, 32 KiB a core of its 64).
#define SC_THREADS 128
#define SC_MAX_K 4  // the taps the staging arrays hold: causal_conv1d's widths 2 to 4 (LFM2's 3)
