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
// moe_gate_up_routed  gmm_decode_rows's gate/up product of mps_ext's MoE
//                  layer with moe_route's routing in the same dispatch
//                  (each threadgroup routes from the router's logits).
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
// gmm_tiled_dense  the same kernel for a dense product (linear.cpp's
//                  F.linear / mm / addmm past 8 rows): the batched mode with
//                  one group, fixed at compile time, so it never reads offs
//                  and keeps none of the other modes' code. _e4m3w: 16-bit
//                  activations with float8 e4m3 weights (scaled_mm.cpp's
//                  fp8_linear past 8 rows, its weight scale applied to the
//                  float sums, as the grouped products apply theirs).
//
// Element types: float, half, bfloat, and float8_e4m3fn bytes (uchar),
// decoded as value / 256 (fp8_codec.h: e4m3 bits placed into half bits, four
// bytes at a time) with the 256s folded into p.mul.
#include <metal_stdlib>
#include "decode.h"
#include "fp8_codec.h"
#include "grouped_mm_params.h"
#include "moe_route.h"
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
  if (p.scales & GMM_COL_SCALE)
    s *= col_scale[ulong(g) * ulong(p.col_scale_batch) + ((p.scales & GMM_COL_SCALE_ONE) ? 0 : n)];
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

// The rows' work once the slot s is known and rows_at staged (a barrier
// after both): the threadgroup's columns of the group's expert, each
// applied to all the slot's rows.
template <typename TA, typename TB, typename TO, bool VEC>
MPS_EXT_INLINE void gmm_decode_rows_body(device TO* out,
                                         const device TA* a,
                                         const device TB* w,
                                         constant GroupedMMParams& p,
                                         const device float* row_scale,
                                         const device float* col_scale,
                                         RowSlot s,
                                         threadgroup const uint* rows_at,
                                         threadgroup uint* tile,
                                         uint tg_x,
                                         uint tid,
                                         uint threads,
                                         uint sg,
                                         uint simdgroups,
                                         uint lane) {
  typedef GmmDecodeJob<TA, TB, TO, false> Job;
  Job job;
  job.io.init(job.op, out, a, w, p, s);
  job.row_scale = row_scale;
  job.col_scale = col_scale;
  job.rows_at = rows_at;
  // swiglu: one output, col0, of silu(gate) * up, from b's columns col0
  // (gate) and half + col0 (up); else outputs col0 and col0 + 1.
  const uint half_n = p.n / 2;
  job.col0 = (tg_x * simdgroups + sg) * (p.swiglu ? 1 : GMM_ROWS_OUTPUTS);
  MPS_EXT_UNROLL
  for (int q = 0; q < GMM_ROWS_OUTPUTS; ++q) {
    const uint c = p.swiglu ? job.col0 + q * half_n : job.col0 + q;
    job.on[q] = p.swiglu ? job.col0 < half_n : c < p.n;
    job.col[q] = job.on[q] ? c : 0;
  }
  // One specialisation per row count, so one routed row does not pay for 8.
  constexpr int Q = GMM_ROWS_OUTPUTS;
  if (s.rows == 1) decode_rows<Job, 1, Q, VEC>(job, tile, tid, threads, lane);
  else if (s.rows == 2) decode_rows<Job, 2, Q, VEC>(job, tile, tid, threads, lane);
  else if (s.rows <= 4) decode_rows<Job, 4, Q, VEC>(job, tile, tid, threads, lane);
  else decode_rows<Job, 8, Q, VEC>(job, tile, tid, threads, lane);
}

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
  constexpr int TILE_WORDS = decode_tile_words_any<TA, TB, VEC, false>(GmmDecodeJob<TA, TB, TO, false>::TILE_BYTES);
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
  gmm_decode_rows_body<TA, TB, TO, VEC>(out, a, w, p, row_scale, col_scale, s, rows_at, tile, tg.x, tid, threads.x, sg,
                                        simdgroups, lane);
}

