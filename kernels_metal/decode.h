// The one decode matrix-vector template: 1 to 8 activation rows against a
// weight whose bytes must stream from memory exactly once, every weight
// element loaded once and applied to all rows, accumulation in float. It
// serves every decode kernel whose weight is contiguous along K: gemv_rows
// (linear.metal: float, half, bfloat), fp8_gemv (scaled_mm.metal: float8 weights
// with tensor, row or block scales under any activation type) and
// gmm_decode_rows (grouped_mm.metal: rows gathered by expert; and
// moe_down_combine, whose job's store keeps the outputs for a weighted sum
// over the experts, its epilogue), as MLX serves
// its dense, batched and gathered GEMV from one kernel with a loader policy.
//
// What differs between them is two policies, so adding a weight format is
// one format struct and adding a family one job:
// - element formats (DecodeFloat<T>, DecodeFp8): how a 32-bit word of the
//   stored type becomes floats (`word`), one element (`one`), and the unit
//   the sums are multiplied by at the end (fp8 decodes e4m3 as x / 256);
// - the job: its operands (DecodeOperands, below: the formats, the weight,
//   the row count, K and the strides along K), where each activation row
//   starts (the row source: dense rows, or rows gathered by expert into
//   threadgroup memory), the weight row of each output a simdgroup owns,
//   block scales (staged per tile, applied per 16-byte piece) or none, and
//   how the sums are stored.
// A job is one flat struct, its operands a member: Metal has no derived
// classes (MSL 1.5.4; check mode's msl-derived-class), so a family's jobs
// share its operands and code as members and helpers, not as bases.
//
// The work: a simdgroup owns Q weight rows; its lanes take consecutive
// pieces of them (16 bytes with VEC, one element without), so a simdgroup
// reads 512 contiguous bytes of a row per load instruction. The threadgroup
// stages the rows' activations in threadgroup memory, DECODE_TILE_BYTES of
// them a step along K, so that its simdgroups (up to DECODE_MAX_SIMDGROUPS,
// 16) share one copy: the activation bytes a threadgroup reads from the
// caches are the rows' bytes once, against the weight bytes of all its
// outputs.
//
// Registers: these kernels are memory-bound, so they need every thread a
// core can hold (full occupancy) to keep loads in flight: R * Q
// accumulators + U * Q pieces in flight (4 registers each with VEC, 1
// without) stay within the job's budget of 24 (or less where it keeps more
// of its own live), the rest of cpu_metal.FULL_OCCUPANCY_REGISTERS for the
// converted words and addresses.
#pragma once
#include "decode_params.h"
#include "fp8_codec.h"
#include "pieces.h"

// -------------------------------------------------------- element formats --
template <typename TT>
struct DecodeFloat {
  typedef TT T;
  MPS_EXT_INLINE void word(uint bits, thread float* v) const { word_floats(bits, v, T(0)); }
  MPS_EXT_INLINE float one(T x) const { return float(x); }
  MPS_EXT_INLINE float unit() const { return 1.0f; }
};

struct DecodeFp8 {
  typedef uchar T;
  bool e5m2;  // else e4m3fn
  MPS_EXT_INLINE void word(uint bits, thread float* v) const {
    const float4 f = fp8x4_decode(bits, e5m2);
    MPS_EXT_UNROLL
    for (int i = 0; i < 4; ++i) v[i] = f[i];
  }
  MPS_EXT_INLINE float one(T x) const { return fp8_decode(x, e5m2); }
  MPS_EXT_INLINE float unit() const { return fp8_unit_of(e5m2); }
};

// The format's float8 flavour, where it has one (e4m3fn unless e5m2).
MPS_EXT_INLINE void decode_format_e5m2(thread DecodeFp8& f, bool e5m2) { f.e5m2 = e5m2; }
template <typename T>
MPS_EXT_INLINE void decode_format_e5m2(thread DecodeFloat<T>&, bool) {}

// -------------------------------------------------------- the operands --
// What the templates read of every job's operands, its member `op`: the
// activation and weight formats (XF, WF), the weight (decode_cols' element
// [0, 0]; decode_rows reads it through the job's w_row), the activation rows
// (at most 8), K, and the strides along K of the activations (used without
// VEC) and of the weight.
template <typename XF, typename WF>
struct DecodeOperands {
  typedef XF X;
  typedef WF W;
  X xf;
  W wf;
  const device typename WF::T* w;
  int rows, k;
  long x_k, w_k;
};
// The operands' type of a job.
template <typename Job>
using DecodeOperandsOf = decltype(Job::op);

