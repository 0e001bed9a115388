// What norm.cpp's RMSNorm shares with linear.cpp's rms_norm_linear (the
// norm in the GEMV that reads it) and moe.cpp's add_rms_norm_moe_layer:
// the checks, the rows and the team, which decides the order of a row's sum
// (kernels_metal/rms_norm.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <tuple>

#include "norm_params.h"

namespace mps_ext {

// rms_norm's checks of x, its weight and the variant (`op` names the op
// called in errors); whether the variant is zero-centred.
bool check_norm(const char* op, const at::Tensor& x, const at::Tensor& weight, c10::string_view variant);
// t [..., n] as rows [rows, n] with a contiguous last dimension (a view
// when the leading dimensions collapse).
at::Tensor norm_rows(const at::Tensor& t, int64_t n);
// torch.ops.mps_ext.rms_norm.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, c10::string_view variant);
// add_rms_norm's check of its residual: x's shape, dtype and device.
void check_residual(const char* op, const at::Tensor& x, const at::Tensor& residual);
// torch.ops.mps_ext.add_rms_norm: (x + residual, rms_norm(x + residual)).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, c10::string_view variant);
// Elements between rows of such rows.
int64_t row_stride_of(const at::Tensor& rows);
// The kernels' parameters for `rows` rows of n: the team rms_norm runs a
// row with, and the teams over the rows.
RmsNormParams rms_norm_params(int64_t rows, int64_t n, int64_t row_stride, int64_t residual_row_stride, double eps,
                              bool zero_centred);

// The input norm a decode GEMV runs on its own activation rows
// (linear.cpp's rms_norm_linear, scaled_mm.cpp's rms_norm_fp8_linear; the
// kernels' rms_norm.h): x's rows (last dimension contiguous), the norm's
// weight, the rows' output, and the kernel's parameters; with a residual
// (add_rms_norm's form), its rows (last dimension contiguous) and the sums'
// output, both undefined without.
struct NormedRows {
  at::Tensor x, weight, normed;
  at::Tensor residual, sum;
  RmsNormParams params;
};
// Whether the GEMV can norm `rows` rows of n elements of `itemsize` bytes
// itself: a decode row count whose normed rows fit the threadgroup memory
// the kernels keep for them (linear_params.h: RMS_GEMV_NORMED_BYTES).
bool gemv_norms_rows(int64_t rows, int64_t n, int64_t itemsize);
// x [..., n]'s rows as such a norm's, with `normed` (x's shape, contiguous)
// their output; with `residual` (x's shape, checked), the rows of x +
// residual are normed and `sum` (x's shape, contiguous) is their output.
// `op` names the op in errors.
NormedRows normed_rows(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& normed,
                       double eps, bool zero_centred, const at::Tensor* residual = nullptr,
                       const at::Tensor* sum = nullptr);

// linear.cpp: (x + residual, rms_norm(x + residual), F.linear(that,
// weight)) in one dispatch (add_rms_norm_gemv_rows), bit for bit
// add_rms_norm then mps_ext's linear; nullopt where that kernel does not
// take them (more than 8 rows, normed rows past its threadgroup memory, a
// weight not contiguous along K): the caller runs the two ops. For
// moe.cpp's add_rms_norm_moe_layer, whose name the errors give.
c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> add_rms_norm_gemv(const at::Tensor& x,
                                                                                const at::Tensor& residual,
                                                                                const at::Tensor& norm_weight,
                                                                                double eps, c10::string_view variant,
                                                                                const at::Tensor& weight);

}  // namespace mps_ext
