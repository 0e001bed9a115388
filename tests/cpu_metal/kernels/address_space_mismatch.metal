// Check mode must reject this, as Metal's compiler does: a device pointer
// passed where a thread pointer is expected, and a threadgroup pointer where
// a device one is.
#include <metal_stdlib>
using namespace metal;

void store_private(thread float* p, float v) { *p = v; }
void store_device(device float* p, float v) { *p = v; }

kernel void mixes_address_spaces(device float* out [[buffer(0)]],
                                 uint i [[thread_position_in_grid]]) {
  threadgroup float t[32];
  store_private(out + i, 1.0f);
  store_device(t, 2.0f);
}
