// Grouped matrix products for mixture-of-experts layers (_grouped_mm,
// _scaled_grouped_mm). The group offsets are read here, on the GPU, never by
// the host: every launch is sized from shapes alone, and a threadgroup finds
// its group by searching `offs` itself. Threadgroups that find no work exit
// at once. Accumulation is in float.
//
// gmm_decode_rows  few rows (decode): one threadgroup owns 8 output columns
//                  of one group's rows (up to 8 at a time), streams those 8
//                  weight columns of the group's expert once with 16-byte
//                  loads along K (4 simdgroups of 2 columns) and applies
//                  each to all its rows, staged in threadgroup memory. The grid
//                  has one slot per row of `a`; the slot of a group's first
//                  row (and of every 8th after it) works, the others exit.
//                  So experts nobody chose are never touched, and the
//                  launch is the same whatever the routing.
// gmm_decode_cols  the same for a weight whose N dimension is contiguous
//                  (W[E, K, N]): a lane owns a 4-byte word of consecutive
//                  outputs, a simdgroup 128 bytes of a weight row; the
//                  threadgroup's 8 simdgroups split K and add up in
//                  threadgroup memory.
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
// The elements of a 32-bit word of e4m3 bytes as floats (value / 256), for
// pieces.h's word_floats of the other types.
MPS_EXT_INLINE void word_floats(uint bits, thread float* v, uchar) {
  const float4 f = e4m3x4_to_float_div256(bits);
  MPS_EXT_UNROLL for (int i = 0; i < 4; ++i) v[i] = f[i];
}

// A lane's piece of weights, as bits: 16 bytes with VEC; without, one
// element converted to float, in .x (the other words are never used, so
// they take no registers).
template <typename T, bool VEC>
MPS_EXT_INLINE uint4 weight_piece(const device T* p) {
  if (VEC) return *(const device uint4*)p;
  return uint4(as_type<uint>(elem(*p)), 0u, 0u, 0u);
}

// The pieces: with VEC a lane's weight piece is 16 bytes, EB weights along
// K, and its activation piece the EB activations they multiply, WA words
// (8 for bfloat activations under fp8 weights, else 4); without VEC one
// weight and one activation, as floats.
template <typename TA, typename TB, bool VEC>
constexpr int rows_piece_weights() {
  return VEC ? 16 / int(sizeof(TB)) : 1;
}
template <typename TA, typename TB, bool VEC>
constexpr int rows_piece_words() {
  return VEC ? 16 / int(sizeof(TB)) * int(sizeof(TA)) / 4 : 1;
}
// A tile: R rows of 256 / R pieces; word w of piece c of row r at
// (r * WA + w) * stride + c, stride = pieces + 4. A simdgroup reads one word
// of 32 consecutive pieces (32 banks); the + 4 puts the two 16-byte halves
// of a 32-byte piece, which consecutive threads stage, 16 banks apart.
constexpr int rows_tile_pieces(int R) { return GMM_ROWS_TILE_PIECES * GMM_DECODE_MAX_ROWS / R; }
constexpr int rows_tile_stride(int R) { return rows_tile_pieces(R) + 4; }
constexpr int rows_tile_words(int WA) {  // the most of any R: 8 rows
  return GMM_DECODE_MAX_ROWS * WA * rows_tile_stride(GMM_DECODE_MAX_ROWS);
}

