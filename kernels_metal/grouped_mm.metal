// Grouped matrix products for mixture-of-experts layers (_grouped_mm,
// _scaled_grouped_mm). The group offsets are read here, on the GPU, never by
// the host: every launch is sized from shapes alone, and a threadgroup finds
// its group by searching `offs` itself. Threadgroups that find no work exit
// at once. Accumulation is in float.
//
// gmm_decode_rows  few rows (decode): the one decode template of decode.h.
//                  A threadgroup owns 2 output columns per simdgroup of one
//                  group's rows (up to 8 at a time), streams those weight
//                  columns of the group's expert once with 16-byte loads
//                  along K and applies each to all its rows, staged in
//                  threadgroup memory once for its simdgroups. The grid
//                  has one slot per row of `a`; the slot of a group's first
//                  row (and of every 8th after it) works, the others exit.
//                  So experts nobody chose are never touched, and the
//                  launch is the same whatever the routing.
// moe_down_combine  gmm_decode_rows's down product of mps_ext's MoE layer
//                  with each token's weighted sum of its slots as the
//                  epilogue (moe_combine's, bit for bit): one dispatch.
// gmm_decode_cols  the same for a weight whose N dimension is contiguous
//                  (W[E, K, N]): decode.h's cols template (gemv_cols'), a
//                  threadgroup owning 128 bytes of columns.
// gmm_tiled        many rows (prefill, and the K-split and batched modes):
//                  64 x 64 output tiles from simdgroup_matrix products.
//                  In the rows mode a tile of 64 rows may span several
//                  groups; it accumulates each group's rows against that
//                  group's weights (other rows masked to zero).
//
// Element types: float, half, bfloat, and float8_e4m3fn bytes (uchar),
// decoded as value / 256 (fp8_codec.h: e4m3 bits placed into half bits, four
// bytes at a time) with the 256s folded into p.mul.
#include <metal_stdlib>
#include "decode.h"
#include "fp8_codec.h"
#include "grouped_mm_params.h"
#include "pieces.h"
#include "activations.h"
using namespace metal;

// ------------------------------------------------------------ elements --
inline float elem(float v) { return v; }
inline float elem(half v) { return float(v); }
inline float elem(bfloat v) { return float(v); }
inline float elem(uchar v) { return e4m3x4_to_float_div256(uint(v)).x; }

// -------------------------------------------------------------- groups --
// end(g) = clamp(offs[g], 0, m): the rows of group g are [end(g-1), end(g)).
inline uint group_end(const device int* offs, uint g, uint m) {
  return uint(clamp(offs[g], 0, int(min(m, uint(numeric_limits<int>::max())))));
}
inline uint group_start(const device int* offs, uint g, uint m) { return g == 0 ? 0 : group_end(offs, g - 1, m); }

// The group holding row r: the first g with end(g) > r, or `groups` if none
// (a row past offs[-1]). Run by one whole simdgroup: the groups ending at or
// before r form a prefix (offsets are non-decreasing, torch's contract), so
// the answer is their count; the lanes read 32 consecutive offsets (128
// contiguous bytes, one cache line when aligned) a round and stop at the
// first round not wholly below r: 4 rounds at most for 128 experts. If the
// offsets are out of order the answer is some group, still in bounds.
inline uint find_group(const device int* offs, uint groups, uint m, uint r, uint lane) {
  uint g = 0;
  for (uint base = 0; base < groups; base += 32) {
    const bool below = base + lane < groups && group_end(offs, base + lane, m) <= r;
    const uint count = uint(simd_sum(below ? 1 : 0));
    g += count;
    if (count < 32) break;  // uniform: every lane has the same count
  }
  return g;
}

// What a decode threadgroup works on: `rows` rows from `row` of group `g`.
struct RowSlot {
  uint g, row, rows;
};

