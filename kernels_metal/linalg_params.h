// Parameters of the linear-algebra kernels (linalg_lu.metal,
// linalg_solve.metal; host side csrc/ops/linalg*.cpp).
#pragma once
#include "shared_types.h"

// Limits the kernels are written for; larger problems go to torch's kernel.
// A threadgroup holds a matrix's rows as threads (and the LU's row map in
// threadgroup memory), so rows stop at 512 threads; 512 rather than 1024
// because a pipeline's maxTotalThreadsPerThreadgroup can be lower than 1024.
#define LINALG_MAX_ROWS 512
#define LINALG_MAX_THREADS 512
// Columns of an LU panel: one lane of a simdgroup per panel row in the
// update of the columns right of the panel.
#define LINALG_MAX_PANEL 32
// Threadgroup memory on Apple GPUs, and the part lu_panel declares itself
// (for elements of `elem` bytes): the host gives the panel tile the rest.
#define LINALG_THREADGROUP_MEMORY 32768
#define LINALG_PANEL_STATIC_BYTES(elem)                                                                            \
  (8 * (LINALG_MAX_THREADS / 32) + 4 * LINALG_MAX_ROWS + 4 * LINALG_MAX_PANEL + 2 * 4 * 2 * LINALG_MAX_PANEL + 4 + \
   (elem) * (LINALG_MAX_THREADS / 32) * LINALG_MAX_PANEL)
// Leading dimension of lu_panel's tile of m rows (odd: no bank conflicts
// along its rows).
#define LINALG_PANEL_LD(m) ((m) | 1)
// Matrices up to this size are factored (and inverted, solved) in the
// registers of one thread per matrix.
#define LINALG_SMALL_MAX 4
// LuParams::nan_first: set for matrices with more rows or columns than this
// (what torch 2.13's CPU LU, MKL 2024.2, does; measured in
// tests/ops/test_linalg.py).
#define LINALG_NAN_FIRST_ABOVE 16
// Threads per threadgroup of the one-thread-per-matrix kernel.
#define LINALG_SMALL_THREADS 64
// Elements of threadgroup memory that stage the matrices of its threads, E
// elements each (linalg_common.h, Staging: one element of padding per 16 or
// more).
#define LINALG_STAGED_ELEMENTS(e) ((LINALG_SMALL_THREADS + LINALG_SMALL_THREADS / 16) * (e))

// Elements of a row-major B that lu_solve stages in threadgroup memory at a
// time (rows of C right-hand sides; linalg_common.h, Staging: one element
// of padding per 16 or more).
#define LINALG_SOLVE_STAGE 512
#define LINALG_SOLVE_STAGED(C) ((C) == 1 ? 1 : LINALG_SOLVE_STAGE + LINALG_SOLVE_STAGE / 16)  // none for one column

// What the LU kernels compute besides the factors.
#define LINALG_DET_NONE 0
#define LINALG_DET 1      // det: the product of U's diagonal and the permutation's sign
#define LINALG_SLOGDET 2  // sign (of the det's type) and log|det| (float)

// Solves of the one-thread-per-matrix kernel with the matrix M it factored.
#define LINALG_SOLVE_NONE 0
#define LINALG_SOLVE_M 1   // M X = B
#define LINALG_SOLVE_MT 2  // M^T X = B

// Row permutation of the solve kernel, from LAPACK pivots of A = P L U.
#define LINALG_PERM_NONE 0
#define LINALG_PERM_GATHER 1   // read B's rows as P^T B before the sweeps
#define LINALG_PERM_SCATTER 2  // write the result's rows as P X after the sweeps

// The batch dimensions of a call, outermost first, after broadcasting and
// after merging dimensions that are contiguous in every operand.
struct LinalgBatch {
  int64_t sizes[MPS_EXT_MAX_DIMS];
  int64_t count;  // product of sizes (1 for no batch dimension)
  uint32_t rank;
  uint32_t pad;
};