// R rows (a power of two >= the slot's rows; rows past them stage as 0)
// of one group against the simdgroup's GMM_ROWS_OUTPUTS weight columns.
// Activations TA, weights TB (the same, or fp8 weights under bfloat).
// `rows_at`: each row's first activation, as staged by the kernel.
// Registers: 2R accumulators (16 at 8 rows) + U pieces of each column in
// flight (8 registers) + one weight word of each column and one row's
// activation word(s) as floats: within full occupancy.
template <typename TA, typename TB, typename TO, int R, bool VEC>
MPS_EXT_INLINE void decode_rows_body(device TO* out, const device TA* a, const device TB* w,
                                     constant GroupedMMParams& p, const device float* row_scale,
                                     const device float* col_scale, RowSlot s, uint col0, uint tid, uint lane,
                                     threadgroup uint* tile, threadgroup const uint* rows_at) {
  constexpr int Q = GMM_ROWS_OUTPUTS;
  constexpr int EB = rows_piece_weights<TA, TB, VEC>(), WA = rows_piece_words<TA, TB, VEC>();
  constexpr int NW = VEC ? 4 / int(sizeof(TB)) : 1;  // weights of a weight word
  constexpr int AW = VEC ? WA / 4 : 1;                // activation words of a weight word
  constexpr int HALVES = VEC ? WA / 4 : 1;            // 16-byte loads of an activation piece
  constexpr int TP = rows_tile_pieces(R), TS = rows_tile_stride(R);
  // (20: the slot, the scales' indices and two column pointers stay live too)
  constexpr int U = rows_pieces_per_output(R, Q, TP, 20);
  static_assert(TP % (32 * U) == 0, "a tile is whole steps");
  constexpr int THREADS = 32 * GMM_ROWS_SIMDGROUPS;
  const int rows = int(s.rows), K = int(p.k);
  const uint a_k = VEC ? 1 : p.a_k, b_k = VEC ? 1 : p.b_k;
  // swiglu: one output, col0, of silu(gate) * up, from b's columns col0
  // (gate) and half + col0 (up); else outputs col0 and col0 + 1.
  const uint half_n = p.n / 2;
  uint col[Q];
  bool live[Q];
  const device TB* wp[Q];  // the lane's next piece of each column
  float acc[R][Q];
  MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
    const uint c = p.swiglu ? col0 + q * half_n : col0 + q;
    live[q] = p.swiglu ? col0 < half_n : c < p.n;
    col[q] = live[q] ? c : 0;
    wp[q] = w + col[q] * uint(p.b_n) + lane * (EB * b_k);
    MPS_EXT_UNROLL for (int r = 0; r < R; ++r) acc[r][q] = 0.0f;
  }

  const int k_pieces = K / EB;  // whole pieces (all of K without VEC); the rest below
  for (int p0 = 0; p0 < k_pieces; p0 += TP) {
    const int pieces = min(TP, k_pieces - p0);  // of each row in this tile
    // Consecutive threads stage consecutive 16-byte halves (VEC) or
    // elements of a row.
    for (int i = int(tid); i < R * TP * HALVES; i += THREADS) {
      const int r = i / (TP * HALVES), c = i / HALVES % TP, h = i % HALVES;
      if (c >= pieces) continue;
      const uint at = rows_at[r] + uint((p0 + c) * EB + h * (16 / int(sizeof(TA)))) * a_k;
      if (VEC) {
        const uint4 v = r < rows ? *(const device uint4*)(a + at) : uint4(0u);
        MPS_EXT_UNROLL for (int j = 0; j < 4; ++j) tile[(r * WA + h * 4 + j) * TS + c] = v[j];
      } else {
        tile[r * TS + c] = as_type<uint>(r < rows ? elem(a[at]) : 0.0f);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Lanes take consecutive pieces of the weight columns: a simdgroup
    // reads 512 contiguous bytes of a column per load instruction.
    for (int c = int(lane); c < pieces; c += 32 * U) {
      uint4 wv[U][Q];
      MPS_EXT_UNROLL for (int u = 0; u < U; ++u)
        MPS_EXT_UNROLL for (int q = 0; q < Q; ++q)
          wv[u][q] = live[q] && c + 32 * u < pieces ? weight_piece<TB, VEC>(wp[q] + u * (32 * EB * b_k)) : uint4(0u);
      MPS_EXT_UNROLL for (int u = 0; u < U; ++u) {
        // Past the tile's pieces the weights are 0: any staged value will do.
        const int cu = min(c + 32 * u, pieces - 1);
        // A weight word of each column at a time, converted once for all rows.
        MPS_EXT_UNROLL for (int j = 0; j < (VEC ? 4 : 1); ++j) {
          float wf[Q][4];  // (4: the most floats of a word; NW used)
          MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
            if (VEC) word_floats(wv[u][q][j], wf[q], TB(0));
            else wf[q][0] = as_type<float>(wv[u][q].x);
          }
          MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
            float xf[4];
            MPS_EXT_UNROLL for (int i = 0; i < AW; ++i) {
              const uint xw = tile[(r * WA + j * AW + i) * TS + cu];
              if (VEC) word_floats(xw, xf + i * (NW / AW), TA(0));
              else xf[0] = as_type<float>(xw);
            }
            MPS_EXT_UNROLL for (int q = 0; q < Q; ++q)
              MPS_EXT_UNROLL for (int e = 0; e < NW; ++e) acc[r][q] += xf[e] * wf[q][e];
          }
        }
      }
      MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) wp[q] += U * (32 * EB * b_k);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // The last K % EB elements (VEC only: fewer than a piece, so one a lane).
  const int k = k_pieces * EB + int(lane);
  if (k < K) {
    MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
      if (!live[q]) continue;
      const float wk = elem(w[col[q] * uint(p.b_n) + uint(k)]);
      MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
        if (r < rows) acc[r][q] += elem(a[rows_at[r] + uint(k)]) * wk;
    }
  }

  // Lane q writes column q's output (swiglu: lane 0 the one output), so
  // that one store instruction writes consecutive outputs of one row.
  const uint lane_col = lane == 1 ? col[1] : col[0];
  const bool writes = p.swiglu ? lane == 0 && live[0] : lane < uint(Q) && (lane == 1 ? live[1] : live[0]);
  MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
    if (r >= rows) continue;  // (not break: the loop must unroll, acc stay in registers)
    const uint m = s.row + uint(r);
    const float t0 = simd_sum(acc[r][0]), t1 = simd_sum(acc[r][1]);
    if (writes) {
      float v;
      if (p.swiglu) {
        const float gate = t0 * scale_of(p, row_scale, col_scale, s.g, m, col[0]);
        v = silu(gate) * t1 * scale_of(p, row_scale, col_scale, s.g, m, col[1]);
      } else {
        v = (lane == 1 ? t1 : t0) * scale_of(p, row_scale, col_scale, s.g, m, lane_col);
      }
      out[ulong(m) * ulong(p.out_m) + ulong(p.swiglu ? col0 : lane_col) * ulong(p.out_n)] = TO(v);
    }
  }
}

