// Matrix-vector products for decode: 1 to 8 activation rows against a weight
// whose bytes must stream from memory exactly once. Every weight element is
// loaded once and applied to all activation rows; the accumulation is in
// float.
//
// gemv_rows  the weight's K dimension is contiguous (F.linear's [N, K] W).
//            A simdgroup owns Q (1 or 2) weight rows; its lanes stride K with
//            16-byte loads and the row sums end in simd_sum. The threadgroup
//            stages the activations in threadgroup memory, a K-tile at a
//            time, so that its simdgroups do not each read them from memory
//            (and Q outputs share each activation word a lane reads there).
// gemv_cols  the weight's N dimension is contiguous (x @ W with W [K, N]).
//            A threadgroup owns 128 bytes of columns (one cache line of each
//            weight row) and a range of K: 8 lanes cover the columns with
//            16-byte loads, 4 lanes and 8 simdgroups split the rows, and the
//            partial sums add up through shuffles and threadgroup memory.
//            When the columns alone give too few threadgroups, K is split
//            over several (gemv_cols_finish adds their sums).
// VEC: 16-byte loads of the weight (and, in gemv_rows, the activations),
// used when the host found the addresses 16-byte aligned; otherwise element
// loads.
//
// Registers: these kernels are memory-bound, so they need every thread a
// core can hold (full occupancy) to keep loads in flight; a thread's live
// 32-bit values must stay within cpu_metal.FULL_OCCUPANCY_REGISTERS (52).
// gemv_rows holds R * Q accumulators + U * Q weight pieces in flight (at
// most 24 registers together) + one word of activations and its products;
// gemv_cols at most 16 accumulators (lanes along K in groups of 2 or 4 swap
// parts of their pieces) + U pieces in flight (at most 20 together) + one
// activation and a piece's floats.
#include <metal_stdlib>
#include "gemv_params.h"
#include "pieces.h"
using namespace metal;

// Elements of a piece: 16 bytes with VEC, one element without.
#define PIECE(T, VEC) ((VEC) ? int(16 / sizeof(T)) : 1)

// A piece of T, held as its bits: with VEC 16 bytes of T; without, one
// element, converted to float, in .x (the other lanes of the vector are
// never used, so they take no registers).
template <typename T, bool VEC>
MPS_EXT_INLINE uint4 load_piece(const device T* p) {
  if (VEC) return *(const device uint4*)p;
  return uint4(as_type<uint>(float(*p)), 0u, 0u, 0u);
}

// acc + the sum of the products of the elements of two 32-bit words of T
// (one float each, or two halves / bfloats).
template <typename T>
MPS_EXT_INLINE float dot_words(uint a, uint b, float acc) {
  constexpr int N = 4 / sizeof(T);
  float x[N], y[N];
  word_floats(a, x, T(0));
  word_floats(b, y, T(0));
  MPS_EXT_UNROLL for (int e = 0; e < N; ++e) acc += x[e] * y[e];
  return acc;
}

MPS_EXT_INLINE float finish(float acc, constant GemvParams& p, float bias) {
  return p.has_bias ? p.alpha * acc + p.beta * bias : p.alpha * acc;
}

template <typename T>
MPS_EXT_INLINE void write_output(device T* y, const device T* bias, constant GemvParams& p, long r, long n,
                                 float total) {
  const float b = p.has_bias ? float(bias[r * p.bias_row_stride + n * p.bias_n_stride]) : 0.0f;
  y[r * p.y_row_stride + n * p.y_n_stride] = T(finish(total, p, b));
}

// ------------------------------------------------------------ gemv_rows --
// U, the weight pieces of one output a lane loads before it uses the first:
// pieces.h's rows_pieces_per_output.

