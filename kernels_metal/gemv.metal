// Matrix-vector products for decode: 1 to 8 activation rows against a weight
// whose bytes must stream from memory exactly once. Every weight element is
// loaded once and applied to all activation rows, held in registers; the
// accumulation is in float.
//
// gemv_rows  the weight's K dimension is contiguous (F.linear's [N, K] W).
//            A simdgroup owns outputs_per_simdgroup weight rows; its lanes
//            stride K with 16-byte loads and the row sums end in simd_sum.
// gemv_cols  the weight's N dimension is contiguous (x @ W with W [K, N]).
//            Each lane owns 16 bytes of consecutive outputs; the simdgroups
//            of a threadgroup split K and add up through threadgroup memory.
// VEC: 16-byte loads of the weight (and the activations), used when the host
// found the addresses 16-byte aligned; otherwise element loads.
#include <metal_stdlib>
#include "gemv_params.h"
using namespace metal;

// 16 bytes of T as float: 4 floats, or 8 halves / bfloats. (N is an
// enumerator: a static data member would be a program-scope variable, which
// Metal allows only in the constant address space.)
template <typename T>
struct Wide {
  enum : int { N = int(16 / sizeof(T)) };
  float v[N];
};

// One 16-byte load; the overloads pick how to unpack it (MSL has no
// `if constexpr`).
inline Wide<float> load16(const device float* p) {
  float4 f = *(const device float4*)p;
  Wide<float> w;
  for (int i = 0; i < 4; ++i) w.v[i] = f[i];
  return w;
}
template <typename T>
inline Wide<T> load16_pairs(const device T* p) {
  uint4 bits = *(const device uint4*)p;
  Wide<T> w;
  for (int i = 0; i < 4; ++i) {
    vec<T, 2> pair = as_type<vec<T, 2>>(bits[i]);
    w.v[2 * i] = float(pair.x);
    w.v[2 * i + 1] = float(pair.y);
  }
  return w;
}
inline Wide<half> load16(const device half* p) { return load16_pairs(p); }
inline Wide<bfloat> load16(const device bfloat* p) { return load16_pairs(p); }

inline float finish(float acc, constant GemvParams& p, float bias) {
  return p.has_bias ? p.alpha * acc + p.beta * bias : p.alpha * acc;
}

