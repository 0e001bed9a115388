#include <metal_stdlib>
using namespace metal;
// One simdgroup per output row; lanes stride K with half4 loads.
kernel void gemv_f16(device half* y [[buffer(0)]],
                     const device half4* W [[buffer(1)]],
                     const device half4* x [[buffer(2)]],
                     constant uint& K4 [[buffer(3)]],
                     uint row [[threadgroup_position_in_grid]],
                     uint lane [[thread_index_in_simdgroup]]) {
  float acc = 0.0f;
  const device half4* w = W + row * K4;
  for (uint k = lane; k < K4; k += 32) {
    acc += dot(float4(w[k]), float4(x[k]));
  }
  acc = simd_sum(acc);
  if (lane == 0) y[row] = half(acc);
}
