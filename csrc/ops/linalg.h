// The linear-algebra family's building blocks (csrc/ops/linalg_kernels.cpp):
// each launches one kernel of kernels_metal/linalg_lu.metal or
// linalg_solve.metal on strided views, so transposes, lazy conjugation and
// broadcast batches cost no copies. The aten ops are put together from them
// in csrc/ops/linalg.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "dispatch/registry.h"

namespace mps_ext {
namespace linalg {

// float32 and complex64: what the kernels compute in.
bool kernel_dtype(c10::ScalarType t);

// Why an operand cannot go to the kernels (none if it can): dtype, layout,
// more than MPS_EXT_MAX_DIMS batch dimensions, a matrix spanning 2^31
// elements or more, `max_rows` exceeded (rows of the last two dims).
// `matrix_dims`: 2 for matrices, 1 for pivots.
Reason operand_unsupported(const at::Tensor& t, int64_t matrix_dims, int64_t max_rows);

// The batch shape of a and b broadcast against each other (each without its
// last `a_dims` / `b_dims` dims); empty optional if they do not broadcast.
c10::optional<std::vector<int64_t>> broadcast_batch(const at::Tensor& a, int64_t a_dims, const at::Tensor& b,
                                                    int64_t b_dims);

// LU factorisation (getrf) of `a` (..., m, n): LU column-major per matrix
// (torch's layout), pivots (..., min(m, n)) int32 1-based, info (...)
// int32. det_mode (LINALG_DET_*) also computes det, or sign and logabsdet.
struct Factors {
  at::Tensor lu, pivots, info, det, logabsdet;
};
Factors lu_factor(const at::Tensor& a, bool pivot, uint32_t det_mode);

// X = A^-1 B (or X = B A^-1) from the LU factors of A, as
// torch.linalg.lu_solve(lu, pivots, b, left=left, adjoint=adjoint) does,
// written into `x` (any strides). b undefined: B is the identity. The batch
// is x's; lu, pivots and b broadcast to it.
void lu_solve_into(const at::Tensor& lu, const at::Tensor& pivots, const at::Tensor& b, const at::Tensor& x, bool left,
                   bool adjoint);

// Throws what lu_solve_into(..., x, left, ...) would throw before its
// launch: its kernel cannot run here (BackendUnavailable), or not for x's
// rows (CallNotTaken). inv_ex and solve_ex ask before they factor, so that
// no factorisation is dispatched for a solve that then cannot run.
void check_solve(const at::Tensor& x, bool left);

// X = op(A)^-1 B for triangular A, into `x`: op(A) = A, or A^T (transpose);
// `upper` describes A. left=false solves X op(A) = B. Batch as lu_solve_into.
void triangular_solve_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& x, bool upper, bool transpose,
                           bool unitriangular, bool left);

// Matrices up to LINALG_SMALL_MAX in one thread each: the LU of `a` (as
// lu_factor, into `factors` if write_lu) and, if x is defined, the solve
// as lu_solve_into(lu, pivots, b, x, left, adjoint) (b undefined: the
// identity). x's batch must be a's.
bool small_path(const at::Tensor& a);
void small_factor_solve(const at::Tensor& a, bool pivot, uint32_t det_mode, bool write_lu, Factors& factors,
                        const at::Tensor& b, const at::Tensor& x, bool left, bool adjoint);

// P, L, U of torch.lu_unpack. P is (..., m, m), L (..., m, k), U (..., k, n),
// contiguous; each is skipped if undefined.
void lu_unpack_into(const at::Tensor& lu, const at::Tensor& pivots, const at::Tensor& P, const at::Tensor& L,
                    const at::Tensor& U);

}  // namespace linalg
}  // namespace mps_ext