// A job's block scales, as the templates call them: with BLOCK_SCALED, the
// job's own stage_scales, x_scale, w_scale and tail_scale; without, nothing
// staged and scales of 1, so that a job without block scales writes none
// of those functions (its calls are in branches on a constant).
template <typename Job, bool SCALED = Job::BLOCK_SCALED != 0>
struct DecodeScales {
  static MPS_EXT_INLINE void stage(thread const Job& job, int k0, int elements, uint tid, uint threads) {
    job.stage_scales(k0, elements, tid, threads);
  }
  static MPS_EXT_INLINE float x(thread const Job& job, int r, int block) { return job.x_scale(r, block); }
  static MPS_EXT_INLINE float w(thread const Job& job, int q, int block) { return job.w_scale(q, block); }
  static MPS_EXT_INLINE float tail(thread const Job& job, int r, int q, int kb) { return job.tail_scale(r, q, kb); }
};
template <typename Job>
struct DecodeScales<Job, false> {
  static MPS_EXT_INLINE void stage(thread const Job&, int, int, uint, uint) {}
  static MPS_EXT_INLINE float x(thread const Job&, int, int) { return 1.0f; }
  static MPS_EXT_INLINE float w(thread const Job&, int, int) { return 1.0f; }
  static MPS_EXT_INLINE float tail(thread const Job&, int, int, int) { return 1.0f; }
};

// ------------------------------------------------------------- the tile --
// Pieces of each activation row a tile holds: the tile's bytes (the job's
// TILE_BYTES, DECODE_TILE_BYTES unless it says otherwise) over the rows (at
// least one per lane), fewer with block scales. WA: words of an activation
// piece (the activations of one weight piece), E: weights of a piece.
constexpr int decode_tile_pieces(int R, int WA, int E, bool scaled, int tile_bytes = DECODE_TILE_BYTES) {
  const int bytes = tile_bytes / (R * WA * 4);
  const int pieces = bytes < 32 ? 32 : bytes;
  return scaled && pieces * E > DECODE_SCALED_TILE_ELEMENTS ? DECODE_SCALED_TILE_ELEMENTS / E : pieces;
}
// Words from one word of a row's pieces to the next: word w of piece c of
// row r is at (r * WA + w) * stride + c, so that a simdgroup reading one word
// of 32 consecutive pieces hits 32 banks. Threads stage consecutive 16-byte
// quarters of a piece (AW of them) and pieces: the padding 8 / AW puts
// those AW quarters' words 32 / AW banks apart, so one store instruction
// also hits 32 banks.
constexpr int decode_tile_stride(int pieces, int AW, bool vec) { return vec && AW > 1 ? pieces + 8 / AW : pieces; }

template <typename TX, typename TW, bool VEC>
struct DecodeShape {
  enum {
    E = VEC ? 16 / int(sizeof(TW)) : 1,                // weights of a piece
    NW = VEC ? 4 / int(sizeof(TW)) : 1,                // weights of a weight word
    AW = VEC ? int(sizeof(TX)) / int(sizeof(TW)) : 1,  // activation words of a weight word
    WA = VEC ? 4 * AW : 1,                             // activation words of a piece
  };
};

// Threadgroup words of the tile at R rows.
template <typename TX, typename TW, bool VEC, bool SCALED>
constexpr int decode_tile_words(int R, int tile_bytes = DECODE_TILE_BYTES) {
  typedef DecodeShape<TX, TW, VEC> S;
  return R * S::WA * decode_tile_stride(decode_tile_pieces(R, S::WA, S::E, SCALED, tile_bytes), S::AW, VEC);
}
// ... at the most of any R (a kernel that picks R at run time).
template <typename TX, typename TW, bool VEC, bool SCALED>
constexpr int decode_tile_words_any(int tile_bytes = DECODE_TILE_BYTES) {
  int most = 0;
  for (int R = 1; R <= 8; R *= 2) {
    const int w = decode_tile_words<TX, TW, VEC, SCALED>(R, tile_bytes);
    most = w > most ? w : most;
  }
  return most;
}

