// Float-to-integer conversions of NaN or out-of-range values are undefined
// in Metal: the executor reports them with the line.
#include <metal_stdlib>
using namespace metal;

kernel void to_int(device int* out [[buffer(0)]],
                   const device float* x [[buffer(1)]],
                   uint i [[thread_position_in_grid]]) {
  out[i] = int(x[i]);
}

kernel void to_uchar(device uchar* out [[buffer(0)]],
                     const device float* x [[buffer(1)]],
                     uint i [[thread_position_in_grid]]) {
  out[i] = uchar(x[i]);
}

kernel void to_int4(device int4* out [[buffer(0)]],
                    const device float4* x [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  out[i] = int4(x[i]);
}

kernel void half_to_short_implicit(device short* out [[buffer(0)]],
                                   const device half* x [[buffer(1)]],
                                   uint i [[thread_position_in_grid]]) {
  short s = x[i];
  out[i] = s;
}

// The GPU-valid variant, as a quantizer must be written: clamp first (NaN
// becomes 0), then convert.
kernel void to_char_clamped(device char* out [[buffer(0)]],
                            const device float* x [[buffer(1)]],
                            uint i [[thread_position_in_grid]]) {
  float v = isnan(x[i]) ? 0.0f : clamp(x[i], -128.0f, 127.0f);
  out[i] = char(v);
}
