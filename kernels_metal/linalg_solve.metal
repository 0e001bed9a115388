// Triangular solves, float and complex64: linalg.solve_triangular,
// triangular_solve, and the solves with LU factors (linalg.lu_solve,
// linalg.solve, linalg.inv) as one or two triangular sweeps with LAPACK's
// row permutation before or after.
//
// One threadgroup per (matrix, chunk of C right-hand-side columns); thread i
// owns row i and keeps its C values in registers for the whole solve. Each
// step of a sweep, the thread of the finished row divides it by the
// diagonal and publishes it in threadgroup memory; after one barrier every
// remaining row subtracts its multiple. The factors are read once per
// threadgroup, B and X once: a barrier per row is the price, and rows stop
// at LINALG_MAX_ROWS (the threadgroup's threads).
#include <metal_stdlib>
#include "linalg_common.h"
using namespace metal;

// Whether row i subtracts a multiple of finished row j in a sweep.
inline bool eliminates(bool active, bool lower, int i, int j) { return active && (lower ? i > j : i < j); }

template <typename T, int C>
[[max_total_threads_per_threadgroup(LINALG_MAX_THREADS)]]
kernel void lu_solve(device T* x [[buffer(0)]],
                     const device T* a [[buffer(1)]],
                     const device T* b [[buffer(2)]],
                     const device int* pivots [[buffer(3)]],
                     constant SolveParams& p [[buffer(4)]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint threads [[threads_per_threadgroup]],
                     uint group [[threadgroup_position_in_grid]]) {
  threadgroup int perm[LINALG_MAX_ROWS];  // row i of P^T B is row perm[i] of B
  threadgroup T b_stage[LINALG_SOLVE_STAGED(C)];
  threadgroup T published[2][C];  // the finished row, double-buffered: one barrier per step

  const int n = p.n, k = p.k, i = int(tid);
  const int chunks = (k + C - 1) / C;
  const long mat = long(group / uint(chunks));
  const int col0 = int(group % uint(chunks)) * C;
  const bool active = i < n;

  if (p.perm != LINALG_PERM_NONE) {
    if (active) perm[i] = i;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
      const device int* pm = pivots + batch_offset(p.batch, p.pivot_batch_strides, mat);
      for (int j = 0; j < n; ++j) {
        const int r = pm[j] - 1;
        if (r < 0 || r >= n) continue;  // not a pivot of an n x n LU: no access outside the matrix
        const int v = perm[j];
        perm[j] = perm[r];
        perm[r] = v;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // 64-bit arithmetic once, for where the matrices start; 32-bit inside
  // them (the host checked that a matrix spans less than 2^31 elements).
  //
  // B's rows, as P^T B for LINALG_PERM_GATHER. Lanes on consecutive rows
  // read consecutive elements of a column-major B; a row-major B's rows
  // (C values each) go through threadgroup memory, LINALG_SOLVE_STAGE
  // elements at a time, copied with lanes along the rows.
  T xr[C];
  for (int c = 0; c < C; ++c) {
    const int row = p.perm == LINALG_PERM_GATHER && active ? perm[i] : i;
    xr[c] = p.identity != 0 && row == col0 + c && col0 + c < k ? one<T>() : T(0.0f);
  }
  if (p.identity == 0) {
    const device T* bm = b + batch_offset(p.batch, p.b.batch_strides, mat);
    const int rs = int(p.b.row_stride), cs = int(p.b.col_stride);
    const bool conj = p.b.conj != 0;
    if (C > 1 && cs == 1) {
      constexpr int R = LINALG_SOLVE_STAGE / C;  // rows per copy
      const Staging st = staging<T>(C);
      for (int r0 = 0; r0 < n; r0 += R) {
        const int rows = min(R, n - r0);
        for (int idx = int(tid); idx < rows * C; idx += int(threads)) {
          const int slot = r0 + idx / C, col = col0 + idx % C;
          const int row = p.perm == LINALG_PERM_GATHER ? perm[slot] : slot;
          if (col < k) b_stage[st.at(uint(idx))] = conj_if(bm[row * rs + col], conj);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (active && i >= r0 && i < r0 + rows) {
          for (int c = 0; c < C; ++c)
            if (col0 + c < k) xr[c] = b_stage[st.at(uint((i - r0) * C + c))];
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // the next copy overwrites the stage
      }
    } else if (active) {
      const int row = p.perm == LINALG_PERM_GATHER ? perm[i] : i;
      for (int c = 0; c < C; ++c) {
        const int col = col0 + c;
        if (col < k) xr[c] = conj_if(bm[row * rs + col * cs], conj);
      }
    }
  }

  const device T* am = a + batch_offset(p.batch, p.a.batch_strides, mat);
  uint step = 0;
  for (uint s = 0; s < p.sweep_count; ++s) {
    const SolveSweep w = p.sweeps[s];
    const int rs = int(w.row_stride), cs = int(w.col_stride);
    const bool conj = (w.conj != 0) != (p.a.conj != 0);
    const bool lower = w.lower != 0;
    // Every load of a step is issued a step ahead, before the barrier that
    // ends the step before it, so that its latency overlaps that barrier's
    // wait instead of following it (2n barriers a solve, each otherwise
    // followed by a device load the next step waits on): the diagonal of
    // the next step's row, by its thread alone (one lane, one line), and
    // each row's multiplier of the next step's row.
    const int first = lower ? 0 : n - 1;
    const bool divide = w.unit == 0;
    T diag = divide && i == first ? conj_if(am[i * rs + i * cs], conj) : one<T>();
    T e = n > 0 && eliminates(active, lower, i, first) ? conj_if(am[i * rs + first * cs], conj) : T(0.0f);
    for (int t = 0; t < n; ++t, ++step) {
      const int j = lower ? t : n - 1 - t;
      threadgroup T* pub = published[step & 1];
      if (i == j) {
        if (divide)
          for (int c = 0; c < C; ++c) xr[c] = cdiv(xr[c], diag);
        for (int c = 0; c < C; ++c) pub[c] = xr[c];
      }
      const int next = lower ? j + 1 : j - 1;
      const T e_next =
          t + 1 < n && eliminates(active, lower, i, next) ? conj_if(am[i * rs + next * cs], conj) : T(0.0f);
      if (divide && t + 1 < n && i == next) diag = conj_if(am[i * rs + i * cs], conj);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (eliminates(active, lower, i, j))
        for (int c = 0; c < C; ++c) xr[c] -= cmul(e, pub[c]);
      e = e_next;
    }
  }

  if (active) {
    const int row = p.perm == LINALG_PERM_SCATTER ? perm[i] : i;
    device T* xm = x + batch_offset(p.batch, p.x.batch_strides, mat);
    const int rs = int(p.x.row_stride), cs = int(p.x.col_stride);
    for (int c = 0; c < C; ++c) {
      const int col = col0 + c;
      if (col < k) xm[row * rs + col * cs] = xr[c];
    }
  }
}

// clang-format off
#define INSTANTIATE_SOLVE(name, T, C) \
  template [[host_name("lu_solve_" #name "_" #C)]] kernel decltype(lu_solve<T, C>) lu_solve<T, C>;
INSTANTIATE_SOLVE(f32, float, 1)
INSTANTIATE_SOLVE(f32, float, 4)
INSTANTIATE_SOLVE(f32, float, 16)
INSTANTIATE_SOLVE(c64, float2, 1)
INSTANTIATE_SOLVE(c64, float2, 4)
INSTANTIATE_SOLVE(c64, float2, 16)
// clang-format on
