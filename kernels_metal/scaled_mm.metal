// Scaled matrix products with float8 weights (torch._scaled_mm,
// torch._scaled_mm_v2 / F.scaled_mm, and the weight-only FP8 linear of
// mps_ext.quantize_fp8). fp8_params.h defines what is computed.
//
// fp8_gemv_<act>_r<R>_<vec|scalar>   decode, 1 to R (1, 2, 4, 8) activation
//     rows: the one decode template of decode.h (linear.metal's gemv_rows with
//     float8 weights, 16 a 16-byte load, and block scales).
// fp8_mm_tile_<act>_<vec|scalar>     prefill: a threadgroup computes a
//     64 x 64 tile of outputs with simdgroup_matrix 8x8 products, 2 x 2
//     simdgroups of 32 x 32; both operands are decoded and scaled once, 32
//     elements of K at a time, into float tiles that all four read. Every
//     weight byte is read once per 64 activation rows.
// <act> is the activation type: fp8 (e4m3fn or e5m2, p.a_format), f16,
// bf16 or f32. vec: the host found the weight rows and activation rows
// contiguous along K and 16-byte aligned; scalar: element loads, any strides
// (fp8_mm_tile: of the activations, and of weights unless p.w_vec).
// Accumulation is in float; the result goes through store_output.
#include <metal_stdlib>
#include <metal_simdgroup_matrix>
#include "decode.h"
#include "fp8_codec.h"
#include "fp8_params.h"
#include "linear_params.h"
using namespace metal;
#include "rms_norm.h"

// Decoding by the float8 format code of an operand (p.a_format, p.w_format).
// fp8x4_to_float gives e4m3 values divided by fp8_unit (256; see
// e4m3x4_to_float_div256), e5m2 values as they are.
inline float4 fp8x4_to_float(uint u, uint format) { return fp8x4_decode(u, format == FP8_TYPE_E5M2); }
inline float fp8_unit(uint format) { return fp8_unit_of(format == FP8_TYPE_E5M2); }

// Activation types: T, the decode.h format of fp8_gemv, and for
// fp8_mm_tile `Quad`, the bits of 4 consecutive elements, `quad`, their
// values as floats, `quad_at`, Quad q of 16 bytes (one load), `put` (by
// value: a reference keeps the executor's Quad in memory) and `put16`,
// element e of a Quad or of 16 bytes from a single load, and
// `unit`: values come divided by unit(format) (fp8x4_to_float's
// convention for e4m3; 1 for everything else).
struct ActFp8 {
  typedef uchar T;
  typedef DecodeFp8 Format;
  typedef uint Quad;
  static float4 quad(Quad q, uint format) { return fp8x4_to_float(q, format); }
  static Quad quad_at(uint4 u, int q) { return u[q]; }
  static Quad put(Quad q, int e, T v) { return q | uint(v) << (8 * e); }
  static void put16(thread uint4& u, int e, T v) { u[e / 4] |= uint(v) << (8 * (e % 4)); }
  static float unit(uint format) { return fp8_unit(format); }
};
struct ActF16 {
  typedef half T;
  typedef DecodeFloat<half> Format;
  typedef uint2 Quad;
  static float4 quad(Quad q, uint) { return float4(as_type<half4>(q)); }
  static Quad quad_at(uint4 u, int q) { return uint2(u[2 * q], u[2 * q + 1]); }
  static Quad put(Quad q, int e, T v) {
    q[e / 2] |= uint(as_type<ushort>(v)) << (16 * (e % 2));
    return q;
  }
  static void put16(thread uint4& u, int e, T v) { u[e / 2] |= uint(as_type<ushort>(v)) << (16 * (e % 2)); }
  static float unit(uint) { return 1.0f; }
};
struct ActBF16 {
  typedef bfloat T;
  typedef DecodeFloat<bfloat> Format;
  typedef uint2 Quad;
  static float4 quad(Quad q, uint) {
    return float4(as_type<float>(q.x << 16), as_type<float>(q.x & 0xFFFF0000u), as_type<float>(q.y << 16),
                  as_type<float>(q.y & 0xFFFF0000u));
  }
  static Quad quad_at(uint4 u, int q) { return uint2(u[2 * q], u[2 * q + 1]); }
  static Quad put(Quad q, int e, T v) {
    q[e / 2] |= uint(as_type<ushort>(v)) << (16 * (e % 2));
    return q;
  }
  static void put16(thread uint4& u, int e, T v) { u[e / 2] |= uint(as_type<ushort>(v)) << (16 * (e % 2)); }
  static float unit(uint) { return 1.0f; }
};
struct ActF32 {
  typedef float T;
  typedef DecodeFloat<float> Format;
  typedef uint4 Quad;
  static float4 quad(Quad q, uint) { return as_type<float4>(q); }
  static Quad quad_at(uint4 u, int) { return u; }
  static Quad put(Quad q, int e, T v) {
    q[e] = as_type<uint>(v);
    return q;
  }
  static void put16(thread uint4& u, int e, T v) { u = put(u, e, v); }
  static float unit(uint) { return 1.0f; }
};

