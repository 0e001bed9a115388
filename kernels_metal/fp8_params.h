// Parameters of the FP8 kernels (fp8.metal: conversions; scaled_mm.metal:
// scaled matrix products) and of their host side (csrc/ops/fp8*.cpp).
#pragma once
#include "shared_types.h"

// Element types the kernels convert between, and the codes of runtime
// dtype switches (output and bias of the scaled products).
#define FP8_TYPE_NONE 0
#define FP8_TYPE_F32 1
#define FP8_TYPE_F16 2
#define FP8_TYPE_BF16 3
#define FP8_TYPE_E4M3 4  // torch.float8_e4m3fn
#define FP8_TYPE_E5M2 5  // torch.float8_e5m2

// dst[i] = convert(src[i]) over a tensor of up to MPS_EXT_MAX_DIMS
// dimensions, in the row-major order of `sizes` (src strides are 0 where
// it is broadcast; fields past `rank` are 0). The dense kernels take only
// numel (both tensors contiguous, numel < 2^31); the strided ones address
// with 64-bit offsets.
struct Fp8ConvertParams {
  int64_t numel;
  int64_t sizes[MPS_EXT_MAX_DIMS];
  int64_t dst_strides[MPS_EXT_MAX_DIMS];
  int64_t src_strides[MPS_EXT_MAX_DIMS];
  uint32_t rank;
  // > 0: a transposing copy (rank 2, src contiguous along dimension 0, dst
  // along dimension 1) by tiles of FP8_CONVERT_TILE x FP8_CONVERT_TILE
  // elements, one a threadgroup: `tiles` of them along dimension 1.
  uint32_t tiles;
};

// Elements one conversion thread handles, and threads of a threadgroup.
#define FP8_CONVERT_PER_THREAD 4
#define FP8_CONVERT_THREADS 256
#define FP8_CONVERT_TILE 32  // FP8_CONVERT_TILE^2 = FP8_CONVERT_PER_THREAD * FP8_CONVERT_THREADS

// y[m, n] = out( sum over k of a(m, k) * sa(m, k / 128) * w(n, k) * sb(n, k / 128) + bias[n] )
// where out() multiplies by 1 / scale_result (fp8 outputs that have one)
// and rounds to the output type. The weight `w` is seen as [N, K]
// (torch's mat_b transposed); every operand is described by element
// strides. Scales are fp32 and indexed by (row, 128-wide K block):
//   sa(m, kb) = scale_a[m * sa_row_stride + kb * sa_k_stride]
//   sb(n, kb) = scale_b[(n / sb_n_group) * sb_n_stride + kb * sb_k_stride]
// so tensor-wise scales have all strides 0, row-wise ones a row stride,
// and the block-wise recipes (1x128 activations, 128x128 or 1x128
// weights) both strides. has_scale_a = 0: the activation is not scaled
// (bf16/fp16/fp32 activations of the weight-only path).
struct Fp8MatmulParams {
  int64_t m, n, k;
  int64_t a_row_stride, a_k_stride;
  int64_t w_n_stride, w_k_stride;
  int64_t y_row_stride, y_n_stride;
  int64_t sa_row_stride, sa_k_stride;
  int64_t sb_n_stride, sb_k_stride;
  int64_t bias_stride;
  uint32_t sb_n_group;  // 1, or 128 for 128x128 weight blocks
  uint32_t a_format;    // FP8_TYPE_E4M3 / FP8_TYPE_E5M2 when the activation is fp8
  uint32_t w_format;    // FP8_TYPE_E4M3 / FP8_TYPE_E5M2
  uint32_t out_type;    // FP8_TYPE_*
  uint32_t bias_type;   // FP8_TYPE_NONE, _F32, _F16 or _BF16
  uint32_t has_scale_a;
  uint32_t has_scale_result;       // fp8 output divided by scale_result
  uint32_t outputs_per_simdgroup;  // decode: weight rows per simdgroup (1 or 2)
  uint32_t w_vec;                  // the weight rows are contiguous along K and 16-byte aligned (16-byte loads)
};

// Scales of the block-wise recipes cover 128 elements of K.
#define FP8_SCALE_BLOCK 128
// Decode kernels: weight rows a simdgroup owns with R activation rows of
// A_BYTES bytes an element (R x outputs accumulators): 2, but 1 at 4 or 8
// rows, except float activations at 8 rows, whose threadgroup needs 32
// outputs (16 simdgroups of 2) for the activation bytes it stages to stay
// within its weight bytes (8 x 4 per element of K against 1 per output).
// Simdgroups of a threadgroup: decode_geometry (csrc/dispatch/kernel_choice.h).
#define FP8_GEMV_OUTPUTS(R, A_BYTES) ((R) >= 4 && (R) * (A_BYTES) <= 16 ? 1 : 2)
// Prefill tiles: a threadgroup of 4 simdgroups computes 64 x 64 outputs,
// K in stages of 32 elements staged through threadgroup memory, loaded a
// whole 128-byte line of every row at a time (scaled_mm.metal).
#define FP8_TILE_M 64
#define FP8_TILE_N 64
#define FP8_TILE_STAGE 32  // elements of K a stage: 4 a scale block
#define FP8_TILE_THREADS 128
