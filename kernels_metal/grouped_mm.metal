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
// gmm_decode_cols  the same for a weight whose N dimension is contiguous
//                  (W[E, K, N]): decode.h's cols template (gemv_cols'), a
//                  threadgroup owning 128 bytes of columns.
// gmm_tiled        many rows (prefill, and the K-split and batched modes):
//                  32 x 32 output tiles from simdgroup_matrix products.
//                  In the rows mode a tile of 32 rows may span several
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
using namespace metal;

// ------------------------------------------------------------ elements --
inline float elem(float v) { return v; }
inline float elem(half v) { return float(v); }
inline float elem(bfloat v) { return float(v); }
inline float elem(uchar v) { return e4m3x4_to_float_div256(uint(v)).x; }

inline float silu(float x) { return x / (1.0f + exp(-x)); }

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
inline RowSlot decode_slot(const device int* offs, constant GroupedMMParams& p, uint row, uint sg, uint lane,
                           threadgroup uint* shared) {
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

inline float scale_of(constant GroupedMMParams& p, const device float* row_scale, const device float* col_scale,
                      uint g, uint m, uint n) {
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

// What both of this family's jobs read: the slot's rows of one group, the
// group's expert.
template <typename TA, typename TB, typename TO>
struct GmmOperands {
  typedef typename GmmFormat<TA>::type X;
  typedef typename GmmFormat<TB>::type W;
  X xf;
  W wf;
  device TO* out;
  const device TA* a;
  const device TB* w;  // the group's expert
  constant GroupedMMParams* p;
  RowSlot s;
  int rows, k;
  long x_k, w_k;
  MPS_EXT_INLINE void init(device TO* out_, const device TA* a_, const device TB* w_, constant GroupedMMParams& p_,
                           RowSlot s_) {
    decode_format_e5m2(xf, false);  // float8 operands are e4m3fn
    decode_format_e5m2(wf, false);
    out = out_;
    a = a_;
    w = w_ + ulong(s_.g) * ulong(p_.b_batch);
    p = &p_;
    s = s_;
    rows = int(s_.rows);
    k = int(p_.k);
    x_k = p_.a_k;
    w_k = p_.b_k;
  }
};

template <typename TA, typename TB, typename TO>
struct GmmDecodeJob : GmmOperands<TA, TB, TO>, DecodeUnscaled {
  // (20: the slot, the scales' indices and two column pointers stay live too)
  enum { BUDGET = 20 };
  const device float* row_scale;
  const device float* col_scale;
  threadgroup const uint* rows_at;
  uint col0;
  uint col[GMM_ROWS_OUTPUTS];
  bool on[GMM_ROWS_OUTPUTS];
  MPS_EXT_INLINE const device TA* x_row(int r) const { return this->a + rows_at[r]; }
  MPS_EXT_INLINE bool live(int q) const { return on[q]; }
  MPS_EXT_INLINE const device TB* w_row(int q) const { return this->w + col[q] * uint(this->p->b_n); }
  // Lane q writes column q's output (swiglu: lane 0 the one output), so
  // that one store instruction writes consecutive outputs of one row.
  MPS_EXT_INLINE void store(int r, thread const float* total, uint lane) const {
    constant GroupedMMParams& p = *this->p;
    const uint g = this->s.g, m = this->s.row + uint(r), lane_col = lane == 1 ? col[1] : col[0];
    const bool writes = p.swiglu ? lane == 0 && on[0] : lane < uint(GMM_ROWS_OUTPUTS) && (lane == 1 ? on[1] : on[0]);
    if (!writes) return;
    float v;
    if (p.swiglu) {
      const float gate = total[0] * scale_of(p, row_scale, col_scale, g, m, col[0]);
      v = silu(gate) * total[1] * scale_of(p, row_scale, col_scale, g, m, col[1]);
    } else {
      v = (lane == 1 ? total[1] : total[0]) * scale_of(p, row_scale, col_scale, g, m, lane_col);
    }
    this->out[ulong(m) * ulong(p.out_m) + ulong(p.swiglu ? col0 : lane_col) * ulong(p.out_n)] = TO(v);
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
  constexpr int TILE_WORDS = decode_tile_words_any<TA, TB, VEC, false>();
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
  GmmDecodeJob<TA, TB, TO> job;
  job.init(out, a, w, p, s);
  job.row_scale = row_scale;
  job.col_scale = col_scale;
  job.rows_at = rows_at;
  // swiglu: one output, col0, of silu(gate) * up, from b's columns col0
  // (gate) and half + col0 (up); else outputs col0 and col0 + 1.
  const uint half_n = p.n / 2;
  job.col0 = (tg.x * simdgroups + sg) * (p.swiglu ? 1 : GMM_ROWS_OUTPUTS);
  MPS_EXT_UNROLL for (int q = 0; q < GMM_ROWS_OUTPUTS; ++q) {
    const uint c = p.swiglu ? job.col0 + q * half_n : job.col0 + q;
    job.on[q] = p.swiglu ? job.col0 < half_n : c < p.n;
    job.col[q] = job.on[q] ? c : 0;
  }
  // One specialisation per row count, so one routed row does not pay for 8.
  typedef GmmDecodeJob<TA, TB, TO> Job;
  constexpr int Q = GMM_ROWS_OUTPUTS;
  if (s.rows == 1) decode_rows<Job, 1, Q, VEC>(job, tile, tid, threads.x, lane);
  else if (s.rows == 2) decode_rows<Job, 2, Q, VEC>(job, tile, tid, threads.x, lane);
  else if (s.rows <= 4) decode_rows<Job, 4, Q, VEC>(job, tile, tid, threads.x, lane);
  else decode_rows<Job, 8, Q, VEC>(job, tile, tid, threads.x, lane);
}

// ------------------------------------------------------ gmm_decode_cols --
// decode.h's cols template; this family's job: the slot's rows of one
// group against its expert (W[E, K, N], N contiguous), K never split.
template <typename T>
struct GmmColsJob : GmmOperands<T, T, T> {
  int splits;
  long n, w_n;
  // `a` fits 32-bit offsets (the host checks).
  MPS_EXT_INLINE const device T* x_row(int r) const { return this->a + (this->s.row + uint(r)) * uint(this->p->a_m); }
  MPS_EXT_INLINE void store(int r, long n_, float total, uint) const {
    this->out[ulong(this->s.row + uint(r)) * ulong(this->p->out_m) + ulong(n_) * ulong(this->p->out_n)] = T(total);
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
  constexpr int RING_WORDS = decode_cols_ring_words_any<T, VEC>();
  threadgroup float x_tile[RING_WORDS];
  threadgroup uint shared[2];
  const RowSlot s = decode_slot(offs, p, tg.y, sg, lane, shared);
  if (s.rows == 0) return;  // uniform: every thread read the same slot
  GmmColsJob<T> job;
  job.init(out, a, w, p, s);
  job.splits = 1;
  job.n = p.n;
  job.w_n = p.b_n;
  threadgroup float* partial = (threadgroup float*)partial_mem;
  typedef GmmColsJob<T> Job;
  if (s.rows == 1) decode_cols<Job, 1, VEC>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
  else if (s.rows == 2) decode_cols<Job, 2, VEC>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
  else if (s.rows <= 4) decode_cols<Job, 4, VEC>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
  else decode_cols<Job, 8, VEC>(job, partial, x_tile, tg.x, 0, tid, sg, lane);
}

// ------------------------------------------------------------ gmm_tiled --
// One threadgroup: a GMM_TILE_M x GMM_TILE_N output tile; 4 simdgroups in a
// 2 x 2 arrangement, each 16 x 16 (2 x 2 simdgroup matrices). Operand tiles
// are staged in threadgroup memory as float, converted once on the way in.
//
// Bank conflicts: a simdgroup_load of 8 x 8 floats reads, per instruction,
// one even (or odd) column of 4 and all 8 rows of the block. Rows stored S
// floats apart always put two of those 32 words on one bank (all 8 rows
// start on even banks, or the odd S puts rows 0 and 2 of columns 2 apart
// together). Stored transposed (each row of memory one column of the
// block) with S = 4 mod 16, the 4 columns start 8 banks apart and the 8
// rows fill the 8 between: 32 banks. So A is staged as At[k][m], B as
// Bt[n][k] and the result as Ct[n][m], all with S = GMM_TILE_STRIDE and
// transposed loads and stores. Staging and reading back go along the
// dimension contiguous in device memory (coalesced); where that is the
// strided one of the tile, a thread moves 4 consecutive elements of the
// contiguous one as one 16-byte access (4 words a lane: 4 cycles, the
// fewest, as 8 lanes fill the 32 banks).
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
  constexpr uint BM = GMM_TILE_M, BN = GMM_TILE_N, BK = GMM_TILE_K, S = GMM_TILE_STRIDE;
  static_assert(S % 4 == 0 && S % 16 == 4 && S >= BM && S >= BK, "rows of 16-byte words, 4 mod 16 floats apart");
  // float4 arrays: the 16-byte accesses below are aligned.
  threadgroup float4 at_mem[BK * S / 4];  // At[k][m] = a[m][k]
  threadgroup float4 bt_mem[BN * S / 4];  // Bt[n][k] = b[k][n]
  threadgroup float4 ct_mem[BN * S / 4];  // Ct[n][m] = out[m][n]
  threadgroup float* At = (threadgroup float*)at_mem;
  threadgroup float* Bt = (threadgroup float*)bt_mem;
  threadgroup float* Ct = (threadgroup float*)ct_mem;
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
  for (uint i = tid; i < BM; i += GMM_TILE_THREADS) row_group[i] = g_begin;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the segments below overwrite some

  simdgroup_float8x8 acc[2][2];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  const uint sr = (sg / 2) * 16, sc = (sg % 2) * 16;

  for (uint g = g_begin; g < g_end; ++g) {
    // Rows [seg0, seg1) of this tile belong to group g; K runs over [k0, k1).
    uint seg0 = r0, seg1 = r1, k0 = 0, k1 = p.k;
    if (p.mode == GMM_MODE_ROWS) {
      const uint start = group_start(offs, g, p.m);
      if (start >= r1) break;  // this group and all later ones start past the tile
      seg0 = max(r0, start);
      seg1 = min(r1, group_end(offs, g, p.m));
      if (seg0 >= seg1) continue;  // an empty group
      for (uint i = seg0 + tid; i < seg1; i += GMM_TILE_THREADS) row_group[i - r0] = g;
    } else if (p.mode == GMM_MODE_K) {
      k0 = min(group_start(offs, g, p.k), p.k);
      k1 = max(k0, group_end(offs, g, p.k));
    }
    const device T* ag = a + ulong(g) * ulong(p.a_batch);
    const device T* bg = w + ulong(g) * ulong(p.b_batch);
    for (uint kt = k0; kt < k1; kt += BK) {
      // A: lanes along K (a's rows are contiguous in the MoE layouts), 4
      // rows a thread, one 16-byte store of At.
      for (uint i = tid; i < BM * BK / 4; i += GMM_TILE_THREADS) {
        const uint kk = i % BK, m0 = i / BK * 4, k = kt + kk;
        float v[4];
        for (uint j = 0; j < 4; ++j) {
          const uint row = r0 + m0 + j;
          v[j] = row >= seg0 && row < seg1 && k < k1 ? elem(ag[row * uint(p.a_m) + k * uint(p.a_k)]) : 0.0f;
        }
        *(threadgroup float4*)(At + kk * S + m0) = float4(v[0], v[1], v[2], v[3]);
      }
      // B: lanes along whichever dimension of b is contiguous. K: one
      // element a lane, consecutive words of Bt; N: 4 values of K a
      // thread, one 16-byte store.
      if (p.b_k == 1) {
        for (uint i = tid; i < BK * BN; i += GMM_TILE_THREADS) {
          const uint kk = i % BK, c = i / BK, k = kt + kk, n = n0 + c;
          Bt[c * S + kk] = k < k1 && n < p.n ? elem(bg[k + n * uint(p.b_n)]) : 0.0f;
        }
      } else {
        for (uint i = tid; i < BK * BN / 4; i += GMM_TILE_THREADS) {
          const uint c = i % BN, kk0 = i / BN * 4, n = n0 + c;
          float v[4];
          for (uint j = 0; j < 4; ++j) {
            const uint k = kt + kk0 + j;
            v[j] = k < k1 && n < p.n ? elem(bg[k * uint(p.b_k) + n * uint(p.b_n)]) : 0.0f;
          }
          *(threadgroup float4*)(Bt + c * S + kk0) = float4(v[0], v[1], v[2], v[3]);
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (uint kk = 0; kk < BK; kk += 8) {
        simdgroup_float8x8 am[2], bm[2];
        // Transposed: origin 0 and the block's first element as the pointer
        // (Metal leaves a transposed origin's coordinates unspecified).
        // Element (r, c) is read at p[c * S + r]: am[i] (r = m, c = k) from
        // At[kk + c][sr + 8i + r], bm[j] (r = k, c = n) from Bt[sc + 8j + c][kk + r].
        for (int i = 0; i < 2; ++i) simdgroup_load(am[i], At + kk * S + sr + 8 * i, S, ulong2(0), true);
        for (int j = 0; j < 2; ++j) simdgroup_load(bm[j], Bt + (sc + 8 * j) * S + kk, S, ulong2(0), true);
        for (int i = 0; i < 2; ++i)
          for (int j = 0; j < 2; ++j) simdgroup_multiply_accumulate(acc[i][j], am[i], bm[j], acc[i][j]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
  }

  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)  // (r = m, c = n) to Ct[sc + 8j + c][sr + 8i + r]
      simdgroup_store(acc[i][j], Ct + (sc + 8 * j) * S + sr + 8 * i, S, ulong2(0), true);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Rows past offs[-1] belong to no group: torch leaves them unwritten too.
  const uint rows_end = p.mode == GMM_MODE_ROWS ? min(r1, group_end(offs, p.groups - 1, p.m)) : r1;
  const ulong out_base = p.mode == GMM_MODE_ROWS ? 0 : ulong(tg.z) * ulong(p.out_batch);
  // Lanes along N (the output's rows are contiguous), 4 rows a thread from
  // one 16-byte read of Ct.
  for (uint i = tid; i < BM * BN / 4; i += GMM_TILE_THREADS) {
    const uint c = i % BN, rr0 = i / BN * 4, n = n0 + c;
    const float4 v = *(threadgroup const float4*)(Ct + c * S + rr0);
    for (uint j = 0; j < 4; ++j) {
      const uint r = rr0 + j, m = r0 + r;
      if (m >= rows_end || n >= p.n) continue;
      // (min: offsets out of order, which torch forbids, must still not read out of bounds)
      const uint g = p.mode == GMM_MODE_ROWS ? min(row_group[r], p.groups - 1) : tg.z;
      out[out_base + ulong(m) * ulong(p.out_m) + ulong(n) * ulong(p.out_n)] =
          TO(v[j] * scale_of(p, row_scale, col_scale, g, m, n));
    }
  }
}

// ------------------------------------------------------ instantiations --
// Buffer 2, `w`, is the grouped operand: the experts' weights of the MoE
// forward (the name the benchmarks and tests count weight traffic by).
#define GMM_DECODE_ROWS(tname, TA, TB, TO)                                                            \
  template [[host_name("gmm_decode_rows_" #tname "_vec")]] kernel                                     \
      decltype(gmm_decode_rows<TA, TB, TO, true>) gmm_decode_rows<TA, TB, TO, true>;                  \
  template [[host_name("gmm_decode_rows_" #tname "_scalar")]] kernel                                  \
      decltype(gmm_decode_rows<TA, TB, TO, false>) gmm_decode_rows<TA, TB, TO, false>;
#define GMM_DECODE_COLS(tname, T)                                                                     \
  template [[host_name("gmm_decode_cols_" #tname "_vec")]] kernel                                     \
      decltype(gmm_decode_cols<T, true>) gmm_decode_cols<T, true>;                                    \
  template [[host_name("gmm_decode_cols_" #tname "_scalar")]] kernel                                  \
      decltype(gmm_decode_cols<T, false>) gmm_decode_cols<T, false>;
#define GMM_TILED(tname, T, TO) \
  template [[host_name("gmm_tiled_" #tname)]] kernel decltype(gmm_tiled<T, TO>) gmm_tiled<T, TO>;

GMM_DECODE_ROWS(f32, float, float, float)
GMM_DECODE_ROWS(f16, half, half, half)
GMM_DECODE_ROWS(bf16, bfloat, bfloat, bfloat)
GMM_DECODE_ROWS(e4m3, uchar, uchar, bfloat)
GMM_DECODE_ROWS(bf16_e4m3w, bfloat, uchar, bfloat)  // bfloat activations, e4m3 weights (mps_ext's MoE ops)
GMM_DECODE_COLS(f32, float)
GMM_DECODE_COLS(f16, half)
GMM_DECODE_COLS(bf16, bfloat)
GMM_TILED(f32, float, float)
GMM_TILED(f16, half, half)
GMM_TILED(bf16, bfloat, bfloat)
GMM_TILED(e4m3, uchar, bfloat)
