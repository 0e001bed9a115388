// The attention layer's output gate, one dispatch (csrc/ops/attention_gate.cpp,
// mps_ext/passes/attention.py): out = x * sigmoid(gate), the output gate of
// Qwen3.5/3.6 and Qwen3-Next's attention, read where q_proj left it (each
// head's query, then its gate: a strided view, no copy). Rounded where torch
// rounds `x * torch.sigmoid(gate)`: sigmoid in float32 (1 / (1 + exp(-g)),
// torch's formula), rounded to T; the product of two T in float32, rounded
// to T. Each element moves once; consecutive lanes take consecutive
// elements, so each simdgroup load and store covers consecutive addresses.
#include <metal_stdlib>
#include "attention_gate_params.h"
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
  out[row * p.n + col] = sigmoid_gated<T>(x[row * p.n + col], gate[row * p.gate_row_stride + col]);
}

// clang-format off
template [[host_name("sigmoid_gate_f32")]] kernel decltype(sigmoid_gate<float>) sigmoid_gate<float>;
template [[host_name("sigmoid_gate_f16")]] kernel decltype(sigmoid_gate<half>) sigmoid_gate<half>;
template [[host_name("sigmoid_gate_bf16")]] kernel decltype(sigmoid_gate<bfloat>) sigmoid_gate<bfloat>;
// clang-format on
