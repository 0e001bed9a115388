// Scaled matrix products with float8 weights (torch._scaled_mm,
// torch._scaled_mm_v2 / F.scaled_mm, and the weight-only FP8 linear of
// mps_ext.quantize_fp8). fp8_params.h defines what is computed.
//
// fp8_gemv_<act>_r<R>_<vec|scalar>   decode, 1 to R (1, 2, 4, 8) activation
//     rows: like gemv.metal, a simdgroup owns up to 4 weight rows, its lanes
//     stride K with 16-byte loads (16 fp8 weights each), every weight byte is
//     read once and applied to all activation rows held in registers.
// fp8_mm_tile_<act>_<vec|scalar>     prefill: a threadgroup computes a
//     32 x 64 tile of outputs with simdgroup_matrix 8x8 products; each step
//     decodes a 32 x 32 activation tile and a 64 x 32 weight tile (scaled,
//     in float) into threadgroup memory, so every weight byte is read once
//     per 32 activation rows.
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
struct ActFp8 {
  typedef uchar T;
  enum { E = 16 };
  static void load16(const device uchar* p, uint format, thread float* v) {
    uint4 u = *(const device uint4*)p;
    for (int i = 0; i < 4; ++i) {
      float4 f = fp8x4_to_float(u[i], format);
      for (int j = 0; j < 4; ++j) v[4 * i + j] = f[j];
    }
  }
  static float load1(const device uchar* p, uint format) { return fp8_to_float(*p, format); }
  static float unit(uint format) { return fp8_unit(format); }
};
struct ActF16 {
  typedef half T;
  enum { E = 8 };
  static void load16(const device half* p, uint, thread float* v) {
    uint4 u = *(const device uint4*)p;
    for (int i = 0; i < 4; ++i) {
      half2 h = as_type<half2>(u[i]);
      v[2 * i] = float(h.x);
      v[2 * i + 1] = float(h.y);
    }
  }
  static float load1(const device half* p, uint) { return float(*p); }
  static float unit(uint) { return 1.0f; }
};
struct ActBF16 {
  typedef bfloat T;
  enum { E = 8 };
  static void load16(const device bfloat* p, uint, thread float* v) {
    uint4 u = *(const device uint4*)p;
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = as_type<float>(u[i] << 16);
      v[2 * i + 1] = as_type<float>(u[i] & 0xFFFF0000u);
    }
  }
  static float load1(const device bfloat* p, uint) { return float(*p); }
  static float unit(uint) { return 1.0f; }
};
struct ActF32 {
  typedef float T;
  enum { E = 4 };
  static void load16(const device float* p, uint, thread float* v) {
    float4 f = *(const device float4*)p;
    for (int j = 0; j < 4; ++j) v[j] = f[j];
  }
  static float load1(const device float* p, uint) { return *p; }
  static float unit(uint) { return 1.0f; }
};

