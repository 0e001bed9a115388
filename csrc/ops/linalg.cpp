// The linear-algebra family: LU factorisation, triangular solves, inverse,
// and the solvers built on them, float32 and complex64, batched, any strides.
// Kernels: kernels_metal/linalg_lu.metal, linalg_solve.metal (launched by
// csrc/ops/linalg_kernels.cpp).
//
// Which aten ops, and why these (read from the macOS wheels of torch
// 2.9-2.15, tools/linalg_entry_points.py):
//   linalg_lu_factor_ex   torch.linalg.lu_factor(_ex), torch.lu (_lu_with_info)
//   linalg_lu_factor      torch 2.9 only: it has its own MPS kernel there
//   linalg_lu, lu_unpack  torch.linalg.lu, torch.lu_unpack
//   linalg_solve_triangular, triangular_solve
//   linalg_inv_ex         torch.linalg.inv(_ex), torch.inverse
//   _linalg_solve_ex      torch.linalg.solve(_ex): MPS has its own kernel
//   linalg_lu_solve       torch.linalg.lu_solve, torch.lu_solve (no MPS
//                         kernel before 2.14: mps_ext registers one)
//   _linalg_det, _linalg_slogdet   torch.(linalg.)det, slogdet, logdet
// Each returns what torch's CPU kernel returns, including the layout of its
// outputs and which matrix it factors (A, or A^T where torch does), so that
// torch's autograd formulas, which call these ops again, see the same
// factors. Invalid inputs go to torch's own kernel, which reports them,
// except for ops torch may have no MPS kernel for (linalg_lu,
// linalg_lu_solve): those check their inputs here, with torch's messages.
#include <ATen/ATen.h>
#include <ATen/native/LinearAlgebraUtils.h>
#include <torch/version.h>

#include <limits>

#include "linalg_params.h"
#include "ops/linalg.h"
#include "dispatch/registration.h"
#include "dispatch/registry.h"

