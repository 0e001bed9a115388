// Parameters of the decode-time matrix-vector kernels (gemv.metal,
// csrc/ops/linear.cpp).
#pragma once
#include "shared_types.h"

// y[r, n] = alpha * sum_k x[r, k] * w[n, k] + beta * bias[r, n]
// for r < rows (1 to 8 activation rows) and n < n_out. Every tensor is
// described by element strides, so F.linear's [N, K] weight, its transpose
// (x @ W with W [K, N]), mm with few columns and broadcast biases all map
// onto the same kernels. Offsets into x are below 2^31 (the host checks);
// the weight, y and bias are addressed in 64 bits.
struct GemvParams {
  int64_t rows;
  int64_t n_out;
  int64_t k;
  int64_t x_row_stride, x_k_stride;
  int64_t w_n_stride, w_k_stride;
  int64_t y_row_stride, y_n_stride;
  int64_t bias_row_stride, bias_n_stride;
  float alpha;
  float beta;
  uint32_t has_bias;  // 0: bias is not read (addmm with beta = 0)
  uint32_t splits;    // gemv_cols: threadgroups along K; 1 writes y, more write partial sums
};

// Threads of a gemv_cols threadgroup (and of gemv_cols_finish): its 8
// simdgroups split the threadgroup's K rows.
#define GEMV_COLS_THREADS 256
// gemv_cols splits K into chunks of this many rows, `splits` threadgroups
// taking chunks [i * chunks / splits, (i + 1) * chunks / splits): each
// threadgroup's rows start at a multiple of 32, so that its loads of an
// activation row start at a cache line or halfway into one. The host keeps
// splits * chunks below 2^31.
#define GEMV_COLS_K_CHUNK 32
// Most threads of a gemv_rows threadgroup: 8 simdgroups, each owning 1 or 2
// weight rows.
#define GEMV_ROWS_MAX_THREADS 256
// Activation rows a gemv_rows threadgroup stages in threadgroup memory per
// step along K, all rows together (R rows of 8192 / R bytes): every
// simdgroup of the threadgroup reads them there instead of from memory.
#define GEMV_ROWS_TILE_BYTES 8192
