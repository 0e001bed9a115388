// Scaled matrix products with float8 weights (torch._scaled_mm,
// torch._scaled_mm_v2 / F.scaled_mm, and the weight-only FP8 linear of
// mps_ext.quantize_fp8). fp8_params.h defines what is computed.
//
// fp8_gemv_<act>_r<R>_<vec|scalar>   decode, 1 to R (1, 2, 4, 8) activation
//     rows: the one decode template of decode.h (linear.metal's gemv_rows with
//     float8 weights, 16 a 16-byte load, and block scales).
// fp8_mm_tile_<act>_<vec|scalar>     prefill: a threadgroup computes a
//     32 x 64 tile of outputs with simdgroup_matrix 8x8 products, a 128-wide
//     scale block of K a step: each simdgroup owns 16 of the columns and
//     decodes their weights once, in registers, from its own 16-byte loads;
//     the activation rows are decoded and scaled once into a float tile that
//     all four read. Every weight byte is read once per 32 activation rows.
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
using namespace metal;

// Decoding by the float8 format code of an operand (p.a_format, p.w_format).
// fp8x4_to_float gives e4m3 values divided by fp8_unit (256; see
// e4m3x4_to_float_div256), e5m2 values as they are.
inline float4 fp8x4_to_float(uint u, uint format) { return fp8x4_decode(u, format == FP8_TYPE_E5M2); }
inline float fp8_unit(uint format) { return fp8_unit_of(format == FP8_TYPE_E5M2); }

