// Parameters of the attention's decode pieces (attention.metal,
// csrc/ops/attention.cpp): the output gate and the KV cache append.
#pragma once
#include "shared_types.h"

// out = x * sigmoid(gate), over rows of the last dimension: threadgroup
// (x, y) = (column block x, row y), a thread per element, so consecutive
// lanes take consecutive elements of one row. x and out are contiguous;
// gate's rows lie gate_row_stride elements apart (the gate is a strided
// view of q_proj's output, each head's query then its gate).
struct SigmoidGateParams {
  uint32_t rows;
  uint32_t n;                // elements of a row
  uint32_t gate_row_stride;  // elements between gate's rows (x's: n)
};

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

// Threads of a sigmoid_gate threadgroup (fewer, a multiple of 32, for short rows).
#define SIGMOID_GATE_THREADS 256
// Threads of a kv_append threadgroup at most: a row of up to this many
// elements is one pass, longer rows loop.
#define KV_APPEND_MAX_THREADS 256