// Simdgroup 0 finds the slot's group and shares it; rows == 0: no work.
// Every thread of the threadgroup must call this (it has a barrier).
inline RowSlot decode_slot(
    const device int* offs, constant GroupedMMParams& p, uint row, uint sg, uint lane, threadgroup uint* shared) {
  if (sg == 0) {
    const uint g = find_group(offs, p.groups, p.m, row, lane);
    if (lane == 0) {
      uint rows = 0;
      if (g < p.groups) {
        const uint start = group_start(offs, g, p.m), end = group_end(offs, g, p.m);
        // Rows of a group are taken 8 at a time, by the slots of its 1st, 9th, ... row.
        if ((row - start) % GMM_DECODE_MAX_ROWS == 0) rows = min(uint(GMM_DECODE_MAX_ROWS), end - row);
      }
      shared[0] = g;
      shared[1] = rows;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  RowSlot s;
  s.g = shared[0];
  s.row = row;
  s.rows = shared[1];
  return s;
}

inline float scale_of(
    constant GroupedMMParams& p, const device float* row_scale, const device float* col_scale, uint g, uint m, uint n) {
  float s = p.mul;
  if (p.scales & GMM_ROW_SCALE) s *= row_scale[ulong(g) * ulong(p.row_scale_batch) + m];
  if (p.scales & GMM_COL_SCALE) s *= col_scale[ulong(g) * ulong(p.col_scale_batch) + n];
  return s;
}

// ------------------------------------------------------ gmm_decode_rows --
// decode.h's template; this family's job: the rows of one group (the
// slot's), each an activation row of its own or its token's (rows_at,
// staged by the kernel), against the group's expert; a simdgroup owns two
// weight columns: two outputs, or with swiglu the gate and up columns of
// one. Scales (p.mul folds in fp8's 256s) on the way out.
template <typename T>
struct GmmFormat {
  typedef DecodeFloat<T> type;
};
template <>
struct GmmFormat<uchar> {  // float8_e4m3fn
  typedef DecodeFp8 type;
};

// What this family's jobs read beyond their operands: the slot's rows of
// one group, the group's expert. A member of each job (Metal has no derived
// classes), with the job's operands filled by init.
template <typename TA, typename TB, typename TO>
struct GmmInOut {
  typedef DecodeOperands<typename GmmFormat<TA>::type, typename GmmFormat<TB>::type> Operands;
  device TO* out;
  const device TA* a;
  constant GroupedMMParams* p;
  RowSlot s;
  MPS_EXT_INLINE void init(thread Operands& op,
                           device TO* out_,
                           const device TA* a_,
                           const device TB* w_,
                           constant GroupedMMParams& p_,
                           RowSlot s_) {
    decode_format_e5m2(op.xf, false);  // float8 operands are e4m3fn
    decode_format_e5m2(op.wf, false);
    out = out_;
    a = a_;
    op.w = w_ + ulong(s_.g) * ulong(p_.b_batch);  // the group's expert
    p = &p_;
    s = s_;
    op.rows = int(s_.rows);
    op.k = int(p_.k);
    op.x_k = p_.a_k;
    op.w_k = p_.b_k;
  }
  // The slot's own row r of `a` (no gather; offsets fit 32 bits: the host checks).
  MPS_EXT_INLINE const device TA* slot_row(int r) const { return a + (s.row + uint(r)) * uint(p->a_m); }
};

// The job of gmm_decode_rows (COMBINE false) and of moe_down_combine (true,
// below): one flat struct, so that both store one output the same way.
// gmm_decode_rows's rows are each an activation row of its own or its
// token's (rows_at, staged by the kernel); moe_down_combine's are the
// chunk's own rows, and it keeps their outputs in threadgroup memory (ys)
// for its epilogue.
template <typename TA, typename TB, typename TO, bool COMBINE>
struct GmmDecodeJob {
  // (20: the slot, the scales' indices and two column pointers stay live too)
  // Half DECODE_TILE_BYTES: a threadgroup also keeps rows_at and the slot
  // (40 bytes), and with a whole 8 KiB tile a core held 7 threadgroups of
  // 128 threads by threadgroup memory where their registers allow 8.
  enum { BLOCK_SCALED = 0, BUDGET = 20, TILE_BYTES = DECODE_TILE_BYTES / 2 };
  typename GmmInOut<TA, TB, TO>::Operands op;
  GmmInOut<TA, TB, TO> io;
  const device float* row_scale;
  const device float* col_scale;
  threadgroup const uint* rows_at;  // (gmm_decode_rows)
  threadgroup TO* ys;               // (moe_down_combine) [row][column of the block]
  uint local;                       // (moe_down_combine) the simdgroup's first column in the block
  uint outputs_log2;                // (moe_down_combine)
  uint col0;
  uint col[GMM_ROWS_OUTPUTS];
  bool on[GMM_ROWS_OUTPUTS];
  MPS_EXT_INLINE const device TA* x_row(int r) const { return COMBINE ? io.slot_row(r) : io.a + rows_at[r]; }
  MPS_EXT_INLINE bool live(int q) const { return on[q]; }
  MPS_EXT_INLINE const device TB* w_row(int q) const { return op.w + col[q] * uint(io.p->b_n); }
  // Lane q writes column q's output (swiglu: lane 0 the one output), so
  // that one store instruction writes consecutive outputs of one row;
  // moe_down_combine (never swiglu) into ys, what moe_experts writes to y.
  MPS_EXT_INLINE void store(int r, thread const float* total, uint lane) const {
    constant GroupedMMParams& p = *io.p;
    const bool swiglu = !COMBINE && p.swiglu;
    const uint g = io.s.g, m = io.s.row + uint(r), lane_col = lane == 1 ? col[1] : col[0];
    const bool writes = swiglu ? lane == 0 && on[0] : lane < uint(GMM_ROWS_OUTPUTS) && (lane == 1 ? on[1] : on[0]);
    if (!writes) return;
    float v;
    if (swiglu) {
      const float gate = total[0] * scale_of(p, row_scale, col_scale, g, m, col[0]);
      v = silu(gate) * total[1] * scale_of(p, row_scale, col_scale, g, m, col[1]);
    } else {
      v = (lane == 1 ? total[1] : total[0]) * scale_of(p, row_scale, col_scale, g, m, lane_col);
    }
    if (COMBINE) ys[(m << outputs_log2) + local + lane] = TO(v);
    else io.out[ulong(m) * ulong(p.out_m) + ulong(swiglu ? col0 : lane_col) * ulong(p.out_n)] = TO(v);
  }
};

template <typename TA, typename TB, typename TO, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void gmm_decode_rows(device TO* out [[buffer(0)]],
                            const device TA* a [[buffer(1)]],
                            const device TB* w [[buffer(2)]],
                            const device int* offs [[buffer(3)]],
                            constant GroupedMMParams& p [[buffer(4)]],
                            const device float* row_scale [[buffer(5)]],
                            const device float* col_scale [[buffer(6)]],
                            const device int* rows_of [[buffer(7)]],
                            uint2 tg [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint2 threads [[threads_per_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint simdgroups [[simdgroups_per_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  typedef GmmDecodeJob<TA, TB, TO, false> Job;
  constexpr int TILE_WORDS = decode_tile_words_any<TA, TB, VEC, false>(Job::TILE_BYTES);
  threadgroup uint tile[TILE_WORDS];
  threadgroup uint rows_at[GMM_DECODE_MAX_ROWS];
  threadgroup uint shared[2];
  const RowSlot s = decode_slot(offs, p, tg.y, sg, lane, shared);
  if (s.rows == 0) return;  // not the first row of a chunk, or past offs[-1]
  // Each row's activations: its own row of `a`, or its token's (offsets
  // in `a` fit in 32 bits: the host checks).
  if (tid < s.rows) {
    const uint m = s.row + tid;
    rows_at[tid] = (p.gather ? uint(rows_of[m]) / p.gather : m) * uint(p.a_m);
  } else if (tid < GMM_DECODE_MAX_ROWS) {
    rows_at[tid] = 0;  // rows past the slot's: never read from `a`
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  Job job;
  job.io.init(job.op, out, a, w, p, s);
  job.row_scale = row_scale;
  job.col_scale = col_scale;
  job.rows_at = rows_at;
  // swiglu: one output, col0, of silu(gate) * up, from b's columns col0
  // (gate) and half + col0 (up); else outputs col0 and col0 + 1.
  const uint half_n = p.n / 2;
  job.col0 = (tg.x * simdgroups + sg) * (p.swiglu ? 1 : GMM_ROWS_OUTPUTS);
  MPS_EXT_UNROLL
  for (int q = 0; q < GMM_ROWS_OUTPUTS; ++q) {
    const uint c = p.swiglu ? job.col0 + q * half_n : job.col0 + q;
    job.on[q] = p.swiglu ? job.col0 < half_n : c < p.n;
    job.col[q] = job.on[q] ? c : 0;
  }
  // One specialisation per row count, so one routed row does not pay for 8.
  constexpr int Q = GMM_ROWS_OUTPUTS;
  if (s.rows == 1) decode_rows<Job, 1, Q, VEC>(job, tile, tid, threads.x, lane);
  else if (s.rows == 2) decode_rows<Job, 2, Q, VEC>(job, tile, tid, threads.x, lane);
  else if (s.rows <= 4) decode_rows<Job, 4, Q, VEC>(job, tile, tid, threads.x, lane);
  else decode_rows<Job, 8, Q, VEC>(job, tile, tid, threads.x, lane);
}

// ----------------------------------------------------- moe_down_combine --
// The down projection of mps_ext's MoE layer (moe.cpp) with each
// token's weighted sum of its slots fused in: one dispatch where
// gmm_decode_rows and moe_combine (moe.metal) took two, with the
// same bits. A threadgroup owns a block of output (hidden) columns, all
// its simdgroups' (1 << p.outputs_log2), and takes the chosen experts' rows
// a chunk of up to 8 at a time in row order (the chunks gmm_decode_rows's
// slots take), each expert's weight rows of the block read once (decode.h).
// Each row's outputs are rounded to TO as gmm_decode_rows stores y, and
// kept in threadgroup memory (every row of the step: the host sizes the
// block so that they fit MOE_DOWN_Y_ELEMENTS), because moe_combine adds a
// token's slots in slot order (the router's rank, the shared expert last),
// not in the experts' order the rows come in, and float additions in
// another order round differently. Then the threadgroup sums each token's
// slots for its columns as moe_combine does and writes `out`, with the
// decoder layer's residual added when p.residual says so (a uniform branch:
// one pipeline for both, and the add costs no dispatch of its own).
// The chunk of rows from `row` (the first of a group's rows or 8 past the
// previous chunk's): its group and rows, none past offs[-1]. Run by whole
// simdgroups, each finding the same (no barrier: the loop below has none of
// its own, so that no load of it waits behind one).
inline RowSlot chunk_at(const device int* offs, constant GroupedMMParams& p, uint row, uint lane) {
  RowSlot s;
  s.row = row;
  s.g = find_group(offs, p.groups, p.m, row, lane);
  s.rows = s.g < p.groups ? min(uint(GMM_DECODE_MAX_ROWS), group_end(offs, s.g, p.m) - row) : 0;
  return s;
}

template <typename TA, typename TB, typename TO, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void moe_down_combine(device TO* out [[buffer(0)]],
                             const device TA* a [[buffer(1)]],
                             const device TB* w [[buffer(2)]],
                             const device int* offs [[buffer(3)]],
                             constant GroupedMMParams& p [[buffer(4)]],
                             const device float* col_scale [[buffer(5)]],
                             const device float* weights [[buffer(6)]],
                             const device int* row_of_slot [[buffer(7)]],
                             const device TO* residual [[buffer(8)]],
                             uint tg [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint threads [[threads_per_threadgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]]) {
  typedef GmmDecodeJob<TA, TB, TO, true> Job;
  // The tile decode_rows stages at the job's TILE_BYTES (half a tile).
  constexpr int TILE_WORDS = decode_tile_words_any<TA, TB, VEC, false>(Job::TILE_BYTES);
  threadgroup uint tile[TILE_WORDS];
  threadgroup TO ys[MOE_DOWN_Y_ELEMENTS];
  constexpr int Q = GMM_ROWS_OUTPUTS;
  Job job;
  job.row_scale = col_scale;  // (never read: p.scales is GMM_COL_SCALE or nothing)
  job.col_scale = col_scale;
  job.ys = ys;
  job.outputs_log2 = p.outputs_log2;
  job.local = sg * Q;
  const uint block0 = tg << p.outputs_log2;
  job.col0 = block0 + job.local;
  MPS_EXT_UNROLL
  for (int q = 0; q < Q; ++q) {
    job.on[q] = job.col0 + q < p.n;
    job.col[q] = job.on[q] ? job.col0 + q : 0;
  }
  // Uniform: every simdgroup finds the same chunks (decode_rows has barriers).
  for (RowSlot s = chunk_at(offs, p, 0, lane); s.rows > 0; s = chunk_at(offs, p, s.row + s.rows, lane)) {
    job.io.init(job.op, out, a, w, p, s);
    if (s.rows == 1) decode_rows<Job, 1, Q, VEC>(job, tile, tid, threads, lane);
    else if (s.rows == 2) decode_rows<Job, 2, Q, VEC>(job, tile, tid, threads, lane);
    else if (s.rows <= 4) decode_rows<Job, 4, Q, VEC>(job, tile, tid, threads, lane);
    else decode_rows<Job, 8, Q, VEC>(job, tile, tid, threads, lane);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // every row's outputs in ys
  // moe_combine's sums: consecutive threads take consecutive columns of a
  // token (coalesced stores), 32 / Q tokens at a time; the slots in order,
  // each an fma as in moe_combine (written out: contracting `acc += w * y`
  // is the compiler's choice, not Safe math's promise).
  const uint c = tid & ((1u << p.outputs_log2) - 1), col = block0 + c;
  if (col >= p.n) return;
  for (uint t = tid >> p.outputs_log2; t < p.tokens; t += threads >> p.outputs_log2) {
    float acc = 0.0f;
    for (uint j = 0; j < p.slots; ++j) {
      const uint slot = t * p.slots + j;
      acc = fma(weights[slot], float(ys[(uint(row_of_slot[slot]) << p.outputs_log2) + c]), acc);
    }
    const ulong at = ulong(t) * ulong(p.out_m) + col;
    // The layer's output rounded to TO first, then the residual added in
    // float and rounded again: torch's `residual + moe_out`, bit for bit.
    out[at] = p.residual ? TO(float(TO(acc)) + float(residual[at])) : TO(acc);
  }
}

// ------------------------------------------------------ gmm_decode_cols --
// decode.h's cols template; this family's job: the slot's rows of one
// group against its expert (W[E, K, N], N contiguous), K never split.
template <typename T>
struct GmmColsJob {
  typename GmmInOut<T, T, T>::Operands op;
  GmmInOut<T, T, T> io;
  int splits;
  long n, w_n;
  MPS_EXT_INLINE const device T* x_row(int r) const { return io.slot_row(r); }
  MPS_EXT_INLINE void store(int r, long n_, float total, uint) const {
    io.out[ulong(io.s.row + uint(r)) * ulong(io.p->out_m) + ulong(n_) * ulong(io.p->out_n)] = T(total);
  }
};

template <typename T, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_COLS_THREADS)]]
kernel void gmm_decode_cols(device T* out [[buffer(0)]],
                            const device T* a [[buffer(1)]],
                            const device T* w [[buffer(2)]],
                            const device int* offs [[buffer(3)]],
                            constant GroupedMMParams& p [[buffer(4)]],
                            uint2 tg [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  constexpr int PARTIAL_WORDS = decode_cols_partial_words();
  threadgroup float4 partial_mem[PARTIAL_WORDS / 4];
  // A word a lane (4-byte pieces): a lane's accumulators stay at one word's
  // columns a row, 4 words in flight, up to 8 rows (16-byte pieces needed
  // lane groups that swap parts of their pieces: 43-47 registers, not 26-38).
  constexpr int B = VEC ? 4 : 0;
  constexpr int RING_WORDS = decode_cols_ring_words_any<T, B>();
  threadgroup float x_tile[RING_WORDS];
  threadgroup uint shared[2];
  const RowSlot s = decode_slot(offs, p, tg.y, sg, lane, shared);
  if (s.rows == 0) return;  // uniform: every thread read the same slot
  GmmColsJob<T> job;
  job.io.init(job.op, out, a, w, p, s);
  job.splits = 1;
  job.n = p.n;
  job.w_n = p.b_n;
  threadgroup float* partial = (threadgroup float*)partial_mem;
  typedef GmmColsJob<T> Job;
  if (s.rows == 1) decode_cols<Job, 1, B>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
  else if (s.rows == 2) decode_cols<Job, 2, B>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
  else if (s.rows <= 4) decode_cols<Job, 4, B>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
  else decode_cols<Job, 8, B>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
}

// ------------------------------------------------------------ gmm_tiled --
// One threadgroup: a GMM_TILE_M x GMM_TILE_N output tile, K in steps of
// GMM_TILE_K; 4 simdgroups in a 2 x 2 arrangement, each owning 32 x 32
// outputs, 4 x 4 float accumulators (simdgroup_float8x8). A step of 8 along
// K loads 4 fragments of A and 4 of B for 16 multiply-accumulates (the
// 32 x 32 tiles' simdgroups loaded 4 for 4).
//
// Operands are staged in threadgroup memory in their own type (float8
// experts decoded once to half, exactly: e4m3 / 256 is a half). Float
// tiles load as fragments (simdgroup_load); from 16-bit ones each lane
// builds its two elements of a float fragment (thread_elements(), Apple's
// fragment layout, as MLX's steel GEMM does): bfloat simdgroup matrices are
// MSL 3.1 and M1 has no bfloat arithmetic; float fragments run on every Mac
// mps_ext supports, and accumulate in float. The result goes back through the same memory in the output's type, scaled,
// so that the stores to `out` run along its contiguous rows.
//
// Layouts (rows of the staged tiles 16 bytes longer than the tile, so that
// a row starts 4 banks after the one above it): A as As[m][k], B as
// Bs[n][k] when b's K is contiguous (the MoE layout) or Bs[k][n] when its
// N is, the result as Cs[m][n]: each filled with lanes along the dimension
// contiguous in device memory (32 lanes on 32 consecutive elements, the
// fewest cache lines), each fragment read with the 8 rows of a load on
// distinct banks.
template <typename T>
struct GmmStaged {
  typedef T type;
};
template <>
struct GmmStaged<uchar> {
  typedef half type;
};

// A lane's place in an 8 x 8 fragment: its row and the first of its two
// columns (the layout the executor's simdgroup_matrix documents).
inline uint frag_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline uint frag_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

// Fragment f of a staged tile: its element (r, c) at origin[r * stride + c],
// or origin[c * stride + r] when transposed. A float tile is the
// fragment's own type (one simdgroup_load); a 16-bit one is converted by
// each lane, its two elements at (fr, fc) and (fr, fc + 1).
inline void tile_frag(
    thread simdgroup_float8x8& f, threadgroup const float* origin, uint stride, bool transposed, uint, uint) {
  simdgroup_load(f, origin, stride, ulong2(0), transposed);
}
template <typename S>
inline void tile_frag(
    thread simdgroup_float8x8& f, threadgroup const S* origin, uint stride, bool transposed, uint fr, uint fc) {
  if (transposed) {
    f.thread_elements()[0] = float(origin[fc * stride + fr]);
    f.thread_elements()[1] = float(origin[(fc + 1) * stride + fr]);
  } else {  // two adjacent elements: one load
    const vec<S, 2> v = *(threadgroup const vec<S, 2>*)(origin + fr * stride + fc);
    f.thread_elements()[0] = float(v.x);
    f.thread_elements()[1] = float(v.y);
  }
}

template <typename T, typename TO>
[[max_total_threads_per_threadgroup(GMM_TILE_THREADS)]]
kernel void gmm_tiled(device TO* out [[buffer(0)]],
                      const device T* a [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      const device int* offs [[buffer(3)]],
                      constant GroupedMMParams& p [[buffer(4)]],
                      const device float* row_scale [[buffer(5)]],
                      const device float* col_scale [[buffer(6)]],
                      uint3 tg [[threadgroup_position_in_grid]],
                      uint3 tpos [[thread_position_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  typedef typename GmmStaged<T>::type S;
  constexpr uint BM = GMM_TILE_M, BN = GMM_TILE_N, BK = GMM_TILE_K, THREADS = GMM_TILE_THREADS;
  constexpr uint FM = 4, FN = 4;  // fragments a simdgroup owns along M and N
  static_assert(THREADS == 128 && BM == 2 * 8 * FM && BN == 2 * 8 * FN, "2 x 2 simdgroups of 4 x 4 fragments");
  static_assert(BK == 32 && BN % 32 == 0, "32 lanes stage 32 consecutive elements of a row");
  // Row strides, 16 bytes past the row: a row starts 4 banks after the one above.
  constexpr uint SA = BK + 16 / sizeof(S);   // As[m][k]
  constexpr uint SBK = BK + 16 / sizeof(S);  // Bs[n][k]
  constexpr uint SBN = BN + 16 / sizeof(S);  // Bs[k][n]
  constexpr uint SC = BN + 16 / sizeof(TO);  // Cs[m][n]
  constexpr uint A_BYTES = BM * SA * sizeof(S);
  constexpr uint B_BYTES = (BN * SBK > BK * SBN ? BN * SBK : BK * SBN) * sizeof(S);
  constexpr uint C_BYTES = BM * SC * sizeof(TO);
  // The result reuses the operands' memory once the last step has read them.
  constexpr uint MEM_WORDS = ((A_BYTES + B_BYTES > C_BYTES ? A_BYTES + B_BYTES : C_BYTES) + 15) / 16;
  threadgroup float4 mem[MEM_WORDS];
  threadgroup S* As = (threadgroup S*)mem;
  threadgroup S* Bs = (threadgroup S*)((threadgroup uchar*)mem + A_BYTES);
  threadgroup TO* Cs = (threadgroup TO*)mem;
  threadgroup uint row_group[BM];  // rows mode: each row's group, for the scales
  threadgroup uint first[1];
  const uint tid = tpos.x;
  const uint r0 = tg.y * BM, n0 = tg.x * BN;
  const uint r1 = min(r0 + BM, p.m);

  // The groups this tile meets, [g_begin, g_end), and the K range of each.
  uint g_begin, g_end;
  if (p.mode == GMM_MODE_ROWS) {
    if (sg == 0) {
      const uint g = find_group(offs, p.groups, p.m, r0, lane);
      if (lane == 0) first[0] = g;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    g_begin = first[0];
    g_end = p.groups;
  } else {
    g_begin = tg.z;
    g_end = tg.z + 1;
  }
  for (uint i = tid; i < BM; i += THREADS) row_group[i] = g_begin;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the segments below overwrite some

  simdgroup_float8x8 acc[FM][FN];
  MPS_EXT_UNROLL
  for (uint i = 0; i < FM; ++i) MPS_EXT_UNROLL
  for (uint j = 0; j < FN; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  const uint sr = (sg / 2) * (8 * FM), sc = (sg % 2) * (8 * FN);
  const uint fr = frag_row(lane), fc = frag_col(lane);
  // B's staged layout: fragment j's origin at b_at + 8j * b_n_step, the
  // tile Bs[n][k] (a fragment's transpose) or Bs[k][n].
  const bool b_k_major = p.b_k == 1;
  const uint b_n_step = b_k_major ? SBK : 1;
  const uint b_at = b_k_major ? sc * SBK : sc;
  const uint b_k_step = b_k_major ? 1 : SBN;
  const uint b_stride = b_k_major ? SBK : SBN;

  for (uint g = g_begin; g < g_end; ++g) {
    // Rows [seg0, seg1) of this tile belong to group g; K runs over [k0, k1).
    uint seg0 = r0, seg1 = r1, k0 = 0, k1 = p.k;
    if (p.mode == GMM_MODE_ROWS) {
      const uint start = group_start(offs, g, p.m);
      if (start >= r1) break;  // this group and all later ones start past the tile
      seg0 = max(r0, start);
      seg1 = min(r1, group_end(offs, g, p.m));
      if (seg0 >= seg1) continue;  // an empty group
      for (uint i = seg0 + tid; i < seg1; i += THREADS) row_group[i - r0] = g;
    } else if (p.mode == GMM_MODE_K) {
      k0 = min(group_start(offs, g, p.k), p.k);
      k1 = max(k0, group_end(offs, g, p.k));
    }
    // A simdgroup skips its fragment rows that hold none of the group's rows
    // (a tile spanning several groups passes over K once for each).
    bool live[FM];
    MPS_EXT_UNROLL
    for (uint i = 0; i < FM; ++i) {
      const uint row = r0 + sr + 8 * i;
      live[i] = row < seg1 && row + 8 > seg0;
    }
    const device T* ag = a + ulong(g) * ulong(p.a_batch);
    const device T* bg = w + ulong(g) * ulong(p.b_batch);
    for (uint kt = k0; kt < k1; kt += BK) {
      // A: lanes along K (a's rows are contiguous in the MoE layouts).
      for (uint i = tid; i < BM * BK; i += THREADS) {
        const uint kk = i % BK, mm = i / BK, row = r0 + mm, k = kt + kk;
        As[mm * SA + kk] =
            S(row >= seg0 && row < seg1 && k < k1 ? elem(ag[row * uint(p.a_m) + k * uint(p.a_k)]) : 0.0f);
      }
      // B: lanes along whichever of its dimensions is contiguous.
      if (b_k_major) {
        for (uint i = tid; i < BN * BK; i += THREADS) {
          const uint kk = i % BK, c = i / BK, k = kt + kk, n = n0 + c;
          Bs[c * SBK + kk] = S(k < k1 && n < p.n ? elem(bg[k + n * uint(p.b_n)]) : 0.0f);
        }
      } else {
        for (uint i = tid; i < BN * BK; i += THREADS) {
          const uint c = i % BN, kk = i / BN, k = kt + kk, n = n0 + c;
          Bs[kk * SBN + c] = S(k < k1 && n < p.n ? elem(bg[k * uint(p.b_k) + n * uint(p.b_n)]) : 0.0f);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      // Rolled: unrolled, the 32 fragment addresses of a step are loop
      // invariants a compiler keeps live across the whole K loop (123
      // registers by the executor's estimate against 82).
      _Pragma("clang loop unroll(disable)") for (uint kk = 0; kk < BK; kk += 8) {
        // am[i]: (m, k) = (sr + 8i + r, kk + c); b: (k, n) = (kk + r, sc + 8j + c),
        // one column block at a time (fewer live registers than all four).
        simdgroup_float8x8 am[FM];
        MPS_EXT_UNROLL
        for (uint i = 0; i < FM; ++i)
          if (live[i]) tile_frag(am[i], As + (sr + 8 * i) * SA + kk, SA, false, fr, fc);
        MPS_EXT_UNROLL
        for (uint j = 0; j < FN; ++j) {
          simdgroup_float8x8 b;
          tile_frag(b, Bs + b_at + 8 * j * b_n_step + kk * b_k_step, b_stride, b_k_major, fr, fc);
          MPS_EXT_UNROLL
          for (uint i = 0; i < FM; ++i)
            if (live[i]) simdgroup_multiply_accumulate(acc[i][j], am[i], b, acc[i][j]);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  // Rows past offs[-1] belong to no group: torch leaves them unwritten too.
  const uint rows_end = p.mode == GMM_MODE_ROWS ? min(r1, group_end(offs, p.groups - 1, p.m)) : r1;
  // row_group complete (with K = 0 no step's barrier followed its writes).
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Each lane scales its elements and rounds them to the output's type.
  MPS_EXT_UNROLL
  for (uint i = 0; i < FM; ++i) {
    const uint r = sr + 8 * i + fr, m = r0 + r;
    // (min: offsets out of order, which torch forbids, must still not read out of bounds)
    const uint g = p.mode == GMM_MODE_ROWS ? min(row_group[r], p.groups - 1) : tg.z;
    MPS_EXT_UNROLL
    for (uint j = 0; j < FN; ++j) {
      const uint c = sc + 8 * j + fc;
      vec<TO, 2> v;
      MPS_EXT_UNROLL
      for (uint e = 0; e < 2; ++e) {
        const uint n = min(n0 + c + e, p.n - 1);  // columns past n are computed (zeros) but never stored
        v[e] = TO(acc[i][j].thread_elements()[e] * (m < rows_end ? scale_of(p, row_scale, col_scale, g, m, n) : 0.0f));
      }
      *(threadgroup vec<TO, 2>*)(Cs + r * SC + c) = v;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const ulong out_base = p.mode == GMM_MODE_ROWS ? 0 : ulong(tg.z) * ulong(p.out_batch);
  // Lanes along N (the output's rows are contiguous).
  for (uint i = tid; i < BM * BN; i += THREADS) {
    const uint c = i % BN, r = i / BN, m = r0 + r, n = n0 + c;
    if (m < rows_end && n < p.n) out[out_base + ulong(m) * ulong(p.out_m) + ulong(n) * ulong(p.out_n)] = Cs[r * SC + c];
  }
}

// ------------------------------------------------------ instantiations --
// Buffer 2, `w`, is the grouped operand: the experts' weights of the MoE
// forward (the name the benchmarks and tests count weight traffic by).
// clang-format off
#define GMM_DECODE_ROWS(tname, TA, TB, TO)                                                            \
  template [[host_name("gmm_decode_rows_" #tname "_vec")]] kernel                                     \
      decltype(gmm_decode_rows<TA, TB, TO, true>) gmm_decode_rows<TA, TB, TO, true>;                  \
  template [[host_name("gmm_decode_rows_" #tname "_scalar")]] kernel                                  \
      decltype(gmm_decode_rows<TA, TB, TO, false>) gmm_decode_rows<TA, TB, TO, false>;
#define MOE_DOWN_COMBINE(tname, TA, TB, TO)                                                          \
  template [[host_name("moe_down_combine_" #tname "_vec")]] kernel                                    \
      decltype(moe_down_combine<TA, TB, TO, true>) moe_down_combine<TA, TB, TO, true>;                \
  template [[host_name("moe_down_combine_" #tname "_scalar")]] kernel                                 \
      decltype(moe_down_combine<TA, TB, TO, false>) moe_down_combine<TA, TB, TO, false>;
#define GMM_DECODE_COLS(tname, T)                                                                     \
  template [[host_name("gmm_decode_cols_" #tname "_vec")]] kernel                                     \
      decltype(gmm_decode_cols<T, true>) gmm_decode_cols<T, true>;                                    \
  template [[host_name("gmm_decode_cols_" #tname "_scalar")]] kernel                                  \
      decltype(gmm_decode_cols<T, false>) gmm_decode_cols<T, false>;
#define GMM_TILED(tname, T, TO) \
  template [[host_name("gmm_tiled_" #tname)]] kernel decltype(gmm_tiled<T, TO>) gmm_tiled<T, TO>;
// clang-format on

GMM_DECODE_ROWS(f32, float, float, float)
GMM_DECODE_ROWS(f16, half, half, half)
GMM_DECODE_ROWS(bf16, bfloat, bfloat, bfloat)
GMM_DECODE_ROWS(e4m3, uchar, uchar, bfloat)
GMM_DECODE_ROWS(bf16_e4m3w, bfloat, uchar, bfloat)  // bfloat activations, e4m3 weights (mps_ext's MoE ops)
MOE_DOWN_COMBINE(f32, float, float, float)
MOE_DOWN_COMBINE(f16, half, half, half)
MOE_DOWN_COMBINE(bf16, bfloat, bfloat, bfloat)
MOE_DOWN_COMBINE(bf16_e4m3w, bfloat, uchar, bfloat)
GMM_DECODE_COLS(f32, float)
GMM_DECODE_COLS(f16, half)
GMM_DECODE_COLS(bf16, bfloat)
GMM_TILED(f32, float, float)
GMM_TILED(f16, half, half)
GMM_TILED(bf16, bfloat, bfloat)
GMM_TILED(e4m3, uchar, bfloat)