template <typename T, int R, bool VEC>
[[max_total_threads_per_threadgroup(GEMV_ROWS_MAX_THREADS)]]
kernel void gemv_rows(device T* y [[buffer(0)]],
                      const device T* x [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      constant GemvParams& p [[buffer(3)]],
                      const device T* bias [[buffer(4)]],
                      uint group [[threadgroup_position_in_grid]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int Q = GEMV_MAX_OUTPUTS_PER_SIMDGROUP;
  const int outputs = int(p.outputs_per_simdgroup);
  const long first = (long(group) * simdgroups + sg) * outputs;
  const int rows = int(p.rows);
  float acc[R][Q];
  const device T* wrow[Q];
  bool live[Q];
  for (int q = 0; q < Q; ++q) {
    live[q] = q < outputs && first + q < p.n_out;
    wrow[q] = w + (live[q] ? (first + q) * p.w_n_stride : 0);
    for (int r = 0; r < R; ++r) acc[r][q] = 0.0f;
  }

  long k_done = 0;
  if (VEC) {
    // Lanes take consecutive 16-byte pieces of the row: a simdgroup reads
    // 512 contiguous bytes of each weight row per step.
    constexpr int E = Wide<T>::N;
    const long k_vec = p.k / E * E;
    for (long k = long(lane) * E; k < k_vec; k += 32 * E) {
      Wide<T> xv[R];
      for (int r = 0; r < R; ++r)
        if (r < rows) xv[r] = load16(x + r * p.x_row_stride + k);
      for (int q = 0; q < Q; ++q) {
        if (!live[q]) continue;
        Wide<T> wv = load16(wrow[q] + k);
        for (int r = 0; r < R; ++r) {
          if (r >= rows) continue;
          float s = 0.0f;
          for (int e = 0; e < E; ++e) s += xv[r].v[e] * wv.v[e];
          acc[r][q] += s;
        }
      }
    }
    k_done = k_vec;
  }
  // The elements a 16-byte step cannot take (all of them without VEC).
  for (long k = k_done + lane; k < p.k; k += 32) {
    float xs[R];
    for (int r = 0; r < R; ++r) xs[r] = r < rows ? float(x[r * p.x_row_stride + k * p.x_k_stride]) : 0.0f;
    for (int q = 0; q < Q; ++q) {
      if (!live[q]) continue;
      float wv = float(wrow[q][k * p.w_k_stride]);
      for (int r = 0; r < R; ++r) acc[r][q] += xs[r] * wv;
    }
  }

  for (int q = 0; q < Q; ++q) {
    if (q >= outputs) break;
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      float total = simd_sum(acc[r][q]);
      // Lane i writes output i: stores spread over the simdgroup.
      if (lane == uint(r * Q + q) % 32 && live[q]) {
        long n = first + q;
        float b = p.has_bias ? float(bias[r * p.bias_row_stride + n * p.bias_n_stride]) : 0.0f;
        y[r * p.y_row_stride + n * p.y_n_stride] = T(finish(total, p, b));
      }
    }
  }
}

// `partial` holds one row per simdgroup of at most GEMV_COLS_THREADS threads.
template <typename T, int R, bool VEC>
[[max_total_threads_per_threadgroup(GEMV_COLS_THREADS)]]
kernel void gemv_cols(device T* y [[buffer(0)]],
                      const device T* x [[buffer(1)]],
                      const device T* w [[buffer(2)]],
                      constant GemvParams& p [[buffer(3)]],
                      const device T* bias [[buffer(4)]],
                      uint group [[threadgroup_position_in_grid]],
                      uint threads [[threads_per_threadgroup]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint simdgroups [[simdgroups_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]]) {
  constexpr int E = VEC ? Wide<T>::N : 1;
  constexpr int COLS = 32 * E;  // outputs of one threadgroup
  // Partial sums of every simdgroup for one activation row: 8 x 256 floats.
  threadgroup float partial[GEMV_COLS_THREADS / 32][COLS];
  const long col0 = long(group) * COLS + long(lane) * E;
  const int rows = int(p.rows);
  float acc[R][E];
  for (int r = 0; r < R; ++r)
    for (int e = 0; e < E; ++e) acc[r][e] = 0.0f;

  const bool whole = col0 + E <= p.n_out;  // all E columns exist
  for (long k = sg; k < p.k; k += simdgroups) {
    const device T* wk = w + k * p.w_k_stride + col0 * p.w_n_stride;
    float wv[E];
    if (VEC && whole) {
      Wide<T> v = load16(wk);
      for (int e = 0; e < E; ++e) wv[e] = v.v[e];
    } else {
      for (int e = 0; e < E; ++e) wv[e] = col0 + e < p.n_out ? float(wk[e * p.w_n_stride]) : 0.0f;
    }
    for (int r = 0; r < R; ++r) {
      if (r >= rows) break;
      float xs = float(x[r * p.x_row_stride + k * p.x_k_stride]);
      for (int e = 0; e < E; ++e) acc[r][e] += xs * wv[e];
    }
  }

  for (int r = 0; r < R; ++r) {
    if (r >= rows) break;
    for (int e = 0; e < E; ++e) partial[sg][lane * E + e] = acc[r][e];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint c = tid; c < uint(COLS); c += threads) {
      long n = long(group) * COLS + c;
      if (n < p.n_out) {
        float total = 0.0f;
        for (uint s = 0; s < simdgroups; ++s) total += partial[s][c];
        float b = p.has_bias ? float(bias[r * p.bias_row_stride + n * p.bias_n_stride]) : 0.0f;
        y[r * p.y_row_stride + n * p.y_n_stride] = T(finish(total, p, b));
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

#define INSTANTIATE_GEMV(kind, tname, T, R)                                                              \
  template [[host_name("gemv_" #kind "_" #tname "_r" #R "_vec")]] kernel                                 \
      decltype(gemv_##kind<T, R, true>) gemv_##kind<T, R, true>;                                         \
  template [[host_name("gemv_" #kind "_" #tname "_r" #R "_scalar")]] kernel                              \
      decltype(gemv_##kind<T, R, false>) gemv_##kind<T, R, false>;
#define INSTANTIATE_GEMV_ROWS(kind, tname, T) \
  INSTANTIATE_GEMV(kind, tname, T, 1) INSTANTIATE_GEMV(kind, tname, T, 2) \
  INSTANTIATE_GEMV(kind, tname, T, 4) INSTANTIATE_GEMV(kind, tname, T, 8)

INSTANTIATE_GEMV_ROWS(rows, f32, float)
INSTANTIATE_GEMV_ROWS(rows, f16, half)
INSTANTIATE_GEMV_ROWS(rows, bf16, bfloat)
INSTANTIATE_GEMV_ROWS(cols, f32, float)
INSTANTIATE_GEMV_ROWS(cols, f16, half)
INSTANTIATE_GEMV_ROWS(cols, bf16, bfloat)