inline float scale_a_at(constant Fp8MatmulParams& p, const device float* sa, long row, long kb) {
  return p.has_scale_a ? sa[row * p.sa_row_stride + kb * p.sa_k_stride] : 1.0f;
}
inline float scale_b_at(constant Fp8MatmulParams& p, const device float* sb, long n, long kb) {
  return sb[(n / long(p.sb_n_group)) * p.sb_n_stride + kb * p.sb_k_stride];
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

template <typename A, int R, bool VEC>
[[max_total_threads_per_threadgroup(64)]]
kernel void fp8_gemv(device uchar* y [[buffer(0)]],
                     const device typename A::T* x [[buffer(1)]],
                     const device uchar* w [[buffer(2)]],
                     constant Fp8MatmulParams& p [[buffer(3)]],
                     const device float* scale_a [[buffer(4)]],
                     const device float* scale_b [[buffer(5)]],
                     const device uchar* bias [[buffer(6)]],
                     const device float* scale_result [[buffer(7)]],
                     uint group [[threadgroup_position_in_grid]],
                     uint sg [[simdgroup_index_in_threadgroup]],
                     uint simdgroups [[simdgroups_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
  const int Q = FP8_GEMV_MAX_OUTPUTS;
  const int outputs = int(p.outputs_per_simdgroup);
  const long first = (long(group) * simdgroups + sg) * outputs;
  const int rows = int(p.m);
  float acc[R][Q];
  bool live[Q];
  const device uchar* wrow[Q];
  for (int q = 0; q < Q; ++q) {
    live[q] = q < outputs && first + q < p.n;
    wrow[q] = w + (live[q] ? (first + q) * p.w_n_stride : 0);
    for (int r = 0; r < R; ++r) acc[r][q] = 0.0f;
  }

  long k_done = 0;
  if (VEC) {
    // Lane i takes bytes [16 i, 16 i + 16) of each 512-byte step of a weight
    // row; 16 divides FP8_SCALE_BLOCK, so a step lies in one scale block.
    const long k_vec = p.k / 16 * 16;
    for (long k = long(lane) * 16; k < k_vec; k += 32 * 16) {
      const long kb = k / FP8_SCALE_BLOCK;
      float xv[R][16];
      float sa[R];
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        for (int c = 0; c < 16 / A::E; ++c) A::load16(x + r * p.a_row_stride + k + c * A::E, p.a_format, &xv[r][c * A::E]);
        sa[r] = scale_a_at(p, scale_a, r, kb);
      }
      for (int q = 0; q < Q; ++q) {
        if (!live[q]) continue;
        float wv[16];
        uint4 u = *(const device uint4*)(wrow[q] + k);
        for (int i = 0; i < 4; ++i) {
          float4 f = fp8x4_to_float(u[i], p.w_format);
          for (int j = 0; j < 4; ++j) wv[4 * i + j] = f[j];
        }
        const float sb = scale_b_at(p, scale_b, first + q, kb);
        for (int r = 0; r < R; ++r) {
          if (r >= rows) break;
          float s = 0.0f;
          for (int e = 0; e < 16; ++e) s += xv[r][e] * wv[e];
          acc[r][q] += s * (sa[r] * sb);
        }
      }
    }
    k_done = k_vec;
  }
  // The elements a 16-byte step cannot take (all of them without VEC).
  for (long k = k_done + lane; k < p.k; k += 32) {
    const long kb = k / FP8_SCALE_BLOCK;
    float xs[R];
    for (int r = 0; r < R; ++r)
      xs[r] = r < rows ? A::load1(x + r * p.a_row_stride + k * p.a_k_stride, p.a_format) * scale_a_at(p, scale_a, r, kb)
                       : 0.0f;
    for (int q = 0; q < Q; ++q) {
      if (!live[q]) continue;
      const float wv = fp8_to_float(wrow[q][k * p.w_k_stride], p.w_format) * scale_b_at(p, scale_b, first + q, kb);
      for (int r = 0; r < R; ++r) acc[r][q] += xs[r] * wv;
    }
  }

  const float unit = A::unit(p.a_format) * fp8_unit(p.w_format);
  for (int q = 0; q < Q; ++q) {
    if (q >= outputs) break;
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      const float total = simd_sum(acc[r][q]) * unit;
      // Lane i writes output i: stores spread over the simdgroup.
      if (lane == uint(r * Q + q) % 32 && live[q]) {
        const long n = first + q;
        store_output(y, r * p.y_row_stride + n * p.y_n_stride, total, n, p, bias, scale_result);
      }
    }
  }
}

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
                        uint sg [[simdgroup_index_in_threadgroup]]) {
  const int TM = FP8_TILE_M, TN = FP8_TILE_N, TK = FP8_TILE_K, THREADS = FP8_TILE_THREADS;
  // Scaled operands in float: a[m][k] and w transposed, b[k][n], so that
  // both load into simdgroup matrices without a transpose.
  threadgroup float a_tile[FP8_TILE_M][FP8_TILE_K];
  threadgroup float b_tile[FP8_TILE_K][FP8_TILE_N];
  threadgroup float c_tile[FP8_TILE_M][FP8_TILE_N];
  const long m0 = long(group.y) * TM, n0 = long(group.x) * TN;
  const float a_unit = A::unit(p.a_format), w_unit = fp8_unit(p.w_format);
  // Simdgroup sg computes rows [16 (sg / 2), +16) and columns [32 (sg % 2), +32).
  const uint sm = (sg / 2) * 16, sn = (sg % 2) * 32;
  simdgroup_float8x8 acc[2][4];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (long k0 = 0; k0 < p.k; k0 += TK) {
    const long kb = k0 / FP8_SCALE_BLOCK;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the previous step's products are done
    // Activation tile: 16-byte chunks of A::E elements along K.
    for (uint c = tid; c < uint(TM * TK / A::E); c += THREADS) {
      const uint row = c / (TK / A::E), kc = (c % (TK / A::E)) * A::E;
      const long gm = m0 + row, gk = k0 + kc;
      const float s = gm < p.m ? scale_a_at(p, scale_a, gm, kb) * a_unit : 0.0f;
      float v[16];
      if (VEC && gm < p.m && gk + A::E <= p.k) {
        A::load16(x + gm * p.a_row_stride + gk, p.a_format, v);
      } else {
        for (int e = 0; e < A::E; ++e)
          v[e] = gm < p.m && gk + e < p.k ? A::load1(x + gm * p.a_row_stride + (gk + e) * p.a_k_stride, p.a_format) : 0.0f;
      }
      for (int e = 0; e < A::E; ++e) a_tile[row][kc + e] = v[e] * s;
    }
    // Weight tile: one 16-byte chunk (16 weights of one row) per thread.
    for (uint c = tid; c < uint(TN * TK / 16); c += THREADS) {
      const uint row = c / (TK / 16), kc = (c % (TK / 16)) * 16;
      const long gn = n0 + row, gk = k0 + kc;
      const float s = gn < p.n ? scale_b_at(p, scale_b, gn, kb) * w_unit : 0.0f;
      float v[16];
      if (VEC && gn < p.n && gk + 16 <= p.k) {
        uint4 u = *(const device uint4*)(w + gn * p.w_n_stride + gk);
        for (int i = 0; i < 4; ++i) {
          float4 f = fp8x4_to_float(u[i], p.w_format);
          for (int j = 0; j < 4; ++j) v[4 * i + j] = f[j];
        }
      } else {
        for (int e = 0; e < 16; ++e)
          v[e] = gn < p.n && gk + e < p.k ? fp8_to_float(w[gn * p.w_n_stride + (gk + e) * p.w_k_stride], p.w_format) : 0.0f;
      }
      for (int e = 0; e < 16; ++e) b_tile[kc + e][row] = v[e] * s;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int kk = 0; kk < TK; kk += 8) {
      simdgroup_float8x8 a[2], b[4];
      for (int i = 0; i < 2; ++i) simdgroup_load(a[i], &a_tile[0][0], TK, ulong2(kk, sm + 8 * i));
      for (int j = 0; j < 4; ++j) simdgroup_load(b[j], &b_tile[0][0], TN, ulong2(sn + 8 * j, kk));
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
  }

  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) simdgroup_store(acc[i][j], &c_tile[0][0], TN, ulong2(sn + 8 * j, sm + 8 * i));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < uint(TM * TN); e += THREADS) {
    const long gm = m0 + e / TN, gn = n0 + e % TN;
    if (gm < p.m && gn < p.n)
      store_output(y, gm * p.y_row_stride + gn * p.y_n_stride, c_tile[e / TN][e % TN], gn, p, bias, scale_result);
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
