// softmax, log_softmax and their backward passes over one dimension of a
// tensor of any rank and strides, accumulating in float.
//
// Three shapes of work, chosen on the host (csrc/ops/softmax.cpp):
//  segment  rows of up to 128 elements: lanes_per_row lanes of a simdgroup
//           share a row, so one threadgroup packs many rows;
//  block    rows of up to 8192 elements: one threadgroup per row;
//  split    longer rows: a row is cut into chunks, one threadgroup each.
//           partial_* writes each chunk's partial reduction, finish_*
//           combines a row's partials and writes the chunk: two dispatches,
//           and a long decode-time row spreads over the whole GPU.
// Each thread keeps its elements in registers between the reduction and the
// write, so segment and block read the input once.
#include <metal_stdlib>
#include "softmax_params.h"
using namespace metal;

// Elements each thread holds.
#define SEGMENT_ELEMENTS 4
#define BLOCK_ELEMENTS 16

// ------------------------------------------------------------- indexing --
struct RowOffsets {
  long x, y, out;
};

// Where row `row` starts in each tensor.
inline RowOffsets row_offsets(constant SoftmaxParams& p, long row) {
  RowOffsets o = {0, 0, 0};
  for (int d = int(p.rank) - 1; d >= 0; --d) {
    long c = row % p.row_sizes[d];
    row /= p.row_sizes[d];
    o.x += c * p.x_strides[d];
    o.y += c * p.y_strides[d];
    o.out += c * p.out_strides[d];
  }
  return o;
}

// ------------------------------------------------------------ reductions --
// (max, sum of exp(x - max)) of the elements seen so far, mergeable in any
// order. It follows torch's results for special values: a NaN anywhere or a
// +inf makes the row NaN; a row of -inf gives 0 / 0 = NaN; -inf elements
// of a finite row contribute exp(-inf) = 0.
struct MaxSum {
  float m;
  float s;
};

inline float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }

// exp(a - m), where an -inf element contributes 0 even if the max is -inf.
inline float exp_from(float a, float m) { return a == -INFINITY ? 0.0f : precise::exp(a - m); }

inline MaxSum merge(MaxSum a, MaxSum b) {
  float m = nan_max(a.m, b.m);
  return MaxSum{m, a.s * exp_from(a.m, m) + b.s * exp_from(b.m, m)};
}

inline MaxSum empty_max_sum() { return MaxSum{-INFINITY, 0.0f}; }

// Reduce across `lanes` consecutive lanes (a power of two up to 32); every
// lane of the group gets the result.
inline MaxSum lanes_merge(MaxSum v, uint lanes) {
  for (ushort offset = ushort(lanes / 2); offset > 0; offset /= 2)
    v = merge(v, MaxSum{simd_shuffle_xor(v.m, offset), simd_shuffle_xor(v.s, offset)});
  return v;
}
inline float lanes_sum(float v, uint lanes) {
  for (ushort offset = ushort(lanes / 2); offset > 0; offset /= 2) v += simd_shuffle_xor(v, offset);
  return v;
}

// Reduce across the threadgroup; every thread gets the result. `scratch`
// holds one partial per simdgroup.
inline MaxSum block_merge(MaxSum v, threadgroup float2* scratch, uint lane, uint sg, uint simdgroups) {
  v = lanes_merge(v, 32);
  if (lane == 0) scratch[sg] = float2(v.m, v.s);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  MaxSum total = empty_max_sum();
  for (uint i = 0; i < simdgroups; ++i) total = merge(total, MaxSum{scratch[i].x, scratch[i].y});
  return total;
}
inline float block_sum(float v, threadgroup float* scratch, uint lane, uint sg, uint simdgroups) {
  v = simd_sum(v);
  if (lane == 0) scratch[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < simdgroups; ++i) total += scratch[i];
  return total;
}

// ----------------------------------------------------------- the results --
inline float softmax_value(float x, MaxSum t, bool log) {
  return log ? x - t.m - precise::log(t.s) : exp_from(x, t.m) / t.s;
}

// grad_input of softmax: y * (g - sum(g * y)); of log_softmax: g - exp(y) * sum(g).
inline float backward_term(float g, float y, bool log) { return log ? g : g * y; }
inline float backward_value(float g, float y, float sum, bool log) {
  return log ? g - precise::exp(y) * sum : y * (g - sum);
}

