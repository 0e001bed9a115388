// LU factorisation with LAPACK's results (getrf: partial pivoting, the
// first row of largest |x| or |re| + |im| wins, unit lower L and U stored in
// one matrix, 1-based pivots, info = the first zero pivot), float and
// complex64, for a batch of m x n matrices of any strides; and lu_unpack.
//
// Two kernels factor, chosen on the host (csrc/ops/linalg_kernels.cpp):
//  lu_small  matrices up to 4 x 4, one thread per matrix in registers. It
//            can also solve with its factors (an inverse, a linalg.solve),
//            so a batch of millions of tiny systems is one dispatch that
//            reads each input and writes each output once.
//  lu_panel  one threadgroup per matrix, right-looking and blocked: a panel
//            of columns is factored in threadgroup memory (the whole matrix
//            when it fits), then the columns right of it are updated in
//            device memory, one simdgroup per column. One dispatch per call
//            whatever the size.
#include <metal_stdlib>
#include "linalg_common.h"
using namespace metal;

// ------------------------------------------------ one thread per matrix --
// Registers are indexed by compile-time loops only (N is a template
// argument): a dynamically indexed register array would spill on the GPU.
// Operands that are blocks (the usual contiguous batch) go through
// threadgroup memory (Staging): `stage` holds A, then LU, then X (E <= N^2
// elements per matrix), and after it B when B is read; `piv_stage` the
// pivots. The host sizes `stage`.
template <typename T>
MPS_EXT_INLINE void swap_values(thread T& a, thread T& b) {
  const T t = a;
  a = b;
  b = t;
}
template <typename T, int N>
MPS_EXT_INLINE void swap_values(thread T (&a)[N], thread T (&b)[N]) {
  MPS_EXT_UNROLL
  for (int c = 0; c < N; ++c) {
    const T t = a[c];
    a[c] = b[c];
    b[c] = t;
  }
}

// Swaps rows j and r (r >= j) of a thread's array of N rows (values, or
// rows of a matrix), by compile-time indices only (see above).
template <typename R, int N>
MPS_EXT_INLINE void swap_rows(thread R (&rows)[N], int j, int r) {
  MPS_EXT_UNROLL
  for (int i = j + 1; i < N; ++i)
    if (i == r) swap_values(rows[j], rows[i]);
}