template <typename TA, typename TB, typename TO, bool VEC>
[[max_total_threads_per_threadgroup(32 * GMM_ROWS_SIMDGROUPS)]]
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
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint tile[rows_tile_words(rows_piece_words<TA, TB, VEC>())];
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
  const device TB* wg = w + ulong(s.g) * ulong(p.b_batch);
  const uint col0 = (tg.x * GMM_ROWS_SIMDGROUPS + sg) * (p.swiglu ? 1 : GMM_ROWS_OUTPUTS);
  // One specialisation per row count, so one routed row does not pay for 8.
  if (s.rows == 1)
    decode_rows_body<TA, TB, TO, 1, VEC>(out, a, wg, p, row_scale, col_scale, s, col0, tid, lane, tile, rows_at);
  else if (s.rows == 2)
    decode_rows_body<TA, TB, TO, 2, VEC>(out, a, wg, p, row_scale, col_scale, s, col0, tid, lane, tile, rows_at);
  else if (s.rows <= 4)
    decode_rows_body<TA, TB, TO, 4, VEC>(out, a, wg, p, row_scale, col_scale, s, col0, tid, lane, tile, rows_at);
  else
    decode_rows_body<TA, TB, TO, 8, VEC>(out, a, wg, p, row_scale, col_scale, s, col0, tid, lane, tile, rows_at);
}

// ------------------------------------------------------ gmm_decode_cols --
// A lane owns NE consecutive columns: a 4-byte word of T with VEC (1 float,
// 2 halves or bfloats), one element without. A simdgroup's 32 lanes read
// 128 contiguous bytes of one weight row per load instruction (64 without
// VEC); the threadgroup's simdgroups take rows of K S apart, and their
// partial sums add up in threadgroup memory. Registers: R * NE accumulators
// (at most 16) + U words in flight, as floats + one activation at a time,
// from a tile of them in threadgroup memory.
template <typename T, bool VEC>
constexpr int cols_lane_columns() {
  return VEC ? 4 / int(sizeof(T)) : 1;
}
template <typename T, bool VEC>
constexpr int cols_partial_words() {  // a row's partial sums: every simdgroup's columns
  return GMM_COLS_THREADS * cols_lane_columns<T, VEC>();
}

