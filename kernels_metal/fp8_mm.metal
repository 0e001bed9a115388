// Scaled matrix products with float8 weights (torch._scaled_mm,
// torch._scaled_mm_v2 / F.scaled_mm, and the weight-only FP8 linear of
// mps_ext.quantize_fp8). fp8_params.h defines what is computed.
//
// fp8_gemv_<act>_r<R>_<vec|scalar>   decode, 1 to R (1, 2, 4, 8) activation
//     rows: like gemv.metal's gemv_rows, a simdgroup owns 1 or 2 weight rows,
//     its lanes stride K with 16-byte loads (16 fp8 weights each), every
//     weight byte is read once and applied to all activation rows, which the
//     threadgroup stages in threadgroup memory.
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
#include "fp8_codec.h"
#include "fp8_params.h"
using namespace metal;

// Decoding by the float8 format code of an operand (p.a_format, p.w_format).
// fp8x4_to_float and fp8_to_float give e4m3 values divided by fp8_unit (256;
// see e4m3x4_to_float_div256), e5m2 values as they are.
inline float4 fp8x4_to_float(uint u, uint format) {
  return format == FP8_TYPE_E5M2 ? e5m2x4_to_float(u) : e4m3x4_to_float_div256(u);
}
inline float fp8_unit(uint format) { return format == FP8_TYPE_E5M2 ? 1.0f : 256.0f; }
inline float fp8_to_float(uchar b, uint format) {
  return as_type<float>(format == FP8_TYPE_E5M2 ? e5m2_to_bits(b) : e4m3_to_bits(b)) / fp8_unit(format);
}

// Activation loaders: values divided by unit(format) (fp8x4_to_float's
// convention for e4m3; 1 for everything else). E: elements in 16 bytes.
// group4: 4 elements from the bits fp8_gemv staged, the words of the group
// `stride` apart (one word for fp8, two for 16-bit types, four for float).
// pair: elements k and k + 1 (k even) of a row fp8_mm_tile staged as bits.
struct ActFp8 {
  typedef uchar T;
  enum { E = 16 };
  static float load1(const device uchar* p, uint format) { return fp8_to_float(*p, format); }
  static float4 group4(threadgroup const uint* p, int, uint format) { return fp8x4_to_float(p[0], format); }
  static float2 pair(threadgroup const uint* row, int k, uint format) {
    return fp8x4_to_float(row[k / 4] >> (8 * (k % 4)), format).xy;
  }
  static float unit(uint format) { return fp8_unit(format); }
};
struct ActF16 {
  typedef half T;
  enum { E = 8 };
  static float load1(const device half* p, uint) { return float(*p); }
  static float4 group4(threadgroup const uint* p, int stride, uint) {
    const half2 a = as_type<half2>(p[0]), b = as_type<half2>(p[stride]);
    return float4(float(a.x), float(a.y), float(b.x), float(b.y));
  }
  static float2 pair(threadgroup const uint* row, int k, uint) { return float2(as_type<half2>(row[k / 2])); }
  static float unit(uint) { return 1.0f; }
};
struct ActBF16 {
  typedef bfloat T;
  enum { E = 8 };
  static float load1(const device bfloat* p, uint) { return float(*p); }
  static float4 group4(threadgroup const uint* p, int stride, uint) {
    const uint a = p[0], b = p[stride];
    return float4(as_type<float>(a << 16), as_type<float>(a & 0xFFFF0000u), as_type<float>(b << 16),
                  as_type<float>(b & 0xFFFF0000u));
  }
  static float2 pair(threadgroup const uint* row, int k, uint) {
    const uint a = row[k / 2];
    return float2(as_type<float>(a << 16), as_type<float>(a & 0xFFFF0000u));
  }
  static float unit(uint) { return 1.0f; }
};
struct ActF32 {
  typedef float T;
  enum { E = 4 };
  static float load1(const device float* p, uint) { return *p; }
  static float4 group4(threadgroup const uint* p, int stride, uint) {
    return float4(as_type<float>(p[0]), as_type<float>(p[stride]), as_type<float>(p[2 * stride]),
                  as_type<float>(p[3 * stride]));
  }
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
// A simdgroup owns up to Q = FP8_GEMV_OUTPUTS(R) weight rows (the host's
// outputs_per_simdgroup). With VEC, a step of the
// simdgroup takes 512 bytes of each of its weight rows, lane i the 16
// bytes [16 i, 16 i + 16): one coalesced 16-byte load per output; the
// activations of those 512 elements are staged by the threadgroup in
// threadgroup memory (consecutive threads load consecutive 16-byte pieces
// of a row), as their bits, and so are the scales of the tile's 128-wide
// K blocks. Element loads (not VEC, and the last K % 16 elements): lanes
// take consecutive elements, a scale block at a time.
//
// Staged layout: the 4 * E words of a row's step (E: bytes of an
// activation element) are read by lane i as groups of 4 elements j = 0..3
// (word w < E of each), at [(j * E + w) * STAGE_STRIDE(E) + i]: for one
// (j, w) the 32 lanes hit 32 banks. The stride is 32 + 8 / E so that the
// threads staging 32 consecutive pieces (of 4 words each) also write 32
// distinct banks per store: piece c's words land in lane c * 4 / (4 * E)'s
// column at rows shifted by 8 / E words a group. Tile t puts lane i's
// column at (i + t) % 32 (any rotation keeps both properties): the
// addresses a lane reads change with the tile, so that a compiler keeps no
// R * 4 * E addresses of its own live through the loop.
constexpr int fp8_stage_stride(int E) { return 32 + 8 / E; }
// Steps of a tile: 8 KB of activation bits per tile (R rows of 512 E
// bytes a step), at least one step.
constexpr int fp8_gemv_steps(int R, int E) { return R * E >= 8 ? 1 : 8 / (R * E); }

// Registers: R * Q accumulators + Q weight pieces (4 words each) + R
// partial sums of one output + a group of 4 weights and of 4 activations
// (+ addresses): within FULL_OCCUPANCY_REGISTERS.
template <typename A, int R, bool VEC>
[[max_total_threads_per_threadgroup(FP8_GEMV_MAX_THREADS)]]
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
  constexpr int Q = FP8_GEMV_OUTPUTS(R);
  constexpr int E = sizeof(typename A::T);
  constexpr int STEP = 32 * 16;                      // elements of K a step covers
  constexpr int S = fp8_stage_stride(E);
  constexpr int STEP_WORDS = 4 * E * S;              // staged words of one row's step
  constexpr int PIECES = STEP * E / 16;              // 16-byte pieces of one row's step
  constexpr int STEPS = fp8_gemv_steps(R, E);
  constexpr int TILE = STEPS * STEP;
  constexpr int TB = TILE / FP8_SCALE_BLOCK;         // scale blocks of a tile
  constexpr int TQ = Q * FP8_GEMV_MAX_THREADS / 32;  // most outputs of a threadgroup
  threadgroup uint x_mem[VEC ? R * STEPS * STEP_WORDS : 1];
  threadgroup float sa_mem[VEC ? R * TB : 1];   // [row][block]
  threadgroup float sb_mem[VEC ? TB * TQ : 1];  // [block][output of the threadgroup]