// --------------------------------------------------------------- forward --
template <typename T, typename O>
[[max_total_threads_per_threadgroup(SOFTMAX_SEGMENT_THREADS)]]
kernel void softmax_segment(device O* out [[buffer(0)]],
                            const device T* x [[buffer(1)]],
                            constant SoftmaxParams& p [[buffer(2)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint threads [[threads_per_threadgroup]],
                            uint group [[threadgroup_position_in_grid]]) {
  const uint lanes = p.lanes_per_row;
  const long row = long(group) * (threads / lanes) + tid / lanes;
  const uint lane = tid % lanes;
  const bool valid = row < p.rows;  // idle lanes still join the shuffles
  RowOffsets o = valid ? row_offsets(p, row) : RowOffsets{0, 0, 0};
  float v[SEGMENT_ELEMENTS];
  MaxSum st = empty_max_sum();
  for (uint j = 0; j < SEGMENT_ELEMENTS; ++j) {
    long k = lane + long(j) * lanes;
    if (valid && k < p.row_length) {
      v[j] = float(x[o.x + k * p.x_dim_stride]);
      st = merge(st, MaxSum{v[j], 1.0f});
    }
  }
  st = lanes_merge(st, lanes);
  for (uint j = 0; j < SEGMENT_ELEMENTS; ++j) {
    long k = lane + long(j) * lanes;
    if (valid && k < p.row_length) out[o.out + k * p.out_dim_stride] = O(softmax_value(v[j], st, p.log));
  }
}

template <typename T, typename O>
[[max_total_threads_per_threadgroup(SOFTMAX_BLOCK_MAX_THREADS)]]
kernel void softmax_block(device O* out [[buffer(0)]],
                          const device T* x [[buffer(1)]],
                          constant SoftmaxParams& p [[buffer(2)]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint threads [[threads_per_threadgroup]],
                          uint row [[threadgroup_position_in_grid]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float2 scratch[32];
  RowOffsets o = row_offsets(p, row);
  float v[BLOCK_ELEMENTS];
  MaxSum st = empty_max_sum();
  for (uint j = 0; j < BLOCK_ELEMENTS; ++j) {
    long k = tid + long(j) * threads;
    if (k < p.row_length) {
      v[j] = float(x[o.x + k * p.x_dim_stride]);
      st = merge(st, MaxSum{v[j], 1.0f});
    }
  }
  st = block_merge(st, scratch, lane, sg, simdgroups);
  for (uint j = 0; j < BLOCK_ELEMENTS; ++j) {
    long k = tid + long(j) * threads;
    if (k < p.row_length) out[o.out + k * p.out_dim_stride] = O(softmax_value(v[j], st, p.log));
  }
}

// Split rows run on a 2-D grid (chunk, row) of 1-D threadgroups. Metal wants
// every position and size attribute of a kernel with the same number of
// components, so the threadgroup size comes as uint2 too.
//
// Split rows, pass 1: the (max, sum) of each chunk.
template <typename T>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_partial(device float2* partials [[buffer(0)]],
                            const device T* x [[buffer(1)]],
                            constant SoftmaxParams& p [[buffer(2)]],
                            uint tid [[thread_index_in_threadgroup]],
                            uint2 group_size [[threads_per_threadgroup]],
                            uint2 group [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]],
                            uint sg [[simdgroup_index_in_threadgroup]],
                            uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float2 scratch[32];
  const uint chunk = group.x, row = group.y, threads = group_size.x;
  RowOffsets o = row_offsets(p, row);
  const long begin = long(chunk) * p.chunk_length;
  const long end = min(begin + p.chunk_length, p.row_length);
  MaxSum st = empty_max_sum();
  for (long k = begin + tid; k < end; k += threads) st = merge(st, MaxSum{float(x[o.x + k * p.x_dim_stride]), 1.0f});
  st = block_merge(st, scratch, lane, sg, simdgroups);
  if (tid == 0) partials[long(row) * p.chunks + chunk] = float2(st.m, st.s);
}

// Split rows, pass 2: combine the row's partials and write the chunk.
template <typename T, typename O>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_finish(device O* out [[buffer(0)]],
                           const device T* x [[buffer(1)]],
                           constant SoftmaxParams& p [[buffer(2)]],
                           const device float2* partials [[buffer(3)]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint2 group_size [[threads_per_threadgroup]],
                           uint2 group [[threadgroup_position_in_grid]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float2 scratch[32];
  const uint chunk = group.x, row = group.y, threads = group_size.x;
  MaxSum st = empty_max_sum();
  for (long c = tid; c < p.chunks; c += threads) {
    float2 q = partials[long(row) * p.chunks + c];
    st = merge(st, MaxSum{q.x, q.y});
  }
  st = block_merge(st, scratch, lane, sg, simdgroups);
  RowOffsets o = row_offsets(p, row);
  const long begin = long(chunk) * p.chunk_length;
  const long end = min(begin + p.chunk_length, p.row_length);
  for (long k = begin + tid; k < end; k += threads)
    out[o.out + k * p.out_dim_stride] = O(softmax_value(float(x[o.x + k * p.x_dim_stride]), st, p.log));
}

// -------------------------------------------------------------- backward --
// g: grad_output, y: the forward output (same dtype G); out: grad_input.
template <typename G, typename O>
[[max_total_threads_per_threadgroup(SOFTMAX_SEGMENT_THREADS)]]
kernel void softmax_backward_segment(device O* out [[buffer(0)]],
                                     const device G* g [[buffer(1)]],
                                     constant SoftmaxParams& p [[buffer(2)]],
                                     const device G* y [[buffer(3)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint threads [[threads_per_threadgroup]],
                                     uint group [[threadgroup_position_in_grid]]) {
  const uint lanes = p.lanes_per_row;
  const long row = long(group) * (threads / lanes) + tid / lanes;
  const uint lane = tid % lanes;
  const bool valid = row < p.rows;
  RowOffsets o = valid ? row_offsets(p, row) : RowOffsets{0, 0, 0};
  float gv[SEGMENT_ELEMENTS], yv[SEGMENT_ELEMENTS];
  float sum = 0.0f;
  for (uint j = 0; j < SEGMENT_ELEMENTS; ++j) {
    long k = lane + long(j) * lanes;
    if (valid && k < p.row_length) {
      gv[j] = float(g[o.x + k * p.x_dim_stride]);
      yv[j] = float(y[o.y + k * p.y_dim_stride]);
      sum += backward_term(gv[j], yv[j], p.log);
    }
  }
  sum = lanes_sum(sum, lanes);
  for (uint j = 0; j < SEGMENT_ELEMENTS; ++j) {
    long k = lane + long(j) * lanes;
    if (valid && k < p.row_length) out[o.out + k * p.out_dim_stride] = O(backward_value(gv[j], yv[j], sum, p.log));
  }
}

template <typename G, typename O>
[[max_total_threads_per_threadgroup(SOFTMAX_BLOCK_MAX_THREADS)]]
kernel void softmax_backward_block(device O* out [[buffer(0)]],
                                   const device G* g [[buffer(1)]],
                                   constant SoftmaxParams& p [[buffer(2)]],
                                   const device G* y [[buffer(3)]],
                                   uint tid [[thread_index_in_threadgroup]],
                                   uint threads [[threads_per_threadgroup]],
                                   uint row [[threadgroup_position_in_grid]],
                                   uint lane [[thread_index_in_simdgroup]],
                                   uint sg [[simdgroup_index_in_threadgroup]],
                                   uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[32];
  RowOffsets o = row_offsets(p, row);
  float gv[BLOCK_ELEMENTS], yv[BLOCK_ELEMENTS];
  float sum = 0.0f;
  for (uint j = 0; j < BLOCK_ELEMENTS; ++j) {
    long k = tid + long(j) * threads;
    if (k < p.row_length) {
      gv[j] = float(g[o.x + k * p.x_dim_stride]);
      yv[j] = float(y[o.y + k * p.y_dim_stride]);
      sum += backward_term(gv[j], yv[j], p.log);
    }
  }
  sum = block_sum(sum, scratch, lane, sg, simdgroups);
  for (uint j = 0; j < BLOCK_ELEMENTS; ++j) {
    long k = tid + long(j) * threads;
    if (k < p.row_length) out[o.out + k * p.out_dim_stride] = O(backward_value(gv[j], yv[j], sum, p.log));
  }
}

template <typename G>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_backward_partial(device float* partials [[buffer(0)]],
                                     const device G* g [[buffer(1)]],
                                     constant SoftmaxParams& p [[buffer(2)]],
                                     const device G* y [[buffer(3)]],
                                     uint tid [[thread_index_in_threadgroup]],
                                     uint2 group_size [[threads_per_threadgroup]],
                                     uint2 group [[threadgroup_position_in_grid]],
                                     uint lane [[thread_index_in_simdgroup]],
                                     uint sg [[simdgroup_index_in_threadgroup]],
                                     uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[32];
  const uint chunk = group.x, row = group.y, threads = group_size.x;
  RowOffsets o = row_offsets(p, row);
  const long begin = long(chunk) * p.chunk_length;
  const long end = min(begin + p.chunk_length, p.row_length);
  float sum = 0.0f;
  for (long k = begin + tid; k < end; k += threads)
    sum += backward_term(float(g[o.x + k * p.x_dim_stride]), float(y[o.y + k * p.y_dim_stride]), p.log);
  sum = block_sum(sum, scratch, lane, sg, simdgroups);
  if (tid == 0) partials[long(row) * p.chunks + chunk] = sum;
}

template <typename G, typename O>
[[max_total_threads_per_threadgroup(SOFTMAX_SPLIT_THREADS)]]
kernel void softmax_backward_finish(device O* out [[buffer(0)]],
                                    const device G* g [[buffer(1)]],
                                    constant SoftmaxParams& p [[buffer(2)]],
                                    const device G* y [[buffer(3)]],
                                    const device float* partials [[buffer(4)]],
                                    uint tid [[thread_index_in_threadgroup]],
                                    uint2 group_size [[threads_per_threadgroup]],
                                    uint2 group [[threadgroup_position_in_grid]],
                                    uint lane [[thread_index_in_simdgroup]],
                                    uint sg [[simdgroup_index_in_threadgroup]],
                                    uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float scratch[32];
  const uint chunk = group.x, row = group.y, threads = group_size.x;
  float sum = 0.0f;
  for (long c = tid; c < p.chunks; c += threads) sum += partials[long(row) * p.chunks + c];
  sum = block_sum(sum, scratch, lane, sg, simdgroups);
  RowOffsets o = row_offsets(p, row);
  const long begin = long(chunk) * p.chunk_length;
  const long end = min(begin + p.chunk_length, p.row_length);
  for (long k = begin + tid; k < end; k += threads)
    out[o.out + k * p.out_dim_stride] =
        O(backward_value(float(g[o.x + k * p.x_dim_stride]), float(y[o.y + k * p.y_dim_stride]), sum, p.log));
}

// ------------------------------------------------------- instantiations --
// Forward: input -> output dtype (same, or half -> float for half_to_float).
#define INSTANTIATE_FORWARD(in_name, T, out_name, O)                                          \
  template [[host_name("softmax_segment_" #in_name "_" #out_name)]] kernel                    \
      decltype(softmax_segment<T, O>) softmax_segment<T, O>;                                  \
  template [[host_name("softmax_block_" #in_name "_" #out_name)]] kernel                      \
      decltype(softmax_block<T, O>) softmax_block<T, O>;                                      \
  template [[host_name("softmax_finish_" #in_name "_" #out_name)]] kernel                     \
      decltype(softmax_finish<T, O>) softmax_finish<T, O>;
INSTANTIATE_FORWARD(f32, float, f32, float)
INSTANTIATE_FORWARD(f16, half, f16, half)
INSTANTIATE_FORWARD(bf16, bfloat, bf16, bfloat)
INSTANTIATE_FORWARD(f16, half, f32, float)
template [[host_name("softmax_partial_f32")]] kernel decltype(softmax_partial<float>) softmax_partial<float>;
template [[host_name("softmax_partial_f16")]] kernel decltype(softmax_partial<half>) softmax_partial<half>;
template [[host_name("softmax_partial_bf16")]] kernel decltype(softmax_partial<bfloat>) softmax_partial<bfloat>;

// Backward: grad dtype -> grad_input dtype (same, or float -> half / bfloat
// after a half_to_float forward).
#define INSTANTIATE_BACKWARD(g_name, G, out_name, O)                                          \
  template [[host_name("softmax_backward_segment_" #g_name "_" #out_name)]] kernel            \
      decltype(softmax_backward_segment<G, O>) softmax_backward_segment<G, O>;                \
  template [[host_name("softmax_backward_block_" #g_name "_" #out_name)]] kernel              \
      decltype(softmax_backward_block<G, O>) softmax_backward_block<G, O>;                    \
  template [[host_name("softmax_backward_finish_" #g_name "_" #out_name)]] kernel             \
      decltype(softmax_backward_finish<G, O>) softmax_backward_finish<G, O>;
INSTANTIATE_BACKWARD(f32, float, f32, float)
INSTANTIATE_BACKWARD(f16, half, f16, half)
INSTANTIATE_BACKWARD(bf16, bfloat, bf16, bfloat)
INSTANTIATE_BACKWARD(f32, float, f16, half)
template [[host_name("softmax_backward_partial_f32")]] kernel decltype(softmax_backward_partial<float>) softmax_backward_partial<float>;
template [[host_name("softmax_backward_partial_f16")]] kernel decltype(softmax_backward_partial<half>) softmax_backward_partial<half>;
template [[host_name("softmax_backward_partial_bf16")]] kernel decltype(softmax_backward_partial<bfloat>) softmax_backward_partial<bfloat>;