// A lane's piece of a weight row, as bits: B = 16 bytes (a uint4) or 4
// (one word, a uint), loaded as they are; B = 0, one element converted to
// float (a uint: a uint4 with 3 unused words would still be 4 registers
// wherever it is selected or merged, as the zero piece of an output that
// does not exist is).
template <int B>
struct DecodePiece {
  typedef uint4 type;
  template <typename WF>
  static MPS_EXT_INLINE type load(thread const WF&, const device typename WF::T* p) {
    return *(const device uint4*)p;
  }
  // E floats of one row's piece (past the last column: zeros) as its bits.
  template <int E, typename T>
  static MPS_EXT_INLINE type of_floats(thread const float* v, T) {
    return pack16<E>(v, T(0));
  }
  static MPS_EXT_INLINE uint word(type v, int j) { return v[j]; }
};
template <>
struct DecodePiece<4> {
  typedef uint type;
  template <typename WF>
  static MPS_EXT_INLINE type load(thread const WF&, const device typename WF::T* p) {
    return *(const device uint*)p;
  }
  static MPS_EXT_INLINE type pack(thread const float* v, float) { return as_type<uint>(v[0]); }
  template <typename H>
  static MPS_EXT_INLINE type pack(thread const float* v, H) {
    return as_type<uint>(vec<H, 2>(H(v[0]), H(v[1])));
  }
  template <int E, typename T>
  static MPS_EXT_INLINE type of_floats(thread const float* v, T) {
    return pack(v, T(0));
  }
  static MPS_EXT_INLINE uint word(type v, int) { return v; }
};
template <>
struct DecodePiece<0> {
  typedef uint type;
  template <typename WF>
  static MPS_EXT_INLINE type load(thread const WF& wf, const device typename WF::T* p) {
    return as_type<uint>(wf.one(*p));
  }
  template <int E, typename T>
  static MPS_EXT_INLINE type of_floats(thread const float* v, T) {
    return as_type<uint>(v[0]);
  }
  static MPS_EXT_INLINE uint word(type v, int) { return v; }
};

// ------------------------------------------------------- the products --
// acc[r * Q + q] += the products of one piece of each of the Q weight rows
// (wv) with the activations staged for that piece (the tile's words from
// tcu at stride TS); `block`: the piece's scale block within the tile.
template <typename Job, int R, int Q, bool VEC, int TS>
MPS_EXT_INLINE void decode_products(thread const Job& job,
                                    thread float* acc,
                                    thread const typename DecodePiece<VEC ? 16 : 0>::type* wv,
                                    const threadgroup uint* tcu,
                                    int block) {
  typedef DecodeOperandsOf<Job> Op;
  typedef DecodeScales<Job> Scales;
  typedef DecodeShape<typename Op::X::T, typename Op::W::T, VEC> Shape;
  constexpr int NW = Shape::NW, AW = Shape::AW, WA = Shape::WA;
  constexpr bool SCALED = Job::BLOCK_SCALED != 0;
  // Block scales: a piece lies in one 128-wide block of K. The weight's
  // scale multiplies each weight as it is converted, the activation row's
  // each word's products (no partial sums to keep). (Rows past `rows` and
  // outputs that do not exist have no scales staged: their products are 0.)
  float ws[Q];
  MPS_EXT_UNROLL
  for (int q = 0; q < Q; ++q) ws[q] = SCALED && job.live(q) ? Scales::w(job, q, block) : 1.0f;
  // A weight word of each output at a time, converted once for all rows:
  // only one is live per output.
  MPS_EXT_UNROLL
  for (int j = 0; j < (VEC ? 4 : 1); ++j) {
    float wf[Q][4];  // (NW used)
    MPS_EXT_UNROLL
    for (int q = 0; q < Q; ++q) {
      if (VEC) job.op.wf.word(DecodePiece < VEC ? 16 : 0 > ::word(wv[q], j), wf[q]);
      else wf[q][0] = as_type<float>(DecodePiece < VEC ? 16 : 0 > ::word(wv[q], 0));
      if (SCALED) {
        MPS_EXT_UNROLL
        for (int e = 0; e < NW; ++e) wf[q][e] *= ws[q];
      }
    }
    MPS_EXT_UNROLL
    for (int r = 0; r < R; ++r) {
      // Each activation word's floats (NW / AW of them) go into the sums
      // as it is read: one word live, not the weight word's AW.
      float d[Q];
      MPS_EXT_UNROLL
      for (int q = 0; q < Q; ++q) d[q] = SCALED ? 0.0f : acc[r * Q + q];
      MPS_EXT_UNROLL
      for (int i = 0; i < AW; ++i) {
        float xf[4];  // (NW / AW used)
        const uint xw = tcu[(r * WA + j * AW + i) * TS];
        if (VEC) job.op.xf.word(xw, xf);
        else xf[0] = as_type<float>(xw);
        MPS_EXT_UNROLL
        for (int q = 0; q < Q; ++q) MPS_EXT_UNROLL
        for (int e = 0; e < NW / AW; ++e) d[q] += xf[e] * wf[q][i * (NW / AW) + e];
      }
      const float xs = SCALED && r < job.op.rows ? Scales::x(job, r, block) : 0.0f;
      MPS_EXT_UNROLL
      for (int q = 0; q < Q; ++q) acc[r * Q + q] = SCALED ? acc[r * Q + q] + d[q] * xs : d[q];
    }
  }
}