// --------------------------------------------------- moe_gate_up_routed --
// gmm_decode_rows's gate/up product of mps_ext's MoE layer (swiglu, each
// slot's row its token's) from the router's logits, with moe_route's
// dispatch folded in: every threadgroup routes the tokens itself
// (moe_route.h, the same ids), in threadgroup memory, finds the slot of its
// grid row as decode_slot would from moe_route's offs, and then does
// gmm_decode_rows's work; threadgroup (0, 0) also writes what the next
// dispatch, moe_down_combine, reads (weights, offs, slot_of_row,
// row_of_slot: moe_route's outputs, bit for bit; the dispatch boundary
// orders them, no other threadgroup reads them). Three dispatches a layer
// where moe_route made four.
//
// The experts are chosen by counting, not by moe_route's top_k rounds of
// threadgroup max (two barriers each): each thread takes experts e =
// tid, tid + threads, ... and counts the experts that beat e's key (a
// larger key, or an equal one at a smaller index: torch.topk's order and
// ties, NaN first), stopping at top_k; e's rank, if below top_k, is its
// slot. Every lane of a simdgroup reads the same key at a time (a
// broadcast of threadgroup memory). The cost a threadgroup pays before it
// streams its weights: for each token, its logits read (the experts' x 2
// or 4 bytes, from cache after the first threadgroup), and at most
// experts / threads x experts compares a thread, most experts leaving
// after a few (a random expert meets top_k better ones within about
// top_k x experts / its rank); two barriers a token and three after.
// Measured on the executor (IR instructions, one token, bf16, the 80-core
// geometry; gate/up against gmm_decode_rows on moe_route's outputs):
// Qwen3.6 (2048 wide, 256 experts + shared, top 8, 333 threadgroups of
// 448 threads) 424 more a thread (+23% on gmm_decode_rows' 1843), 3 more
// barriers a threadgroup, where moe_route's one threadgroup ran 2113 a
// thread; LFM2.5 (32 experts, sigmoid + bias, top 4, 448 threadgroups of
// 512) 63 more a thread (+3%). The logits come from cache: 514 distinct
// bytes, 171 KB over the threadgroups (Qwen3.6).
// Threadgroup (0, 0) adds the softmax's denominators in moe_route's order
// (route_softmax_sum) and the weights (one thread). Shapes past
// MOE_FUSED_MAX_EXPERTS experts or MOE_FUSED_MAX_SLOTS slots, and rows
// not 16-byte aligned, stay on moe_route (moe.cpp's choice). The keys,
// the slots' experts and the partial sums live in the activation tile,
// unused until the rows are staged: no threadgroup memory of their own.
template <typename TA, typename TB, typename TO>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void moe_gate_up_routed(device TO* out [[buffer(0)]],
                               const device TA* a [[buffer(1)]],
                               const device TB* w [[buffer(2)]],
                               const device uchar* logits [[buffer(3)]],
                               constant GroupedMMParams& p [[buffer(4)]],
                               const device float* row_scale [[buffer(5)]],
                               const device float* col_scale [[buffer(6)]],
                               constant MoeRouteParams& rp [[buffer(7)]],
                               const device float* expert_bias [[buffer(8)]],
                               device float* weights [[buffer(9)]],
                               device int* offs [[buffer(10)]],
                               device int* slot_of_row [[buffer(11)]],
                               device int* row_of_slot [[buffer(12)]],
                               uint2 tg [[threadgroup_position_in_grid]],
                               uint tid [[thread_index_in_threadgroup]],
                               uint2 threads [[threads_per_threadgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]],
                               uint simdgroups [[simdgroups_per_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]]) {
  constexpr int TILE_WORDS = decode_tile_words_any<TA, TB, true, false>(GmmDecodeJob<TA, TB, TO, false>::TILE_BYTES);
  static_assert(TILE_WORDS >= MOE_FUSED_MAX_EXPERTS + MOE_FUSED_MAX_SLOTS + MOE_ROUTE_THREADS / 32,
                "the routing fits the activation tile");
  threadgroup uint tile[TILE_WORDS];
  threadgroup uint rows_at[GMM_DECODE_MAX_ROWS];
  threadgroup uint shared[2];
  threadgroup uint* keys = tile;
  threadgroup int* ids = (threadgroup int*)(tile + MOE_FUSED_MAX_EXPERTS);
  threadgroup float* sums = (threadgroup float*)(tile + MOE_FUSED_MAX_EXPERTS + MOE_FUSED_MAX_SLOTS);
  const uint n = threads.x, slots = rp.top_k + rp.shared, total = rp.tokens * slots, row = tg.y;
  const bool writer = tg.x == 0 && tg.y == 0;  // uniform in the threadgroup
  for (uint t = 0; t < rp.tokens; ++t) {
    const RouteLogitsAny lt{logits + ulong(t) * ulong(rp.logits_t_stride) * (rp.logits_type == MOE_LOGITS_F32 ? 4 : 2),
                            rp.logits_e_stride, rp.logits_type};
    for (uint e = tid; e < rp.experts; e += n) keys[e] = rank_key(route_rank_value(lt, e, lt.at(e), rp, expert_bias));
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint e = tid; e < rp.experts; e += n) {
      const uint key = keys[e];
      uint rank = 0;
      for (uint j = 0; j < rp.experts && rank < rp.top_k; ++j)
        rank += keys[j] > key || (keys[j] == key && j < e) ? 1 : 0;
      if (rank < rp.top_k) ids[t * slots + rank] = int(e);
    }
    if (tid == 0 && rp.shared) ids[t * slots + rp.top_k] = int(rp.experts);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (writer) {
      // Softmax: the max logit is the first chosen expert's (NaN if any is).
      const bool softmax = rp.scoring == MOE_SCORING_SOFTMAX;
      const float mx = softmax ? key_value(keys[ids[t * slots]]) : 0.0f;
      const float sum = softmax ? route_softmax_sum(lt, rp.experts, mx, sg, lane, simdgroups, sums) : 0.0f;
      if (tid == 0) {
        float chosen_sum = 0.0f;
        for (uint k = 0; k < rp.top_k; ++k) {
          const float prob = route_weight(lt, lt.at(uint(ids[t * slots + k])), mx, sum, rp);
          chosen_sum += prob;
          weights[t * slots + k] = prob;
        }
        route_finish(chosen_sum, rp.shared ? lt.at(rp.experts) : 0.0f, rp, weights + t * slots);
      }
    }
    // (The next token's keys overwrite these: every read of them is before
    // the barrier above, or route_softmax_sum's.)
  }
  // The slot of grid row `row`: the group (expert) of the slot sorted to
  // it; it works if it is its group's first row, or 8, 16, ... past it (as
  // decode_slot decides from offs), on that many of the group's rows, each
  // its slot's token's row of `a`.
  if (tid < GMM_DECODE_MAX_ROWS) rows_at[tid] = 0;
  if (tid == 0) shared[1] = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (writer) route_offsets(ids, total, rp.experts + rp.shared, tid, n, offs);
  for (uint i = tid; i < total; i += n) {
    const int r = route_row(ids, total, i);
    if (writer) {
      slot_of_row[r] = int(i);
      row_of_slot[i] = r;
    }
    if (uint(r) >= row && uint(r) < row + GMM_DECODE_MAX_ROWS) rows_at[uint(r) - row] = (i / slots) * uint(p.a_m);
    if (uint(r) == row) {
      const int g = ids[i];
      uint start = 0, end = 0;
      for (uint j = 0; j < total; ++j) {
        start += ids[j] < g ? 1 : 0;
        end += ids[j] <= g ? 1 : 0;
      }
      shared[0] = uint(g);
      shared[1] = (row - start) % GMM_DECODE_MAX_ROWS == 0 ? min(uint(GMM_DECODE_MAX_ROWS), end - row) : 0;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  RowSlot s;
  s.g = shared[0];
  s.row = row;
  s.rows = shared[1];
  if (s.rows == 0) return;  // uniform: not the first row of a chunk
  // Rows past the slot's (another expert's) are never read from `a`; the
  // tile's routing is dead once every thread is past this barrier.
  if (tid >= s.rows && tid < GMM_DECODE_MAX_ROWS) rows_at[tid] = 0;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  gmm_decode_rows_body<TA, TB, TO, true>(out, a, w, p, row_scale, col_scale, s, rows_at, tile, tg.x, tid, n, sg,
                                         simdgroups, lane);
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
// One threadgroup: a GMM_TILE_M x GMM_TILE_N output tile, K in stages of
// GMM_TILE_K; 4 simdgroups in a 2 x 2 arrangement, each owning 32 x 32
// outputs, 4 x 4 float accumulators (simdgroup_float8x8). A step of 8 along
// K loads 4 fragments of A and 4 of B for 16 multiply-accumulates (MLX's
// steel GEMM's arrangement at its 64 x 64 tiles, and fp8_mm_tile's).
//
// Each stage both operands are decoded once into float tiles of threadgroup
// memory (float8 experts as value / 256, exactly), which the simdgroups read
// with simdgroup_load: float fragments run on every Mac mps_ext supports
// (bfloat simdgroup matrices are MSL 3.1, and M1 has no bfloat arithmetic)
// and accumulate in float. Layouts: A as As[m][k], B as Bs[n][k] when b's K
// is contiguous (the MoE layout, read transposed) or Bs[k][n] when its N is;
// rows 4 words longer than the tile (4 mod 32: the fragment loads and the
// float4 stores meet no bank conflicts). The result goes back through the
// same memory in the output's type, scaled, so that the stores to `out` run
// along its contiguous rows.
//
// Staging (GmmStage): a thread owns E = sizeof(T) 16-byte pieces of each
// operand's stage, at one column of the tile and rows 128 / P apart (P
// pieces a row: consecutive lanes on consecutive pieces of a row, whole
// lines), their offsets computed once per group and advanced by a stage at
// a time (32-bit: the host keeps a group's offsets below 2^32). A stage's
// pieces are loaded during the stage before (into registers, in flight
// during its products) and decoded into the tiles after its barrier.
// 16-byte loads where the host found the operand contiguous and 16-byte
// aligned (p.tile_vec) and the piece lies wholly within the bounds;
// element loads for the rest, zeros past the bounds.

// Quad q of a piece's bits as floats (4 consecutive elements; float8 e4m3
// as value / 256).
inline float4 piece_quad(uint4 u, uint q, float) { return as_type<float4>(u); }
inline float4 piece_quad(uint4 u, uint q, half) { return float4(as_type<half4>(uint2(u[2 * q], u[2 * q + 1]))); }
inline float4 piece_quad(uint4 u, uint q, bfloat) {
  const uint x = u[2 * q], y = u[2 * q + 1];
  return float4(as_type<float>(x << 16), as_type<float>(x & 0xFFFF0000u), as_type<float>(y << 16),
                as_type<float>(y & 0xFFFF0000u));
}
inline float4 piece_quad(uint4 u, uint q, uchar) { return e4m3x4_to_float_div256(u[q]); }
// A piece's floats at `to`. float8 e4m3: pieces without a NaN code (nearly
// all) take fp8_codec.h's conversion without its NaN fix-up.
template <typename T>
inline void put_piece(threadgroup float* to, uint4 u) {
  MPS_EXT_UNROLL
  for (uint q = 0; q < 16 / sizeof(T) / 4; ++q) *(threadgroup float4*)(to + 4 * q) = piece_quad(u, q, T(0));
}
template <>
inline void put_piece<uchar>(threadgroup float* to, uint4 u) {
  // (A branch per word: one store each, as the other types make, not one
  // wide store of the whole piece, whose lanes' 64 bytes meet bank conflicts.)
  MPS_EXT_UNROLL
  for (uint q = 0; q < 4; ++q) {
    if (e4m3x4_has_nan(u[q])) *(threadgroup float4*)(to + 4 * q) = e4m3x4_to_float_div256(u[q]);
    else *(threadgroup float4*)(to + 4 * q) = e4m3x4_finite_to_float_div256(u[q]);
  }
}
// An element's bits, for building a piece from element loads.
inline uint element_bits(float v) { return as_type<uint>(v); }
inline uint element_bits(half v) { return uint(as_type<ushort>(v)); }
inline uint element_bits(bfloat v) { return uint(as_type<ushort>(v)); }
inline uint element_bits(uchar v) { return uint(v); }

// R x C elements of an operand's stage, the C columns along the operand's
// row (contiguous in device memory when the pieces are loaded whole).
template <typename T, uint R, uint C>
struct GmmStage {
  enum {
    E = sizeof(T),
    N = 16 / E,                       // elements of a piece
    P = C / N,                        // pieces of a row
    J = R * P / GMM_TILE_THREADS,     // pieces of a thread
    ROW_STEP = GMM_TILE_THREADS / P,  // rows between a thread's pieces
    S = C + 4,                        // the float tile's row stride (4 mod 32)
    R_ROWS = R,
  };
  static_assert(J * GMM_TILE_THREADS == R * P && C % N == 0, "the threads own whole pieces");
  uint4 bits[J];
  // Piece j's first element in the group's matrix: off + j * jump (one
  // offset kept, not J: registers).
  uint off, jump;
  uint row, col;  // the tile row of piece 0, the tile column of every piece

  MPS_EXT_INLINE void init(uint tid, uint row0, uint col0, uint row_stride, uint col_stride) {
    row = tid / P;
    col = (tid % P) * N;
    off = (row0 + row) * row_stride + (col0 + col) * col_stride;
    jump = ROW_STEP * row_stride;
  }
  // The pieces of the stage whose tile rows [row_lo, row_hi) and columns
  // [0, col_hi) hold elements (the rest are zeros).
  // (Members are read once into locals: to the executor a member is memory,
  // read again after every access of the unrolled loops.)
  MPS_EXT_INLINE void load(const device T* base, uint col_stride, bool vec, uint row_lo, uint row_hi, uint col_hi) {
    const uint r0 = row, c0 = col, o = off, step = jump;
    const uint cols = c0 < col_hi ? min(uint(N), col_hi - c0) : 0;
    MPS_EXT_UNROLL
    for (uint j = 0; j < J; ++j) {
      const uint r = r0 + j * ROW_STEP;
      const uint count = r >= row_lo && r < row_hi ? cols : 0;
      uint4 u = uint4(0u);
      if (vec && count == N) {
        u = *(const device uint4*)(base + o + j * step);
      } else if (count > 0) {
        const device T* at = base + o + j * step;
        for (uint e = 0; e < count; ++e) u[e / (4 / E)] |= element_bits(at[e * col_stride]) << (8 * E * (e % (4 / E)));
      }
      bits[j] = u;
    }
  }
  MPS_EXT_INLINE void advance(uint elements) { off += elements; }
  // The loaded pieces, decoded, into the float tile [R][S]; only those
  // whose tile rows lie in [row_lo, row_hi) (rows outside are never read).
  MPS_EXT_INLINE void put(threadgroup float* tile, uint row_lo, uint row_hi) const {
    const uint r0 = row;
    threadgroup float* at = tile + col;
    MPS_EXT_UNROLL
    for (uint j = 0; j < J; ++j) {
      const uint r = r0 + j * ROW_STEP;
      if (r < row_lo || r >= row_hi) continue;
      put_piece<T>(at + r * S, bits[j]);
    }
  }
};

// A lane's place in an 8 x 8 fragment: its row and the first of its two
// columns (the layout the executor's simdgroup_matrix documents).
inline uint frag_row(uint lane) { return ((lane / 4) & 4) + (lane / 2) % 4; }
inline uint frag_col(uint lane) { return ((lane / 4) & 2) * 2 + (lane % 2) * 2; }

// B's stage: the tile's columns [0, n_end) and K [0, k_end), as Bs[n][k]
// (K_MAJOR) or Bs[k][n].
template <bool K_MAJOR, typename Stage, typename T>
MPS_EXT_INLINE void gmm_load_b(
    thread Stage& st, const device T* bg, uint b_k, uint b_n, bool vec, uint n_end, uint k_end) {
  if (K_MAJOR) st.load(bg, b_k, vec, 0, n_end, k_end);
  else st.load(bg, b_n, vec, 0, k_end, n_end);
}

// The kernel's body, for b's K contiguous (B_K_MAJOR) or not: one
// specialisation each, so that neither keeps the other's staging registers.
// DENSE: p's mode is GMM_MODE_BATCHED with one group (the host's contract).
// TA, TB: a's and w's elements (one type, or 16-bit activations with e4m3
// weights: fp8_linear's prefill, each weight decoded once a stage as here).
template <typename TA, typename TB, typename TO, bool B_K_MAJOR, bool DENSE>
MPS_EXT_INLINE void gmm_tiled_body(device TO* out,
                                   const device TA* a,
                                   const device TB* w,
                                   const device int* offs,
                                   constant GroupedMMParams& p,
                                   const device float* row_scale,
                                   const device float* col_scale,
                                   threadgroup float* tile,
                                   threadgroup uint* row_group,
                                   threadgroup uint* first,
                                   uint3 tg,
                                   uint tid,
                                   uint sg,
                                   uint lane) {
  constexpr uint BM = GMM_TILE_M, BN = GMM_TILE_N, BK = GMM_TILE_K, THREADS = GMM_TILE_THREADS;
  constexpr uint FM = 4, FN = 4;  // fragments a simdgroup owns along M and N
  static_assert(THREADS == 128 && BM == 2 * 8 * FM && BN == 2 * 8 * FN && BK == 32, "2 x 2 simdgroups of 4 x 4");
  typedef GmmStage<TA, BM, BK> StageA;  // As[m][k]
  // Bs[n][k] when b's K is contiguous, else Bs[k][n]
  typedef GmmStage<TB, B_K_MAJOR ? BN : BK, B_K_MAJOR ? BK : BN> StageB;
  constexpr uint SA = StageA::S, SB = StageB::S;
  constexpr uint SC = BN + 16 / sizeof(TO);  // Cs[m][n]
  threadgroup float* As = tile;
  threadgroup float* Bs = tile + BM * SA;
  // The result reuses the operands' memory once the last stage has read them.
  threadgroup TO* Cs = (threadgroup TO*)tile;
  const uint r0 = tg.y * BM, n0 = tg.x * BN;
  const uint r1 = min(r0 + BM, p.m);
  const uint mode = DENSE ? uint(GMM_MODE_BATCHED) : p.mode;

  // The groups this tile meets, [g_begin, g_end), and the K range of each.
  uint g_begin, g_end;
  if (mode == GMM_MODE_ROWS) {
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
  // Strides within a group's matrices (32 bits: the host checks).
  const uint a_m = uint(p.a_m), a_k = uint(p.a_k), b_k = uint(p.b_k), b_n = uint(p.b_n);

  const uint n_end = p.n - n0;  // the tile's columns that exist
  // B's staged layout: fragment j's origin at b_at + 8j * b_n_step + kk * b_k_step.
  constexpr uint b_n_step = B_K_MAJOR ? SB : 1, b_k_step = B_K_MAJOR ? 1 : SB;
  const uint b_at = B_K_MAJOR ? sc * SB : sc;
  StageA sa;
  StageB sb;

  for (uint g = g_begin; g < g_end; ++g) {
    // Rows [seg0, seg1) of this tile belong to group g; K runs over [k0, k1).
    uint seg0 = r0, seg1 = r1, k0 = 0, k1 = p.k;
    if (mode == GMM_MODE_ROWS) {
      const uint start = group_start(offs, g, p.m);
      if (start >= r1) break;  // this group and all later ones start past the tile
      seg0 = max(r0, start);
      seg1 = min(r1, group_end(offs, g, p.m));
      if (seg0 >= seg1) continue;  // an empty group
      for (uint i = seg0 + tid; i < seg1; i += THREADS) row_group[i - r0] = g;
    } else if (mode == GMM_MODE_K) {
      k0 = min(group_start(offs, g, p.k), p.k);
      k1 = max(k0, group_end(offs, g, p.k));
    }
    const device TA* ag = a + ulong(g) * ulong(p.a_batch);
    const device TB* bg = w + ulong(g) * ulong(p.b_batch);
    // 16-byte loads: K's pieces start 16 bytes apart only where K does (the K-split mode's groups start anywhere).
    const bool vec_a = (p.tile_vec & GMM_TILE_VEC_A) && k0 % (16 / sizeof(TA)) == 0;
    const bool vec_b = (p.tile_vec & GMM_TILE_VEC_B) && (k0 % (16 / sizeof(TB)) == 0 || !B_K_MAJOR);
    const uint row_lo = seg0 - r0, row_hi = seg1 - r0;
    // The fragment rows that hold some of the group's rows: a simdgroup
    // skips its others (a tile spanning several groups passes over K once
    // for each), fragment i live when frag_lo <= sr + 8i < frag_hi.
    const uint frag_lo = row_lo / 8 * 8, frag_hi = (row_hi + 7) / 8 * 8;
    sa.init(tid, r0, k0, a_m, a_k);
    sa.load(ag, a_k, vec_a, row_lo, row_hi, k1 - k0);
    if (B_K_MAJOR) sb.init(tid, n0, k0, b_n, b_k);
    else sb.init(tid, k0, n0, b_k, b_n);
    gmm_load_b<B_K_MAJOR>(sb, bg, b_k, b_n, vec_b, n_end, k1 - k0);
    for (uint kt = k0; kt < k1; kt += BK) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous stage's products are done with the tiles
      // A's rows of the fragments that hold some of the group's rows (the
      // fragments the simdgroups read; their other rows are zeros).
      sa.put(As, frag_lo, frag_hi);
      sb.put(Bs, 0, StageB::R_ROWS);
      // The next stage's pieces, in flight during this stage's products.
      const uint next = kt + BK;
      if (next < k1) {
        sa.advance(BK * a_k);
        sa.load(ag, a_k, vec_a, row_lo, row_hi, k1 - next);
        sb.advance(BK * b_k);
        gmm_load_b<B_K_MAJOR>(sb, bg, b_k, b_n, vec_b, n_end, k1 - next);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (sr + 8 * FM <= frag_lo || sr >= frag_hi) continue;  // uniform: none of this simdgroup's rows are the group's
      // Rolled: unrolled, the fragment addresses of a stage are loop
      // invariants a compiler keeps live across the whole K loop.
      _Pragma("clang loop unroll(disable)") for (uint kk = 0; kk < BK; kk += 8) {
        // am[i]: (m, k) = (sr + 8i + r, kk + c); b: (k, n) = (kk + r, sc + 8j + c),
        // one column block at a time (fewer live registers than all four).
        simdgroup_float8x8 am[FM];
        MPS_EXT_UNROLL
        for (uint i = 0; i < FM; ++i)
          if (sr + 8 * i >= frag_lo && sr + 8 * i < frag_hi) simdgroup_load(am[i], As + (sr + 8 * i) * SA + kk, SA);
        MPS_EXT_UNROLL
        for (uint j = 0; j < FN; ++j) {
          simdgroup_float8x8 b;
          simdgroup_load(b, Bs + b_at + 8 * j * b_n_step + kk * b_k_step, SB, ulong2(0), B_K_MAJOR);
          MPS_EXT_UNROLL
          for (uint i = 0; i < FM; ++i)
            if (sr + 8 * i >= frag_lo && sr + 8 * i < frag_hi)
              simdgroup_multiply_accumulate(acc[i][j], am[i], b, acc[i][j]);
        }
      }
    }
  }

  // Rows past offs[-1] belong to no group: torch leaves them unwritten too.
  const uint rows_end = mode == GMM_MODE_ROWS ? min(r1, group_end(offs, p.groups - 1, p.m)) : r1;
  // The last stage's products are done with the tiles, and row_group is
  // complete (with K = 0 no stage's barrier followed its writes).
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Each lane scales its elements and rounds them to the output's type.
  const uint fr = frag_row(lane), fc = frag_col(lane);
  MPS_EXT_UNROLL
  for (uint i = 0; i < FM; ++i) {
    const uint r = sr + 8 * i + fr, m = r0 + r;
    // (min: offsets out of order, which torch forbids, must still not read out of bounds)
    const uint g = mode == GMM_MODE_ROWS ? min(row_group[r], p.groups - 1) : tg.z;
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
  const ulong out_base = mode == GMM_MODE_ROWS ? 0 : ulong(tg.z) * ulong(p.out_batch);
  // Lanes along N (the output's rows are contiguous).
  for (uint i = tid; i < BM * BN; i += THREADS) {
    const uint c = i % BN, r = i / BN, m = r0 + r, n = n0 + c;
    if (m < rows_end && n < p.n) out[out_base + ulong(m) * ulong(p.out_m) + ulong(n) * ulong(p.out_n)] = Cs[r * SC + c];
  }
}

template <typename TA, typename TB, typename TO, bool DENSE>
[[max_total_threads_per_threadgroup(GMM_TILE_THREADS)]]
kernel void gmm_tiled(device TO* out [[buffer(0)]],
                      const device TA* a [[buffer(1)]],
                      const device TB* w [[buffer(2)]],
                      const device int* offs [[buffer(3)]],
                      constant GroupedMMParams& p [[buffer(4)]],
                      const device float* row_scale [[buffer(5)]],
                      const device float* col_scale [[buffer(6)]],
                      uint3 tg [[threadgroup_position_in_grid]],
                      uint3 tpos [[thread_position_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr uint BM = GMM_TILE_M, BN = GMM_TILE_N, BK = GMM_TILE_K;
  // As[BM][BK + 4] then Bs, [BN][BK + 4] or [BK][BN + 4] (GmmStage's float tiles)
  constexpr uint A_WORDS = BM * (BK + 4), B_WORDS = BN * (BK + 4) > BK * (BN + 4) ? BN * (BK + 4) : BK * (BN + 4);
  static_assert(BM * (BN + 16 / sizeof(TO)) * sizeof(TO) <= (A_WORDS + B_WORDS) * 4, "the result fits in the tiles");
  threadgroup float tile[A_WORDS + B_WORDS];
  threadgroup uint row_group[BM];  // rows mode: each row's group, for the scales
  threadgroup uint first[1];
  if (p.b_k == 1)
    gmm_tiled_body<TA, TB, TO, true, DENSE>(out, a, w, offs, p, row_scale, col_scale, tile, row_group, first, tg,
                                            tpos.x, sg, lane);
  else
    gmm_tiled_body<TA, TB, TO, false, DENSE>(out, a, w, offs, p, row_scale, col_scale, tile, row_group, first, tg,
                                             tpos.x, sg, lane);
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
// Only _vec: rows not 16-byte aligned stay on moe_route and gmm_decode_rows.
#define MOE_GATE_UP_ROUTED(tname, TA, TB, TO)                                                        \
  template [[host_name("moe_gate_up_routed_" #tname "_vec")]] kernel                                  \
      decltype(moe_gate_up_routed<TA, TB, TO>) moe_gate_up_routed<TA, TB, TO>;
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
  template [[host_name("gmm_tiled_" #tname)]] kernel decltype(gmm_tiled<T, T, TO, false>) gmm_tiled<T, T, TO, false>;
// The output is the activations' type.
#define GMM_TILED_DENSE(tname, TA, TB) \
  template [[host_name("gmm_tiled_dense_" #tname)]] kernel \
      decltype(gmm_tiled<TA, TB, TA, true>) gmm_tiled<TA, TB, TA, true>;
// clang-format on

GMM_DECODE_ROWS(f32, float, float, float)
GMM_DECODE_ROWS(f16, half, half, half)
GMM_DECODE_ROWS(bf16, bfloat, bfloat, bfloat)
GMM_DECODE_ROWS(e4m3, uchar, uchar, bfloat)
GMM_DECODE_ROWS(bf16_e4m3w, bfloat, uchar, bfloat)  // bfloat activations, e4m3 weights (mps_ext's MoE ops)
MOE_GATE_UP_ROUTED(f32, float, float, float)
MOE_GATE_UP_ROUTED(f16, half, half, half)
MOE_GATE_UP_ROUTED(bf16, bfloat, bfloat, bfloat)
MOE_GATE_UP_ROUTED(bf16_e4m3w, bfloat, uchar, bfloat)
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
// float32 stays torch's (linear.cpp): no dense variant.
GMM_TILED_DENSE(f16, half, half)
GMM_TILED_DENSE(bf16, bfloat, bfloat)
// fp8_linear past 8 rows (scaled_mm.cpp): 16-bit activations, e4m3 weights,
// a tensor-wise (GMM_COL_SCALE_ONE) or row-wise weight scale.
GMM_TILED_DENSE(f16_e4m3w, half, uchar)
GMM_TILED_DENSE(bf16_e4m3w, bfloat, uchar)