inline float scale_a_at(constant Fp8MatmulParams& p, const device float* sa, long row, long kb) {
  return p.has_scale_a ? sa[row * p.sa_row_stride + kb * p.sa_k_stride] : 1.0f;
}
// Where the scales of weight row n start; n < 2^31 (the host checks): a
// 32-bit division.
inline long scale_b_row(constant Fp8MatmulParams& p, long n) { return long(uint(n) / p.sb_n_group) * p.sb_n_stride; }
inline float scale_b_at(constant Fp8MatmulParams& p, const device float* sb, long n, long kb) {
  return sb[scale_b_row(p, n) + kb * p.sb_k_stride];
}

// Bias, 1 / scale_result for fp8 outputs, rounding to the output type (in
// this order, as torch's CPU kernel does).
inline void store_output(device uchar* y,
                         long index,
                         float v,
                         long n,
                         constant Fp8MatmulParams& p,
                         const device uchar* bias,
                         const device float* scale_result) {
  if (p.bias_type == FP8_TYPE_F32) v += ((const device float*)bias)[n * p.bias_stride];
  else if (p.bias_type == FP8_TYPE_F16) v += float(((const device half*)bias)[n * p.bias_stride]);
  else if (p.bias_type == FP8_TYPE_BF16) v += float(((const device bfloat*)bias)[n * p.bias_stride]);
  if (p.has_scale_result) v *= precise::divide(1.0f, scale_result[0]);
  switch (p.out_type) {
    case FP8_TYPE_F32: ((device float*)y)[index] = v; break;
    case FP8_TYPE_F16: ((device half*)y)[index] = half(v); break;
    case FP8_TYPE_BF16: ((device bfloat*)y)[index] = bfloat(v); break;
    case FP8_TYPE_E4M3: y[index] = e4m3_from_bits(as_type<uint>(v)); break;
    default: y[index] = e5m2_from_bits(as_type<uint>(v)); break;
  }
}

// ------------------------------------------------------------- fp8_gemv --
// decode.h's template with float8 weights; this family's job: dense rows
// of x (activation format A::Format), the scales of a tile's 128-wide K
// blocks staged in threadgroup memory with it (the activation's per row,
// the weight's per output of the threadgroup: a block per thread, from the
// layouts of the row-wise and block-wise recipes), applied per 16-byte
// piece (a piece lies in one block; decode_rows), and store_output on the
// way out. A
// simdgroup owns up to Q = FP8_GEMV_OUTPUTS(R, activation bytes) weight rows,
// p.outputs_per_simdgroup of them.
// sb_tile's blocks are FP8_GEMV_SB_STRIDE words apart, one more than the
// most outputs of a threadgroup: a simdgroup reads 4 blocks' scales of one
// output at once, which then fall in 4 banks.
enum {
  FP8_GEMV_TILE_BLOCKS = DECODE_SCALED_TILE_ELEMENTS / FP8_SCALE_BLOCK,
  FP8_GEMV_TILE_OUTPUTS = 2 * DECODE_MAX_SIMDGROUPS,  // the most outputs of a threadgroup (Q <= 2)
  FP8_GEMV_SB_STRIDE = FP8_GEMV_TILE_OUTPUTS + 1,
};

