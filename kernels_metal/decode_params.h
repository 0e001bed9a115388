// What the host's decode geometry (csrc/dispatch/kernel_choice.h, decode_geometry)
// and the one decode kernel template (decode.h) share.
#pragma once
#include "shared_types.h"

// Most simdgroups of a decode threadgroup, each owning 1 or 2 weight rows:
// they share each staged activation tile. 16: fp8 weights at 8 rows (one
// output per simdgroup) under bfloat activations need 16 outputs for the
// activation bytes a threadgroup stages to stay within its weight bytes;
// 512 threads allow 104 registers (cpu_metal.registers_for), twice what
// these kernels use, so a pipeline always allows them.
#define DECODE_MAX_SIMDGROUPS 16
#define DECODE_MAX_THREADS (32 * DECODE_MAX_SIMDGROUPS)
// Activation bytes a decode threadgroup stages per step along K, all rows
// together: every simdgroup reads them there instead of from memory.
#define DECODE_TILE_BYTES 8192
// With block scales a tile covers at most this many elements of K (16 scale
// blocks of 128): the scales of a tile are staged too, per row and output.
#define DECODE_SCALED_TILE_ELEMENTS 2048

// The cols kernel (decode.h, decode_cols): threads of a threadgroup (its 8
// simdgroups split the threadgroup's K rows; gemv_cols_finish's too), and
// the chunks K is split in: `splits` threadgroups take chunks [i * chunks /
// splits, (i + 1) * chunks / splits), each starting at a multiple of 32
// rows, so that its loads of an activation row start at a cache line or
// halfway into one. The host keeps splits * chunks below 2^31.
#define DECODE_COLS_THREADS 256
#define DECODE_COLS_K_CHUNK 32
