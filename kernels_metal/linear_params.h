// Parameters of the decode-time matrix-vector kernels (linear.metal,
// csrc/ops/linear.cpp).
#pragma once
#include "decode_params.h"
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

// rms_norm_gemv_rows (linear.metal): the bytes of the normed activation rows
// a threadgroup keeps in threadgroup memory (rows * K * sizeof(T)): a hidden
// size up to 4096 in half or bfloat at one row (Qwen3.6's and LFM2.5's
// 2048 at two), 2048 in float; and its decode tile's, half gemv_rows'
// (the tile's size changes no sum's order: a lane's pieces are consecutive
// across tiles). With both, 12 KB a threadgroup keeps 5 on a core
// (cpu_metal.THREADGROUP_MEMORY_PER_CORE), which its decode launches need
// (tests/test_budgets.py's threadgroup-memory residency).
#define RMS_GEMV_NORMED_BYTES 8192
#define RMS_GEMV_TILE_BYTES 4096
// rms_norm_fp8_gemv (scaled_mm.metal)'s decode tile, 16-byte variants:
// half again, since fp8_gemv's block scales of a tile (sa_tile, sb_tile:
// 2 KB) come on top, so that it too keeps within 12.8 KB a threadgroup (5 a
// core; its element-load variants keep RMS_GEMV_TILE_BYTES).
#define RMS_FP8_GEMV_TILE_BYTES 2048
