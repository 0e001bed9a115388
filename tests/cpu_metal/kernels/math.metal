// The math library, plain, precise:: and fast::, in float and half; and
// threadgroup memory as a threadgroup first sees it.
#include <metal_stdlib>
using namespace metal;

kernel void float_math(device float* out [[buffer(0)]],
                       const device float* x [[buffer(1)]],
                       uint i [[thread_position_in_grid]]) {
  float v = x[i];
  float a = abs(v);
  device float* o = out + 16 * i;
  o[0] = exp(v);
  o[1] = precise::exp(v);
  o[2] = fast::exp(v);
  o[3] = log(a + 1.0f);
  o[4] = sqrt(a);
  o[5] = rsqrt(a + 1.0f);
  o[6] = tanh(v);
  o[7] = sin(v) + cos(v);
  o[8] = exp2(v) - log2(a + 1.0f);
  o[9] = pow(a, 1.5f);
  o[10] = floor(v) + ceil(v) + trunc(v) + round(v);
  o[11] = fract(v);
  o[12] = atan2(v, 2.0f);
  o[13] = fmin(v, 0.5f) + fmax(v, -0.5f) + copysign(1.0f, v);
  o[14] = fma(v, 3.0f, 1.0f);
  o[15] = fast::divide(v, 7.0f) + precise::sqrt(a);
}

kernel void half_math(device half* out [[buffer(0)]],
                      const device half* x [[buffer(1)]],
                      uint i [[thread_position_in_grid]]) {
  half v = x[i];
  device half* o = out + 4 * i;
  o[0] = exp(v);
  o[1] = sqrt(abs(v));
  o[2] = tanh(v);
  o[3] = log(abs(v) + 1.0h);
}

// Reads a threadgroup array before anything writes it: each threadgroup must
// find it poisoned, whatever an earlier threadgroup left there.
kernel void poisoned(device uint* out [[buffer(0)]],
                     uint lid [[thread_position_in_threadgroup]],
                     uint group [[threadgroup_position_in_grid]]) {
  threadgroup uint t[32];
  out[group * 32 + lid] = t[lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  t[lid] = 12345;
}