// Activation types: T, the decode.h format of fp8_gemv, and for
// fp8_mm_tile `Quad`, the bits of 4 consecutive elements (one load), `quad`,
// their values as floats, `put`, element e of a Quad from a single load,
// and `unit`: values come divided by unit(format) (fp8x4_to_float's
// convention for e4m3; 1 for everything else).
struct ActFp8 {
  typedef uchar T;
  typedef DecodeFp8 Format;
  typedef uint Quad;
  static float4 quad(Quad q, uint format) { return fp8x4_to_float(q, format); }
  static void put(thread Quad& q, int e, T v) { q |= uint(v) << (8 * e); }
  static float unit(uint format) { return fp8_unit(format); }
};
struct ActF16 {
  typedef half T;
  typedef DecodeFloat<half> Format;
  typedef uint2 Quad;
  static float4 quad(Quad q, uint) { return float4(as_type<half4>(q)); }
  static void put(thread Quad& q, int e, T v) { q[e / 2] |= uint(as_type<ushort>(v)) << (16 * (e % 2)); }
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
  static void put(thread Quad& q, int e, T v) { q[e / 2] |= uint(as_type<ushort>(v)) << (16 * (e % 2)); }
  static float unit(uint) { return 1.0f; }
};
struct ActF32 {
  typedef float T;
  typedef DecodeFloat<float> Format;
  typedef uint4 Quad;
  static float4 quad(Quad q, uint) { return as_type<float4>(q); }
  static void put(thread Quad& q, int e, T v) { q[e] = as_type<uint>(v); }
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

template <typename A, int Q>
struct Fp8GemvJob {
  // (16: the block scales of a piece and their addresses stay live too)
  enum { BLOCK_SCALED = 1, BUDGET = 16, TILE_BYTES = DECODE_TILE_BYTES };
  DecodeOperands<typename A::Format, DecodeFp8> op;
  device uchar* y;
  const device typename A::T* x;
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
  typedef typename A::T TX;
  constexpr int Q = FP8_GEMV_OUTPUTS(R, int(sizeof(TX)));
  constexpr int TILE_WORDS = decode_tile_words<TX, uchar, VEC, true>(R);
  threadgroup uint tile[TILE_WORDS];
  threadgroup float sa_tile[R * FP8_GEMV_TILE_BLOCKS];
  threadgroup float sb_tile[FP8_GEMV_TILE_BLOCKS * FP8_GEMV_SB_STRIDE];
  Fp8GemvJob<A, Q> job;
  decode_format_e5m2(job.op.xf, p.a_format == FP8_TYPE_E5M2);
  decode_format_e5m2(job.op.wf, p.w_format == FP8_TYPE_E5M2);
  job.y = y;
  job.x = x;
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
  decode_rows<Fp8GemvJob<A, Q>, R, Q, VEC>(job, tile, tid, threads, lane);
}

// ---------------------------------------------------------- fp8_mm_tile --
// The elements of an 8 x 8 simdgroup matrix that a lane holds
// (thread_elements()): (row, col) and (row, col + 1), as Apple's GPUs lay
// them out (the layout MLX's steel GEMM relies on, and the executor's).
inline void fragment_coord(uint lane, thread uint& row, thread uint& col) {
  const uint q = lane / 4;
  row = (q & 4) + (lane / 2) % 4;
  col = (q & 2) * 2 + (lane % 2) * 2;
}

// Bytes 0 and 2 of u, two float8 values, as floats in fp8x4_to_float's
// convention (its even bytes: the same bits, the same values).
inline float2 fp8_pair_to_float(uint u, uint format) {
  const uint b = u & 0x00FF00FFu;
  return float2(
      as_type<half2>(format == FP8_TYPE_E5M2 ? b << 8 : e4m3x2_to_half_bits(b & 0x007F007Fu, b & 0x00800080u)));
}

// v[(e + r) % 4] at e: a lane's four values in the order it stores them.
inline float4 rotate4(float4 v, uint r) {
  v = (r & 1) ? v.yzwx : v;
  return (r & 2) ? v.zwxy : v;
}

// The outputs of a simdgroup: rows 8 i, columns 16 sg + 8 jb. Apart from
// the job, whose fields then stay registers (the matrices' addresses go to
// the executor's simd calls).
struct Fp8TileAcc {
  simdgroup_float8x8 m[4][2];
};

// A threadgroup of 4 simdgroups computes 32 x 64 outputs (TM x TN); a
// simdgroup owns 16 columns over all 32 rows, so that each weight is decoded
// once in its threadgroup, by the lane that loaded it. A step of K is one
// scale block (TK = 128), taken as 16 products of 8: product t pairs
// fragment index j (0..7) with k = 16 j + t (the sum runs in that order),
// which puts the weights a B-fragment lane needs for all 16 products in 16
// consecutive bytes of each of its rows (fr: its k index, fc and fc + 1: its
// columns): four 16-byte loads a lane, each simdgroup instruction 4 whole
// rows of the block. The lane decodes and scales them in registers.
// The activation rows are shared by the 4 simdgroups: each thread loads
// 4 elements of each of 8 rows (a whole row an instruction) and decodes
// them, scaled by their row's scale, into a tile of floats the simdgroups
// read with simdgroup_load; the tile holds half of a block (products t = 8h..8h+7)
// at a time, column 8 (t - 8h) + j of a row, rows S = 72 floats apart
// (S = 8 mod 32: the 8 x 8 loads and stores meet no bank conflicts).
// A block's device loads go into registers before the barrier that opens
// the block (as llama.cpp's mul_mm does), so none waits behind a barrier.
template <typename A, bool VEC>
struct Fp8TileJob {
  enum { TM = FP8_TILE_M, TN = FP8_TILE_N, TK = FP8_TILE_K, S = 72 };
  typedef typename A::Quad Quad;
  const device typename A::T* x;
  const device uchar* w;
  constant Fp8MatmulParams* p;
  const device float* scale_a;
  const device float* scale_b;
  threadgroup float* tile;  // [TM][S]
  int M, N, K, blocks, m0, n0;
  uint sg, lane, fr, fc;
  bool w_vec;
  // The activation chunks of this thread: 4 elements of row 8 sg + i (i <
  // 8) each. VEC: elements [4 c, 4 c + 4) of the block, c = (lane + 2 i) %
  // 32; element loads: k + 32 e (e < 4), k = (lane + 8 i) % 32, consecutive
  // lanes on consecutive elements. Either way a chunk lies in the half of
  // the block given by bit 1 of c (bit 3 of k), which flips with i: every
  // thread stores 4 chunks of each half.
  Quad xq[8];
  float xs[8];  // their rows' scale_a times the unit
  // The weights of this lane: rows n0 + 16 sg + 8 jb + fc + r (jb, r < 2),
  // bytes [16 fr, 16 fr + 16) of the block, and their scales times the unit.
  uint4 wq[2][2];
  float2 ws[2];
  long sb_row[2][2];  // scale_b's offset of each row's scales (its 32-bit division once)