// ------------------------------------------------- the activation loads --
// decode_rows' reads of activation row r at element k: 16 bytes (VEC) or
// one element as float, from the job's x_row(r) in device memory. A job
// whose rows are elsewhere specialises this (linear.metal's rms_norm_gemv_rows:
// rows it normed into threadgroup memory).
template <typename Job>
struct DecodeRowLoads {
  static MPS_EXT_INLINE uint4 piece(thread const Job& job, int r, int k) {
    return *(const device uint4*)(job.x_row(r) + k);
  }
  template <typename I>  // (the index as the caller computes it: int or long)
  static MPS_EXT_INLINE float one(thread const Job& job, int r, I k) {
    return job.op.xf.one(job.x_row(r)[k]);
  }
};

// ---------------------------------------------------------- the kernel --
// Run by every thread of the threadgroup (it has barriers). R: a power of
// two >= job.rows; rows past them stage as 0. `tile`: decode_tile_words
// words of threadgroup memory.
//
// The job (see the file comment) provides: op, its DecodeOperands;
// BLOCK_SCALED, BUDGET and TILE_BYTES (enum); x_row(r), the first
// activation of row r; live(q) and w_row(q), whether the simdgroup's
// output q exists and its weight row; with BLOCK_SCALED (DecodeScales),
// stage_scales(k0, elements, tid, threads), x_scale(r, block of the tile)
// and w_scale(q, block of the tile) for a tile's block scales,
// tail_scale(r, q, block) for the elements past the tiles; and store(r,
// totals of the Q outputs, lane).
template <typename Job, int R, int Q, bool VEC>
MPS_EXT_INLINE void decode_rows(thread const Job& job, threadgroup uint* tile, uint tid, uint threads, uint lane) {
  typedef typename DecodeOperandsOf<Job>::X XF;
  typedef typename DecodeOperandsOf<Job>::W WF;
  typedef DecodeShape<typename XF::T, typename WF::T, VEC> Shape;
  typedef DecodePiece<VEC ? 16 : 0> P;
  typedef typename P::type Piece;
  constexpr int E = Shape::E, NW = Shape::NW, AW = Shape::AW, WA = Shape::WA;
  constexpr bool SCALED = Job::BLOCK_SCALED != 0;
  constexpr int TP = decode_tile_pieces(R, WA, E, SCALED, int(Job::TILE_BYTES)), TS = decode_tile_stride(TP, AW, VEC);
  constexpr int U = rows_pieces_per_output(R, Q, TP, int(Job::BUDGET));
  static_assert(AW >= 1, "activations at least as wide as the weights");
  // Every full tile takes each lane the same number of steps of 32 * U
  // pieces: a lane's pieces are consecutive across tiles, and its weight
  // pointers just advance.
  static_assert(TP % (32 * U) == 0, "a tile is whole steps");
  static_assert(!SCALED || (TP * E) % 128 == 0, "a tile is whole scale blocks");

  const int rows = job.op.rows, K = job.op.k;
  const long w_k = VEC ? 1 : job.op.w_k;
  const long u_step = 32 * E * w_k;  // from a lane's piece to its next one
  bool live[Q];
  const device typename WF::T* wp[Q];  // the lane's next piece of each weight row
  float acc[R][Q];
  MPS_EXT_UNROLL
  for (int q = 0; q < Q; ++q) {
    live[q] = job.live(q);
    wp[q] = job.w_row(q) + long(lane) * E * w_k;
    MPS_EXT_UNROLL
    for (int r = 0; r < R; ++r) acc[r][q] = 0.0f;
  }

  // Elements whole pieces cover (all of them without VEC); the rest first.
  const int k_pieces = VEC ? K / E * E : K;
  // The last K % E elements (VEC only: fewer than a piece, so one a lane),
  // first: what they need is not kept through the loop.
  const int k = k_pieces + int(lane);
  if (k < K) {
    MPS_EXT_UNROLL
    for (int q = 0; q < Q; ++q) {
      if (!live[q]) continue;
      const float wk = job.op.wf.one(job.w_row(q)[k]);
      MPS_EXT_UNROLL
      for (int r = 0; r < R; ++r) {
        if (r >= rows) continue;
        const float v = DecodeRowLoads<Job>::one(job, r, k) * wk;
        acc[r][q] += SCALED ? v * DecodeScales<Job>::tail(job, r, q, k / 128) : v;
      }
    }
  }

  // What derives from k0 and c below is unsigned arithmetic, selects and
  // shifts, not min() or signed division, and the counters k0 and c are
  // unsigned: index arithmetic, which a GPU keeps in 32 bits (the CPU's IR,
  // which cpu_metal's register estimate reads, would otherwise widen a
  // signed counter to 64 bits and keep a 32-bit copy too). The tiles run
  // while a whole piece is left before K, not up to k_pieces: K is the
  // job's, the same for every thread, where k_pieces, after the tail's
  // lane-dependent branch, is one more value a thread keeps (fp8_gemv at 4
  // rows: 36 -> 32 registers with fp8 activations, 35 -> 31 with bfloat).
  for (uint k0u = 0; k0u + uint(VEC ? E : 1) <= uint(K); k0u += uint(TP * E)) {
    const int k0 = int(k0u);
    const int left = K - k0;
    const int pieces = left >= TP * E ? TP : int(uint(left) / uint(E));  // of each row in this tile
    // Consecutive threads stage consecutive 16-byte quarters of a row's
    // pieces (VEC), or elements as floats; rows past `rows` stage as zeros,
    // so that the products need no check.
    for (int i = int(tid); i < R * TP * AW; i += int(threads)) {
      const int r = i / (TP * AW), c = i / AW % TP, h = i % AW;
      if (c >= pieces) continue;
      if (VEC) {
        const uint4 v = r < rows
                            ? DecodeRowLoads<Job>::piece(job, r, k0 + c * E + h * (16 / int(sizeof(typename XF::T))))
                            : uint4(0u);
        MPS_EXT_UNROLL
        for (int j = 0; j < 4; ++j) tile[(r * WA + h * 4 + j) * TS + c] = v[j];
      } else {
        tile[r * TS + c] = as_type<uint>(r < rows ? DecodeRowLoads<Job>::one(job, r, long(k0 + c) * job.op.x_k) : 0.0f);
      }
    }
    if (SCALED) DecodeScales<Job>::stage(job, k0, pieces * E, tid, threads);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Whole steps of U pieces of each output first: no bounds to check, so
    // that no index per piece stays live from the loads to the products
    // (registers); the lane's tile words are at constant offsets from tc.
    // Not unrolled: its trip count has a bound (a tile's steps), and a
    // compiler that unrolls up to it keeps every step's tile addresses live
    // (fp8_gemv_f32_r8_scalar: 182 registers in the estimate).
    const uint full = pieces > 32 * (U - 1) ? uint(pieces - 32 * (U - 1)) : 0u;  // where whole steps end
    uint c = lane;
    _Pragma("clang loop unroll(disable)") for (; c < full; c += uint(32 * U)) {
      const threadgroup uint* tc = tile + c;
      Piece wv[U][Q];
      MPS_EXT_UNROLL
      for (int u = 0; u < U; ++u) MPS_EXT_UNROLL
      for (int q = 0; q < Q; ++q) wv[u][q] = live[q] ? P::load(job.op.wf, wp[q] + u * u_step) : Piece(0u);
      MPS_EXT_UNROLL
      for (int u = 0; u < U; ++u)
        decode_products<Job, R, Q, VEC, TS>(job, &acc[0][0], wv[u], tc + 32 * u,
                                            SCALED ? int((c + uint(32 * u)) * uint(E) / 128u) : 0);
      MPS_EXT_UNROLL
      for (int q = 0; q < Q; ++q) wp[q] += U * u_step;
    }
    // The last tile's last pieces, one at a time (U = 1: the steps took
    // them all). (Past the tile's pieces there is nothing to add, not even
    // 0 times a staged value: an inf activation would make it NaN.)
    for (; U > 1 && c < uint(pieces); c += 32u) {
      Piece wv[Q];
      MPS_EXT_UNROLL
      for (int q = 0; q < Q; ++q) wv[q] = live[q] ? P::load(job.op.wf, wp[q]) : Piece(0u);
      decode_products<Job, R, Q, VEC, TS>(job, &acc[0][0], wv, tile + c, SCALED ? int(c * uint(E) / 128u) : 0);
      MPS_EXT_UNROLL
      for (int q = 0; q < Q; ++q) wp[q] += u_step;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  MPS_EXT_UNROLL
  for (int r = 0; r < R; ++r) {
    if (r >= rows) continue;  // (not break: the loop must unroll, acc stay in registers)
    float total[Q];
    MPS_EXT_UNROLL
    for (int q = 0; q < Q; ++q) total[q] = simd_sum(acc[r][q]);
    job.store(r, total, lane);
  }
}

// ------------------------------------------------------ the cols kernel --
// The decode kernel of a weight whose N dimension is contiguous (x @ W with
// W [K, N]): gemv_cols (linear.metal) and gmm_decode_cols (grouped_mm.metal).
// A threadgroup owns 128 bytes of columns (one cache line of each weight
// row; 32 columns with element loads) and a range of K: the lanes of a
// row cover the columns with pieces of B bytes (16: 8 lanes, the other 4
// along K; 4: all 32 lanes, a word each), 8 simdgroups split the rows, and
// the partial sums add up through shuffles and threadgroup memory. When the
// columns alone give too few threadgroups, the host splits K over several
// (the job stores partial sums; gemv_cols_finish adds them).
// Registers: at most 16 accumulators (with 16-byte pieces, lanes along K in
// groups of 2 or 4 swap parts of their pieces) + U pieces in flight (at
// most 20 words together) + one activation and a piece's floats. 4-byte
// pieces (gmm_decode_cols) keep a lane's accumulators at one word's columns
// (2 at most) a row and 4 words in flight at every row count; 16-byte ones
// (gemv_cols) take a quarter of the load instructions.
//
// A lane's 16-byte piece holds E columns of one row of K. Lanes along K
// in groups of G (rows k, k + 1, ... of one step, the same columns) swap
// parts of their pieces so that each accumulates OWN = E / G columns of all
// G rows: G = 1, 2 or 4, so that no lane holds more than 16 accumulators.
template <int B, int TB, int R>  // B: bytes of a piece (0: an element), TB: of an element
struct ColsShape {
  enum {
    E = B ? B / TB : 1,     // columns of a lane's piece
    LN = B ? 128 / B : 32,  // lanes along N
    LK = 32 / LN,           // lanes along K
    PW = B ? B / 4 : 1,     // words of a piece
    G = B == 16 && E * R > 32  ? 4
        : B == 16 && E* R > 16 ? 2
                               : 1,
    OWN = E / G,  // columns a lane accumulates
    WO = PW / G,  // words of each row's piece it keeps
    // Pieces a lane loads before it uses the first: 4 while the
    // accumulators leave room, fewer as they grow (a power of two, for the
    // activation ring of decode_cols).
    U = floor_pow2(clamp_constexpr((20 - R * OWN) / PW, 1, 4)),
    RS = (DECODE_COLS_THREADS / 32) * LK,  // rows of K a threadgroup step covers
    TK = U * RS,                           // ... and U steps
  };
};

// V floats to threadgroup memory, one store (V = 1, 2 or 4).
template <int V>
MPS_EXT_INLINE void store_floats(threadgroup float* p, thread const float* v);
template <>
MPS_EXT_INLINE void store_floats<1>(threadgroup float* p, thread const float* v) {
  *p = v[0];
}
template <>
MPS_EXT_INLINE void store_floats<2>(threadgroup float* p, thread const float* v) {
  *(threadgroup float2*)p = float2(v[0], v[1]);
}
template <>
MPS_EXT_INLINE void store_floats<4>(threadgroup float* p, thread const float* v) {
  *(threadgroup float4*)p = float4(v[0], v[1], v[2], v[3]);
}

// The threadgroup memory the kernel passes: the partial sums (a round of
// them: each simdgroup's, for DECODE_COLS_THREADS outputs), and the
// activation ring of R rows.
constexpr int decode_cols_partial_words() { return DECODE_COLS_THREADS / 32 * DECODE_COLS_THREADS; }
template <typename T, int B>
constexpr int decode_cols_ring_words(int R) {
  return R * 3 *
         (R == 1   ? ColsShape<B, int(sizeof(T)), 1>::TK
          : R == 2 ? ColsShape<B, int(sizeof(T)), 2>::TK
          : R == 4 ? ColsShape<B, int(sizeof(T)), 4>::TK
                   : ColsShape<B, int(sizeof(T)), 8>::TK);
}
template <typename T, int B>
constexpr int decode_cols_ring_words_any() {
  int most = 0;
  for (int R = 1; R <= 8; R *= 2)
    most = decode_cols_ring_words<T, B>(R) > most ? decode_cols_ring_words<T, B>(R) : most;
  return most;
}

// decode_cols' activations of rows [tile_k, tile_k + TK) of K into the
// ring (below): rows past K (and activation rows past `rows`) stage as 0,
// so that the products need no checks: their weights are 0 too.
template <int R, int TK, typename Job>
MPS_EXT_INLINE void decode_cols_stage(
    thread const Job& job, threadgroup float* x_tile, int tile_k, int k_end, uint tid) {
  constexpr int RING = 2 * TK, XS = RING + TK;
  for (int t = int(tid); t < R * TK; t += DECODE_COLS_THREADS) {
    const int r = t / TK, k = tile_k + t % TK;
    x_tile[r * XS + (k & (RING - 1))] =
        r < job.op.rows && k < k_end ? job.op.xf.one(job.x_row(r)[long(k) * job.op.x_k]) : 0.0f;
  }
}

// The job provides op, its DecodeOperands (formats DecodeFloat types,
// whose pieces DecodePiece rebuilds); n and w_n (the columns and their
// stride), splits (of K; the split this threadgroup takes is `split`),
// x_row(r), and store(r, n, total, split). `block`: the
// threadgroup's block of columns. B: the bytes of a piece (16 or 4, 0 for
// element loads).
template <typename Job, int R, int B>
MPS_EXT_INLINE void decode_cols(thread const Job& job,
                                threadgroup float* partial,
                                threadgroup float* x_tile,
                                uint block,
                                uint split,
                                uint tid,
                                uint sg,
                                uint lane) {
  typedef typename DecodeOperandsOf<Job>::W WF;
  typedef typename WF::T T;
  typedef ColsShape<B, int(sizeof(T)), R> Shape;
  typedef DecodePiece<B> P;
  constexpr bool VEC = B != 0;
  constexpr int E = Shape::E, LN = Shape::LN, LK = Shape::LK, G = Shape::G, OWN = Shape::OWN, WO = Shape::WO;
  constexpr int U = Shape::U, RS = Shape::RS, TK = Shape::TK;
  constexpr int CB = LN * E;  // columns of the threadgroup
  constexpr int S = DECODE_COLS_THREADS / 32;
  constexpr int RB = DECODE_COLS_THREADS / CB;  // rows of partial sums per round through threadgroup memory
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
  constexpr int RING = 2 * TK, XS = RING + TK;
  static_assert((RING & (RING - 1)) == 0, "the ring is a power of two");

  const int rows = job.op.rows;
  const int nq = int(lane) % LN, kq = int(lane) / LN;
  const long col0 = long(block) * CB + nq * E;
  const long left = job.n - col0;
  const int ncols = left <= 0 ? 0 : left >= E ? E : int(left);  // columns of the piece that exist
  // K fits in 31 bits (the host checks the activation's offsets).
  const int K = job.op.k, chunks = (K + DECODE_COLS_K_CHUNK - 1) / DECODE_COLS_K_CHUNK, splits = job.splits;
  const int k_begin = int(split) * chunks / splits * DECODE_COLS_K_CHUNK;
  const int k_end = min((int(split) + 1) * chunks / splits * DECODE_COLS_K_CHUNK, K);
  const int lane_row = int(sg) * LK + kq;  // this lane's row within a step

  float acc[R][OWN];
  MPS_EXT_UNROLL
  for (int r = 0; r < R; ++r) MPS_EXT_UNROLL
  for (int e = 0; e < OWN; ++e) acc[r][e] = 0.0f;

  // The weight pointer advances by a step's rows: no 64-bit multiply in the loop.
  const device T* wp = job.op.w + long(k_begin + lane_row) * job.op.w_k + col0 * job.w_n;
  const long w_step = RS * job.op.w_k;
  // With 4-byte pieces and element loads, the staging first, then the
  // weight pieces, still before the barrier (in flight while the
  // threadgroup waits there): loaded before the staging, they and what the
  // staging needs would be live together (gmm_decode_cols at 8 rows: 31
  // registers, not 24). 16-byte pieces (gemv_cols) load theirs first: in
  // flight during the staging too, within their figures.
  constexpr bool STAGE_FIRST = B != 16;
  for (int tile_k = k_begin; tile_k < k_end; tile_k += TK) {
    if (STAGE_FIRST) decode_cols_stage<R, TK>(job, x_tile, tile_k, k_end, tid);
    typename P::type wv[U];
    MPS_EXT_UNROLL
    for (int u = 0; u < U; ++u) {
      const bool ok = tile_k + u * RS + lane_row < k_end;
      const device T* wu = wp + u * w_step;
      if (ok && ncols == E) {
        wv[u] = P::load(job.op.wf, wu);
      } else {  // past K, or a piece past the last column: its elements one by one, zeros beyond
        float v[E];
        MPS_EXT_UNROLL
        for (int e = 0; e < E; ++e) v[e] = ok && e < ncols ? job.op.wf.one(wu[e * job.w_n]) : 0.0f;
        wv[u] = P::template of_floats<E>(v, T(0));
      }
    }
    if (!STAGE_FIRST) decode_cols_stage<R, TK>(job, x_tile, tile_k, k_end, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    // Row k = tile_k + u * RS + lane_row of the ring is at base + u * RS
    // (tile_k is a multiple of TK, the ring 2 TK): one value live, not a k
    // per u (the weight loads' checks computed those). (16-byte pieces: the
    // ring index of each k, within their figures.)
    const int base = (tile_k + lane_row) & (RING - 1);
    MPS_EXT_UNROLL
    for (int u = 0; u < U; ++u) {
      const int g = kq % G;
      // Lane g ^ m of the group holds row k - g + (g ^ m): it sends this
      // lane its part g of that row's piece, and takes part g ^ m of ours.
      MPS_EXT_UNROLL
      for (int m = 0; m < G; ++m) {
        float wf[OWN];
        if (VEC) {
          MPS_EXT_UNROLL
          for (int i = 0; i < WO; ++i) {
            uint word = P::word(wv[u], (g ^ m) * WO + i);
            if (m > 0) word = simd_shuffle_xor(word, ushort(m * LN));
            job.op.wf.word(word, wf + i * (OWN / WO));
          }
        } else {
          wf[0] = as_type<float>(P::word(wv[u], 0));
        }
        const int slot = STAGE_FIRST ? base - g + (g ^ m) + u * RS  // (rows of one step: no wrap)
                                     : (tile_k + u * RS + lane_row - g + (g ^ m)) & (RING - 1);
        MPS_EXT_UNROLL
        for (int r = 0; r < R; ++r) {
          const float xr = x_tile[r * XS + slot];
          MPS_EXT_UNROLL
          for (int e = 0; e < OWN; ++e) acc[r][e] += xr * wf[e];
        }
      }
    }
    wp += U * w_step;
  }

  // The simdgroup's sums: lanes that hold the same columns (one g in each
  // group along K) add up across their rows of K.
  MPS_EXT_UNROLL
  for (int r = 0; r < R; ++r) MPS_EXT_UNROLL
  for (int e = 0; e < OWN; ++e)
    for (ushort offset = ushort(G * LN); offset < 32; offset *= 2) acc[r][e] += simd_shuffle_xor(acc[r][e], offset);
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
  threadgroup float* slots = partial;
  MPS_EXT_UNROLL
  for (int r0 = 0; r0 < R; r0 += RB) {
    if (r0 >= rows) break;
    if (holder) {
      MPS_EXT_UNROLL
      for (int rr = 0; rr < RB; ++rr) {
        const int r = r0 + rr;
        if (r >= R) break;
        MPS_EXT_UNROLL
        for (int i = 0; i < CHUNKS; ++i) {
          const int j = (i + h / (32 / OWN)) % CHUNKS;
          float v[V];
          MPS_EXT_UNROLL
          for (int t = 0; t < V; ++t) v[t] = acc[r][t];
          MPS_EXT_UNROLL
          for (int jj = 1; jj < CHUNKS; ++jj)
            if (j == jj) MPS_EXT_UNROLL
          for (int t = 0; t < V; ++t) v[t] = acc[r][jj * V + t];
          store_floats<V>(slots + (int(sg) * RB + rr) * CB + h * OWN + j * V, v);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    {
      const int rr = int(tid) / CB, s = int(tid) % CB;
      const int r = r0 + rr;
      const long n = long(block) * CB + s;
      if (r < rows && n < job.n) {
        float total = 0.0f;
        MPS_EXT_UNROLL
        for (int g = 0; g < S; ++g) total += slots[(g * RB + rr) * CB + s];
        job.store(r, n, total, split);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
