// The KV cache append, one dispatch (csrc/ops/kv_cache.cpp,
// mps_ext/passes/attention.py): a decode step's new key and value rows
// written into caches with spare capacity (mps_ext keeps transformers'
// DynamicLayer keys and values as views of them), where torch.cat would copy
// the whole cache twice a token. Each element moves once; consecutive lanes
// take consecutive elements, so each simdgroup load and store covers
// consecutive addresses.
#include <metal_stdlib>
#include "kv_cache_params.h"
using namespace metal;

template <typename T>
[[max_total_threads_per_threadgroup(KV_APPEND_MAX_THREADS)]]
kernel void kv_append(device T* k_cache [[buffer(0)]],
                      device T* v_cache [[buffer(1)]],
                      const device T* k [[buffer(2)]],
                      const device T* v [[buffer(3)]],
                      constant KvAppendParams& p [[buffer(4)]],
                      uint3 group [[threadgroup_position_in_grid]],
                      uint3 tid3 [[thread_position_in_threadgroup]],
                      uint3 threads3 [[threads_per_threadgroup]]) {
  // One width for the position attributes, as the grid's (3-D).
  const uint h = group.x, t = group.y, b = group.z, tid = tid3.x, threads = threads3.x;
  const uint dst = ((b * p.heads + h) * p.capacity + p.start + t) * p.head_dim;
  const uint ks = b * p.k_stride_b + h * p.k_stride_h + t * p.k_stride_t;
  const uint vs = b * p.v_stride_b + h * p.v_stride_h + t * p.v_stride_t;
  for (uint d = tid; d < p.head_dim; d += threads) {
    k_cache[dst + d] = k[ks + d];
    v_cache[dst + d] = v[vs + d];
  }
}

// ------------------------------------------------------ decode attention --
// One decoded token's attention over the cache, grouped-query (params in
// kv_cache_params.h): torch's decode kernels give each query head a
// threadgroup that walks its key-value head's whole cache, requesting the
// cache gqa times; here each key and value row is loaded from device memory
// once, into threadgroup memory, and read there by the gqa query heads that
// share it. A lane holds elements lane, lane + 32, ... of its head's query
// and output (consecutive lanes, consecutive threadgroup addresses). The
// softmax is online, in base 2: a running maximum m, sum l and output o,
// rescaled by exp2(m_old - m_new) when the maximum grows.
template <int D>
struct DecodeState {
  float m, l, o[D / 32];
};

