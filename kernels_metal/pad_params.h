// Parameters of the constant-pad kernel (pad.metal, csrc/ops/pad.cpp).
#pragma once
#include "shared_types.h"

// Dimensions are listed in the output's memory order, outermost first, so
// that consecutive threads write consecutive addresses whatever the memory
// format. An output coordinate c maps to input coordinate c - pad_before;
// outside [0, in_size) the output gets the fill value.
struct PadParams {
  int64_t numel;  // output elements
  int64_t out_sizes[MPS_EXT_MAX_DIMS];
  int64_t in_sizes[MPS_EXT_MAX_DIMS];
  int64_t in_strides[MPS_EXT_MAX_DIMS];
  int64_t pad_before[MPS_EXT_MAX_DIMS];  // negative crops
  uint64_t fill_bits;  // the fill value, already converted to the dtype
  uint32_t rank;
  uint32_t pad;
};

// Output elements written by one thread: a short run lets the coordinate
// arithmetic be done once and then stepped.
#define PAD_ELEMENTS_PER_THREAD 4