  MPS_EXT_INLINE int w_row(int jb, int r) const { return n0 + 16 * int(sg) + 8 * jb + int(fc) + r; }

  // Block kb's device loads; zeros past K, M and N.
  MPS_EXT_INLINE void load(int kb) {
    const int k0 = kb * TK;
    MPS_EXT_UNROLL
    for (int i = 0; i < 8; ++i) {
      const int gm = m0 + 8 * int(sg) + i;
      Quad q = Quad(0);
      if (VEC) {
        const int gk = k0 + 4 * int((lane + 2 * uint(i)) % 32);
        if (gm < M && gk + 4 <= K) {
          q = *(const device Quad*)(x + gm * p->a_row_stride + gk);
        } else if (gm < M) {
          for (int e = 0; e < 4; ++e)
            if (gk + e < K) A::put(q, e, x[gm * p->a_row_stride + gk + e]);
        }
      } else if (gm < M) {
        const int gk = k0 + int((lane + 8 * uint(i)) % 32);
        for (int e = 0; e < 4; ++e)
          if (gk + 32 * e < K) A::put(q, e, x[gm * p->a_row_stride + long(gk + 32 * e) * p->a_k_stride]);
      }
      xq[i] = q;
      xs[i] = gm < M ? scale_a_at(*p, scale_a, gm, kb) * A::unit(p->a_format) : 0.0f;
    }
    MPS_EXT_UNROLL
    for (int jb = 0; jb < 2; ++jb) {
      MPS_EXT_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int gn = w_row(jb, r), gk = k0 + 16 * int(fr);
        uint4 u = uint4(0u);
        if (gn < N && w_vec && gk + 16 <= K) {
          u = *(const device uint4*)(w + gn * p->w_n_stride + gk);
        } else if (gn < N) {
          for (int e = 0; e < 16; ++e)
            if (gk + e < K) u[e / 4] |= uint(w[gn * p->w_n_stride + long(gk + e) * p->w_k_stride]) << (8 * (e % 4));
        }
        wq[jb][r] = u;
        ws[jb][r] = gn < N ? scale_b[sb_row[jb][r] + long(kb) * p->sb_k_stride] * fp8_unit(p->w_format) : 0.0f;
      }
    }
  }

  // Half h of the block into the tile: this thread's 4 chunks in it,
  // decoded and scaled once. A lane stores its 4 values rotated
  // (rotate4) so that the 32 lanes of each store meet 32 banks.
  MPS_EXT_INLINE void stage(uint h) const {
    const uint g = h ^ (VEC ? (lane >> 1) & 1 : (lane >> 3) & 1);
    MPS_EXT_UNROLL
    for (int q = 0; q < 4; ++q) {
      const uint i = 2 * uint(q) + g;
      float4 v = A::quad(g ? xq[2 * q + 1] : xq[2 * q], p->a_format) * (g ? xs[2 * q + 1] : xs[2 * q]);
      uint base, step, rot;
      if (VEC) {
        const uint c = (lane + 2 * i) % 32;
        base = 32 * (c & 1) + c / 4, step = 8, rot = 2 * (c & 1);
      } else {
        const uint k = (lane + 8 * i) % 32;
        base = 8 * (lane % 8) + k / 16, step = 2, rot = ((lane >> 2) & 1) + 2 * g;
      }
      v = rotate4(v, rot);
      threadgroup float* row = tile + (8 * sg + i) * S + base;
      MPS_EXT_UNROLL
      for (uint e = 0; e < 4; ++e) row[step * ((e + rot) % 4)] = v[e];
    }
  }