  // The host keeps N and K below 2^31.
  const int outputs = int(p.outputs_per_simdgroup), rows = int(p.m), K = int(p.k), N = int(p.n);
  const int tg_first = int(group * simdgroups) * outputs;
  const int first = tg_first + int(sg) * outputs;
  bool live[Q];
  const device uchar* wrow[Q];
  float acc[R][Q];
  MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
    live[q] = q < outputs && first + q < N;
    wrow[q] = w + (live[q] ? long(first + q) * p.w_n_stride : 0);
    MPS_EXT_UNROLL for (int r = 0; r < R; ++r) acc[r][q] = 0.0f;
  }

  int k_done = 0;
  if (VEC) {
    const int k_vec = K / 16 * 16, blocks = (K + FP8_SCALE_BLOCK - 1) / FP8_SCALE_BLOCK;
    for (int k0 = 0, t = 0; k0 < k_vec; k0 += TILE, ++t) {
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous tile is used up
      // Activations past k_vec (and rows past `rows`) stage as 0: their
      // weights are 0 as well, so that the products need no checks.
      for (int i = int(tid); i < R * STEPS * PIECES; i += int(threads)) {
        const int rs = i / PIECES, c = i % PIECES;  // rs: row * STEPS + step
        const int r = rs / STEPS, k = k0 + (rs % STEPS) * STEP + c * (16 / E);
        const uint4 v = r < rows && k < k_vec ? *(const device uint4*)(x + r * p.a_row_stride + k) : uint4(0u);
        threadgroup uint* step = x_mem + rs * STEP_WORDS;
        MPS_EXT_UNROLL for (int i4 = 0; i4 < 4; ++i4) {
          const int word = c * 4 + i4, g = word / E;  // g: the group of 4 elements, of lane g / 4
          step[((g % 4) * E + word % E) * S + ((g / 4 + t) & 31)] = v[i4];
        }
      }
      // Scales of the tile's blocks that exist (lanes past k_vec read none):
      // a block per lane along a row of scale_a, an output per lane along
      // scale_b's (the layouts of the row-wise and block-wise recipes).
      // (Run-time trip counts: a compiler keeps no address per row or block.)
      const int kb0 = k0 / FP8_SCALE_BLOCK, tile_blocks = min(TB, blocks - kb0);
      if (int(tid) < tile_blocks)
        for (int r = 0; r < rows; ++r) sa_mem[r * TB + int(tid)] = scale_a_at(p, scale_a, r, kb0 + int(tid));
      if (int(tid) < TQ) {
        const int n = tg_first + int(tid);
        for (int b = 0; b < tile_blocks; ++b) sb_mem[b * TQ + int(tid)] = n < N ? scale_b_at(p, scale_b, n, kb0 + b) : 0.0f;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const int steps = min(STEPS, (k_vec - k0 + STEP - 1) / STEP);  // of this tile
      for (int s = 0; s < steps; ++s) {
        const int k = k0 + s * STEP + int(lane) * 16;
        if (k >= k_vec) break;  // the last step of K may leave lanes out
        uint4 wv[Q];
        MPS_EXT_UNROLL for (int q = 0; q < Q; ++q)
          wv[q] = live[q] ? *(const device uint4*)(wrow[q] + k) : uint4(0u);
        const int b = s * 4 + int(lane) / 8;  // this lane's scale block
        threadgroup const uint* xs = x_mem + s * STEP_WORDS + ((int(lane) + t) & 31);
        MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
          if (!live[q]) continue;
          float part[R];
          MPS_EXT_UNROLL for (int r = 0; r < R; ++r) part[r] = 0.0f;
          MPS_EXT_UNROLL for (int j = 0; j < 4; ++j) {
            const float4 wf = fp8x4_to_float(wv[q][j], p.w_format);
            MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
              part[r] += dot(A::group4(xs + r * STEPS * STEP_WORDS + j * E * S, S, p.a_format), wf);
          }
          const float sb = sb_mem[b * TQ + int(sg) * outputs + q];
          MPS_EXT_UNROLL for (int r = 0; r < R; ++r)
            if (r < rows) acc[r][q] += part[r] * (sa_mem[r * TB + b] * sb);
        }
      }
    }
    k_done = k_vec;
  }
  // Element loads from k_done on: a scale block at a time, lanes along K.
  for (int kb0 = k_done; kb0 < K;) {
    const int kb = kb0 / FP8_SCALE_BLOCK, end = min((kb + 1) * FP8_SCALE_BLOCK, K);
    float sa[R], sb[Q];
    MPS_EXT_UNROLL for (int r = 0; r < R; ++r) sa[r] = r < rows ? scale_a_at(p, scale_a, r, kb) : 0.0f;
    MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) sb[q] = live[q] ? scale_b_at(p, scale_b, first + q, kb) : 0.0f;
    for (int k = kb0 + int(lane); k < end; k += 32) {
      float wk[Q];
      MPS_EXT_UNROLL for (int q = 0; q < Q; ++q)
        wk[q] = live[q] ? fp8_to_float(wrow[q][k * p.w_k_stride], p.w_format) * sb[q] : 0.0f;
      MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
        if (r >= rows) continue;
        const float xk = A::load1(x + r * p.a_row_stride + k * p.a_k_stride, p.a_format) * sa[r];
        MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) acc[r][q] += xk * wk[q];
      }
    }
    kb0 = end;
  }

  const float unit = A::unit(p.a_format) * fp8_unit(p.w_format);
  MPS_EXT_UNROLL for (int q = 0; q < Q; ++q) {
    MPS_EXT_UNROLL for (int r = 0; r < R; ++r) {
      if (q >= outputs || r >= rows) continue;
      const float total = simd_sum(acc[r][q]) * unit;
      // Lane i writes output i: stores spread over the simdgroup.
      if (lane == uint(r * Q + q) % 32 && live[q]) {
        const long n = first + q;
        store_output(y, r * p.y_row_stride + n * p.y_n_stride, total, n, p, bias, scale_result);
      }
    }
  }
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
