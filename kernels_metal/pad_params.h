// Parameters of the constant-pad kernel (pad.metal, csrc/ops/pad.cpp).
#pragma once
#include "shared_types.h"

// Dimensions are listed in the output's memory order, outermost first, after
// the host merged every pair it could (an unpadded dimension into the one
// outside it, when the input strides allow) and dropped unpadded dimensions
// of size 1: most pads end up with 1 to 4. The last dimension is contiguous
// in the output; a row is one index into all the others. An output
// coordinate c maps to input coordinate c - pad_before; outside [0, in_size)
// the output gets the fill value.
struct PadParams {
  int64_t out_sizes[MPS_EXT_MAX_DIMS];
  int64_t in_sizes[MPS_EXT_MAX_DIMS];
  int64_t in_strides[MPS_EXT_MAX_DIMS];
  int64_t pad_before[MPS_EXT_MAX_DIMS];  // negative crops
  uint64_t fill_bits;                    // the fill value, already converted to the dtype
  uint32_t rank;
  uint32_t segments_per_row;  // PAD_SEGMENT_BYTES pieces of output a row spans
  uint32_t tasks;             // rows * segments_per_row, one simdgroup each
  uint32_t pad;
};

// Threads of a threadgroup (kernels declare it: their staging buffer has one
// segment per simdgroup).
#define PAD_THREADS 256
// A simdgroup writes one segment of an output row, starting at a 128-byte
// line: 16 bytes a lane, one vector store each.
#define PAD_SEGMENT_BYTES 512