template <typename T, int R, int Q, bool VEC>
[[max_total_threads_per_threadgroup(GEMV_ROWS_MAX_THREADS)]]
kernel void gemv_rows(device T* y [[buffer(0)]],
                      const device T* x [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      constant GemvParams& p [[buffer(3)]],
                      const device T* bias [[buffer(4)]],
                      uint group [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint threads [[threads_per_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int E = PIECE(T, VEC);
  constexpr int TILE = GEMV_ROWS_TILE_BYTES / (R * int(sizeof(T)));  // elements of each activation row per tile
  constexpr int TILE_PIECES = TILE / E;
  constexpr int U = rows_pieces_per_output(R, Q, TILE_PIECES);
  // Every full tile takes each lane the same number of steps of 32 * U
  // pieces: a lane's pieces are consecutive across tiles, and its weight
  // pointers just advance.
  static_assert(TILE_PIECES % (32 * U) == 0, "a tile is whole steps");
  // The activations of a tile. With VEC, word j of piece c of row r at
  // words[r][j][c]: a simdgroup's loads of one word of 32 pieces hit 32
  // banks, and a lane needs one word of one row at a time. Without, T
  // elements [r][c].
  threadgroup uint tile_mem[GEMV_ROWS_TILE_BYTES / 4];
  threadgroup T* tile = (threadgroup T*)tile_mem;

  const int rows = int(p.rows), K = int(p.k);
  const int x_row_stride = int(p.x_row_stride), x_k_stride = int(p.x_k_stride);
  const long first = (long(group) * simdgroups + sg) * Q;  // this simdgroup's first output
  // Along K: elements one apart with VEC (the host checked), else w_k_stride.
  const long w_k_stride = VEC ? 1 : p.w_k_stride;
  const long u_step = 32 * E * w_k_stride;  // from a lane's piece to its next one
  bool live[Q];
  const device T* wp[Q];  // the lane's next piece of each weight row
  float acc[R][Q];
  MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
    live[q] = first + q < p.n_out;
    wp[q] = w + (live[q] ? (first + q) * p.w_n_stride : 0) + long(lane) * E * w_k_stride;
    MPS_EXT_UNROLL for (int r = 0; r < R; ++r) acc[r][q] = 0.0f;
  }

  // Elements whole pieces cover (all of them without VEC); the rest below.
  const int k_pieces = VEC ? K / E * E : K;
  for (int k0 = 0; k0 < k_pieces; k0 += TILE) {
    const int pieces = min(TILE, k_pieces - k0) / E;  // of each row in this tile
    // Consecutive threads stage consecutive pieces of an activation row;
    // rows past `rows` stage as zeros, so that the products need no check.
    for (int i = int(tid); i < R * TILE_PIECES; i += int(threads)) {
      const int r = i / TILE_PIECES, c = i % TILE_PIECES;
      if (c >= pieces) continue;
      const int at = r * x_row_stride + (k0 + c * E) * x_k_stride;
      if (VEC) {
        const uint4 v = r < rows ? *(const device uint4*)(x + at) : uint4(0u);
        MPS_EXT_UNROLL for (int j = 0; j < 4; ++j) tile_mem[(r * 4 + j) * TILE_PIECES + c] = v[j];
      } else {
        tile[i] = r < rows ? x[at] : T(0);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Lanes take consecutive pieces of the weight rows: a simdgroup reads
    // 512 contiguous bytes of a row per load instruction.
    for (int c = int(lane); c < pieces; c += 32 * U) {
      uint4 wv[U][Q];
      MPS_EXT_UNROLL for (int u = 0; u < U; ++u)
        MPS_EXT_UNROLL for (int q = 0; q < Q; ++q)
          wv[u][q] = live[q] && c + 32 * u < pieces ? load_piece<T, VEC>(wp[q] + u * u_step) : uint4(0u);
      MPS_EXT_UNROLL for (int u = 0; u < U; ++u) {
        // Past the tile's pieces the weights are 0: any staged value will do.
        const int cu = min(c + 32 * u, pieces - 1);
        // A word of the pieces at a time, every row and output: each
        // weight word is converted once, and only one is live per output.
        MPS_EXT_UNROLL for (int j = 0; j < (VEC ? 4 : 1); ++j) {
          MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
            if (VEC) {
              const uint xw = tile_mem[(r * 4 + j) * TILE_PIECES + cu];
              MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) acc[r][q] = dot_words<T>(xw, wv[u][q][j], acc[r][q]);
            } else {  // the weight element is a float already
              const uint xw = as_type<uint>(float(tile[r * TILE + cu]));
              MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) acc[r][q] = dot_words<float>(xw, wv[u][q].x, acc[r][q]);
            }
          }
        }
      }
      MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) wp[q] += U * u_step;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // The last K % E elements (VEC only: fewer than a piece, so one a lane).
  const int k = k_pieces + int(lane);
  if (k < K) {
    MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
      if (!live[q]) continue;
      const float wk = float(w[(first + q) * p.w_n_stride + k]);
      MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
        if (r < rows) acc[r][q] += float(x[r * x_row_stride + k]) * wk;
    }
  }

  MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
    MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
      if (r >= rows) continue;
      const float total = simd_sum(acc[r][q]);
      // Lane i writes output i: stores spread over the simdgroup.
      if (lane == uint(r * Q + q) % 32 && live[q]) write_output(y, bias, p, r, first + q, total);
    }
  }
}

