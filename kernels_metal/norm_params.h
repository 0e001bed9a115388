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
  uint32_t n;           // elements of a row
  uint32_t row_stride;  // elements between rows of x (out is contiguous)
  uint32_t team_shift;
  uint32_t teams;
  uint32_t iterations;  // rows per team, ceil(rows / teams)
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
