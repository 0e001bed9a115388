// Scaled matrix products with float8 weights (torch._scaled_mm,
// torch._scaled_mm_v2 / F.scaled_mm, and the weight-only FP8 linear of
// mps_ext.quantize_fp8). fp8_params.h defines what is computed.
//
// fp8_gemv_<act>_r<R>_<vec|scalar>   decode, 1 to R (1, 2, 4, 8) activation
//     rows: the one decode template of decode.h (gemv.metal's gemv_rows with
//     float8 weights, 16 a 16-byte load, and block scales).
// fp8_mm_tile_<act>_<vec|scalar>     prefill: a threadgroup computes a
//     32 x 64 tile of outputs with simdgroup_matrix 8x8 products; each step
//     of K (one 128-wide scale block) stages the bits of a 32 x 128
//     activation tile and a 64 x 128 weight tile in threadgroup memory, which
//     the lanes decode and scale into their fragments, so every weight byte
//     is read once per 32 activation rows.
// <act> is the activation type: fp8 (e4m3fn or e5m2, p.a_format), f16,
// bf16 or f32. vec: the host found the weight rows and activation rows
// contiguous along K and 16-byte aligned; scalar: element loads, any strides.
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
// fp8_mm_tile `pair`, elements k and k + 1 (k even) of a row staged as bits,
// and `unit`: values come divided by unit(format) (fp8x4_to_float's
// convention for e4m3; 1 for everything else).
struct ActFp8 {
  typedef uchar T;
  typedef DecodeFp8 Format;
  static float2 pair(threadgroup const uint* row, int k, uint format) {
    return fp8x4_to_float(row[k / 4] >> (8 * (k % 4)), format).xy;
  }
  static float unit(uint format) { return fp8_unit(format); }
};
struct ActF16 {
  typedef half T;
  typedef DecodeFloat<half> Format;
  static float2 pair(threadgroup const uint* row, int k, uint) { return float2(as_type<half2>(row[k / 2])); }
  static float unit(uint) { return 1.0f; }
};
struct ActBF16 {
  typedef bfloat T;
  typedef DecodeFloat<bfloat> Format;
  static float2 pair(threadgroup const uint* row, int k, uint) {
    const uint a = row[k / 2];
    return float2(as_type<float>(a << 16), as_type<float>(a & 0xFFFF0000u));
  }
  static float unit(uint) { return 1.0f; }
};
struct ActF32 {
  typedef float T;
  typedef DecodeFloat<float> Format;
  static float2 pair(threadgroup const uint* row, int k, uint) { return *(threadgroup const float2*)(row + k); }
  static float unit(uint) { return 1.0f; }
};

inline float scale_a_at(constant Fp8MatmulParams& p, const device float* sa, long row, long kb) {
  return p.has_scale_a ? sa[row * p.sa_row_stride + kb * p.sa_k_stride] : 1.0f;
}
// n < 2^31 (the host checks): a 32-bit division.
inline float scale_b_at(constant Fp8MatmulParams& p, const device float* sb, long n, long kb) {
  return sb[long(uint(n) / p.sb_n_group) * p.sb_n_stride + kb * p.sb_k_stride];
}

