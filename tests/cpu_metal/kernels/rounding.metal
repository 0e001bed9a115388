// half and bfloat: conversions round to nearest even, and arithmetic rounds
// to the type after every operation.
#include <metal_stdlib>
using namespace metal;

kernel void to_half_and_bfloat(device half* h [[buffer(0)]],
                               device bfloat* b [[buffer(1)]],
                               const device float* x [[buffer(2)]],
                               uint i [[thread_position_in_grid]]) {
  h[i] = half(x[i]);
  b[i] = bfloat(x[i]);
}

// out = a * b + c, each operation rounded to T.
template <typename T>
kernel void fused_in_type(device T* out [[buffer(0)]],
                          const device T* a [[buffer(1)]],
                          const device T* b [[buffer(2)]],
                          const device T* c [[buffer(3)]],
                          uint i [[thread_position_in_grid]]) {
  T p = a[i] * b[i];
  out[i] = p + c[i];
}
template [[host_name("mul_add_half")]] kernel void fused_in_type<half>(device half*, const device half*, const device half*, const device half*, uint);
template [[host_name("mul_add_bfloat")]] kernel void fused_in_type<bfloat>(device bfloat*, const device bfloat*, const device bfloat*, const device bfloat*, uint);

// Vector conversions between the three float types.
kernel void vector_rounding(device half4* h [[buffer(0)]],
                            device bfloat4* b [[buffer(1)]],
                            const device float4* x [[buffer(2)]],
                            uint i [[thread_position_in_grid]]) {
  h[i] = half4(x[i]);
  b[i] = bfloat4(x[i]);
}