template <typename T, int N>
[[max_total_threads_per_threadgroup(LINALG_SMALL_THREADS)]]
kernel void lu_small(device T* lu [[buffer(0)]],
                     device int* pivots [[buffer(1)]],
                     device int* info [[buffer(2)]],
                     device T* x [[buffer(3)]],
                     device T* det [[buffer(4)]],
                     device float* logabsdet [[buffer(5)]],
                     const device T* a [[buffer(6)]],
                     const device T* b [[buffer(7)]],
                     constant LuParams& p [[buffer(8)]],
                     threadgroup T* stage [[threadgroup(0)]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint group [[threadgroup_position_in_grid]]) {
  threadgroup int piv_stage[LINALG_STAGED_ELEMENTS(N)];
  constexpr uint NN = N * N;
  // 64-bit arithmetic once, for where the threadgroup's run of matrices and
  // a matrix start; 32-bit inside them (the host checked that every matrix
  // spans less than 2^31 elements).
  const long first = long(group) * LINALG_SMALL_THREADS;
  const long mat = first + long(tid);
  const bool live = mat < p.batch.count;
  const uint count = uint(min(p.batch.count - first, long(LINALG_SMALL_THREADS)));  // matrices of the threadgroup
  const bool solve = p.solve != LINALG_SOLVE_NONE;
  const bool read_b = solve && p.identity == 0;
  const uint E = uint(N * p.k);  // elements of a matrix of B and X
  threadgroup T* b_stage = stage + LINALG_STAGED_ELEMENTS(NN);
  const Staging sa = staging<T>(NN);
  const Staging sb = staging<T>(max(E, 1u));

  if (p.a.block != 0) stage_in(stage, sa, a + first * NN, count * NN, tid);
  if (read_b && p.b.block != 0) stage_in(b_stage, sb, b + first * E, count * E, tid);
  if (p.a.block != 0 || (read_b && p.b.block != 0)) threadgroup_barrier(mem_flags::mem_threadgroup);

  T M[N][N];
  {
    const int rs = int(p.a.row_stride), cs = int(p.a.col_stride);
    const bool conj = p.a.conj != 0;
    const device T* am = live && p.a.block == 0 ? a + batch_offset(p.batch, p.a.batch_strides, mat) : a;
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) {
        T v = T(0.0f);
        if (live) v = p.a.block != 0 ? stage[sa.at(tid * NN + uint(i * rs + j * cs))] : am[i * rs + j * cs];
        M[i][j] = conj_if(v, conj);
      }
  }

  // getf2 in registers. Pivot search as isamax / icamax: first row of the
  // largest magnitude; a NaN is taken only on the diagonal, where the search
  // starts (LuParams::nan_first 0). A zero pivot leaves its column unscaled
  // (LAPACK).
  int piv[N];
  int first_zero = 0;
  DetAccumulator<T> acc;
  acc.init();
  for (int j = 0; j < N; ++j) {
    int r = j;
    if (p.pivot != 0) {
      float best = abs1(M[j][j]);
      for (int i = j + 1; i < N; ++i) {
        float v = abs1(M[i][j]);
        if (v > best) {
          best = v;
          r = i;
        }
      }
    }
    piv[j] = r;
    swap_rows(M, j, r);
    const T d = M[j][j];
    const bool zero = is_zero(d);
    if (zero && first_zero == 0) first_zero = j + 1;
    acc.add(d, r != j, p.det);
    const PivotScale<T> scale = pivot_scale(d);
    for (int i = j + 1; i < N; ++i) {
      if (!zero) M[i][j] = scale.apply(M[i][j]);
      for (int c = j + 1; c < N; ++c) M[i][c] -= cmul(M[i][j], M[j][c]);
    }
  }

  if (live) {
    info[mat] = first_zero;
    if (p.det != LINALG_DET_NONE) det[mat] = acc.det;
    if (p.det == LINALG_SLOGDET) logabsdet[mat] = acc.log_abs;
  }
  if (p.write_lu != 0) {  // column-major LU and the pivots, matrix after matrix
    // Every thread has read A from `stage` (the barrier after the loads is
    // behind it) before any thread writes LU there.
    if (p.a.block != 0) threadgroup_barrier(mem_flags::mem_threadgroup);
    const Staging sp = staging<int>(N);
    if (live) {
      for (int j = 0; j < N; ++j) {
        piv_stage[sp.at(tid * N + uint(j))] = piv[j] + 1;
        for (int i = 0; i < N; ++i) stage[sa.at(tid * NN + uint(j * N + i))] = M[i][j];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    stage_out(lu + first * NN, stage, sa, count * NN, tid);
    stage_out(pivots + first * N, piv_stage, sp, count * N, tid);
  }
  if (!solve) return;

  // X goes to `stage` after every thread is done with what it held (A, or
  // LU on its way out).
  if (p.x.block != 0 && (p.a.block != 0 || p.write_lu != 0)) threadgroup_barrier(mem_flags::mem_threadgroup);
  const device T* bm = live && read_b && p.b.block == 0 ? b + batch_offset(p.batch, p.b.batch_strides, mat) : b;
  device T* xm = live && p.x.block == 0 ? x + batch_offset(p.batch, p.x.batch_strides, mat) : x;
  const int brs = int(p.b.row_stride), bcs = int(p.b.col_stride);
  const int xrs = int(p.x.row_stride), xcs = int(p.x.col_stride);
  const bool transposed = p.solve == LINALG_SOLVE_MT;
  // Lanes read and write the same element of their matrices (no bank
  // conflict in `stage`): the row permutation is applied in registers, as
  // the pivots' swaps (getrs' laswp), with selects rather than indices.
  for (int col = 0; col < p.k && live; ++col) {
    T y[N];
    for (int i = 0; i < N; ++i) {
      const int at = i * brs + col * bcs;
      T v = i == col ? one<T>() : T(0.0f);
      if (read_b) v = conj_if(p.b.block != 0 ? b_stage[sb.at(tid * E + uint(at))] : bm[at], p.b.conj != 0);
      y[i] = v;
    }
    if (!transposed) {  // P^T B, then L (unit lower), then U
      for (int j = 0; j < N; ++j) swap_rows(y, j, piv[j]);
      for (int i = 0; i < N; ++i)
        for (int j = 0; j < i; ++j) y[i] -= cmul(M[i][j], y[j]);
      for (int i = N - 1; i >= 0; --i) {
        for (int j = i + 1; j < N; ++j) y[i] -= cmul(M[i][j], y[j]);
        y[i] = cdiv(y[i], M[i][i]);
      }
    } else {  // U^T (lower), then L^T (unit upper), then P
      for (int i = 0; i < N; ++i) {
        for (int j = 0; j < i; ++j) y[i] -= cmul(M[j][i], y[j]);
        y[i] = cdiv(y[i], M[i][i]);
      }
      for (int i = N - 1; i >= 0; --i)
        for (int j = i + 1; j < N; ++j) y[i] -= cmul(M[j][i], y[j]);
      for (int j = N - 1; j >= 0; --j) swap_rows(y, j, piv[j]);
    }
    for (int i = 0; i < N; ++i) {
      const int at = i * xrs + col * xcs;
      if (p.x.block != 0) stage[sb.at(tid * E + uint(at))] = y[i];
      else xm[at] = y[i];
    }
  }
  if (p.x.block != 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
    stage_out(x + first * E, stage, sb, count * E, tid);
  }
}

// --------------------------------------------- one threadgroup per matrix --
// Best (magnitude, row) of a pivot search; ties go to the lower row, as
// isamax / icamax return the first maximum. A NaN magnitude beats every
// number (the search makes the NaNs it skips -1 instead:
// LuParams::nan_first).
struct PivotCandidate {
  float value;
  int row;
};

inline PivotCandidate better(PivotCandidate a, PivotCandidate b) {
  const bool a_nan = isnan(a.value), b_nan = isnan(b.value);
  if (a_nan != b_nan) return b_nan ? b : a;
  return (b.value > a.value || ((a_nan || b.value == a.value) && b.row < a.row)) ? b : a;
}

// Largest-magnitude row of a panel column over the threadgroup; every
// thread gets the result. Rows a thread did not see count as (-1, large).
inline PivotCandidate threadgroup_argmax(
    PivotCandidate c, threadgroup PivotCandidate* scratch, uint lane, uint sg, uint simdgroups) {
  for (ushort offset = 16; offset > 0; offset /= 2) {
    PivotCandidate o = {simd_shuffle_xor(c.value, offset), simd_shuffle_xor(c.row, offset)};
    c = better(c, o);
  }
  if (lane == 0) scratch[sg] = c;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  PivotCandidate best = scratch[0];
  for (uint i = 1; i < simdgroups; ++i) best = better(best, scratch[i]);
  return best;
}

// The panel is `panel` columns starting at column p0, rows p0..m-1, held in
// threadgroup memory column-major with leading dimension m (`tile`). Each
// step:
//  1. load the panel (from A in the first step, from LU after);
//  2. factor it: per column a pivot search (threadgroup argmax), the row
//     swap, the column scaled by the pivot, the rest of the panel updated;
//  3. every column outside the panel gets the panel's row swaps (columns
//     left of it: the L already computed; LAPACK swaps those too), and
//     each column right of it its rows of U (a unit lower triangular solve
//     with the panel's L11) and the update of the rows below by L21 U12;
//     one simdgroup per column, so a column needs no threadgroup barrier;
//  4. the panel is written to LU.
// In the first step the columns right of the panel are read from A through
// the row map (a row swap is where a row is read from), so A is copied to
// LU by the same pass that updates it, and A and LU are read and written
// once when the matrix fits in one panel. A row-major A is read along its
// rows instead: the first panel's load takes lanes along them, and the
// columns right of it are copied to LU by tiles before step 1 (a_to_lu).
template <typename T>
[[max_total_threads_per_threadgroup(LINALG_MAX_THREADS)]]
kernel void lu_panel(device T* lu [[buffer(0)]],
                     device int* pivots [[buffer(1)]],
                     device int* info [[buffer(2)]],
                     device T* det [[buffer(3)]],
                     device float* logabsdet [[buffer(4)]],
                     const device T* a [[buffer(5)]],
                     constant LuParams& p [[buffer(6)]],
                     threadgroup T* tile [[threadgroup(0)]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint threads [[threads_per_threadgroup]],
                     uint group [[threadgroup_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup PivotCandidate scratch[LINALG_MAX_THREADS / 32];
  threadgroup int row_map[LINALG_MAX_ROWS];        // row i of the swapped panel rows is row row_map[i]
  threadgroup int panel_pivots[LINALG_MAX_PANEL];  // 0-based pivot rows of the current panel
  threadgroup int swap_dst[2 * LINALG_MAX_PANEL];  // rows a panel's swaps change, and
  threadgroup int swap_src[2 * LINALG_MAX_PANEL];  // the row each one takes its value from
  threadgroup int swap_count[1];
  threadgroup T u12[LINALG_MAX_THREADS / 32][LINALG_MAX_PANEL];  // a column's rows of U, per simdgroup

  const int m = p.m, n = p.n, kmin = min(m, n);
  const long mat = long(group);
  // 64-bit arithmetic once, for where the matrices start; 32-bit inside
  // them (the host checked that a matrix spans less than 2^31 elements).
  const device T* am = a + batch_offset(p.batch, p.a.batch_strides, mat);
  const int ars = int(p.a.row_stride), acs = int(p.a.col_stride);
  const bool aconj = p.a.conj != 0;
  device T* out = lu + mat * long(m * n);  // column-major, leading dimension m
  // The panel's leading dimension in `tile`: odd, so that lanes on one row
  // across the panel's columns (loads along rows, row swaps) fall on
  // distinct banks.
  const int ld = LINALG_PANEL_LD(m);
  device int* piv_out = pivots + mat * kmin;
  int first_zero = 0;  // thread 0's
  DetAccumulator<T> acc;
  acc.init();

  // A row-major A's columns right of the first panel: read down a column,
  // as step 3 reads them, lanes would be a row (a line) apart. They are
  // copied to LU first instead, by 32 x 32 tiles (rows padded to 33) in the
  // panel's tile memory, read along A's rows and written down LU's columns;
  // step 3 then takes them from LU, as in later steps. (One more write and
  // read of them, for no line per lane.)
  constexpr int TILE = 32;
  const bool a_to_lu = acs < ars && n > p.panel && ld * p.panel >= TILE * (TILE + 1);
  if (a_to_lu) {
    for (int r0 = 0; r0 < m; r0 += TILE) {
      for (int c0 = p.panel / TILE * TILE; c0 < n; c0 += TILE) {
        for (int s = int(sg); s < TILE; s += int(simdgroups)) {
          const int r = r0 + s, c = c0 + int(lane);
          if (r < m && c >= p.panel && c < n) tile[s * (TILE + 1) + int(lane)] = conj_if(am[r * ars + c * acs], aconj);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int s = int(sg); s < TILE; s += int(simdgroups)) {
          const int r = r0 + int(lane), c = c0 + s;
          if (r < m && c >= p.panel && c < n) out[c * m + r] = tile[int(lane) * (TILE + 1) + s];
        }
        // The next tile overwrites this one after every thread wrote it out.
        threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
      }
    }
  }

  for (int p0 = 0; p0 < kmin; p0 += p.panel) {
    const int nb = min(p.panel, kmin - p0);
    const bool first = p0 == 0;
    const bool from_a = first && !a_to_lu;  // step 3 reads A (through the row map), not LU

    // 1. Load the panel; reset the row map. Lanes go down the panel's
    // columns, except along its rows when they are what is contiguous (the
    // first panel of a row-major A).
    // Down a column, lanes start at a multiple of 32 rows (rows above p0
    // idle): a column of LU starts on a line when m is a multiple of 32,
    // and so does every simdgroup's run of rows.
    const bool along_rows = first && acs < ars;
    const int base = p0 / 32 * 32, rows = m - base;
    for (int idx = int(tid); idx < rows * nb; idx += int(threads)) {
      const int i = base + (along_rows ? idx / nb : idx % rows), t = along_rows ? idx % nb : idx / rows;
      if (i >= p0) tile[t * ld + i] = first ? conj_if(am[i * ars + t * acs], aconj) : out[(p0 + t) * m + i];
    }
    for (int i = int(tid); i < m; i += int(threads)) row_map[i] = i;
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 2. Factor the panel.
    for (int j = 0; j < nb; ++j) {
      const int col = p0 + j;
      threadgroup T* tj = tile + j * ld;
      int r = col;
      if (p.pivot != 0) {
        // Every row is a candidate (-1 below any magnitude), so the
        // diagonal's thread always holds one and the winner is a row.
        PivotCandidate c = {-1.0f, m};
        for (int i = col + int(tid); i < m; i += int(threads)) {
          float v = abs1(tj[i]);
          if (isnan(v) && p.nan_first == 0 && i != col) v = -1.0f;
          c = better(c, PivotCandidate{v, i});
        }
        r = threadgroup_argmax(c, scratch, lane, sg, simdgroups).row;
      }
      if (r != col) {
        for (int t = int(tid); t < nb; t += int(threads)) {
          T v = tile[t * ld + col];
          tile[t * ld + col] = tile[t * ld + r];
          tile[t * ld + r] = v;
        }
      }
      if (tid == 0) panel_pivots[j] = r;
      // The swap is done, and the rows below are as the last step left
      // them (each thread updates the rows it searches, so without
      // pivoting this barrier is also what orders the steps).
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const T d = tj[col];
      const bool zero = is_zero(d);
      if (tid == 0) {
        if (zero && first_zero == 0) first_zero = col + 1;
        acc.add(d, r != col, p.det);
      }
      const PivotScale<T> scale = pivot_scale(d);
      for (int i = col + 1 + int(tid); i < m; i += int(threads)) {
        T l = tj[i];
        if (!zero) {
          l = scale.apply(l);
          tj[i] = l;
        }
        for (int t = j + 1; t < nb; ++t) tile[t * ld + i] -= cmul(l, tile[t * ld + col]);
      }
    }

    // The panel's swaps as a row map, and as the list of rows they change.
    if (tid == 0) {
      for (int j = 0; j < nb; ++j) {
        const int r = panel_pivots[j];
        piv_out[p0 + j] = r + 1;
        const int v = row_map[p0 + j];
        row_map[p0 + j] = row_map[r];
        row_map[r] = v;
      }
      int count = 0;
      for (int j = 0; j < nb; ++j) {
        const int row = p0 + j;
        if (row_map[row] != row) {
          swap_dst[count] = row;
          swap_src[count] = row_map[row];
          ++count;
        }
      }
      for (int j = 0; j < nb; ++j) {  // rows below the panel's rows, each once
        const int row = panel_pivots[j];
        bool seen = row < p0 + nb || row_map[row] == row;
        for (int q = 0; q < j && !seen; ++q) seen = panel_pivots[q] == row;
        if (!seen) {
          swap_dst[count] = row;
          swap_src[count] = row_map[row];
          ++count;
        }
      }
      swap_count[0] = count;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 3. The columns outside the panel, one simdgroup each.
    const int swaps = swap_count[0];
    for (int q = int(sg); q < n - nb; q += int(simdgroups)) {
      const int c = q < p0 ? q : q + nb;
      device T* oc = out + c * m;
      if (!from_a && swaps > 0) {  // every lane reads its rows before any lane writes
        T v0 = T(0.0f), v1 = T(0.0f);
        const int s0 = int(lane), s1 = int(lane) + 32;
        if (s0 < swaps) v0 = oc[swap_src[s0]];
        if (s1 < swaps) v1 = oc[swap_src[s1]];
        simdgroup_barrier(mem_flags::mem_device);
        if (s0 < swaps) oc[swap_dst[s0]] = v0;
        if (s1 < swaps) oc[swap_dst[s1]] = v1;
        simdgroup_barrier(mem_flags::mem_device);
      }
      if (c < p0) continue;
      // Rows p0..p0+nb-1 of U: x = L11^-1 (swapped column), lane t holds row p0 + t.
      const device T* ac = am + c * acs;
      T xv = T(0.0f);
      if (int(lane) < nb) {
        const int i = p0 + int(lane);
        xv = from_a ? conj_if(ac[row_map[i] * ars], aconj) : oc[i];
      }
      for (int t = 0; t < nb; ++t) {
        const T xt = simd_shuffle(xv, ushort(t));
        if (int(lane) > t && int(lane) < nb) xv -= cmul(tile[t * ld + p0 + int(lane)], xt);
      }
      if (int(lane) < nb) {
        oc[p0 + int(lane)] = xv;
        u12[sg][lane] = xv;
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = (p0 + nb) / 32 * 32 + int(lane); i < m; i += 32) {  // from a multiple of 32, as in step 1
        if (i < p0 + nb) continue;
        T v = from_a ? conj_if(ac[row_map[i] * ars], aconj) : oc[i];
        for (int t = 0; t < nb; ++t) v -= cmul(tile[t * ld + i], u12[sg][t]);
        oc[i] = v;
      }
      // The next column's U rows overwrite u12 only after every lane used it.
      simdgroup_barrier(mem_flags::mem_threadgroup);
    }

    // 4. The panel to LU.
    for (int idx = int(tid); idx < rows * nb; idx += int(threads)) {  // from a multiple of 32, as in step 1
      const int i = base + idx % rows, t = idx / rows;
      if (i >= p0) out[(p0 + t) * m + i] = tile[t * ld + i];
    }
    // LU is complete up to the next panel; the next panel reads it, and
    // reuses the tile and the row map.
    threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  }

  if (tid == 0) {
    info[mat] = first_zero;
    if (p.det != LINALG_DET_NONE) det[mat] = acc.det;
    if (p.det == LINALG_SLOGDET) logabsdet[mat] = acc.log_abs;
  }
}

// ------------------------------------------------------------- lu_unpack --
// One threadgroup per matrix: the permutation from the pivots (thread 0, in
// threadgroup memory: `perm`, m ints, and its inverse after it), then P, one thread per output element
// in memory order, then L and U by 32 x 32 tiles of LU: LU is read with the
// lanes of a simdgroup along its contiguous dimension (down a column of the
// usual column-major LU), L's and U's rows are written with lanes along them,
// and the tile in threadgroup memory turns one into the other (rows padded
// to 33 elements: both directions free of bank conflicts). Every element of
// LU is L's or U's, so LU is read once. Pivots outside 1..m are ignored: no
// read or write leaves the matrix (the host rejects them first, except on
// MPS with torch 2.9, whose own kernel does not check them either).
#define UNPACK_TILE 32
template <typename T>
[[max_total_threads_per_threadgroup(LINALG_MAX_THREADS)]]
kernel void lu_unpack(device T* P [[buffer(0)]],
                      device T* L [[buffer(1)]],
                      device T* U [[buffer(2)]],
                      const device T* lu [[buffer(3)]],
                      const device int* pivots [[buffer(4)]],
                      constant UnpackParams& p [[buffer(5)]],
                      threadgroup int* perm [[threadgroup(0)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint threads [[threads_per_threadgroup]],
                      uint group [[threadgroup_position_in_grid]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup T tile[UNPACK_TILE][UNPACK_TILE + 1];
  const int m = p.m, n = p.n, kmin = min(m, n);
  const long mat = long(group);
  if (p.unpack_pivots != 0) {
    threadgroup int* inverse = perm + m;
    for (int i = int(tid); i < m; i += int(threads)) perm[i] = inverse[i] = i;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid == 0) {
      const device int* pm = pivots + batch_offset(p.batch, p.pivot_batch_strides, mat);
      for (int j = 0; j < kmin; ++j) {
        const int r = pm[j] - 1;
        if (r < 0 || r >= m) continue;
        const int v = perm[j], w = perm[r];
        perm[j] = w;
        perm[r] = v;
        inverse[w] = j;
        inverse[v] = r;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // P[perm[c], c] = 1 (A = P L U): row r's 1 is in column inverse[r],
    // which the lanes on a row read as one word.
    device T* out = P + mat * long(m * m);
    for (int idx = int(tid); idx < m * m; idx += int(threads)) {
      const int r = idx / m, c = idx % m;
      out[idx] = inverse[r] == c ? one<T>() : T(0.0f);
    }
  }
  if (p.unpack_data != 0) {
    const device T* in = lu + batch_offset(p.batch, p.lu.batch_strides, mat);
    const int rs = int(p.lu.row_stride), cs = int(p.lu.col_stride);
    const bool conj = p.lu.conj != 0;
    const bool down_columns = rs <= cs;  // the lanes' direction in LU
    device T* lm = L + mat * long(m * kmin);
    device T* um = U + mat * long(kmin * n);
    const int l = int(lane);
    for (int r0 = 0; r0 < m; r0 += UNPACK_TILE) {
      for (int c0 = 0; c0 < n; c0 += UNPACK_TILE) {
        for (int s = int(sg); s < UNPACK_TILE; s += int(simdgroups)) {
          const int r = r0 + (down_columns ? l : s), c = c0 + (down_columns ? s : l);
          if (r < m && c < n) tile[r - r0][c - c0] = conj_if(in[r * rs + c * cs], conj);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const int c = c0 + l;
        for (int s = int(sg); s < UNPACK_TILE && r0 + s < m; s += int(simdgroups)) {
          const int r = r0 + s;
          const T v = tile[s][l];
          if (c < kmin) lm[r * kmin + c] = r == c ? one<T>() : (r > c ? v : T(0.0f));
          if (r < kmin && c < n) um[r * n + c] = r <= c ? v : T(0.0f);
        }
        // The next tile overwrites this one after every thread wrote it out.
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
    }
  }
}

// ------------------------------------------------------- instantiations --
// clang-format off
#define INSTANTIATE_SMALL(name, T, N) \
  template [[host_name("lu_small_" #name "_" #N)]] kernel decltype(lu_small<T, N>) lu_small<T, N>;
INSTANTIATE_SMALL(f32, float, 1)
INSTANTIATE_SMALL(f32, float, 2)
INSTANTIATE_SMALL(f32, float, 3)
INSTANTIATE_SMALL(f32, float, 4)
INSTANTIATE_SMALL(c64, float2, 1)
INSTANTIATE_SMALL(c64, float2, 2)
INSTANTIATE_SMALL(c64, float2, 3)
INSTANTIATE_SMALL(c64, float2, 4)

template [[host_name("lu_panel_f32")]] kernel decltype(lu_panel<float>) lu_panel<float>;
template [[host_name("lu_panel_c64")]] kernel decltype(lu_panel<float2>) lu_panel<float2>;
template [[host_name("lu_unpack_f32")]] kernel decltype(lu_unpack<float>) lu_unpack<float>;
template [[host_name("lu_unpack_c64")]] kernel decltype(lu_unpack<float2>) lu_unpack<float2>;
// clang-format on
