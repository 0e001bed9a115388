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
