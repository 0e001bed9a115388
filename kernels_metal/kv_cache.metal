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

// clang-format off
template [[host_name("kv_append_f32")]] kernel decltype(kv_append<float>) kv_append<float>;
template [[host_name("kv_append_f16")]] kernel decltype(kv_append<half>) kv_append<half>;
template [[host_name("kv_append_bf16")]] kernel decltype(kv_append<bfloat>) kv_append<bfloat>;
// clang-format on
