// Parameters of the KV cache append (kv_cache.metal, csrc/ops/kv_cache.cpp).
#pragma once
#include "shared_types.h"

// A decode step's new keys and values written at positions start ..
// start + tokens - 1 of caches [batch, heads, capacity, head_dim]
// (contiguous, spare capacity past the filled rows). Threadgroup (h, t, b)
// copies row t of head h of batch b, of k and of v: its threads take
// consecutive elements of the row. The new rows are strided views (the
// head dimension contiguous).
struct KvAppendParams {
  uint32_t heads;
  uint32_t head_dim;
  uint32_t capacity;
  uint32_t start;
  uint32_t k_stride_b, k_stride_h, k_stride_t;
  uint32_t v_stride_b, v_stride_h, v_stride_t;
};

// Threads of a kv_append threadgroup at most: a row of up to this many
// elements is one pass, longer rows loop.
#define KV_APPEND_MAX_THREADS 256

// Decode attention over the cache (kv_decode_attention, kv_decode_merge):
// one query row per sequence q [batch, q_heads, head_dim] against the filled
// keys and values [batch, kv_heads, keys, head_dim] (the head dimension
// contiguous), grouped-query: query head hq reads key-value head
// hq / gqa. Threadgroup (kv head, block, batch) stages its block's key and
// value rows through threadgroup memory a tile at a time, each row read from
// device memory once, and runs the gqa query heads sharing them on its
// simdgroups: simdgroup s takes query head s % gqa and the tile's keys
// s / gqa, s / gqa + streams, ... (streams = simdgroups / gqa). One block
// writes the normalised output; several write their unnormalised partial
// sums, maximum and sum of the block's exponentials (in base 2), which
// kv_decode_merge combines in a second dispatch.
struct DecodeAttentionParams {
  uint32_t q_heads;
  uint32_t kv_heads;
  uint32_t gqa;
  uint32_t streams;
  uint32_t keys;
  uint32_t keys_per_block;  // a whole number of tiles
  uint32_t blocks;
  uint32_t q_stride_b, q_stride_h;
  uint32_t k_stride_b, k_stride_h, k_stride_t;
  uint32_t v_stride_b, v_stride_h, v_stride_t;
  float scale_log2;  // the softmax scale times log2(e): scores in base 2 (exp2)
};

// Elements of a key (and of a value) tile in threadgroup memory: 16 rows of
// 128, 8 of 256 (16 KiB for both in float, 8 in half and bfloat).
#define KV_DECODE_TILE_ELEMS 2048
// Simdgroups of a kv_decode_attention threadgroup: gqa * streams, with
// streams = KV_DECODE_STREAM_SIMDGROUPS / gqa (at least 1) for a gqa of up
// to KV_DECODE_MAX_SIMDGROUPS, the most a threadgroup takes. The head
// dimensions it is instantiated for are multiples of 32, at most
// KV_DECODE_MAX_HEAD_DIM.
#define KV_DECODE_STREAM_SIMDGROUPS 8
#define KV_DECODE_MAX_SIMDGROUPS 16
#define KV_DECODE_MAX_HEAD_DIM 256
// Blocks of keys a call splits into at most (kv_cache.cpp: its threadgroup
// target, 256, over batch * kv_heads), merged in threadgroup memory.
#define KV_DECODE_MAX_BLOCKS 256