// Where the matrices of one operand live: element (i, j) of matrix number b
// is at offset(b) + i * row_stride + j * col_stride elements from the
// buffer's start. Broadcast batch dimensions have stride 0. conj: a complex
// operand that is conjugated lazily in torch (is_conj()), conjugated on load.
struct LinalgOperand {
  int64_t batch_strides[MPS_EXT_MAX_DIMS];
  int64_t row_stride;
  int64_t col_stride;
  uint32_t conj;
  // 1: matrix b is the E = rows * cols elements from b * E on, row- or
  // column-major (row_stride and col_stride are then offsets inside it), so
  // the matrices of consecutive threads are one contiguous run: lu_small
  // copies them through threadgroup memory (linalg_common.h, Staging).
  uint32_t block;
};

// LU factorisation of the m x n matrices `a` (LAPACK getrf), written
// column-major, one matrix after another (m * n elements apart); pivots
// (1-based, min(m, n) per matrix), info and the det outputs are contiguous.
// The one-thread-per-matrix kernel also solves with the factors (b, x, k,
// solve, identity).
struct LuParams {
  LinalgBatch batch;
  LinalgOperand a;
  LinalgOperand b;  // right-hand sides (solve), rows = n
  LinalgOperand x;  // solution (solve)
  int32_t m;
  int32_t n;
  int32_t k;          // right-hand-side columns
  int32_t panel;      // columns per panel of the threadgroup kernel
  uint32_t pivot;     // 1: partial pivoting; 0: none (pivots are 1..min(m, n))
  uint32_t det;       // LINALG_DET_*
  uint32_t write_lu;  // write LU and pivots (info is always written)
  uint32_t solve;     // LINALG_SOLVE_*
  uint32_t identity;  // the right-hand sides are the identity (an inverse)
  // Pivot search with NaNs (lu_panel; lu_small always 0): 0, a NaN is
  // skipped unless it is the diagonal element, where the search starts
  // (isamax / icamax of reference BLAS); 1, the first NaN of the column
  // wins. torch's CPU kernel (MKL) does the first for matrices up to
  // LINALG_NAN_FIRST_ABOVE rows and columns, the second for larger ones.
  uint32_t nan_first;
};

// One triangular sweep of the solve kernel over the n x n matrix `a`:
// element (i, j) of the triangle is at the operand's matrix offset
// + i * row_stride + j * col_stride (a transposed view swaps the strides).
struct SolveSweep {
  int64_t row_stride;
  int64_t col_stride;
  uint32_t lower;  // 1: lower triangle, forward substitution
  uint32_t unit;   // 1: the diagonal is taken as 1
  uint32_t conj;   // conjugate the triangle's elements
  uint32_t pad;
};

// Solves op(A) X = B for n x n triangular factors and n x k right-hand sides,
// as up to two sweeps (an LU solve is L then U) with an optional row
// permutation from pivots. Operands b and x are n x k views (the host
// transposes them for right-side solves).
struct SolveParams {
  LinalgBatch batch;
  LinalgOperand a;  // the factors: batch strides and conj (sweeps give the rest)
  LinalgOperand b;
  LinalgOperand x;
  int64_t pivot_batch_strides[MPS_EXT_MAX_DIMS];  // pivots: n per matrix, contiguous
  SolveSweep sweeps[2];
  int32_t n;
  int32_t k;
  uint32_t sweep_count;
  uint32_t perm;      // LINALG_PERM_*
  uint32_t identity;  // B is the identity (an inverse); b is not read
  uint32_t pad;
};

// lu_unpack: P (m x m), L (m x k), U (k x n) of an m x n LU and its pivots,
// written contiguous (row-major), one matrix after another.
struct UnpackParams {
  LinalgBatch batch;
  LinalgOperand lu;
  int64_t pivot_batch_strides[MPS_EXT_MAX_DIMS];  // k pivots per matrix, contiguous
  int32_t m;
  int32_t n;
  uint32_t unpack_data;
  uint32_t unpack_pivots;
};
