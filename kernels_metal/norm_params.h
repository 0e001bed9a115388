// Parameters of the RMSNorm kernel (norm.metal, csrc/ops/norm.cpp).
#pragma once
#include "shared_types.h"

// A team of `1 << team_shift` threads (32 to RMS_NORM_MAX_THREADS) owns a
// row at a time; each thread holds up to RMS_NORM_PER_THREAD of the row's
// elements in registers, so the host takes rows of up to
// RMS_NORM_MAX_THREADS * RMS_NORM_PER_THREAD elements. Team g of `teams`
// takes rows g, g + teams, ... (`iterations` of them, the same count for
// every team, so that the barriers of a multi-simdgroup team are uniform),
// loading its weight elements once for all of them.
struct RmsNormParams {
  uint32_t rows;
  uint32_t n;                    // elements of a row
  uint32_t row_stride;           // elements between rows of x (out is contiguous)
  uint32_t residual_row_stride;  // add_rms_norm: elements between rows of the residual (the sum is contiguous)
  uint32_t team_shift;
  uint32_t teams;
  uint32_t iterations;    // rows per team, ceil(rows / teams)
  uint32_t zero_centred;  // 1: out = T(normed * (1 + w)); 0: out = w * T(normed)
  float eps;
};

// 8 floats a thread: with the 8 weight values, 16 registers of row data.
#define RMS_NORM_PER_THREAD 8
#define RMS_NORM_MAX_THREADS 1024
// Rows a team takes before the host adds another team: the weight is read
// once per team, so fewer teams read it fewer times (a decode token's 32
// query heads: 4 teams), while a prefill's thousands of rows still spread
// over every core.
#define RMS_NORM_ROWS_PER_TEAM 8
// Threads of a threadgroup when teams are narrower than that.
#define RMS_NORM_GROUP_THREADS 256

// Parameters of qk_norm_rope (norm.metal, csrc/ops/norm.cpp): the attention's
// per-head q and k RMSNorms and rotary embedding in one dispatch. Rows are
// the heads of one token, q's Hq then k's Hk (h < q_heads: q's head h, else
// k's head h - q_heads). Threadgroup (x, y, z) = (token t, batch b, head
// group z): heads [z * heads_per_group, ...), its simdgroup s taking heads
// s, s + simdgroups, ... (`iterations` of them). Strides are in elements;
// the last dimension of q, k, cos and sin is contiguous; q_out is
// [B, Hq, T, D] contiguous, k_out (and qk_norm_rope_append's v_out)
// [B, Hk, k_capacity, D]. qk_norm_rope_append's rows go on with v's Hk
// after k's (h >= q_heads + k_heads: v's head h - q_heads - k_heads).
struct QkNormRopeParams {
  uint32_t q_heads, k_heads;
  uint32_t tokens;      // T
  uint32_t head_dim;    // D
  uint32_t rotary_dim;  // R: even, <= D; the first R elements rotate, the rest pass through
  uint32_t q_stride_b, q_stride_t, q_stride_h;
  uint32_t k_stride_b, k_stride_t, k_stride_h;
  // k's output rows [batch, k_heads, k_capacity, head_dim], this call's at
  // k_start ..: qk_norm_rope_append's KV cache (qk_norm_rope: tokens, 0).
  uint32_t k_capacity, k_start;
  // qk_norm_rope_append: v's rows (k_heads of them, v_stride_* as k's),
  // copied into the value cache beside the keys; qk_norm_rope: 0.
  uint32_t v_heads;
  uint32_t v_stride_b, v_stride_t, v_stride_h;
  uint32_t cs_stride_b, cs_stride_t;  // cos and sin (the same strides: the host checks)
  uint32_t heads_per_group;
  uint32_t iterations;      // ceil(heads_per_group / simdgroups)
  uint32_t q_norm, k_norm;  // 1: that tensor has an RMSNorm weight
  uint32_t zero_centred;    // as RmsNormParams
  float eps;
};

// A simdgroup owns a head row; a lane holds QK_ROPE_SLOTS of its elements
// in registers: with np = ceil(R / 64), slots 0 .. np-1 the rotated pairs'
// first halves p = lane, lane + 32, ... (p < R/2), slots np .. 2np-1 their
// second halves p + R/2, so a pair meets in one thread with no exchange,
// and the rest the passed elements R + lane, R + lane + 32, ...; each slot
// a simdgroup's 32 consecutive elements. The host takes (D, R) with
// 2 * np + ceil((D - R) / 32) <= QK_ROPE_SLOTS: any even R of a head_dim up
// to 192, and at 256 the rotary dims of whole slots (multiples of 64).
#define QK_ROPE_SLOTS 8
#define QK_ROPE_MAX_HEAD_DIM 256
#define QK_ROPE_MAX_SIMDGROUPS 8
// A call of at most this many tokens gives each simdgroup one head (decode:
// the heads spread over threadgroups, hence cores); longer ones keep a
// token's heads in one threadgroup, which stages cos, sin and the weights
// once for them all.
#define QK_ROPE_SPREAD_TOKENS 16
