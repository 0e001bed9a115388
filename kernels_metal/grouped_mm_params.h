// Parameters of the grouped matrix products (grouped_mm.metal,
// csrc/ops/grouped_mm.cpp).
#pragma once
#include "shared_types.h"

// The host maps every layout of _grouped_mm onto one problem:
//   out[g][m, n] = mul * row_scale[m] * col_scale[g][n] * sum_k a[g][m, k] * b[g][k, n]
// over the groups g of one of three modes:
//   GMM_MODE_ROWS     the rows m of a 2-D `a` are split into groups by offs
//                     (2D x 3D, the MoE forward; 3D x 2D reaches it transposed);
//                     group g covers rows [end(g-1), end(g)), end(g) = clamp(offs[g], 0, m).
//   GMM_MODE_K        the contraction dimension is split by offs (2D x 2D);
//                     every group has its own [m, n] output.
//   GMM_MODE_BATCHED  no offs (3D x 3D): a batched matmul.
// Strides are in elements. Offsets within one group's matrices fit in 32
// bits (the host checks); a group's base offset is computed in 64 bits.
#define GMM_MODE_ROWS 0
#define GMM_MODE_K 1
#define GMM_MODE_BATCHED 2
#define GMM_ROW_SCALE 1
#define GMM_COL_SCALE 2
// With GMM_COL_SCALE: col_scale holds one scale per group, at
// g * col_scale_batch, for every n (fp8_linear's tensor-wise weight scale).
#define GMM_COL_SCALE_ONE 4

struct GroupedMMParams {
  uint32_t m, n, k;
  uint32_t groups;
  uint32_t mode;
  uint32_t scales;  // GMM_ROW_SCALE | GMM_COL_SCALE (| GMM_COL_SCALE_ONE): which of row_scale, col_scale are read
  // gmm_decode_rows only (the fused MoE ops of mps_ext):
  uint32_t swiglu;  // out[:, j] = silu(gate_j) * up_j with b's columns [gate | up]
  uint32_t gather;  // > 0: row r of `a` is a[rows[r] / gather] (a token's slots -> its row)
  int64_t a_batch, a_m, a_k;
  int64_t b_batch, b_k, b_n;
  int64_t out_batch, out_m, out_n;
  int64_t row_scale_batch;  // row_scale[g * row_scale_batch + m]
  int64_t col_scale_batch;  // col_scale[g * col_scale_batch + n]
  float mul;                // 256 per fp8 operand (each is decoded as x / 256), else 1
  // moe_down_combine only: out[t, n] = sum over j < slots of
  // weights[t * slots + j] * y[row_of_slot[t * slots + j], n], t < tokens,
  // with y the product's rows (m = tokens * slots); a threadgroup owns
  // 1 << outputs_log2 columns. residual: 1 adds residual[t, n] (strides
  // out's) to each sum once it is rounded to the output's type, as
  // `residual + layer(x)` rounds in torch.
  uint32_t slots, tokens, outputs_log2;
  uint32_t residual;
  uint32_t tile_vec;  // gmm_tiled: GMM_TILE_VEC_A | GMM_TILE_VEC_B, the operands 16-byte loads may read
};

// Decode kernels: rows of one group handled by one threadgroup at a time
// (each weight byte read once for all of them).
#define GMM_DECODE_MAX_ROWS 8
// gmm_decode_rows: weight columns per simdgroup (2: R rows x 2
// accumulators, at most 16, fit full occupancy at 8 rows; with swiglu the
// gate and up columns of one output). Simdgroups of a threadgroup:
// decode_geometry (csrc/dispatch/kernel_choice.h).
#define GMM_ROWS_OUTPUTS 2
// moe_down_combine: the rounded outputs a threadgroup keeps until it sums
// each token's slots, rows x its columns: every row moe_route makes
// (MOE_MAX_SLOTS, 1024) at one simdgroup's 2 columns.
#define MOE_DOWN_Y_ELEMENTS 2048
// gmm_tiled: a 64 x 64 output tile per threadgroup of 4 simdgroups (each
// 32 x 32, 4 x 4 fragments), K in steps of 32 (32 lanes stage 32
// consecutive elements of a row: 32 to 128 contiguous bytes).
#define GMM_TILE_M 64
#define GMM_TILE_N 64
#define GMM_TILE_K 32
#define GMM_TILE_THREADS 128
// p.tile_vec: a's K (b's contiguous dimension, K or N) is contiguous, and its
// rows (and b's groups) start at 16-byte aligned addresses.
#define GMM_TILE_VEC_A 1
#define GMM_TILE_VEC_B 2