template <typename T, int D>
[[max_total_threads_per_threadgroup(KV_DECODE_MAX_SIMDGROUPS * 32)]]
kernel void kv_decode_attention(const device T* q [[buffer(0)]],
                                const device T* k [[buffer(1)]],
                                const device T* v [[buffer(2)]],
                                device T* out [[buffer(3)]],
                                device float* partial_o [[buffer(4)]],
                                device float2* partial_ml [[buffer(5)]],
                                constant DecodeAttentionParams& p [[buffer(6)]],
                                uint3 group [[threadgroup_position_in_grid]],
                                uint3 tid3 [[thread_position_in_threadgroup]],
                                uint3 threads3 [[threads_per_threadgroup]]) {
  constexpr int E = D / 32;
  constexpr uint TILE = KV_DECODE_TILE_ELEMS / D;
  threadgroup T ks[KV_DECODE_TILE_ELEMS], vs[KV_DECODE_TILE_ELEMS];
  // Streams 1.. of each head (gqa * (streams - 1) < KV_DECODE_STREAM_SIMDGROUPS simdgroups), by sg - gqa.
  threadgroup float merge_o[KV_DECODE_STREAM_SIMDGROUPS * D];
  threadgroup float2 merge_ml[KV_DECODE_STREAM_SIMDGROUPS];
  const uint hk = group.x, block = group.y, b = group.z, tid = tid3.x, threads = threads3.x;
  const uint lane = tid % 32, sg = tid / 32, g = sg % p.gqa, stream = sg / p.gqa;
  const uint hq = hk * p.gqa + g;
  const uint first = block * p.keys_per_block, last = min(p.keys, first + p.keys_per_block);
  float qv[E];
  const device T* qh = q + b * p.q_stride_b + hq * p.q_stride_h;
  MPS_EXT_UNROLL
  for (int i = 0; i < E; ++i) qv[i] = float(qh[lane + 32 * i]) * p.scale_log2;
  DecodeState<D> st;
  st.m = -INFINITY, st.l = 0.0f;
  MPS_EXT_UNROLL
  for (int i = 0; i < E; ++i) st.o[i] = 0.0f;
  const device T* kh = k + b * p.k_stride_b + hk * p.k_stride_h;
  const device T* vh = v + b * p.v_stride_b + hk * p.v_stride_h;
  for (uint t0 = first; t0 < last; t0 += TILE) {
    const uint rows = min(TILE, last - t0);
    // The tile's rows, consecutive threads on consecutive elements of a row.
    for (uint e = tid; e < rows * D; e += threads) {
      const uint r = e / D, c = e % D;
      ks[e] = kh[(t0 + r) * p.k_stride_t + c];
      vs[e] = vh[(t0 + r) * p.v_stride_t + c];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint r = stream; r < rows; r += p.streams) {
      float dot = 0.0f;
      MPS_EXT_UNROLL
      for (int i = 0; i < E; ++i) dot += qv[i] * float(ks[r * D + lane + 32 * i]);
      const float s = simd_sum(dot);
      const float m = max(st.m, s);
      const float c = exp2(st.m - m), w = exp2(s - m);
      st.m = m;
      st.l = st.l * c + w;
      MPS_EXT_UNROLL
      for (int i = 0; i < E; ++i) st.o[i] = st.o[i] * c + w * float(vs[r * D + lane + 32 * i]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // The streams of each query head merged by its stream 0, in stream order.
  if (p.streams > 1) {
    if (stream > 0) {
      MPS_EXT_UNROLL
      for (int i = 0; i < E; ++i) merge_o[(sg - p.gqa) * D + lane + 32 * i] = st.o[i];
      if (lane == 0) merge_ml[sg - p.gqa] = float2(st.m, st.l);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (stream > 0) return;
    for (uint s = 1; s < p.streams; ++s) {
      const uint from = (s - 1) * p.gqa + g;
      const float2 ml = merge_ml[from];
      const float m = max(st.m, ml.x);
      // A stream that saw no key of the block has m = -inf: its weight is 0
      // (m is finite: stream 0 has the block's first key).
      const float c = exp2(st.m - m), w = exp2(ml.x - m);
      st.m = m;
      st.l = st.l * c + ml.y * w;
      MPS_EXT_UNROLL
      for (int i = 0; i < E; ++i) st.o[i] = st.o[i] * c + merge_o[from * D + lane + 32 * i] * w;
    }
  }
  const uint row = b * p.q_heads + hq;
  if (p.blocks == 1) {
    const float inv = 1.0f / st.l;
    MPS_EXT_UNROLL
    for (int i = 0; i < E; ++i) out[row * D + lane + 32 * i] = T(st.o[i] * inv);
    return;
  }
  const uint slot = row * p.blocks + block;
  MPS_EXT_UNROLL
  for (int i = 0; i < E; ++i) partial_o[slot * D + lane + 32 * i] = st.o[i];
  if (lane == 0) partial_ml[slot] = float2(st.m, st.l);
}

// The blocks of kv_decode_attention combined: threadgroup (query head,
// batch), a thread per element of the head (head_dim threads). The blocks'
// maxima and sums are read once into threadgroup memory and each block's
// weight exp2(m_block - m) computed once there; every thread then adds the
// blocks in order.
template <typename T>
[[max_total_threads_per_threadgroup(KV_DECODE_MAX_HEAD_DIM)]]
kernel void kv_decode_merge(const device float* partial_o [[buffer(0)]],
                            const device float2* partial_ml [[buffer(1)]],
                            device T* out [[buffer(2)]],
                            constant uint& head_dim [[buffer(3)]],
                            constant uint& blocks [[buffer(4)]],
                            uint2 group [[threadgroup_position_in_grid]],
                            uint2 tid2 [[thread_position_in_threadgroup]],
                            uint2 threads2 [[threads_per_threadgroup]],
                            uint2 groups [[threadgroups_per_grid]]) {
  threadgroup float2 ml[KV_DECODE_MAX_BLOCKS];  // (maximum, sum), then (weight, weighted sum)
  threadgroup float m_all;
  const uint row = group.y * groups.x + group.x, tid = tid2.x, threads = threads2.x;
  for (uint j = tid; j < blocks; j += threads) ml[j] = partial_ml[row * blocks + j];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float m = -INFINITY;
    for (uint j = 0; j < blocks; ++j) m = max(m, ml[j].x);
    m_all = m;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint j = tid; j < blocks; j += threads) {
    const float w = exp2(ml[j].x - m_all);
    ml[j] = float2(w, ml[j].y * w);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid >= head_dim) return;
  float l = 0.0f, acc = 0.0f;
  for (uint j = 0; j < blocks; ++j) {
    l += ml[j].y;
    acc += partial_o[(row * blocks + j) * head_dim + tid] * ml[j].x;
  }
  out[row * head_dim + tid] = T(acc / l);
}

// clang-format off
template [[host_name("kv_append_f32")]] kernel decltype(kv_append<float>) kv_append<float>;
template [[host_name("kv_append_f16")]] kernel decltype(kv_append<half>) kv_append<half>;
template [[host_name("kv_append_bf16")]] kernel decltype(kv_append<bfloat>) kv_append<bfloat>;
#define KV_DECODE_ATTENTION(T, name, D) \
  template [[host_name("kv_decode_attention_" #name "_" #D)]] kernel decltype(kv_decode_attention<T, D>) kv_decode_attention<T, D>;
#define KV_DECODE_TYPE(T, name) \
  KV_DECODE_ATTENTION(T, name, 64) KV_DECODE_ATTENTION(T, name, 128) KV_DECODE_ATTENTION(T, name, 256) \
  template [[host_name("kv_decode_merge_" #name)]] kernel decltype(kv_decode_merge<T>) kv_decode_merge<T>;
KV_DECODE_TYPE(float, f32)
KV_DECODE_TYPE(half, f16)
KV_DECODE_TYPE(bfloat, bf16)
// clang-format on
