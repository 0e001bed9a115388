// Floating point as an Apple GPU computes it.
#include <metal_stdlib>
using namespace metal;

// fp32 and bfloat denormals are flushed, as inputs and as results; half
// keeps them.
kernel void denormals(device float* f [[buffer(0)]],
                      device bfloat* b [[buffer(1)]],
                      device half* h [[buffer(2)]],
                      const device float* x [[buffer(3)]],
                      const device half* hx [[buffer(4)]],
                      uint i [[thread_position_in_grid]]) {
  f[2 * i] = x[i] * 0.5f;        // a denormal result
  f[2 * i + 1] = x[i] + 0.0f;    // a denormal input
  bfloat bx = bfloat(x[i]);           // a bfloat denormal input
  b[i] = bx + bx;
  h[i] = hx[i] * 0.5h;           // half denormals survive
}

// The GPU-valid variant: the same products kept normal by scaling, then
// compared with the smallest normal float.
kernel void scaled_products(device float* f [[buffer(0)]],
                            const device float* x [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  // 2^64 and 2^-64 (hexadecimal float literals are C++17, not MSL 3.1).
  const float up = 18446744073709551616.0f, down = 5.42101086242752217e-20f;
  float scaled = (x[i] * up) * 0.5f;  // exact: a normal number
  f[i] = scaled < up * FLT_MIN ? 0.0f : scaled * down;
}

// sinpi, cospi, tanpi and sign: out has 4 values per input.
kernel void pi_functions(device float* out [[buffer(0)]],
                         const device float* x [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
  out[4 * i + 0] = sinpi(x[i]);
  out[4 * i + 1] = cospi(x[i]);
  out[4 * i + 2] = tanpi(x[i]);
  out[4 * i + 3] = sign(x[i]);
}

// The same on half and on vectors.
kernel void pi_functions_half4(device half4* out [[buffer(0)]],
                               const device half4* x [[buffer(1)]],
                               uint i [[thread_position_in_grid]]) {
  out[4 * i + 0] = sinpi(x[i]);
  out[4 * i + 1] = cospi(x[i]);
  out[4 * i + 2] = tanpi(x[i]);
  out[4 * i + 3] = sign(x[i]);
}

// Half geometric functions (accumulated in float, rounded once; see
// mx_metal.h for the bound against a GPU that rounds every step).
kernel void half_geometry(device half* out [[buffer(0)]],
                          const device half4* a [[buffer(1)]],
                          const device half4* b [[buffer(2)]],
                          uint i [[thread_position_in_grid]]) {
  out[3 * i + 0] = dot(a[i], b[i]);
  out[3 * i + 1] = length(a[i]);
  out[3 * i + 2] = distance(a[i], b[i]);
}
