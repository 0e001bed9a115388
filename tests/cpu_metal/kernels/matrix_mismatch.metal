// A Metal compiler rejects this: a float matrix loaded from half memory.
#include <metal_stdlib>
using namespace metal;

kernel void load_half_into_float(device float* out [[buffer(0)]],
                                 const device half* a [[buffer(1)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a);
  simdgroup_store(m, out);
}