// ------------------------------------------------------------ gemv_cols --
// A lane's 16-byte piece holds E columns of one row of K. Lanes along K
// in groups of G (rows k, k + 1, ... of one step, the same columns) swap
// parts of their pieces so that each accumulates OWN = E / G columns of all
// G rows: G = 1, 2 or 4, so that no lane holds more than 16 accumulators.
constexpr int cols_group(int E, int R, bool VEC) { return !VEC ? 1 : E * R > 32 ? 4 : E * R > 16 ? 2 : 1; }

// V floats to threadgroup memory, one store (V = 1, 2 or 4).
template <int V>
MPS_EXT_INLINE void store_floats(threadgroup float* p, thread const float* v);
template <>
MPS_EXT_INLINE void store_floats<1>(threadgroup float* p, thread const float* v) { *p = v[0]; }
template <>
MPS_EXT_INLINE void store_floats<2>(threadgroup float* p, thread const float* v) {
  *(threadgroup float2*)p = float2(v[0], v[1]);
}
template <>
MPS_EXT_INLINE void store_floats<4>(threadgroup float* p, thread const float* v) {
  *(threadgroup float4*)p = float4(v[0], v[1], v[2], v[3]);
}

// Grid: (column blocks, splits of K). partials: [splits, rows, N] floats
// when splits > 1 (then y is written by gemv_cols_finish).
template <typename T, int R, bool VEC>
[[max_total_threads_per_threadgroup(GEMV_COLS_THREADS)]]
kernel void gemv_cols(device T* y [[buffer(0)]],
                      const device T* x [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      constant GemvParams& p [[buffer(3)]],
                      const device T* bias [[buffer(4)]],
                      device float* partials [[buffer(5)]],
                      uint2 group [[threadgroup_position_in_grid]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int E = PIECE(T, VEC);       // columns of a lane's piece
  constexpr int LN = VEC ? 8 : 32;       // lanes along N: 128 bytes of a row with VEC
  constexpr int LK = 32 / LN;            // lanes along K
  constexpr int CB = LN * E;             // columns of the threadgroup
  constexpr int S = GEMV_COLS_THREADS / 32;
  constexpr int RS = S * LK;             // rows of K a threadgroup step covers
  constexpr int G = cols_group(E, R, VEC);  // lanes along K that share their pieces
  constexpr int OWN = E / G;                // columns a lane accumulates
  constexpr int WO = 4 / G;                 // words of each row's piece it keeps (VEC)
  // Pieces a lane loads before it uses the first: 4 while the accumulators
  // are few, fewer as they grow (registers: accumulators + 4 U <= 20; U a
  // power of two, for the activation ring below). Element loads: 4 (a piece
  // is one register; 4 steps of 8 rows stage 32 consecutive activations of
  // a row per simdgroup).
  constexpr int U = !VEC || R * OWN <= 4 ? 4 : R * OWN <= 12 ? 2 : 1;
  constexpr int RB = GEMV_COLS_THREADS / CB;  // rows of partial sums per round through threadgroup memory
  constexpr int CB4 = (CB + 3) / 4;
  threadgroup float4 partial_mem[S][RB][CB4];
  // The activations of two steps of U * RS rows of K, as float: row r of x
  // at k in x_tile[r][k % (2 * TK)], a ring. Staged by consecutive threads
  // along k (coalesced reads of each row, stores to consecutive words); read
  // one float at a time, by the lanes of a row of K at one address (a
  // broadcast). Consecutive steps fill alternate halves, so one barrier a
  // step suffices (a thread staging step i + 2 passed the barrier of step
  // i + 1, which every thread reaches after it used step i); and the
  // addresses a lane reads change with the step, so that a compiler keeps
  // no R * U addresses of its own live through the loop.
  // Rows of the ring XS = RING + TK words apart: where a simdgroup stages
  // several rows at once (TK < 32), they fall in distinct banks.
  constexpr int TK = U * RS;
  constexpr int RING = 2 * TK, XS = RING + TK;
  static_assert((RING & (RING - 1)) == 0, "the ring is a power of two");
  threadgroup float x_tile[R * XS];

  const int rows = int(p.rows);
  const int x_row_stride = int(p.x_row_stride), x_k_stride = int(p.x_k_stride);
  const int nq = int(lane) % LN, kq = int(lane) / LN;
  const long col0 = long(group.x) * CB + nq * E;
  const long left = p.n_out - col0;
  const int ncols = left <= 0 ? 0 : left >= E ? E : int(left);  // columns of the piece that exist
  // K fits in 31 bits (the host checks the activation's offsets).
  const int K = int(p.k), chunks = (K + GEMV_COLS_K_CHUNK - 1) / GEMV_COLS_K_CHUNK, splits = int(p.splits);
  const int k_begin = int(group.y) * chunks / splits * GEMV_COLS_K_CHUNK;
  const int k_end = min((int(group.y) + 1) * chunks / splits * GEMV_COLS_K_CHUNK, K);
  const int lane_row = int(sg) * LK + kq;  // this lane's row within a step

  float acc[R][OWN];
  MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
    MPS_EXT_UNROLL for (int e = 0; e < OWN; ++e) acc[r][e] = 0.0f;

  // The weight pointer advances by a step's rows: no 64-bit multiply in the loop.
  const device T* wp = w + long(k_begin + lane_row) * p.w_k_stride + col0 * p.w_n_stride;
  const long w_step = RS * p.w_k_stride;
  for (int tile_k = k_begin; tile_k < k_end; tile_k += TK) {
    // The weight pieces first: they are in flight while the tile is staged.
    uint4 wv[U];
    MPS_EXT_UNROLL for (int u = 0; u < U; ++u) {
      const bool ok = tile_k + u * RS + lane_row < k_end;
      const device T* wu = wp + u * w_step;
      if (ok && ncols == E) {
        wv[u] = load_piece<T, VEC>(wu);
      } else {  // past K, or a piece past the last column: its elements one by one, zeros beyond
        float v[E];
        MPS_EXT_UNROLL for (int e = 0; e < E; ++e) v[e] = ok && e < ncols ? float(wu[e * p.w_n_stride]) : 0.0f;
        wv[u] = VEC ? pack16<E>(v, T(0)) : uint4(as_type<uint>(v[0]), 0u, 0u, 0u);
      }
    }
    // Rows past K (and activation rows past `rows`) stage as 0, so that the
    // products below need no checks: their weights are 0 too.
    for (int t = int(tid); t < R * TK; t += GEMV_COLS_THREADS) {
      const int r = t / TK, k = tile_k + t % TK;
      x_tile[r * XS + (k & (RING - 1))] = r < rows && k < k_end ? float(x[r * x_row_stride + k * x_k_stride]) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    MPS_EXT_UNROLL for (int u = 0; u < U; ++u) {
      const int k = tile_k + u * RS + lane_row;
      const int g = kq % G;
      // Lane g ^ m of the group holds row k - g + (g ^ m): it sends this
      // lane its part g of that row's piece, and takes part g ^ m of ours.
      MPS_EXT_UNROLL for (int m = 0; m < G; ++m) {
        float wf[OWN];
        if (VEC) {
          MPS_EXT_UNROLL for (int i = 0; i < WO; ++i) {
            uint word = wv[u][(g ^ m) * WO + i];
            if (m > 0) word = simd_shuffle_xor(word, ushort(m * LN));
            word_floats(word, wf + i * (OWN / WO), T(0));
          }
        } else {
          wf[0] = as_type<float>(wv[u].x);
        }
        const int slot = (k - g + (g ^ m)) & (RING - 1);
        MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
          const float xr = x_tile[r * XS + slot];
          MPS_EXT_UNROLL for (int e = 0; e < OWN; ++e) acc[r][e] += xr * wf[e];
        }
      }
    }
    wp += U * w_step;
  }

  // The simdgroup's sums: lanes that hold the same columns (one g in each
  // group along K) add up across their rows of K.
  MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
    MPS_EXT_UNROLL for (int e = 0; e < OWN; ++e)
      for (ushort offset = ushort(G * LN); offset < 32; offset *= 2)
        acc[r][e] += simd_shuffle_xor(acc[r][e], offset);
  // Then the threadgroup's, RB rows at a time: the holders (the first group
  // along K: holder h has columns [h * OWN, (h + 1) * OWN) of the block)
  // write their columns, every thread adds one column of one row, so that
  // consecutive threads write consecutive outputs. A holder stores V
  // columns at a time; with two such chunks (OWN = 8), lanes from the fifth
  // on store their second chunk first, so that the 8 lanes' stores of one
  // instruction hit 32 distinct banks, not 16 twice.
  constexpr int V = OWN >= 4 ? 4 : OWN, CHUNKS = OWN / V;
  const bool holder = kq < G;
  const int h = nq * G + kq % G;
  threadgroup float* slots = (threadgroup float*)partial_mem;
  MPS_EXT_UNROLL for (int r0 = 0; r0 < R; r0 += RB) {
    if (r0 >= rows) break;
    if (holder) {
      MPS_EXT_UNROLL for (int rr = 0; rr < RB; ++rr) {
        const int r = r0 + rr;
        if (r >= R) break;
        MPS_EXT_UNROLL for (int i = 0; i < CHUNKS; ++i) {
          const int j = (i + h / (32 / OWN)) % CHUNKS;
          float v[V];
          MPS_EXT_UNROLL for (int t = 0; t < V; ++t) v[t] = acc[r][t];
          MPS_EXT_UNROLL for (int jj = 1; jj < CHUNKS; ++jj)
            if (j == jj) MPS_EXT_UNROLL for (int t = 0; t < V; ++t) v[t] = acc[r][jj * V + t];
          store_floats<V>(slots + (int(sg) * RB + rr) * CB + h * OWN + j * V, v);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {
      const int rr = int(tid) / CB, s = int(tid) % CB;
      const int r = r0 + rr;
      const long n = long(group.x) * CB + s;
      if (r < rows && n < p.n_out) {
        float total = 0.0f;
        MPS_EXT_UNROLL for (int g = 0; g < S; ++g) total += slots[(g * RB + rr) * CB + s];
        if (p.splits == 1) write_output(y, bias, p, r, n, total);
        else partials[(long(group.y) * rows + r) * p.n_out + n] = total;
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// Split K: y from the splits' partial sums, added in split order (the same
// result every run). Grid: (N / GEMV_COLS_THREADS, rows). Bound like
// gemv_cols; x and w are not read.
template <typename T>
[[max_total_threads_per_threadgroup(GEMV_COLS_THREADS)]]
kernel void gemv_cols_finish(device T* y [[buffer(0)]],
                             const device T* x [[buffer(1)]],
                             const device T* w [[buffer(2)]],
                             constant GemvParams& p [[buffer(3)]],
                             const device T* bias [[buffer(4)]],
                             const device float* partials [[buffer(5)]],
                             uint2 group [[threadgroup_position_in_grid]],
                             uint2 tid [[thread_position_in_threadgroup]]) {
  const long n = long(group.x) * GEMV_COLS_THREADS + tid.x, r = group.y;
  if (n >= p.n_out) return;
  float total = 0.0f;
  const long split_stride = p.rows * p.n_out;  // the same for every thread: no 64-bit multiply a split
  const device float* part = partials + r * p.n_out + n;
  for (uint s = 0; s < p.splits; ++s, part += split_stride) total += *part;
  write_output(y, bias, p, r, n, total);
}

#define INSTANTIATE_GEMV_ROWS(tname, T, R, Q)                                                                   \
  template [[host_name("gemv_rows_" #tname "_r" #R "_q" #Q "_vec")]] kernel                                      \
      decltype(gemv_rows<T, R, Q, true>) gemv_rows<T, R, Q, true>;                                               \
  template [[host_name("gemv_rows_" #tname "_r" #R "_q" #Q "_scalar")]] kernel                                   \
      decltype(gemv_rows<T, R, Q, false>) gemv_rows<T, R, Q, false>;
#define INSTANTIATE_GEMV_COLS(tname, T, R)                                                                      \
  template [[host_name("gemv_cols_" #tname "_r" #R "_vec")]] kernel decltype(gemv_cols<T, R, true>)             \
      gemv_cols<T, R, true>;                                                                                     \
  template [[host_name("gemv_cols_" #tname "_r" #R "_scalar")]] kernel decltype(gemv_cols<T, R, false>)         \
      gemv_cols<T, R, false>;
#define INSTANTIATE_GEMV(tname, T)                                                                               \
  INSTANTIATE_GEMV_ROWS(tname, T, 1, 1) INSTANTIATE_GEMV_ROWS(tname, T, 2, 1)                                   \
  INSTANTIATE_GEMV_ROWS(tname, T, 4, 1) INSTANTIATE_GEMV_ROWS(tname, T, 8, 1)                                   \
  INSTANTIATE_GEMV_ROWS(tname, T, 1, 2) INSTANTIATE_GEMV_ROWS(tname, T, 2, 2)                                   \
  INSTANTIATE_GEMV_ROWS(tname, T, 4, 2) INSTANTIATE_GEMV_ROWS(tname, T, 8, 2)                                   \
  INSTANTIATE_GEMV_COLS(tname, T, 1) INSTANTIATE_GEMV_COLS(tname, T, 2)                                         \
  INSTANTIATE_GEMV_COLS(tname, T, 4) INSTANTIATE_GEMV_COLS(tname, T, 8)                                         \
  template [[host_name("gemv_cols_finish_" #tname)]] kernel decltype(gemv_cols_finish<T>) gemv_cols_finish<T>;

INSTANTIATE_GEMV(f32, float)
INSTANTIATE_GEMV(f16, half)
INSTANTIATE_GEMV(bf16, bfloat)
