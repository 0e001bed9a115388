// Parameters of the Gated DeltaNet decode kernel (linear_attention.metal,
// csrc/ops/linear_attention.cpp): one new token per sequence of a
// linear-attention layer (Qwen3-Next, Qwen3.5/3.6-MoE), from the layer's
// projections to the gated RMSNorm's output.
#pragma once
#include "shared_types.h"

// Sizes: `k_heads` query/key heads of `dk`, `v_heads` value heads of `dv`
// (`ratio` = v_heads / k_heads value heads share a key head), the depthwise
// convolution over conv_dim = 2 * k_heads * dk + v_heads * dv channels with
// a window of `conv_k` (the cached state holds conv_k inputs).
// Geometry: a threadgroup per (key head, sequence); its threads are
// `row_parts` x `cols`: each recurrent-state column (a value channel of one
// of its value heads) is split over row_parts threads of LA_ROWS rows each.
// Strides are in elements; rows of qkv, z, b, a and out are contiguous.
struct LinearAttentionParams {
  uint32_t batch, k_heads, v_heads, dk, dv, ratio, conv_dim, conv_k;
  uint32_t row_parts, cols, pad0, pad1;
  uint32_t qkv_stride, z_stride, b_stride, a_stride;
  uint32_t out_stride, pad2;
  float q_scale;   // sqrt(dk): the query is divided by it after its L2 norm, as transformers does
  float norm_eps;  // the gated RMSNorm's
};

// Rows of a state column one thread keeps in registers: a compile-time count
// so that the array stays in registers (MPS_EXT_UNROLL). 8 keeps the kernel
// at 49 registers, within the 52 that let a core run 1024 threads (16 was
// 92: the rows' values, addresses and bounds all live across the sums).
// 49 is the executor's estimate, not Apple's allocator's: a pipeline that
// allows fewer threads gets fewer columns at once (`cols`), with the same
// result.
#define LA_ROWS 8
#define LA_MAX_THREADS 1024
#define LA_MAX_DK 256                // query/key head size: the threadgroup's q and k arrays
#define LA_MAX_COLS 1024             // ratio * dv: the value channels of one key head's value heads
#define LA_MAX_RATIO 64              // value heads per key head
#define LA_L2_EPS 1e-6f              // transformers' l2norm (and FLA's) epsilon
#define LA_SOFTPLUS_THRESHOLD 20.0f  // F.softplus's default: above it, softplus(x) = x
