// Parameters of the attention layer's output gate (attention_gate.metal,
// csrc/ops/attention_gate.cpp).
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

// Threads of a sigmoid_gate threadgroup (fewer, a multiple of 32, for short rows).
#define SIGMOID_GATE_THREADS 256

// sigmoid_gate_gemv_rows (linear.metal): the gated rows x * sigmoid(gate)
// a decode GEMV stages in threadgroup memory before its product (an
// attention layer's output gate and its o_proj in one dispatch). x: `rows`
// rows of n elements, x_row_stride apart, each contiguous; gate: the same
// elements of q_proj's output, row r's element i = h * head_dim + j at
// r * gate_row_stride + h * gate_head_stride + j (each head's query, then
// its gate).
struct GateRowsParams {
  uint32_t rows;
  uint32_t n;
  uint32_t x_row_stride;
  uint32_t gate_row_stride;
  uint32_t head_dim;  // elements of a head, contiguous in gate
  uint32_t gate_head_stride;
};