template <typename T, int R, bool VEC>
MPS_EXT_INLINE void decode_cols_body(device T* out, const device T* a, const device T* w,
                                     constant GroupedMMParams& p, RowSlot s, uint col_base, uint tid, uint sg,
                                     uint lane, threadgroup float* partial, threadgroup float* x_tile) {
  constexpr int NE = cols_lane_columns<T, VEC>();
  constexpr int S = GMM_COLS_THREADS / 32;
  constexpr int U = GMM_COLS_K_TILE / S;  // rows of K a lane loads before it uses the first: 4
  const int rows = int(s.rows);
  const uint K = p.k, b_k = p.b_k;
  const uint c0 = col_base + lane * NE;
  const uint ncols = c0 >= p.n ? 0 : min(uint(NE), p.n - c0);  // of the lane's columns, those that exist
  const device T* arow = a + s.row * uint(p.a_m);  // `a` fits 32-bit offsets (the host checks)
  float acc[R][NE];
  MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
    MPS_EXT_UNROLL for (int e = 0; e < NE; ++e) acc[r][e] = 0.0f;

  const device T* wp = w + sg * b_k + c0;  // b's columns are contiguous (the host's choice of kernel)
  constexpr int XK = GMM_COLS_K_TILE;
  static_assert(XK == S * U, "a tile of activations is one step");
  // The rows' activations, XK at a time, staged once for the threadgroup
  // (a simdgroup stages 32 consecutive ones of a row); every lane of a
  // simdgroup then reads the same one (a broadcast). Row r at x_tile[r *
  // 2XK + k % 2XK], a ring: consecutive steps fill alternate halves, so one
  // barrier a step suffices (a thread staging step i + 2 passed the barrier
  // of step i + 1, which every thread reaches after it used step i), and
  // the addresses a lane reads change with the step (a compiler keeps no
  // R * U addresses of its own live through the loop).
  for (uint k0 = 0; k0 < K; k0 += XK) {
    const uint ring = k0 & uint(XK);  // this step's half
    for (uint t = tid; t < uint(R * XK); t += GMM_COLS_THREADS) {
      const uint r = t / XK, k = k0 + t % XK;
      x_tile[ring + r * 2 * XK + t % XK] = int(r) < rows && k < K ? elem(arow[r * uint(p.a_m) + k * uint(p.a_k)]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {
      const uint kk = sg, k = k0 + kk;
      // The weights first, zeros past K and past the last column.
      float wf[U][4];  // (NE used)
      MPS_EXT_UNROLL for (int u = 0; u < U; ++u) {
        const bool ok = k + u * S < K;
        const device T* wu = wp + u * (S * b_k);
        if (VEC && ncols == NE) {
          word_floats(ok ? *(const device uint*)wu : 0u, wf[u], T(0));
        } else {
          MPS_EXT_UNROLL for (int e = 0; e < NE; ++e) wf[u][e] = ok && uint(e) < ncols ? elem(wu[e]) : 0.0f;
        }
      }
      MPS_EXT_UNROLL for (int u = 0; u < U; ++u) {
        MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
          const float x = x_tile[ring + r * 2 * XK + kk + u * S];  // (0 past K and past the slot's rows)
          MPS_EXT_UNROLL for (int e = 0; e < NE; ++e) acc[r][e] += x * wf[u][e];
        }
      }
      wp += S * U * b_k;
    }
  }

  // A row at a time: column e of lane l of simdgroup g at partial[(g * NE
  // + e) * 32 + l], so that both the stores and the sums below read 32
  // consecutive words (32 banks).
  constexpr int CT = 32 * NE;  // columns of the threadgroup
  MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
    if (r >= rows) continue;  // uniform (not break: the loop must unroll, acc stay in registers)
    MPS_EXT_UNROLL for (int e = 0; e < NE; ++e) partial[(sg * NE + e) * 32 + lane] = acc[r][e];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < uint(CT)) {
      const uint l = tid % 32, e = tid / 32, n = col_base + l * NE + e;
      if (n < p.n) {
        float total = 0.0f;
        MPS_EXT_UNROLL for (int g = 0; g < S; ++g) total += partial[(g * NE + e) * 32 + l];
        out[ulong(s.row + r) * ulong(p.out_m) + ulong(n) * ulong(p.out_n)] = T(total);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

template <typename T, bool VEC>
[[max_total_threads_per_threadgroup(GMM_COLS_THREADS)]]
kernel void gmm_decode_cols(device T* out [[buffer(0)]],
                            const device T* a [[buffer(1)]],
                            const device T* w [[buffer(2)]],
                            const device int* offs [[buffer(3)]],
                            constant GroupedMMParams& p [[buffer(4)]],
                            uint2 tg [[threadgroup_position_in_grid]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float partial[(cols_partial_words<T, VEC>())];
  threadgroup float x_tile[GMM_DECODE_MAX_ROWS * 2 * GMM_COLS_K_TILE];
  threadgroup uint shared[2];
  const RowSlot s = decode_slot(offs, p, tg.y, sg, lane, shared);
  if (s.rows == 0) return;  // uniform: every thread read the same slot
  const device T* wg = w + ulong(s.g) * ulong(p.b_batch);
  const uint col_base = tg.x * 32 * cols_lane_columns<T, VEC>();
  if (s.rows == 1)
    decode_cols_body<T, 1, VEC>(out, a, wg, p, s, col_base, tid, sg, lane, partial, x_tile);
  else if (s.rows == 2)
    decode_cols_body<T, 2, VEC>(out, a, wg, p, s, col_base, tid, sg, lane, partial, x_tile);
  else if (s.rows <= 4)
    decode_cols_body<T, 4, VEC>(out, a, wg, p, s, col_base, tid, sg, lane, partial, x_tile);
  else
    decode_cols_body<T, 8, VEC>(out, a, wg, p, s, col_base, tid, sg, lane, partial, x_tile);
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
