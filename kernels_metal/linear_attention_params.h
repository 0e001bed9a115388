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

// Parameters of the Gated DeltaNet prefill kernels (linear_attention.metal's
// linear_attention_chunk_prep / _state, csrc/ops/linear_attention.cpp's
// linear_attention_chunk): transformers' torch_chunk_gated_delta_rule (FLA's
// chunk_gated_delta_rule) over `tokens` tokens in chunks of LA_CHUNK.
// Inputs as transformers passes them: q, k [batch, tokens, k_heads, dk],
// v [batch, tokens, v_heads, dv] (any strides: the layer's are a transposed
// view of its convolution's output), g (log decay, float32) and beta
// [batch, tokens, v_heads]; strides in elements, in that order of
// dimensions. Value head h reads key head h / ratio (repeat_interleave).
struct LinearAttentionChunkParams {
  uint32_t batch, tokens, k_heads, v_heads, dk, dv, ratio, chunks;
  uint32_t tile;         // state columns (value channels) per threadgroup of the state pass
  uint32_t l2norm;       // 1: q and k L2-normalised per head (use_qk_l2norm_in_kernel)
  uint32_t has_initial;  // 1: the state pass starts from initial_state, else from zeros
  uint32_t pad0;
  uint32_t q_stride[4], k_stride[4], v_stride[4];
  uint32_t g_stride[3], beta_stride[3];
  float q_scale;  // dk^-0.5, multiplied into the (normalised) query as transformers does
  float pad1;
};

#define LA_CHUNK 64           // tokens per chunk: transformers' chunk_size (and FLA's)
#define LA_CHUNK_THREADS 256  // both prefill kernels' threadgroup (fixed: their least too)
#define LA_GRAM_SLICE 16      // dk columns of q and k staged at a time for the chunk's q k^T and k k^T
// The kernels' products run on 8 x 8 simdgroup matrices: the float32
// scratch between them (q and k decayed, w, u) has rows of dk and dv padded
// with zeros to whole fragments.
#define LA_FRAG_PAD(d) (((d) + 7) / 8 * 8)
// The state pass keeps a [dk, tile] float32 slice of a head's state in
// threadgroup memory (16 KiB, rows 16 bytes longer than the tile), beside
// the chunk's new values [LA_CHUNK, tile] (8 KiB): tile = the largest power
// of two <= min(32, LA_STATE_ELEMS / LA_FRAG_PAD(dk)), 32 for dk <= 128, 16
// up to 256 (a power of two: it divides the threadgroup, so a thread keeps
// one column; at least 8, a fragment's width).
#define LA_STATE_ELEMS 4096
#define LA_MAX_TILE 32