// Bias, 1 / scale_result for fp8 outputs, rounding to the output type (in
// this order, as torch's CPU kernel does).
inline void store_output(device uchar* y, long index, float v, long n, constant Fp8MatmulParams& p,
                         const device uchar* bias, const device float* scale_result) {
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
  typedef typename A::Format X;
  typedef DecodeFp8 W;
  // (16: the block scales of a piece and their addresses stay live too)
  enum { BLOCK_SCALED = 1, BUDGET = 16 };
  X xf;
  W wf;
  device uchar* y;
  const device typename A::T* x;
  const device uchar* w;
  constant Fp8MatmulParams* p;
  const device float* scale_a;
  const device float* scale_b;
  const device uchar* bias;
  const device float* scale_result;
  threadgroup float* sa_tile;  // [row][block of the tile]
  threadgroup float* sb_tile;  // [block of the tile][output of the threadgroup]
  int rows, k, outputs, first, tg_first;
  uint lane;
  long x_k, w_k;
  MPS_EXT_INLINE const device typename A::T* x_row(int r) const { return x + r * p->a_row_stride; }
  MPS_EXT_INLINE bool live(int q) const { return q < outputs && first + q < int(p->n); }
  MPS_EXT_INLINE const device uchar* w_row(int q) const { return w + (live(q) ? long(first + q) * p->w_n_stride : 0); }
  // (Run-time trip counts: a compiler keeps no address per row or block.)
  MPS_EXT_INLINE void stage_scales(int k0, int elements, uint tid, uint) const {
    const int kb0 = k0 / FP8_SCALE_BLOCK, blocks = (elements + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    if (int(tid) < blocks)
      for (int r = 0; r < rows; ++r) sa_tile[r * FP8_GEMV_TILE_BLOCKS + int(tid)] = scale_a_at(*p, scale_a, r, kb0 + int(tid));
    // Each simdgroup its own outputs' (at most 8 bytes an instruction: no
    // load straddles a line, whatever the threadgroup's output count).
    if (int(lane) < outputs) {
      const int n = first + int(lane);
      for (int b = 0; b < blocks; ++b)
        sb_tile[b * FP8_GEMV_SB_STRIDE + n - tg_first] = n < int(p->n) ? scale_b_at(*p, scale_b, n, kb0 + b) : 0.0f;
    }
  }
  MPS_EXT_INLINE float x_scale(int r, int block) const { return sa_tile[r * FP8_GEMV_TILE_BLOCKS + block]; }
  MPS_EXT_INLINE float w_scale(int q, int block) const {
    return sb_tile[block * FP8_GEMV_SB_STRIDE + first - tg_first + q];
  }
  MPS_EXT_INLINE float tail_scale(int r, int q, int kb) const {
    return scale_a_at(*p, scale_a, r, kb) * scale_b_at(*p, scale_b, first + q, kb);
  }
  // Lane i writes output i: stores spread over the simdgroup.
  MPS_EXT_INLINE void store(int r, thread const float* total, uint lane) const {
    const float unit = xf.unit() * wf.unit();
    MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
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
  decode_format_e5m2(job.xf, p.a_format == FP8_TYPE_E5M2);
  decode_format_e5m2(job.wf, p.w_format == FP8_TYPE_E5M2);
  job.y = y;
  job.x = x;
  job.w = w;
  job.p = &p;
  job.scale_a = scale_a;
  job.scale_b = scale_b;
  job.bias = bias;
  job.scale_result = scale_result;
  job.sa_tile = sa_tile;
  job.sb_tile = sb_tile;
  // The host keeps N and K below 2^31.
  job.rows = int(p.m);
  job.k = int(p.k);
  job.outputs = int(p.outputs_per_simdgroup);
  job.tg_first = int(group * simdgroups) * job.outputs;
  job.first = job.tg_first + int(sg) * job.outputs;
  job.lane = lane;
  job.x_k = p.a_k_stride;
  job.w_k = p.w_k_stride;
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

// A step of K is one scale block (FP8_TILE_K = FP8_SCALE_BLOCK): the
// threadgroup stages the bits of 32 activation rows and 64 weight rows of
// it (each a row of 128 to 512 bytes: whole cache lines), and the scales of
// its rows and columns; lanes decode and scale their fragments' elements.
// Rows of the staged bits are 4 words wider than their data (activations)
// or 4 (weights), so that the 16-byte stores of consecutive chunks and the
// fragment reads (8 rows x 2 to 8 words, or one byte of 4 weight rows) meet
// no bank conflicts; the outputs go through the same memory, rows TN + 4
// floats apart.
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
  constexpr int TM = FP8_TILE_M, TN = FP8_TILE_N, TK = FP8_TILE_K, THREADS = FP8_TILE_THREADS;
  constexpr int E = sizeof(typename A::T);
  constexpr int AS = TK * E / 4 + 4, WS = TK / 4 + 4, CS = TN + 4;  // row strides in words
  constexpr int A_CHUNKS = TK * E / 16, W_CHUNKS = TK / 16;        // 16-byte chunks of a row
  constexpr int WORDS = TM * AS + TN * WS > TM * CS ? TM * AS + TN * WS : TM * CS;
  threadgroup uint4 tile_mem[WORDS / 4];
  threadgroup uint* a_bits = (threadgroup uint*)tile_mem;  // [TM][AS]
  threadgroup uint* w_bits = a_bits + TM * AS;               // [TN][WS]
  threadgroup float* c_tile = (threadgroup float*)tile_mem;  // [TM][CS], after the loop
  // Scales times the units: the weight's of the step, and the activation's
  // of SA_BLOCKS steps [row][block] (its block-wise scales are a column of
  // a row-major matrix a step: staged a row or a column at a time, along
  // whichever dimension is contiguous).
  constexpr int SA_BLOCKS = 32;
  threadgroup float sb_tile[FP8_TILE_N];
  threadgroup float sa_tile[FP8_TILE_M * (SA_BLOCKS + 1)];
  // The host keeps M, N and K below 2^31.
  const int M = int(p.m), N = int(p.n), K = int(p.k);
  const int m0 = int(group.y) * TM, n0 = int(group.x) * TN;
  // Simdgroup sg computes rows [16 (sg / 2), +16) and columns [32 (sg % 2), +32).
  const uint sm = (sg / 2) * 16, sn = (sg % 2) * 32;
  uint fr, fc;
  fragment_coord(lane, fr, fc);
  simdgroup_float8x8 acc[2][4];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int k0 = 0; k0 < K; k0 += TK) {
    const int kb = k0 / FP8_SCALE_BLOCK;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous step's products are done
    // Bits past K, M or N stage as 0 (the value 0 in every type).
    if (VEC) {
      for (int c = int(tid); c < TM * A_CHUNKS; c += THREADS) {
        const int row = c / A_CHUNKS, chunk = c % A_CHUNKS, gm = m0 + row, gk = k0 + chunk * (16 / E);
        uint4 u = uint4(0u);
        if (gm < M && gk + 16 / E <= K) {
          u = *(const device uint4*)(x + gm * p.a_row_stride + gk);
        } else if (gm < M) {
          for (int e = 0; e < 16 / E; ++e)
            if (gk + e < K) ((thread typename A::T*)&u)[e] = x[gm * p.a_row_stride + gk + e];
        }
        *(threadgroup uint4*)(a_bits + row * AS + chunk * 4) = u;
      }
      for (int c = int(tid); c < TN * W_CHUNKS; c += THREADS) {
        const int row = c / W_CHUNKS, chunk = c % W_CHUNKS, gn = n0 + row, gk = k0 + chunk * 16;
        uint4 u = uint4(0u);
        if (gn < N && gk + 16 <= K) {
          u = *(const device uint4*)(w + gn * p.w_n_stride + gk);
        } else if (gn < N) {
          for (int e = 0; e < 16; ++e)
            if (gk + e < K) u[e / 4] |= uint(w[gn * p.w_n_stride + gk + e]) << (8 * (e % 4));
        }
        *(threadgroup uint4*)(w_bits + row * WS + chunk * 4) = u;
      }
    } else {
      // Element loads, consecutive threads along K: each simdgroup
      // instruction reads 32 consecutive elements of a row.
      for (int i = int(tid); i < TM * TK; i += THREADS) {
        const int row = i / TK, k = i % TK, gm = m0 + row, gk = k0 + k;
        ((threadgroup typename A::T*)(a_bits + row * AS))[k] =
            gm < M && gk < K ? x[gm * p.a_row_stride + long(gk) * p.a_k_stride] : typename A::T(0);
      }
      for (int i = int(tid); i < TN * TK; i += THREADS) {
        const int row = i / TK, k = i % TK, gn = n0 + row, gk = k0 + k;
        ((threadgroup uchar*)(w_bits + row * WS))[k] = gn < N && gk < K ? w[gn * p.w_n_stride + long(gk) * p.w_k_stride] : 0;
      }
    }
    if (kb % SA_BLOCKS == 0) {
      const bool along_k = p.sa_k_stride == 1;
      const int blocks = (K + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
      for (int i = int(tid); i < TM * SA_BLOCKS; i += THREADS) {
        const int r = along_k ? i / SA_BLOCKS : i % TM, b = along_k ? i % SA_BLOCKS : i / TM;
        if (kb + b < blocks)
          sa_tile[r * (SA_BLOCKS + 1) + b] = m0 + r < M ? scale_a_at(p, scale_a, m0 + r, kb + b) * A::unit(p.a_format) : 0.0f;
      }
    }
    if (int(tid) < TN) {
      const int gn = n0 + int(tid);
      sb_tile[tid] = gn < N ? scale_b_at(p, scale_b, gn, kb) * fp8_unit(p.w_format) : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < TK; kk += 8) {
      // a: elements (row, k) and (row, k + 1) of the activation; b[k][n] =
      // w[n][k]: one element of two weight rows.
      simdgroup_float8x8 a[2], b[4];
      for (int i = 0; i < 2; ++i) {
        const uint row = sm + 8 * i + fr;
        reinterpret_cast<thread float2&>(a[i].thread_elements()) = A::pair(a_bits + row * AS, kk + fc, p.a_format) * sa_tile[row * (SA_BLOCKS + 1) + kb % SA_BLOCKS];
      }
      for (int j = 0; j < 4; ++j) {
        const uint n = sn + 8 * j + fc, k = kk + fr, shift = 8 * (k % 4);
        const uint two = ((w_bits[n * WS + k / 4] >> shift) & 0xFFu) | (((w_bits[(n + 1) * WS + k / 4] >> shift) & 0xFFu) << 8);
        reinterpret_cast<thread float2&>(b[j].thread_elements()) = fp8x4_to_float(two, p.w_format).xy * float2(sb_tile[n], sb_tile[n + 1]);
      }
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // c_tile takes the operands' memory
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j)
      *(threadgroup float2*)(c_tile + (sm + 8 * i + fr) * CS + sn + 8 * j + fc) =
          reinterpret_cast<thread float2&>(acc[i][j].thread_elements());
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = int(tid); e < TM * TN; e += THREADS) {
    const int gm = m0 + e / TN, gn = n0 + e % TN;
    if (gm < M && gn < N)
      store_output(y, gm * p.y_row_stride + long(gn) * p.y_n_stride, c_tile[(e / TN) * CS + e % TN], gn, p, bias,
                   scale_result);
  }
}

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

INSTANTIATE_FP8_MM(fp8, ActFp8)
INSTANTIATE_FP8_MM(f16, ActF16)
INSTANTIATE_FP8_MM(bf16, ActBF16)
INSTANTIATE_FP8_MM(f32, ActF32)