// NORMED (rms_norm_fp8_gemv): the activation rows are `normed`, rows of K
// in threadgroup memory (DecodeRowLoads below), not x. TILE: the decode
// tile's bytes (fp8_gemv_tile_bytes).
template <typename A, int Q, bool NORMED = false, int TILE = DECODE_TILE_BYTES>
struct Fp8GemvJob {
  // (16: the block scales of a piece and their addresses stay live too)
  enum { BLOCK_SCALED = 1, BUDGET = 16, TILE_BYTES = TILE };
  DecodeOperands<typename A::Format, DecodeFp8> op;
  device uchar* y;
  const device typename A::T* x;
  const threadgroup typename A::T* normed;
  constant Fp8MatmulParams* p;
  const device float* scale_a;
  const device float* scale_b;
  const device uchar* bias;
  const device float* scale_result;
  threadgroup float* sa_tile;  // [row][block of the tile]
  // [block of the tile][output of the threadgroup], from this simdgroup's
  // first output (one address kept, not the simdgroup's offset as well)
  threadgroup float* sb_own;
  int outputs, first;
  uint lane;
  MPS_EXT_INLINE const device typename A::T* x_row(int r) const { return x + r * p->a_row_stride; }
  MPS_EXT_INLINE bool live(int q) const { return q < outputs && first + q < int(p->n); }
  MPS_EXT_INLINE const device uchar* w_row(int q) const {
    return op.w + (live(q) ? long(first + q) * p->w_n_stride : 0);
  }
  // (Run-time trip counts: a compiler keeps no address per row or block.)
  MPS_EXT_INLINE void stage_scales(int k0, int elements, uint tid, uint) const {
    // (Unsigned: index arithmetic; decode_rows' loop counters stay 32-bit.)
    const int kb0 = int(uint(k0) / FP8_SCALE_BLOCK),
              blocks = int((uint(elements) + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK);
    if (int(tid) < blocks)
      for (int r = 0; r < op.rows; ++r)
        sa_tile[r * FP8_GEMV_TILE_BLOCKS + int(tid)] = scale_a_at(*p, scale_a, r, kb0 + int(tid));
    // Each simdgroup its own outputs' (at most 8 bytes an instruction: no
    // load straddles a line, whatever the threadgroup's output count).
    if (int(lane) < outputs) {
      const int n = first + int(lane);
      for (int b = 0; b < blocks; ++b)
        sb_own[b * FP8_GEMV_SB_STRIDE + int(lane)] = n < int(p->n) ? scale_b_at(*p, scale_b, n, kb0 + b) : 0.0f;
    }
  }
  MPS_EXT_INLINE float x_scale(int r, int block) const { return sa_tile[r * FP8_GEMV_TILE_BLOCKS + block]; }
  MPS_EXT_INLINE float w_scale(int q, int block) const { return sb_own[block * FP8_GEMV_SB_STRIDE + q]; }
  MPS_EXT_INLINE float tail_scale(int r, int q, int kb) const {
    return scale_a_at(*p, scale_a, r, kb) * scale_b_at(*p, scale_b, first + q, kb);
  }
  // Lane i writes output i: stores spread over the simdgroup.
  MPS_EXT_INLINE void store(int r, thread const float* total, uint lane) const {
    const float unit = op.xf.unit() * op.wf.unit();
    MPS_EXT_UNROLL
    for (int q = 0; q < Q; ++q) {
      if (lane == uint(r * Q + q) % 32 && live(q)) {
        const long n = first + q;
        store_output(y, r * p->y_row_stride + n * p->y_n_stride, total[q] * unit, n, *p, bias, scale_result);
      }
    }
  }
};

template <typename A, int Q, int TILE>
struct DecodeRowLoads<Fp8GemvJob<A, Q, true, TILE>> {
  typedef Fp8GemvJob<A, Q, true, TILE> Job;
  static MPS_EXT_INLINE uint4 piece(thread const Job& job, int r, int k) {
    return rms_normed_piece(job.normed, job.op.k, r, k);
  }
  template <typename I>
  static MPS_EXT_INLINE float one(thread const Job& job, int r, I k) {
    return rms_normed_one(job.normed, job.op.k, r, int(k));
  }
};

// The decode tile's bytes: after the norm, RMS_FP8_GEMV_TILE_BYTES for the
// 16-byte variants (with the scales' tiles within the threadgroup memory
// linear_params.h allows), RMS_GEMV_TILE_BYTES for element loads (their
// tile of 1-element pieces must still hold a whole 128-element scale block
// at 8 rows: decode_rows' static_assert).
constexpr int fp8_gemv_tile_bytes(bool vec, bool normed) {
  return !normed ? DECODE_TILE_BYTES : vec ? RMS_FP8_GEMV_TILE_BYTES : RMS_GEMV_TILE_BYTES;
}
// The threadgroup memory of fp8_gemv_rows, which its kernels declare: the
// tile's words, and the scales' (sa_tile, sb_tile) floats.
template <typename A, int R, bool VEC, bool NORMED>
constexpr int fp8_gemv_tile_words() {
  return decode_tile_words<typename A::T, uchar, VEC, true>(R, fp8_gemv_tile_bytes(VEC, NORMED));
}
#define FP8_GEMV_SA_FLOATS(R) ((R) * FP8_GEMV_TILE_BLOCKS)
#define FP8_GEMV_SB_FLOATS (FP8_GEMV_TILE_BLOCKS * FP8_GEMV_SB_STRIDE)

// fp8_gemv's and rms_norm_fp8_gemv's decode: the job set up from the
// kernel's arguments, then decode_rows. `normed`: NORMED's rows, else null.
template <typename A, int R, bool VEC, bool NORMED>
MPS_EXT_INLINE void fp8_gemv_rows(threadgroup uint* tile,
                                  threadgroup float* sa_tile,
                                  threadgroup float* sb_tile,
                                  device uchar* y,
                                  const device typename A::T* x,
                                  const threadgroup typename A::T* normed,
                                  const device uchar* w,
                                  constant Fp8MatmulParams& p,
                                  const device float* scale_a,
                                  const device float* scale_b,
                                  const device uchar* bias,
                                  const device float* scale_result,
                                  uint group,
                                  uint tid,
                                  uint threads,
                                  uint sg,
                                  uint simdgroups,
                                  uint lane) {
  typedef typename A::T TX;
  constexpr int Q = FP8_GEMV_OUTPUTS(R, int(sizeof(TX)));
  typedef Fp8GemvJob<A, Q, NORMED, fp8_gemv_tile_bytes(VEC, NORMED)> Job;
  Job job;
  decode_format_e5m2(job.op.xf, p.a_format == FP8_TYPE_E5M2);
  decode_format_e5m2(job.op.wf, p.w_format == FP8_TYPE_E5M2);
  job.y = y;
  job.x = x;
  job.normed = normed;
  job.op.w = w;
  job.p = &p;
  job.scale_a = scale_a;
  job.scale_b = scale_b;
  job.bias = bias;
  job.scale_result = scale_result;
  job.sa_tile = sa_tile;

  // The host keeps N and K below 2^31.
  job.op.rows = int(p.m);
  job.op.k = int(p.k);
  job.outputs = int(p.outputs_per_simdgroup);
  job.first = int(group * simdgroups + sg) * job.outputs;
  job.sb_own = sb_tile + int(sg) * job.outputs;
  job.lane = lane;
  job.op.x_k = p.a_k_stride;
  job.op.w_k = p.w_k_stride;
  decode_rows<Job, R, Q, VEC>(job, tile, tid, threads, lane);
}

template <typename A, int R, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void fp8_gemv(device uchar* y [[buffer(0)]],
                     const device typename A::T* x [[buffer(1)]],
                     const device uchar* w [[buffer(2)]],
                     constant Fp8MatmulParams& p [[buffer(3)]],
                     const device float* scale_a [[buffer(4)]],
                     const device float* scale_b [[buffer(5)]],
                     const device uchar* bias [[buffer(6)]],
                     const device float* scale_result [[buffer(7)]],
                     uint group [[threadgroup_position_in_grid]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint threads [[threads_per_threadgroup]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint simdgroups [[simdgroups_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  constexpr int TILE_WORDS = fp8_gemv_tile_words<A, R, VEC, false>();
  threadgroup uint tile[TILE_WORDS];
  threadgroup float sa_tile[FP8_GEMV_SA_FLOATS(R)];
  threadgroup float sb_tile[FP8_GEMV_SB_FLOATS];
  fp8_gemv_rows<A, R, VEC, false>(tile, sa_tile, sb_tile, y, x, nullptr, w, p, scale_a, scale_b, bias, scale_result,
                                  group, tid, threads, sg, simdgroups, lane);
}

// ----------------------------------------------------- rms_norm_fp8_gemv --
// fp8_gemv of rms_norm(x) (mps_ext::rms_norm_fp8_linear): a decoder layer's
// input norm and its fused q/k/v or in_proj projection quantised by
// mps_ext.quantize_fp8, in one dispatch, as linear.metal's
// rms_norm_gemv_rows for floating weights: the rows normed into
// threadgroup memory as rms_norm would (rms_norm.h), threadgroup 0 writing
// them to normed_out, then fp8_gemv's decode of those rows. Activations
// f16, bf16 or f32 (x's and the norm's type); the host takes rows * K *
// sizeof(T) <= RMS_GEMV_NORMED_BYTES, x's rows contiguous along K, and p's
// activation strides the normed rows' (K, 1).
template <typename A, int R, bool VEC>
[[max_total_threads_per_threadgroup(DECODE_MAX_THREADS)]]
kernel void rms_norm_fp8_gemv(device uchar* y [[buffer(0)]],
                              const device typename A::T* x [[buffer(1)]],
                              const device uchar* w [[buffer(2)]],
                              constant Fp8MatmulParams& p [[buffer(3)]],
                              const device float* scale_a [[buffer(4)]],
                              const device float* scale_b [[buffer(5)]],
                              const device uchar* bias [[buffer(6)]],
                              const device float* scale_result [[buffer(7)]],
                              device typename A::T* normed_out [[buffer(8)]],
                              const device typename A::T* norm_w [[buffer(9)]],
                              constant RmsNormParams& np [[buffer(10)]],
                              uint group [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint threads [[threads_per_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint simdgroups [[simdgroups_per_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]]) {
  typedef typename A::T T;
  threadgroup uint4 normed_mem[RMS_GEMV_NORMED_BYTES / 16];  // uint4: 16-byte aligned for the VEC loads
  threadgroup float sums[RMS_NORM_MAX_THREADS / 32];
  threadgroup T* normed = (threadgroup T*)normed_mem;
  rms_norm_rows_into<T, false>(normed, x, x, norm_w, np, sums, tid, threads, sg, simdgroups, lane);  // (no residual)
  rms_norm_rows_out(normed_out, (const threadgroup T*)normed, np, group, tid, threads);
  constexpr int TILE_WORDS = fp8_gemv_tile_words<A, R, VEC, true>();
  threadgroup uint tile[TILE_WORDS];
  threadgroup float sa_tile[FP8_GEMV_SA_FLOATS(R)];
  threadgroup float sb_tile[FP8_GEMV_SB_FLOATS];
  fp8_gemv_rows<A, R, VEC, true>(tile, sa_tile, sb_tile, y, x, normed, w, p, scale_a, scale_b, bias, scale_result,
                                 group, tid, threads, sg, simdgroups, lane);
}

// ---------------------------------------------------------- fp8_mm_tile --
// A threadgroup of 4 simdgroups computes TM x TN = 64 x 64 outputs, 2 x 2
// simdgroups of 32 x 32 (4 x 4 float accumulators): a step of 8 along K
// loads 4 fragments of activations and 4 of weights for 16
// multiply-accumulates (MLX's steel GEMM's arrangement at its 64 x 64
// tiles). K runs in stages of TS = 32 elements, 4 to a scale block: each
// stage both operands' 64 rows x 32 are decoded and scaled once, into float
// tiles of threadgroup memory (As[m][k], Bs[n][k], rows S = 36 floats apart:
// S = 4 mod 32, so the fragment loads and the threads' float4 stores meet
// no bank conflicts), which the simdgroups read with simdgroup_load (Bs
// transposed). So every weight byte is decoded once per threadgroup and
// read once per 64 activation rows.
//
// Device loads: 16 bytes (VEC, and the weights when p.w_vec) take whole
// 128-byte lines: a simdgroup instruction covers 4 rows x 128 bytes of its
// 16 rows (16 sg + 4 i + lane / 8, i < 4), lane l on the line's 16-byte
// piece (l % 8 + 2 i) % 8. A line is 128 / E elements of K (E: an element's
// bytes; the weights' E = 1: a whole scale block), 4 / E stages. A thread
// loads its 4 pieces of the next line in the stage before they are needed
// (their values go only to the next stage: no load waits behind a barrier)
// and keeps them until the last stage that uses them. The rotation by 2 i
// gives each thread E of its 4 pieces in every stage (piece i's 16-byte
// slot of the line is 2 m + l % 2, m = (l % 8 / 2 + i) % 4, in stage m / E):
// every lane decodes the same amount. Element loads (the activations of the
// scalar variants, weights without p.w_vec): 32 lanes on 32 consecutive
// elements of K of a row, 16 rows a simdgroup, a stage at a time.
template <typename A, bool VEC>
struct Fp8TileJob {
  enum {
    TM = FP8_TILE_M,
    TN = FP8_TILE_N,
    TS = FP8_TILE_STAGE,
    S = 36,
    E = sizeof(typename A::T),
    A_STAGES = VEC ? 4 / E : 1,  // stages of one activation load
    XQ = VEC ? 4 : 16,           // the activation pieces (16 bytes) or elements a thread holds
  };
  typedef typename A::Quad Quad;
  const device typename A::T* x;
  const device uchar* w;
  constant Fp8MatmulParams* p;
  const device float* scale_a;
  const device float* scale_b;
  threadgroup float* As;  // [TM][S]
  threadgroup float* Bs;  // [TN][S]
  int M, N, K, m0, n0;
  uint a_format, w_format;
  uint sg, lane, b2, odd;  // b2: lane % 8 / 2, odd: lane % 2
  bool w_vec;
  // The weight pieces of this thread (rows n0 + w_row(i)), each row's scale
  // times the unit, and scale_b's offset of its row (its 32-bit division once).
  uint4 wq[4];
  float ws[4];
  long sb_row[4];
  // VEC: the activation pieces (rows m0 + piece_row(i)) and their row's
  // scale times the unit. Element loads: xs[j], row m0 + 16 sg + j at K
  // index 32 s + lane, decoded and scaled when loaded.
  uint4 xq[VEC ? 4 : 1];
  float xs[XQ];

  MPS_EXT_INLINE int piece_row(int i) const { return 16 * int(sg) + 4 * i + int(lane / 8); }
  // Piece i's first element of K in its line, of 16 / e-element pieces.
  MPS_EXT_INLINE int piece_k(int i, int e) const { return int(2 * ((b2 + uint(i)) % 4) + odd) * (16 / e); }

  // Line `line` of the weights (a scale block), once its last stage is staged.
  MPS_EXT_INLINE void load_w(int line) {
    MPS_EXT_UNROLL
    for (int i = 0; i < 4; ++i) {
      const int gn = n0 + piece_row(i), gk = line * FP8_SCALE_BLOCK + piece_k(i, 1);
      uint4 u = uint4(0u);
      if (gn < N && w_vec && gk + 16 <= K) {
        u = *(const device uint4*)(w + gn * p->w_n_stride + gk);
      } else if (gn < N) {
        for (int e = 0; e < 16; ++e)
          if (gk + e < K) u[e / 4] |= uint(w[gn * p->w_n_stride + long(gk + e) * p->w_k_stride]) << (8 * (e % 4));
      }
      wq[i] = u;
      ws[i] = gn < N && gk < K ? scale_b[sb_row[i] + long(line) * p->sb_k_stride] * fp8_unit(w_format) : 0.0f;
    }
  }

  // The activations of stages [A_STAGES line, A_STAGES (line + 1)), once
  // the previous line's last stage is staged.
  MPS_EXT_INLINE void load_x(int line) {
    const float unit = A::unit(a_format);
    if (VEC) {
      constexpr int LINE = 128 / E;  // elements of K
      MPS_EXT_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int gm = m0 + piece_row(i), gk = line * LINE + piece_k(i, E);
        uint4 u = uint4(0u);
        if (gm < M && gk + 16 / E <= K) {
          u = *(const device uint4*)(x + gm * p->a_row_stride + gk);
        } else if (gm < M) {
          for (int e = 0; e < 16 / E; ++e)
            if (gk + e < K) A::put16(u, e, x[gm * p->a_row_stride + gk + e]);
        }
        xq[i] = u;
        // The scales of the instruction's 4 rows, each with one address for
        // all lanes: 4 rows' block scales in one load would span several
        // lines of a row-major scale_a.
        float scale = 0.0f;
        MPS_EXT_UNROLL
        for (int r = 0; r < 4; ++r) {
          const int gr = m0 + 16 * int(sg) + 4 * i + r;
          const float v = gr < M && line * LINE < K ? scale_a_at(*p, scale_a, gr, line * LINE / FP8_SCALE_BLOCK) : 0.0f;
          scale = uint(r) == lane / 8 ? v : scale;
        }
        xs[i] = scale * unit;
      }
    } else {  // 4 rows' elements decoded at once, each row scaled by its own
      // Members and parameters read once a stage into locals, not again for
      // each of the 16 elements and scales (a member is memory to the
      // executor, read again after every access of the loop).
      const int r0 = m0 + 16 * int(sg), gk = line * TS + int(lane);
      const int rows = M - r0;  // the simdgroup's rows j < rows exist
      const bool k_in = gk < K, block_in = line * TS < K;
      const long row_stride = p->a_row_stride, sa_stride = p->sa_row_stride;
      const device typename A::T* at = x + r0 * row_stride + long(gk) * p->a_k_stride;
      // The rows' scales of the stage's block (scale_a_at's), one address for all lanes.
      const bool has_scale = p->has_scale_a;
      const device float* sa = scale_a + r0 * sa_stride + long(line / 4) * p->sa_k_stride;
      const uint format = a_format;
      MPS_EXT_UNROLL
      for (int q = 0; q < 4; ++q) {
        Quad v = Quad(0);
        float4 scale;
        MPS_EXT_UNROLL
        for (int r = 0; r < 4; ++r) {
          const int j = 4 * q + r;
          if (j < rows && k_in) v = A::put(v, r, at[j * row_stride]);
          scale[r] = j < rows && block_in ? (has_scale ? sa[j * sa_stride] : 1.0f) * unit : 0.0f;
        }
        const float4 f = A::quad(v, format) * scale;
        MPS_EXT_UNROLL
        for (int r = 0; r < 4; ++r) xs[4 * q + r] = f[r];
      }
    }
  }

  // Piece i (a lane-dependent index) of four: selects, not an indexed
  // array, which would go to private memory. By value: selects between
  // loads of one array would fold into a load at a run-time index.
  template <typename V>
  MPS_EXT_INLINE static V pick(V v0, V v1, V v2, V v3, uint i) {
    return i == 0 ? v0 : i == 1 ? v1 : i == 2 ? v2 : v3;
  }

  // 16 bytes of E-byte elements, decoded, scaled, at `to` (4 / E float4s).
  template <typename D, int BYTES>
  MPS_EXT_INLINE static void put(threadgroup float* to, uint4 u, float scale, uint format) {
    MPS_EXT_UNROLL
    for (int q = 0; q < 4 / BYTES; ++q) *(threadgroup float4*)(to + 4 * q) = D::quad(D::quad_at(u, q), format) * scale;
  }

  // Stage s into the tiles: the weights' pieces of it (one of a thread's 4:
  // E = 1, m = s % 4) and the activations'.
  MPS_EXT_INLINE void stage(int s) const {  // s: the stage in its block
    {
      const uint i = (uint(s) - b2) % 4;
      put<ActFp8, 1>(Bs + piece_row(int(i)) * S + 16 * int(odd), pick(wq[0], wq[1], wq[2], wq[3], i),
                     pick(ws[0], ws[1], ws[2], ws[3], i), w_format);
    }
    if (VEC && E == 4) {  // all 4 pieces each stage, in any order: no picking
      MPS_EXT_UNROLL
      for (int i = 0; i < 4; ++i) put<A, E>(As + piece_row(i) * S + piece_k(i, E), xq[i], xs[i], a_format);
    } else if (VEC) {
      MPS_EXT_UNROLL
      for (int j = 0; j < E; ++j) {  // m = E (s % A_STAGES) + j
        const uint i = (uint(E * (s % A_STAGES) + j) - b2) % 4;
        put<A, E>(As + piece_row(int(i)) * S + int(2 * uint(j) + odd) * (16 / E), pick(xq[0], xq[1], xq[2], xq[3], i),
                  pick(xs[0], xs[1], xs[2], xs[3], i), a_format);
      }
    } else {
      MPS_EXT_UNROLL
      for (int j = 0; j < 16; ++j) As[(16 * int(sg) + j) * S + int(lane)] = xs[j];
    }
  }

  // One stage's products: 4 steps of 8 along K.
  MPS_EXT_INLINE void products(thread simdgroup_float8x8 (&acc)[4][4]) const {
    threadgroup const float* at = As + 32 * (sg / 2) * S;
    threadgroup const float* bt = Bs + 32 * (sg % 2) * S;
#pragma clang loop unroll(disable)
    for (int kk = 0; kk < TS; kk += 8) {
      simdgroup_float8x8 a[4];
      MPS_EXT_UNROLL
      for (int i = 0; i < 4; ++i) simdgroup_load(a[i], at + 8 * i * S + kk, S);
      MPS_EXT_UNROLL
      for (int j = 0; j < 4; ++j) {
        simdgroup_float8x8 b;
        simdgroup_load(b, bt + 8 * j * S + kk, S, ulong2(0), true);
        MPS_EXT_UNROLL
        for (int i = 0; i < 4; ++i) simdgroup_multiply_accumulate(acc[i][j], a[i], b, acc[i][j]);
      }
    }
  }
};

template <typename A, bool VEC>
[[max_total_threads_per_threadgroup(FP8_TILE_THREADS)]]
kernel void fp8_mm_tile(device uchar* y [[buffer(0)]],
                        const device typename A::T* x [[buffer(1)]],
                        const device uchar* w [[buffer(2)]],
                        constant Fp8MatmulParams& p [[buffer(3)]],
                        const device float* scale_a [[buffer(4)]],
                        const device float* scale_b [[buffer(5)]],
                        const device uchar* bias [[buffer(6)]],
                        const device float* scale_result [[buffer(7)]],
                        uint2 group [[threadgroup_position_in_grid]],
                        uint tid [[thread_index_in_threadgroup]],
                        uint sg [[simdgroup_index_in_threadgroup]],
                        uint lane [[thread_index_in_simdgroup]]) {
  typedef Fp8TileJob<A, VEC> Job;
  constexpr int TM = Job::TM, TN = Job::TN, TS = Job::TS, S = Job::S, THREADS = FP8_TILE_THREADS;
  constexpr int SC = TN + 4;  // the outputs' rows: 4 mod 32, as S
  static_assert(TM == 64 && TN == 64 && THREADS == 128 && TS == 32, "2 x 2 simdgroups of 32 x 32, 32-wide stages");
  static_assert(TM * SC <= (TM + TN) * S, "the outputs fit in the operands' memory");
  // As then Bs; at the end the outputs [row][column].
  threadgroup float tile[(TM + TN) * S];
  Job job;
  job.x = x;
  job.w = w;
  job.p = &p;
  job.scale_a = scale_a;
  job.scale_b = scale_b;
  job.As = tile;
  job.Bs = tile + TM * S;
  // The host keeps M, N and K below 2^31.
  job.M = int(p.m), job.N = int(p.n), job.K = int(p.k);
  job.m0 = int(group.y) * TM, job.n0 = int(group.x) * TN;
  job.sg = sg, job.lane = lane, job.b2 = (lane % 8) / 2, job.odd = lane % 2;
  job.w_vec = VEC || p.w_vec != 0;
  job.a_format = p.a_format, job.w_format = p.w_format;  // read once, not after each stage's barrier
  for (int i = 0; i < 4; ++i) job.sb_row[i] = scale_b_row(p, job.n0 + job.piece_row(i));
  simdgroup_float8x8 acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  // A stage stages the lines in registers, then loads the next lines where
  // it was the last stage of one (the weights' every 4 stages, the
  // activations' every A_STAGES), in flight during its products. One set of
  // registers (a second, as a prefetch that no barrier waits for, took
  // 129-159 registers): those loads follow the stage's first barrier.
  const int stages = (job.K + TS - 1) / TS;
  job.load_w(0);
  job.load_x(0);
  for (int s = 0; s < stages; ++s) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous stage's products are done with the tiles
    job.stage(s % 4);
    const int t = s + 1;  // (loads past K give zeros)
    if (t % 4 == 0) job.load_w(t / 4);
    if (t % Job::A_STAGES == 0) job.load_x(t / Job::A_STAGES);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    job.products(acc);
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // the outputs take the tiles
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j)
      simdgroup_store(acc[i][j], tile + (32 * int(sg / 2) + 8 * i) * SC + 32 * int(sg % 2) + 8 * j, SC);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(tid); e < TM * TN; e += THREADS) {
    const int gm = job.m0 + e / TN, gn = job.n0 + e % TN;
    if (gm < job.M && gn < job.N)
      store_output(y, gm * p.y_row_stride + long(gn) * p.y_n_stride, tile[(e / TN) * SC + e % TN], gn, p, bias,
                   scale_result);
  }
}

// clang-format off
#define INSTANTIATE_FP8_GEMV(aname, A, R)                                                          \
  template [[host_name("fp8_gemv_" #aname "_r" #R "_vec")]] kernel                                 \
      decltype(fp8_gemv<A, R, true>) fp8_gemv<A, R, true>;                                         \
  template [[host_name("fp8_gemv_" #aname "_r" #R "_scalar")]] kernel                              \
      decltype(fp8_gemv<A, R, false>) fp8_gemv<A, R, false>;
#define INSTANTIATE_FP8_MM(aname, A)                                                               \
  INSTANTIATE_FP8_GEMV(aname, A, 1) INSTANTIATE_FP8_GEMV(aname, A, 2)                              \
  INSTANTIATE_FP8_GEMV(aname, A, 4) INSTANTIATE_FP8_GEMV(aname, A, 8)                              \
  template [[host_name("fp8_mm_tile_" #aname "_vec")]] kernel                                      \
      decltype(fp8_mm_tile<A, true>) fp8_mm_tile<A, true>;                                         \
  template [[host_name("fp8_mm_tile_" #aname "_scalar")]] kernel                                   \
      decltype(fp8_mm_tile<A, false>) fp8_mm_tile<A, false>;
#define INSTANTIATE_RMS_FP8_GEMV_R(aname, A, R)                                                    \
  template [[host_name("rms_norm_fp8_gemv_" #aname "_r" #R "_vec")]] kernel                        \
      decltype(rms_norm_fp8_gemv<A, R, true>) rms_norm_fp8_gemv<A, R, true>;                       \
  template [[host_name("rms_norm_fp8_gemv_" #aname "_r" #R "_scalar")]] kernel                     \
      decltype(rms_norm_fp8_gemv<A, R, false>) rms_norm_fp8_gemv<A, R, false>;
// The norm's types: floating activations.
#define INSTANTIATE_RMS_FP8_GEMV(aname, A)                                                         \
  INSTANTIATE_RMS_FP8_GEMV_R(aname, A, 1) INSTANTIATE_RMS_FP8_GEMV_R(aname, A, 2)                  \
  INSTANTIATE_RMS_FP8_GEMV_R(aname, A, 4) INSTANTIATE_RMS_FP8_GEMV_R(aname, A, 8)
// clang-format on

INSTANTIATE_FP8_MM(fp8, ActFp8)
INSTANTIATE_FP8_MM(f16, ActF16)
INSTANTIATE_FP8_MM(bf16, ActBF16)
INSTANTIATE_FP8_MM(f32, ActF32)
INSTANTIATE_RMS_FP8_GEMV(f16, ActF16)
INSTANTIATE_RMS_FP8_GEMV(bf16, ActBF16)
INSTANTIATE_RMS_FP8_GEMV(f32, ActF32)
