// Vector types: constructors, swizzles, arithmetic, conversions, packed types.
#include <metal_stdlib>
using namespace metal;

kernel void vector_ops(device float* out [[buffer(0)]],
                       const device float4* a [[buffer(1)]],
                       const device packed_float3* p [[buffer(2)]],
                       const device packed_half4* h [[buffer(3)]],
                       uint tid [[thread_position_in_grid]]) {
  float4 v = a[tid];
  float4 w = float4(v.wz, 1.0, v.x);          // concatenating constructor
  float3 q = float3(p[tid]);                  // from a packed 3-vector
  float2 s = v.xy * 2 + v.zw;                 // swizzle arithmetic, scalar broadcast
  float4 r = v;
  r.yx = v.xy;                                // swizzle assignment
  int4 iv = int4(v);                          // element-wise conversion
  half4 hv = h[tid];                          // packed -> vector
  float4 hf = float4(hv) + float4(0.5h);
  device float* o = out + 24 * tid;
  o[0] = w.x; o[1] = w.y; o[2] = w.z; o[3] = w.w;
  o[4] = q.x + q.y * q.z;
  o[5] = s.x; o[6] = s.y;
  o[7] = r.x; o[8] = r.y;
  o[9] = float(iv.x + iv.w);
  o[10] = dot(v, float4(1, 2, 3, 4));
  o[11] = length(v.xyz);
  o[12] = hf.x + hf.w;
  o[13] = as_type<float>(as_type<uint>(v.x) ^ 0x80000000u);  // bit flip of the sign
  float4 m = max(v, float4(0.0f));
  o[14] = m.x + m.y + m.z + m.w;
  o[15] = clamp(v.x, -1.0f, 1.0f);
  o[16] = select(v.x, v.y, v.z > 0);
  o[17] = all(v > float4(-10)) ? 1 : 0;
  o[18] = any(v > float4(10)) ? 1 : 0;
  uint2 u = uint2(7, 9);
  o[19] = float(u.yx.x);
  o[20] = fma(v.x, v.y, v.z);
  o[21] = v.even.x + v.odd.y;                 // .even = (x, z), .odd = (y, w)
  o[22] = v.hi.x - v.lo.y;                    // .hi = (z, w), .lo = (x, y)
  o[23] = float(sizeof(packed_float3) * 100 + sizeof(float3));
}
