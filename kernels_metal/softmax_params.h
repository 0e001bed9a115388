// Parameters of the softmax kernels (softmax.metal, csrc/ops/softmax.cpp).
#pragma once
#include "shared_types.h"

// A softmax runs over `rows` rows of `row_length` elements. A row is one
// index into every dimension but the softmax one; row_sizes lists those
// dimensions, outermost first (after the host merged the ones it could), and
// the strides say where a row starts in each tensor. Along the row, elements
// are `*_dim_stride` apart.
//
// The strided kernels take the last row dimension, contiguous in every
// tensor, as the `inner` one their lanes walk: a threadgroup owns
// 2^lanes_shift consecutive rows of it, in one outer row (the others).
struct SoftmaxParams {
  int64_t row_length;
  int64_t rows;
  int64_t x_dim_stride;  // input (forward) or grad_output (backward)
  int64_t y_dim_stride;  // output of the forward pass (backward only)
  int64_t out_dim_stride;
  int64_t partials_stride;  // split rows: from one row's partials to the next (chunks, rounded up to
                            // 32 entries: a row's partials start at a cache line)
  int64_t chunks;           // split rows: threadgroups per row
  int64_t row_sizes[MPS_EXT_MAX_DIMS];
  int64_t x_strides[MPS_EXT_MAX_DIMS];
  int64_t y_strides[MPS_EXT_MAX_DIMS];
  int64_t out_strides[MPS_EXT_MAX_DIMS];
  uint32_t rank;         // entries used in row_sizes
  uint32_t lanes_shift;  // segment: log2(lanes per row); strided: log2(rows per threadgroup)
  uint32_t log;          // 1: log_softmax
  uint32_t pad;
};

// Elements a thread holds in registers between the reduction and the write
// (csrc/ops/softmax.cpp sizes the launches from them). The vector variants'
// segment threads hold one piece: 16 bytes of the wider of the input and
// output types (4 floats, or 8 halves / bfloats when both are 16-bit).
#define SOFTMAX_SEGMENT_ELEMENTS 4
#define SOFTMAX_BLOCK_ELEMENTS 16
#define SOFTMAX_STRIDED_ELEMENTS 32           // forward: one value per element
#define SOFTMAX_STRIDED_BACKWARD_ELEMENTS 16  // backward: two (gradient and output)
#define SOFTMAX_SPLIT_CHUNK 2048

// Threads per threadgroup of each kernel shape, declared by the kernels as
// [[max_total_threads_per_threadgroup]]. None asks for 1024: a pipeline's
// maxTotalThreadsPerThreadgroup can be lower on a real GPU.
#define SOFTMAX_SEGMENT_THREADS 256
#define SOFTMAX_BLOCK_MAX_THREADS 512
#define SOFTMAX_STRIDED_MAX_THREADS 512
#define SOFTMAX_SPLIT_THREADS 256