namespace mps_ext {
namespace {

using at::Tensor;
using c10::DispatchKey;
using linalg::Factors;

// torch 2.9 and 2.10 factor A^T instead of A in _linalg_solve_ex (and so in
// linalg_inv_ex) when A is contiguous and real, and solve with the adjoint;
// 2.11 and later factor A (their kernel no longer calls mT:
// tools/linalg_entry_points.py). _linalg_det and _linalg_slogdet factor A^H
// for contiguous real A in every release. The factors are outputs that the
// derivative formulas use, so they must be the ones torch computes.
constexpr bool kSolveFactorsTransposedA = TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 10;

// torch checks lu_unpack's pivots on the CPU and, from 2.10 on, on MPS
// (unpack_pivots_stub_impl: le, ge, logical_and, _is_all_true, item: a read
// back, which waits for the GPU); torch 2.9's MPS lu_unpack checks nothing
// and does not wait. mps_ext does as the installed torch does; its kernel
// ignores a pivot outside 1..m, so an unchecked one stays inside the matrix.
constexpr bool kMpsChecksPivots = !(TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR <= 9);

// ------------------------------------------------------------- support --
Reason dtype_unsupported(const Tensor& t) {
  if (linalg::kernel_dtype(t.scalar_type())) return {};
  return because::dtype_not_linalg(t.scalar_type());
}

constexpr Reason kInvalid = because::input_torch_rejects;

// Why a square-matrix op does not take A.
Reason square_unsupported(const Tensor& A) {
  if (A.dim() < 2 || A.size(-1) != A.size(-2)) return kInvalid;
  Reason why = dtype_unsupported(A);
  if (!why) why = linalg::operand_unsupported(A, 2, LINALG_MAX_ROWS);
  return why;
}

// Why two operands A (factors) and B of a solve do not go to the kernels.
Reason pair_unsupported(const Tensor& A, const Tensor& B, int64_t a_dims, int64_t b_dims) {
  if (A.scalar_type() != B.scalar_type()) return kInvalid;
  if (A.device() != B.device()) return kInvalid;
  if (!linalg::broadcast_batch(A, a_dims, B, b_dims)) return kInvalid;
  Reason why = dtype_unsupported(A);
  if (!why) why = linalg::operand_unsupported(A, a_dims, LINALG_MAX_ROWS);
  if (!why) why = linalg::operand_unsupported(B, b_dims, std::numeric_limits<int64_t>::max());
  return why;
}

std::vector<int64_t> with_matrix(std::vector<int64_t> batch, int64_t rows, int64_t cols) {
  batch.push_back(rows);
  batch.push_back(cols);
  return batch;
}

Tensor empty_matrices(c10::IntArrayRef shape, bool column_major, const at::TensorOptions& opts) {
  return at::empty_strided(shape, at::native::batched_matrix_contiguous_strides(shape, column_major), opts);
}

// ---------------------------------------------------------- factorising --
Reason lu_factor_unsupported(const Tensor& A) {
  if (A.dim() < 2) return kInvalid;
  Reason why = dtype_unsupported(A);
  if (!why) why = linalg::operand_unsupported(A, 2, LINALG_MAX_ROWS);
  if (!why && A.size(-1) > LINALG_MAX_ROWS) why = because::columns_past_512;
  return why;
}

std::tuple<Tensor, Tensor, Tensor> lu_factor_ex(const Tensor& A, bool pivot, bool check_errors, const char* api) {
  Factors f = linalg::lu_factor(A.resolve_neg(), pivot, LINALG_DET_NONE);
  if (check_errors) at::_linalg_check_errors(f.info, api, A.dim() == 2);
  return {f.lu, f.pivots, f.info};
}

std::tuple<Tensor, Tensor, Tensor> factor_and_unpack(const Tensor& A, bool pivot) {
  const int64_t m = A.size(-2), n = A.size(-1), k = std::min(m, n);
  const auto batch = A.sizes().slice(0, A.dim() - 2).vec();
  Factors f = linalg::lu_factor(A.resolve_neg(), pivot, LINALG_DET_NONE);
  // Without pivoting torch gives an empty P.
  Tensor P = pivot ? at::empty(with_matrix(batch, m, m), A.options()) : at::empty({0}, A.options());
  Tensor L = at::empty(with_matrix(batch, m, k), A.options());
  Tensor U = at::empty(with_matrix(batch, k, n), A.options());
  linalg::lu_unpack_into(f.lu, f.pivots, pivot ? P : Tensor(), L, U);
  return {P, L, U};
}

Reason lu_unpack_unsupported(const Tensor& LU, const Tensor& pivots, bool unpack_pivots) {
  if (LU.dim() < 2) return kInvalid;
  if (unpack_pivots) {
    if (pivots.scalar_type() != at::kInt || pivots.device() != LU.device()) return kInvalid;
    auto want = LU.sizes().slice(0, LU.dim() - 2).vec();
    want.push_back(std::min(LU.size(-2), LU.size(-1)));
    if (pivots.sizes() != c10::IntArrayRef(want)) return because::pivots_shape;
  }
  Reason why = dtype_unsupported(LU);
  // The kernel holds the permutation of a matrix's rows in threadgroup memory.
  if (!why) why = linalg::operand_unsupported(LU, 2, LINALG_THREADGROUP_MEMORY / 4);
  if (!why && unpack_pivots) why = linalg::operand_unsupported(pivots, 1, 0);
  return why;
}

std::tuple<Tensor, Tensor, Tensor> unpack(const Tensor& LU, const Tensor& pivots, bool unpack_data,
                                          bool unpack_pivots) {
  const int64_t m = LU.size(-2), n = LU.size(-1), k = std::min(m, n);
  const auto batch = LU.sizes().slice(0, LU.dim() - 2).vec();
  if (unpack_pivots && pivots.numel() > 0 && (!LU.is_mps() || kMpsChecksPivots)) {
    // A pivot outside 1..m is an error, not a permutation.
    const bool bad = pivots.lt(1).logical_or(pivots.gt(m)).any().item<bool>();
    TORCH_CHECK(!bad, "pivots passed to lu_unpack must be between 1 and LU.size(-2) inclusive."
                      "Did you properly pass the result of lu_factor?");
  }
  const auto opts = LU.options();
  Tensor P = unpack_pivots ? at::empty(with_matrix(batch, m, m), opts) : at::empty({0}, opts);
  Tensor L = unpack_data ? at::empty(with_matrix(batch, m, k), opts) : at::empty({0}, opts);
  Tensor U = unpack_data ? at::empty(with_matrix(batch, k, n), opts) : at::empty({0}, opts);
  linalg::lu_unpack_into(LU.resolve_neg(), pivots, unpack_pivots ? P : Tensor(), unpack_data ? L : Tensor(),
                         unpack_data ? U : Tensor());
  return {P, L, U};
}

// ------------------------------------------------------ triangular solve --
Reason solve_triangular_unsupported(const Tensor& A, const Tensor& B, bool left) {
  if (A.dim() < 2 || B.dim() < 2 || A.size(-1) != A.size(-2)) return kInvalid;
  if (left ? A.size(-2) != B.size(-2) : A.size(-1) != B.size(-1)) return kInvalid;
  return pair_unsupported(A, B, 2, 2);
}

Tensor solve_triangular(const Tensor& A, const Tensor& B, bool upper, bool left, bool unitriangular) {
  auto batch = *linalg::broadcast_batch(A, 2, B, 2);
  // X's layout as torch's (linalg_solve_triangular_meta): row-major when the
  // broadcast A is a conjugated row-major view's transpose (A.mH of a
  // contiguous A, which torch solves with without a copy), column-major
  // otherwise.
  const Tensor A_ = A.expand(with_matrix(batch, A.size(-2), A.size(-1)));
  const bool row_major = A_.is_conj() && A_.mT().is_contiguous();
  Tensor X = empty_matrices(with_matrix(batch, B.size(-2), B.size(-1)), !row_major, B.options());
  linalg::triangular_solve_into(A.resolve_neg(), B.resolve_neg(), X, upper, false, unitriangular, left);
  return X;
}

std::tuple<Tensor, Tensor> triangular_solve_with_clone(const Tensor& B, const Tensor& A, bool upper, bool transpose,
                                                       bool unitriangular) {
  auto batch = *linalg::broadcast_batch(A, 2, B, 2);
  Tensor X = empty_matrices(with_matrix(batch, B.size(-2), B.size(-1)), true, B.options());
  auto a_shape = with_matrix(batch, A.size(-2), A.size(-1));
  Tensor A_clone = empty_matrices(a_shape, true, A.options());
  A_clone.copy_(A.expand(a_shape));
  linalg::triangular_solve_into(A.resolve_neg(), B.resolve_neg(), X, upper, transpose, unitriangular, true);
  return {X, A_clone};
}

// ------------------------------------------------------- inverse, solve --
std::tuple<Tensor, Tensor> inv_ex(const Tensor& A_, bool check_errors) {
  const Tensor A = A_.resolve_neg();
  const bool transposed = kSolveFactorsTransposedA && A.is_contiguous() && !A.is_complex();
  const Tensor M = transposed ? A.mT() : A;  // the matrix torch factors
  Tensor inverse = empty_matrices(A.sizes(), true, A.options());
  Factors f;
  if (linalg::small_path(M) && A.size(-1) > 0) {
    f.info = at::empty(A.sizes().slice(0, A.dim() - 2), A.options().dtype(at::kInt));
    linalg::small_factor_solve(M, true, LINALG_DET_NONE, false, f, Tensor(), inverse, true, transposed);
  } else {
    linalg::check_solve(inverse, true);
    f = linalg::lu_factor(M, true, LINALG_DET_NONE);
    linalg::lu_solve_into(f.lu, f.pivots, Tensor(), inverse, true, transposed);
  }
  if (check_errors) at::_linalg_check_errors(f.info, "linalg.inv_ex", A.dim() == 2);
  return {inverse, f.info};
}

Reason solve_ex_unsupported(const Tensor& A, const Tensor& B, bool left) {
  if (A.dim() < 2 || A.size(-1) != A.size(-2) || B.dim() < 1) return kInvalid;
  const bool vector_case = at::native::linalg_solve_is_vector_rhs(A, B);
  if (vector_case && !left) return kInvalid;
  const Tensor B_ = vector_case ? B.unsqueeze(-1) : B;
  if (B_.dim() < 2 || (left ? A.size(-2) != B_.size(-2) : A.size(-1) != B_.size(-1))) return kInvalid;
  return pair_unsupported(A, B_, 2, 2);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> solve_ex(const Tensor& A_, const Tensor& B, bool left, bool check_errors) {
  const Tensor A = A_.resolve_neg();
  const bool vector_case = at::native::linalg_solve_is_vector_rhs(A, B);
  const Tensor B_ = (vector_case ? B.unsqueeze(-1) : B).resolve_neg();
  const auto batch = *linalg::broadcast_batch(A, 2, B_, 2);
  auto shape = with_matrix(batch, B_.size(-2), B_.size(-1));
  if (vector_case) shape.pop_back();
  Tensor result = empty_matrices(shape, left, B.options());
  const Tensor result_ = vector_case ? result.unsqueeze(-1) : result;

  const bool transposed = kSolveFactorsTransposedA && A.is_contiguous() && !A.is_complex();
  const Tensor M = transposed ? A.mT() : A;
  Factors f;
  const bool same_batch = c10::IntArrayRef(batch) == A.sizes().slice(0, A.dim() - 2);
  if (linalg::small_path(M) && A.size(-1) > 0 && same_batch) {
    // One dispatch: each thread factors its matrix and solves with it.
    f = Factors{empty_matrices(A.sizes(), true, A.options()),
                at::empty(A.sizes().slice(0, A.dim() - 1), A.options().dtype(at::kInt)),
                at::empty(A.sizes().slice(0, A.dim() - 2), A.options().dtype(at::kInt)), Tensor(), Tensor()};
    linalg::small_factor_solve(M, true, LINALG_DET_NONE, true, f, B_, result_, left, transposed);
  } else {
    linalg::check_solve(result_, left);
    f = linalg::lu_factor(M, true, LINALG_DET_NONE);
    linalg::lu_solve_into(f.lu, f.pivots, B_, result_, left, transposed);
  }
  if (check_errors) at::_linalg_check_errors(f.info, "torch.linalg.solve_ex", A.dim() == 2);
  return {result, f.lu, f.pivots, f.info};
}

// torch may have no MPS kernel for linalg_lu_solve: the checks of its meta
// function, with its messages, before anything else.
void check_lu_solve(const Tensor& LU, const Tensor& pivots, const Tensor& B, bool left) {
  at::native::checkFloatingOrComplex(LU, "torch.linalg.lu_solve");
  TORCH_CHECK(LU.scalar_type() == B.scalar_type(), "linalg.lu_solve: Expected LU and B to have the same dtype, ",
              "but found LU of type ", LU.scalar_type(), " and B of type ", B.scalar_type(), " instead");
  TORCH_CHECK(pivots.dtype() == at::kInt, "linalg.lu_solve: pivots should be a Tensor of scalar type torch.int32");
  at::native::squareCheckInputs(LU, "torch.linalg.lu_solve");
  at::native::checkInputsSolver(LU, B, left, "linalg.lu_solve");
  TORCH_CHECK(LU.size(-1) == pivots.size(-1),
              "linalg.lu_solve: Number of pivots per batch should be same as the dimension of the matrix");
  TORCH_CHECK(LU.sizes().slice(0, LU.dim() - 1).equals(pivots.sizes()),
              "linalg.lu_solve: Expected LU.shape[:-1] and pivots.shape to be the same, but got pivots with shape ",
              pivots.sizes(), " instead");
  at::native::_linalg_broadcast_batch_dims(B, LU);  // B's and LU's batches broadcast
}

Reason lu_solve_unsupported(const Tensor& LU, const Tensor& pivots, const Tensor& B) {
  if (LU.device() != pivots.device()) return kInvalid;
  Reason why = pair_unsupported(LU, B, 2, 2);
  if (!why) why = linalg::operand_unsupported(pivots, 1, 0);
  return why;
}

Tensor solve_with_factors(const Tensor& LU, const Tensor& pivots, const Tensor& B, bool left, bool adjoint) {
  const auto shape = std::get<0>(at::native::_linalg_broadcast_batch_dims(B, LU));
  Tensor X = empty_matrices(shape, left, B.options());
  linalg::lu_solve_into(LU.resolve_neg(), pivots, B.resolve_neg(), X, left, adjoint);
  return X;
}

// ---------------------------------------------------------- determinants --
Factors det_factors(const Tensor& A_, uint32_t mode) {
  const Tensor A = A_.resolve_neg();
  // As torch: det(A) = det(A^H) for the real A, whose A^H is then F-contiguous.
  const bool transposed = A.is_contiguous() && !A.is_complex();
  return linalg::lu_factor(transposed ? A.mH() : A, true, mode);
}

// -------------------------------------------------------- registration --
// The family's ops as route sees them.
const RoutedOp kLinalgLuFactorEx(FamilyId::linalg, "aten::linalg_lu_factor_ex");
const RoutedOp kLinalgLuFactor(FamilyId::linalg, "aten::linalg_lu_factor");
const RoutedOp kLinalgLu(FamilyId::linalg, "aten::linalg_lu");
const RoutedOp kLuUnpack(FamilyId::linalg, "aten::lu_unpack");
const RoutedOp kLinalgSolveTriangular(FamilyId::linalg, "aten::linalg_solve_triangular");
const RoutedOp kTriangularSolve(FamilyId::linalg, "aten::triangular_solve");
const RoutedOp kLinalgInvEx(FamilyId::linalg, "aten::linalg_inv_ex");
const RoutedOp kLinalgSolveEx(FamilyId::linalg, "aten::_linalg_solve_ex");
const RoutedOp kLinalgLuSolve(FamilyId::linalg, "aten::linalg_lu_solve");
const RoutedOp kLinalgDet(FamilyId::linalg, "aten::_linalg_det");
const RoutedOp kLinalgSlogdet(FamilyId::linalg, "aten::_linalg_slogdet");

template <DispatchKey K>
std::tuple<Tensor, Tensor, Tensor> lu_factor_ex_impl(const Tensor& A, bool pivot, bool check_errors) {
  return route<decltype(lu_factor_ex_impl<K>)>(
      kLinalgLuFactorEx, K, lu_factor_unsupported(A),
      [&] { return lu_factor_ex(A, pivot, check_errors, "torch.linalg.lu_factor_ex"); }, A, pivot, check_errors);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor> lu_factor_impl(const Tensor& A, bool pivot) {
  return route<decltype(lu_factor_impl<K>)>(
      kLinalgLuFactor, K, lu_factor_unsupported(A),
      [&] {
        auto r = lu_factor_ex(A, pivot, true, "torch.linalg.lu_factor");
        return std::make_tuple(std::get<0>(r), std::get<1>(r));
      },
      A, pivot);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor, Tensor> linalg_lu_impl(const Tensor& A, bool pivot) {
  TORCH_CHECK(A.dim() >= 2, "linalg.lu: Expected tensor with 2 or more dimensions. Got size: ", A.sizes(), " instead");
  return route<decltype(linalg_lu_impl<K>)>(
      kLinalgLu, K, lu_factor_unsupported(A), [&] { return factor_and_unpack(A, pivot); }, A, pivot);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor, Tensor> lu_unpack_impl(const Tensor& LU, const Tensor& pivots, bool unpack_data,
                                                  bool unpack_pivots) {
  return route<decltype(lu_unpack_impl<K>)>(
      kLuUnpack, K, lu_unpack_unsupported(LU, pivots, unpack_pivots),
      [&] { return unpack(LU, pivots, unpack_data, unpack_pivots); }, LU, pivots, unpack_data, unpack_pivots);
}

template <DispatchKey K>
Tensor solve_triangular_impl(const Tensor& A, const Tensor& B, bool upper, bool left, bool unitriangular) {
  return route<decltype(solve_triangular_impl<K>)>(
      kLinalgSolveTriangular, K, solve_triangular_unsupported(A, B, left),
      [&] { return solve_triangular(A, B, upper, left, unitriangular); }, A, B, upper, left, unitriangular);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor> triangular_solve_impl(const Tensor& B, const Tensor& A, bool upper, bool transpose,
                                                 bool unitriangular) {
  return route<decltype(triangular_solve_impl<K>)>(
      kTriangularSolve, K, solve_triangular_unsupported(A, B, true),
      [&] { return triangular_solve_with_clone(B, A, upper, transpose, unitriangular); }, B, A, upper, transpose,
      unitriangular);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor> inv_ex_impl(const Tensor& A, bool check_errors) {
  return route<decltype(inv_ex_impl<K>)>(
      kLinalgInvEx, K, square_unsupported(A), [&] { return inv_ex(A, check_errors); }, A, check_errors);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor, Tensor, Tensor> solve_ex_impl(const Tensor& A, const Tensor& B, bool left,
                                                         bool check_errors) {
  return route<decltype(solve_ex_impl<K>)>(
      kLinalgSolveEx, K, solve_ex_unsupported(A, B, left), [&] { return solve_ex(A, B, left, check_errors); }, A, B,
      left, check_errors);
}

template <DispatchKey K>
Tensor lu_solve_impl(const Tensor& LU, const Tensor& pivots, const Tensor& B, bool left, bool adjoint) {
  check_lu_solve(LU, pivots, B, left);
  return route<decltype(lu_solve_impl<K>)>(
      kLinalgLuSolve, K, lu_solve_unsupported(LU, pivots, B),
      [&] { return solve_with_factors(LU, pivots, B, left, adjoint); }, LU, pivots, B, left, adjoint);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor, Tensor> det_impl(const Tensor& A) {
  return route<decltype(det_impl<K>)>(
      kLinalgDet, K, square_unsupported(A),
      [&] {
        Factors f = det_factors(A, LINALG_DET);
        return std::make_tuple(f.det, f.lu, f.pivots);
      },
      A);
}

template <DispatchKey K>
std::tuple<Tensor, Tensor, Tensor, Tensor> slogdet_impl(const Tensor& A) {
  return route<decltype(slogdet_impl<K>)>(
      kLinalgSlogdet, K, square_unsupported(A),
      [&] {
        Factors f = det_factors(A, LINALG_SLOGDET);
        return std::make_tuple(f.det, f.logabsdet, f.lu, f.pivots);
      },
      A);
}

template <DispatchKey K>
void register_linalg(FamilyOps& ops) {
  ops.aten("linalg_lu_factor_ex", TORCH_FN(lu_factor_ex_impl<K>));
  // linalg_lu_factor is composite (it calls linalg_lu_factor_ex) except on
  // torch 2.9, which gave it an MPS kernel of its own. An MPS kernel where
  // torch has none would bypass the composite's autograd.
  if (K != DispatchKey::MPS || op_handle("aten::linalg_lu_factor").hasKernelForDispatchKey(DispatchKey::MPS))
    ops.aten("linalg_lu_factor", TORCH_FN(lu_factor_impl<K>));
  ops.aten("linalg_lu", TORCH_FN(linalg_lu_impl<K>));
  ops.aten("lu_unpack", TORCH_FN(lu_unpack_impl<K>));
  ops.aten("linalg_solve_triangular", TORCH_FN(solve_triangular_impl<K>));
  ops.aten("triangular_solve", TORCH_FN(triangular_solve_impl<K>));
  ops.aten("linalg_inv_ex", TORCH_FN(inv_ex_impl<K>));
  ops.aten("_linalg_solve_ex", TORCH_FN(solve_ex_impl<K>));
  ops.aten("linalg_lu_solve", TORCH_FN(lu_solve_impl<K>));
  ops.aten("_linalg_det", TORCH_FN(det_impl<K>));
  ops.aten("_linalg_slogdet", TORCH_FN(slogdet_impl<K>));
}

}  // namespace
}  // namespace mps_ext

// aten::linalg_solve_triangular takes conjugated and negated views itself
// (torch registers it as a fallthrough of the Conjugate and Negative keys),
// so on MPS the override sees A.mH as a view, and its output's layout depends
// on it (solve_triangular). torch.ops.mps_ext's op does the same, so that it
// runs the kernels on CPU tensors as they run on MPS.
TORCH_LIBRARY_IMPL(mps_ext, Conjugate, m) { m.impl("linalg_solve_triangular", torch::CppFunction::makeFallthrough()); }
TORCH_LIBRARY_IMPL(mps_ext, Negative, m) { m.impl("linalg_solve_triangular", torch::CppFunction::makeFallthrough()); }

MPS_EXT_FAMILY(linalg, mps_ext::register_linalg)