  // Products t = 8 h + u (u < 8) from the tile and words 2 h and 2 h + 1
  // of the weights: a B fragment is byte t of two weight rows.
  MPS_EXT_INLINE void products(uint h, thread Fp8TileAcc& acc) const {
    MPS_EXT_UNROLL
    for (int u = 0; u < 8; ++u) {
      const uint word = 2 * h + uint(u) / 4, shift = 8 * (uint(u) % 4);
      simdgroup_float8x8 b[2];
      MPS_EXT_UNROLL
      for (int jb = 0; jb < 2; ++jb) {
        const uint two = ((wq[jb][0][word] >> shift) & 0xFFu) | ((wq[jb][1][word] >> shift) << 16);
        reinterpret_cast<thread float2&>(b[jb].thread_elements()) = fp8_pair_to_float(two, p->w_format) * ws[jb];
      }
      MPS_EXT_UNROLL
      for (int i = 0; i < 4; ++i) {
        simdgroup_float8x8 a;
        simdgroup_load(a, tile + 8 * i * S + 8 * u, S);
        MPS_EXT_UNROLL
        for (int jb = 0; jb < 2; ++jb) simdgroup_multiply_accumulate(acc.m[i][jb], a, b[jb], acc.m[i][jb]);
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
  constexpr int TM = Job::TM, TN = Job::TN, TK = Job::TK, S = Job::S, THREADS = FP8_TILE_THREADS;
  // Half a block of activations [row][8 t + j], then the outputs [row][column].
  threadgroup float tile[TM * S];
  Job job;
  job.x = x;
  job.w = w;
  job.p = &p;
  job.scale_a = scale_a;
  job.scale_b = scale_b;
  job.tile = tile;
  // The host keeps M, N and K below 2^31.
  job.M = int(p.m), job.N = int(p.n), job.K = int(p.k), job.blocks = (job.K + TK - 1) / TK;
  job.m0 = int(group.y) * TM, job.n0 = int(group.x) * TN;
  job.sg = sg, job.lane = lane;
  fragment_coord(lane, job.fr, job.fc);
  job.w_vec = VEC || p.w_vec != 0;
  for (int jb = 0; jb < 2; ++jb)
    for (int r = 0; r < 2; ++r) job.sb_row[jb][r] = scale_b_row(p, job.w_row(jb, r));
  Fp8TileAcc acc;
  for (int i = 0; i < 4; ++i)
    for (int jb = 0; jb < 2; ++jb) acc.m[i][jb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int kb = 0; kb < job.blocks; ++kb) {
    job.load(kb);  // in flight while the other simdgroups finish the previous block
                   // A loop, not two copies: the tile addresses of a half are computed in
                   // it, not all held across the block.
#pragma clang loop unroll(disable)
    for (uint h = 0; h < 2; ++h) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous half's products are done with the tile
      job.stage(h);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      job.products(h, acc);
    }
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // the outputs take the tile
  for (int i = 0; i < 4; ++i)
    for (int jb = 0; jb < 2; ++jb) simdgroup_store(acc.m[i][jb], tile + 8 * i * S + 16 * int(sg) + 8 * jb, S);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(tid); e < TM * TN; e += THREADS) {
    const int gm = job.m0 + e / TN, gn = job.n0 + e % TN;
    if (gm < job.M && gn < job.N)
      store_output(y, gm * p.y_row_stride + long(gn) * p.y_n_stride, tile[(e / TN) * S + e % TN], gn, p, bias,
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
// clang-format on

INSTANTIATE_FP8_MM(fp8, ActFp8)
INSTANTIATE_FP8_MM(f16, ActF16)
INSTANTIATE_FP8_MM(bf16, ActBF16)
INSTANTIATE_FP8_MM(f32, ActF32)
