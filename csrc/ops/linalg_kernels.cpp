// Launches of the linear-algebra kernels (see csrc/ops/linalg.h): parameter
// structs from tensor views, kernel variant and launch geometry.
#include <ATen/ATen.h>
#include <ATen/native/LinearAlgebraUtils.h>

#include <algorithm>
#include <limits>

#include "backend/launch.h"
#include "linalg_params.h"
#include "dispatch/kernel_choice.h"
#include "ops/linalg.h"

namespace mps_ext {
namespace linalg {
namespace {

const char* type_name(c10::ScalarType t) {
  const char* name = t == at::kFloat || t == at::kComplexFloat ? kernel_type_name(t) : nullptr;
  TORCH_CHECK(name, "mps_ext linalg: no kernel for ", t);
  return name;
}

// Threads of a kernel that loops over its rows (or elements) with the
// threadgroup's threads: a thread each, in whole simdgroups, at most `most`
// and what the pipeline allows on `device` (more passes of the loops).
uint32_t threads_for(const c10::Device& device, const char* library, const std::string& kernel, int64_t rows,
                     int64_t most) {
  const int64_t t = (rows + 31) / 32 * 32;
  return static_cast<uint32_t>(std::clamp<int64_t>(t, 32, thread_budget(device, library, kernel, most)));
}

// setThreadgroupMemoryLength takes multiples of 16 bytes.
uint32_t threadgroup_bytes(int64_t bytes) { return static_cast<uint32_t>((bytes + 15) / 16 * 16); }

uint32_t grid_size(int64_t groups) {
  TORCH_CHECK(groups <= std::numeric_limits<uint32_t>::max(), "mps_ext linalg: too many matrices (", groups, ")");
  return static_cast<uint32_t>(groups);
}

// One operand of a batched call: its tensor, how many trailing dims are not
// batch dims (2 for a matrix, 1 for pivots), and where its batch strides go.
struct BatchOperand {
  const at::Tensor* t;
  int64_t matrix_dims;
  int64_t* strides;
};

// The batch of a call: `shape`, with each operand's strides aligned to its
// right end (a missing or size-1 dimension broadcasts: stride 0). Size-1
// dimensions are dropped and neighbours that are contiguous in every
// operand merged, so most calls index a single batch dimension.
LinalgBatch plan_batch(c10::IntArrayRef shape, std::initializer_list<BatchOperand> ops) {
  const int64_t rank = static_cast<int64_t>(shape.size());
  std::vector<int64_t> sizes;
  std::vector<std::vector<int64_t>> strides(ops.size());
  for (int64_t d = 0; d < rank; ++d) {
    if (shape[d] == 1) continue;
    std::vector<int64_t> here;
    for (const auto& op : ops) {
      const int64_t own = op.t->dim() - op.matrix_dims;  // the operand's batch dims
      const int64_t i = d - (rank - own);
      here.push_back(i >= 0 && op.t->size(i) != 1 ? op.t->stride(i) : 0);
    }
    bool merge = !sizes.empty();
    for (size_t k = 0; merge && k < here.size(); ++k) merge = strides[k].back() == here[k] * shape[d];
    if (merge) {
      sizes.back() *= shape[d];
      for (size_t k = 0; k < here.size(); ++k) strides[k].back() = here[k];
    } else {
      sizes.push_back(shape[d]);
      for (size_t k = 0; k < here.size(); ++k) strides[k].push_back(here[k]);
    }
  }
  TORCH_CHECK(sizes.size() <= MPS_EXT_MAX_DIMS, "mps_ext linalg: more than ", MPS_EXT_MAX_DIMS, " batch dimensions");
  LinalgBatch b{};
  b.rank = static_cast<uint32_t>(sizes.size());
  b.count = 1;
  for (size_t d = 0; d < sizes.size(); ++d) {
    b.sizes[d] = sizes[d];
    b.count *= sizes[d];
  }
  size_t k = 0;
  for (const auto& op : ops) {
    for (size_t d = 0; d < sizes.size(); ++d) op.strides[d] = strides[k][d];
    ++k;
  }
  return b;
}

// Row and column strides and lazy conjugation of a matrix view; transposed:
// as its transpose.
void set_matrix(LinalgOperand& o, const at::Tensor& t, bool transposed = false) {
  o.row_stride = transposed ? t.stride(-1) : t.stride(-2);
  o.col_stride = transposed ? t.stride(-2) : t.stride(-1);
  o.conj = t.is_conj() ? 1 : 0;
}

// Whether the operand is a block (LinalgOperand::block): matrix b at b * E
// elements, E = rows * cols, row- or column-major.
void set_block(LinalgOperand& o, const LinalgBatch& batch, int64_t rows, int64_t cols) {
  const int64_t rs = o.row_stride, cs = o.col_stride;
  const bool row_major = (rows == 1 || rs == cols) && (cols == 1 || cs == 1);
  const bool col_major = (rows == 1 || rs == 1) && (cols == 1 || cs == rows);
  const bool batch_dense = batch.rank == 0 || (batch.rank == 1 && o.batch_strides[0] == rows * cols);
  o.block = (row_major || col_major) && batch_dense ? 1 : 0;
}

c10::IntArrayRef batch_shape(const at::Tensor& t, int64_t matrix_dims) {
  return t.sizes().slice(0, t.dim() - matrix_dims);
}

// Pivots with unit stride along their last dimension, as the kernels read them.
at::Tensor pivots_view(const at::Tensor& pivots) { return pivots.stride(-1) == 1 ? pivots : pivots.contiguous(); }

Factors allocate_factors(const at::Tensor& a, uint32_t det_mode) {
  const int64_t m = a.size(-2), n = a.size(-1);
  auto batch = batch_shape(a, 2).vec();
  auto opts = a.options();
  Factors f;
  f.lu =
      at::empty_strided(a.sizes(), at::native::batched_matrix_contiguous_strides(a.sizes(), /*f_contig=*/true), opts);
  auto piv_shape = batch;
  piv_shape.push_back(std::min(m, n));
  f.pivots = at::empty(piv_shape, opts.dtype(at::kInt));
  f.info = at::empty(batch, opts.dtype(at::kInt));
  if (det_mode != LINALG_DET_NONE) f.det = at::empty(batch, opts);
  if (det_mode == LINALG_SLOGDET) f.logabsdet = at::empty(batch, opts.dtype(c10::toRealValueType(a.scalar_type())));
  return f;
}

// Factors of matrices with no element: info 0, det 1, log|det| 0.
void fill_empty_factors(Factors& f) {
  f.info.zero_();
  if (f.det.defined()) f.det.fill_(1);
  if (f.logabsdet.defined()) f.logabsdet.zero_();
}

struct Sweep {
  bool lower, unit, conj, transposed;
};

// lu_solve's kernel for the solution `x` (as the kernel writes it: n rows,
// k columns) and its threads: thread i owns row i, so the pipeline must
// allow n of them, or this call goes to torch (a smaller matrix runs).
struct SolveKernel {
  std::string name;
  int64_t chunk;  // right-hand-side columns per threadgroup (the registers of a row's thread)
  uint32_t threads;
};
SolveKernel solve_kernel(const at::Tensor& x) {
  const int64_t n = x.size(-2), k = x.size(-1);
  SolveKernel s;
  s.chunk = k == 1 ? 1 : (k <= 4 ? 4 : 16);
  s.name = std::string("lu_solve_") + type_name(x.scalar_type()) + "_" + std::to_string(s.chunk);
  const int64_t budget = thread_budget(x.device(), "linalg_solve", s.name, LINALG_MAX_THREADS);
  if (n > budget) throw CallNotTaken{because::past_pipeline(std::string("matrix rows"), budget)};
  s.threads = static_cast<uint32_t>(std::max<int64_t>(32, (n + 31) / 32 * 32));
  return s;
}

// One dispatch of lu_solve: x = the sweeps (and the permutation) applied to
// b, all n x k views with x's batch.
void launch_solve(const at::Tensor& a, const at::Tensor& pivots, const at::Tensor& b, const at::Tensor& x,
                  std::initializer_list<Sweep> sweeps, uint32_t perm) {
  const int64_t n = x.size(-2), k = x.size(-1);
  if (x.numel() == 0) return;
  TORCH_CHECK(!x.is_conj(), "mps_ext linalg: conjugated output");
  SolveParams p{};
  const at::Tensor piv = pivots.defined() ? pivots_view(pivots) : at::Tensor();
  int64_t unused[MPS_EXT_MAX_DIMS];
  p.batch =
      plan_batch(batch_shape(x, 2),
                 {{&a, 2, p.a.batch_strides},
                  {b.defined() ? &b : &x, 2, b.defined() ? p.b.batch_strides : unused},
                  {piv.defined() ? &piv : &x, piv.defined() ? 1 : 2, piv.defined() ? p.pivot_batch_strides : unused},
                  {&x, 2, p.x.batch_strides}});
  if (p.batch.count == 0) return;
  p.a.conj = a.is_conj() ? 1 : 0;
  if (b.defined()) set_matrix(p.b, b);
  set_matrix(p.x, x);
  p.identity = b.defined() ? 0 : 1;
  p.n = static_cast<int32_t>(n);
  p.k = static_cast<int32_t>(k);
  p.perm = perm;
  for (const Sweep& s : sweeps) {
    SolveSweep& w = p.sweeps[p.sweep_count++];
    w.row_stride = s.transposed ? a.stride(-1) : a.stride(-2);
    w.col_stride = s.transposed ? a.stride(-2) : a.stride(-1);
    w.lower = s.lower;
    w.unit = s.unit;
    w.conj = s.conj;
  }
  const SolveKernel kernel = solve_kernel(x);
  const int64_t groups = p.batch.count * ((k + kernel.chunk - 1) / kernel.chunk);
  launch(Launch{"linalg_solve",
                kernel.name,
                {KernelArg::of(x), KernelArg::of(a), KernelArg::of(b.defined() ? b : a),
                 KernelArg::of(piv.defined() ? piv : x), KernelArg::value(p)},
                {grid_size(groups), 1, 1},
                {kernel.threads, 1, 1}});
}

}  // namespace

bool kernel_dtype(c10::ScalarType t) { return t == at::kFloat || t == at::kComplexFloat; }

Reason operand_unsupported(const at::Tensor& t, int64_t matrix_dims, int64_t max_rows) {
  if (t.layout() != at::kStrided) return because::not_strided;
  if (t.dim() - matrix_dims > MPS_EXT_MAX_DIMS) return because::batch_dims_past_8;
  if (t.dim() < matrix_dims) return {};  // torch's checks report it
  int64_t span = 0;
  for (int64_t d = t.dim() - matrix_dims; d < t.dim(); ++d) span += (t.size(d) - 1) * t.stride(d);
  if (span >= (int64_t(1) << 31)) return because::matrix_spans_2_31;
  if (matrix_dims == 2 && t.size(-2) > max_rows) return because::rows_past(max_rows);
  return {};
}

c10::optional<std::vector<int64_t>> broadcast_batch(const at::Tensor& a, int64_t a_dims, const at::Tensor& b,
                                                    int64_t b_dims) {
  auto sa = batch_shape(a, a_dims), sb = batch_shape(b, b_dims);
  const size_t rank = std::max(sa.size(), sb.size());
  std::vector<int64_t> out(rank);
  for (size_t i = 0; i < rank; ++i) {
    const int64_t x = i < rank - sa.size() ? 1 : sa[i - (rank - sa.size())];
    const int64_t y = i < rank - sb.size() ? 1 : sb[i - (rank - sb.size())];
    if (x != y && x != 1 && y != 1) return c10::nullopt;
    out[i] = x == 1 ? y : x;
  }
  return out;
}

bool small_path(const at::Tensor& a) { return a.size(-1) == a.size(-2) && a.size(-1) <= LINALG_SMALL_MAX; }

void small_factor_solve(const at::Tensor& a, bool pivot, uint32_t det_mode, bool write_lu, Factors& f,
                        const at::Tensor& b, const at::Tensor& x, bool left, bool adjoint) {
  const int64_t n = a.size(-1);
  TORCH_INTERNAL_ASSERT(small_path(a) && n >= 1);
  TORCH_INTERNAL_ASSERT(!(adjoint && a.is_complex()), "mps_ext linalg: the small kernel solves without conjugation");
  LuParams p{};
  // Solve M X = B or M^T X = B (M the factored matrix) with n x k views.
  at::Tensor bv, xv;
  if (x.defined()) {
    bv = b.defined() ? (left ? b : b.mT()) : b;
    xv = left ? x : x.mT();
    const bool transposed = left == adjoint;  // left and A^T, or right and A (X A = B is A^T X^T = B^T)
    p.solve = transposed ? LINALG_SOLVE_MT : LINALG_SOLVE_M;
    p.k = static_cast<int32_t>(xv.size(-1));
    p.identity = b.defined() ? 0 : 1;
  }
  int64_t unused[MPS_EXT_MAX_DIMS];
  p.batch = plan_batch(batch_shape(a, 2), {{&a, 2, p.a.batch_strides},
                                           {bv.defined() ? &bv : &a, 2, bv.defined() ? p.b.batch_strides : unused},
                                           {xv.defined() ? &xv : &a, 2, xv.defined() ? p.x.batch_strides : unused}});
  if (p.batch.count == 0) return;
  set_matrix(p.a, a);
  set_block(p.a, p.batch, n, n);
  // B and X are staged where A was (LINALG_STAGED_ELEMENTS(n * n)): up to n
  // columns.
  if (bv.defined()) set_matrix(p.b, bv);
  if (bv.defined() && p.k <= n) set_block(p.b, p.batch, n, p.k);
  if (xv.defined()) set_matrix(p.x, xv);
  if (xv.defined() && p.k <= n) set_block(p.x, p.batch, n, p.k);
  p.m = p.n = static_cast<int32_t>(n);
  p.pivot = pivot ? 1 : 0;
  p.det = det_mode;
  p.write_lu = write_lu ? 1 : 0;
  const at::Tensor& info = f.info;
  launch(Launch{"linalg_lu",
                std::string("lu_small_") + type_name(a.scalar_type()) + "_" + std::to_string(n),
                {KernelArg::of(write_lu ? f.lu : info), KernelArg::of(write_lu ? f.pivots : info), KernelArg::of(info),
                 KernelArg::of(xv.defined() ? xv : info), KernelArg::of(f.det.defined() ? f.det : info),
                 KernelArg::of(f.logabsdet.defined() ? f.logabsdet : info), KernelArg::of(a),
                 KernelArg::of(bv.defined() ? bv : a), KernelArg::value(p)},
                {grid_size((p.batch.count + LINALG_SMALL_THREADS - 1) / LINALG_SMALL_THREADS), 1, 1},
                {LINALG_SMALL_THREADS, 1, 1},
                {threadgroup_bytes((p.b.block != 0 ? 2 : 1) * LINALG_STAGED_ELEMENTS(n * n) * a.itemsize())}});
}

Factors lu_factor(const at::Tensor& a, bool pivot, uint32_t det_mode) {
  Factors f = allocate_factors(a, det_mode);
  const int64_t m = a.size(-2), n = a.size(-1), kmin = std::min(m, n);
  if (f.info.numel() == 0) return f;
  if (kmin == 0) {
    fill_empty_factors(f);
    return f;
  }
  if (small_path(a)) {
    small_factor_solve(a, pivot, det_mode, /*write_lu=*/true, f, at::Tensor(), at::Tensor(), true, false);
    return f;
  }
  LuParams p{};
  p.batch = plan_batch(batch_shape(a, 2), {{&a, 2, p.a.batch_strides}});
  set_matrix(p.a, a);
  p.m = static_cast<int32_t>(m);
  p.n = static_cast<int32_t>(n);
  p.pivot = pivot ? 1 : 0;
  p.nan_first = std::max(m, n) > LINALG_NAN_FIRST_ABOVE ? 1 : 0;
  p.det = det_mode;
  p.write_lu = 1;
  // The widest panel (up to 32 columns) whose m rows (ld apart) fit in threadgroup
  // memory beside what the kernel declares itself; 64 bytes for alignment.
  const int64_t elem = a.itemsize();
  const int64_t room = LINALG_THREADGROUP_MEMORY - LINALG_PANEL_STATIC_BYTES(elem) - 64;
  const int64_t ld = LINALG_PANEL_LD(m);
  p.panel = static_cast<int32_t>(std::min<int64_t>({LINALG_MAX_PANEL, kmin, room / (ld * elem)}));
  TORCH_INTERNAL_ASSERT(p.panel >= 1);
  const at::Tensor& info = f.info;
  const std::string kernel = std::string("lu_panel_") + type_name(a.scalar_type());
  launch(Launch{
      "linalg_lu",
      kernel,
      {KernelArg::of(f.lu), KernelArg::of(f.pivots), KernelArg::of(info), KernelArg::of(f.det.defined() ? f.det : info),
       KernelArg::of(f.logabsdet.defined() ? f.logabsdet : info), KernelArg::of(a), KernelArg::value(p)},
      {grid_size(p.batch.count), 1, 1},
      {threads_for(a.device(), "linalg_lu", kernel, std::max(m, n), LINALG_MAX_THREADS), 1, 1},
      {threadgroup_bytes(ld * p.panel * elem)}});
  return f;
}

void check_solve(const at::Tensor& x, bool left) {
  if (x.numel() != 0) solve_kernel(left ? x : x.mT());
}

void lu_solve_into(const at::Tensor& lu, const at::Tensor& pivots, const at::Tensor& b, const at::Tensor& x, bool left,
                   bool adjoint) {
  // A = P L U. left: A X = B is L U X = P^T B; A^H X = B is U^H L^H P^T X = B.
  // Right: X A = B is A^T X^T = B^T (U^T L^T P^T X^T = B^T), X A^H = B is
  // conj(A) X^T = B^T (P conj(L) conj(U) X^T = B^T). So the factors are
  // read transposed for (left and adjoint) and (right and not adjoint), and
  // conjugated when adjoint.
  const bool transposed = left == adjoint;
  const at::Tensor bv = b.defined() ? (left ? b : b.mT()) : b;
  const at::Tensor xv = left ? x : x.mT();
  if (!transposed) {
    launch_solve(lu, pivots, bv, xv, {{true, true, adjoint, false}, {false, false, adjoint, false}},
                 LINALG_PERM_GATHER);
  } else {
    launch_solve(lu, pivots, bv, xv, {{true, false, adjoint, true}, {false, true, adjoint, true}}, LINALG_PERM_SCATTER);
  }
}

void triangular_solve_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& x, bool upper, bool transpose,
                           bool unitriangular, bool left) {
  // op(A) X = B; X op(A) = B is op(A)^T X^T = B^T.
  const bool transposed = left ? transpose : !transpose;
  const bool lower = transposed ? upper : !upper;
  launch_solve(a, at::Tensor(), left ? b : b.mT(), left ? x : x.mT(), {{lower, unitriangular, false, transposed}},
               LINALG_PERM_NONE);
}

void lu_unpack_into(const at::Tensor& lu, const at::Tensor& pivots, const at::Tensor& P, const at::Tensor& L,
                    const at::Tensor& U) {
  const int64_t m = lu.size(-2), n = lu.size(-1);
  if (std::min(m, n) == 0) {  // L and U have no element; P is the identity
    if (P.defined() && P.numel() > 0) {
      P.zero_();
      P.diagonal(0, -2, -1).fill_(1);
    }
    return;
  }
  UnpackParams p{};
  const at::Tensor piv = P.defined() ? pivots_view(pivots) : lu;
  int64_t unused[MPS_EXT_MAX_DIMS];
  p.batch = plan_batch(batch_shape(lu, 2), {{&lu, 2, p.lu.batch_strides},
                                            {&piv, P.defined() ? 1 : 2, P.defined() ? p.pivot_batch_strides : unused}});
  if (p.batch.count == 0) return;
  set_matrix(p.lu, lu);
  p.m = static_cast<int32_t>(m);
  p.n = static_cast<int32_t>(n);
  p.unpack_pivots = P.defined() ? 1 : 0;
  p.unpack_data = L.defined() ? 1 : 0;
  const int64_t work = std::max({m * m, m * std::min(m, n), std::min(m, n) * n});
  const std::string kernel = std::string("lu_unpack_") + type_name(lu.scalar_type());
  launch(Launch{"linalg_lu",
                kernel,
                {KernelArg::of(P.defined() ? P : lu), KernelArg::of(L.defined() ? L : lu),
                 KernelArg::of(U.defined() ? U : lu), KernelArg::of(lu), KernelArg::of(piv), KernelArg::value(p)},
                {grid_size(p.batch.count), 1, 1},
                {threads_for(lu.device(), "linalg_lu", kernel, work, 256), 1, 1},
                {threadgroup_bytes(2 * m * 4)}});  // the permutation and its inverse
}

}  // namespace linalg
}  // namespace mps_ext
