// An attention layer's decode pieces around torch's scaled_dot_product_attention,
// each one dispatch (csrc/ops/attention.cpp, mps_ext/passes/attention.py):
//
// sigmoid_gate: out = x * sigmoid(gate), the output gate of Qwen3.5/3.6 and
// Qwen3-Next's attention, read where q_proj left it (each head's query, then
// its gate: a strided view, no copy). Rounded where torch rounds
// `x * torch.sigmoid(gate)`: sigmoid in float32 (1 / (1 + exp(-g)), torch's
// formula), rounded to T; the product of two T in float32, rounded to T.
//
// kv_append: a decode step's new key and value rows written into caches
// with spare capacity (mps_ext keeps transformers' DynamicLayer keys and
// values as views of them), where torch.cat would copy the whole cache
// twice a token.
//
// Both move each element once; consecutive lanes take consecutive
// elements, so each simdgroup load and store covers consecutive addresses.
#include <metal_stdlib>
#include "attention_params.h"
#include "activations.h"
using namespace metal;

template <typename T>
[[max_total_threads_per_threadgroup(SIGMOID_GATE_THREADS)]]
kernel void sigmoid_gate(device T* out [[buffer(0)]],
                         const device T* x [[buffer(1)]],
                         const device T* gate [[buffer(2)]],
                         constant SigmoidGateParams& p [[buffer(3)]],
                         uint2 group [[threadgroup_position_in_grid]],
                         uint2 tid2 [[thread_position_in_threadgroup]],
                         uint2 threads2 [[threads_per_threadgroup]]) {
  // Metal wants the position attributes all of one width: the grid's is 2-D.
  const uint col = group.x * threads2.x + tid2.x;
  if (col >= p.n) return;
  const uint row = group.y;
  const T s = T(sigmoid(float(gate[row * p.gate_row_stride + col])));
  out[row * p.n + col] = T(float(x[row * p.n + col]) * float(s));
}

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
template [[host_name("sigmoid_gate_f32")]] kernel decltype(sigmoid_gate<float>) sigmoid_gate<float>;
template [[host_name("sigmoid_gate_f16")]] kernel decltype(sigmoid_gate<half>) sigmoid_gate<half>;
template [[host_name("sigmoid_gate_bf16")]] kernel decltype(sigmoid_gate<bfloat>) sigmoid_gate<bfloat>;
template [[host_name("kv_append_f32")]] kernel decltype(kv_append<float>) kv_append<float>;
template [[host_name("kv_append_f16")]] kernel decltype(kv_append<half>) kv_append<half>;
template [[host_name("kv_append_bf16")]] kernel decltype(kv_append<bfloat>) kv_append<bfloat>;
// clang-format on
