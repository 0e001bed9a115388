// Parameters of the softmax kernels (softmax.metal, csrc/ops/softmax.cpp).
#pragma once
#include "shared_types.h"

// A softmax runs over `rows` rows of `row_length` elements. A row is one
// index into every dimension but the softmax one; row_sizes lists those
// dimensions, outermost first, and the strides say where a row starts in
// each tensor. Along the row, elements are `*_dim_stride` apart.
struct SoftmaxParams {
  int64_t row_length;
  int64_t rows;
  int64_t x_dim_stride;    // input (forward) or grad_output (backward)
  int64_t y_dim_stride;    // output of the forward pass (backward only)
  int64_t out_dim_stride;
  int64_t chunk_length;    // split rows: elements per threadgroup
  int64_t chunks;          // split rows: threadgroups per row
  int64_t row_sizes[MPS_EXT_MAX_DIMS];
  int64_t x_strides[MPS_EXT_MAX_DIMS];
  int64_t y_strides[MPS_EXT_MAX_DIMS];
  int64_t out_strides[MPS_EXT_MAX_DIMS];
  uint32_t rank;           // entries used in row_sizes
  uint32_t lanes_per_row;  // segment kernels: 1, 2, 4, 8, 16 or 32
  uint32_t log;            // 1: log_softmax
  uint32_t pad;
};

// Threads per threadgroup of each kernel shape (csrc/ops/softmax.cpp), declared
// by the kernels as [[max_total_threads_per_threadgroup]].
#define SOFTMAX_SEGMENT_THREADS 256
#define SOFTMAX_BLOCK_MAX_THREADS 512
#define SOFTMAX_SPLIT_THREADS 256
