// Builtins of every thread, for uniform and non-uniform grids.
#include <metal_stdlib>
using namespace metal;

kernel void positions(device uint* out [[buffer(0)]],
                      constant uint3& grid [[buffer(1)]],
                      uint3 gid [[thread_position_in_grid]],
                      uint3 lid [[thread_position_in_threadgroup]],
                      uint3 group [[threadgroup_position_in_grid]],
                      uint3 tpt [[threads_per_threadgroup]],
                      uint3 dtpt [[dispatch_threads_per_threadgroup]],
                      uint3 groups [[threadgroups_per_grid]],
                      uint3 tpg [[threads_per_grid]],
                      uint index [[thread_index_in_threadgroup]],
                      ushort lane [[thread_index_in_simdgroup]],
                      ushort sg [[simdgroup_index_in_threadgroup]],
                      uint sgs [[simdgroups_per_threadgroup]],
                      uint width [[threads_per_simdgroup]]) {
  uint linear = (gid.z * grid.y + gid.y) * grid.x + gid.x;
  device uint* o = out + 24 * linear;
  o[0] = gid.x; o[1] = gid.y; o[2] = gid.z;
  o[3] = lid.x; o[4] = lid.y; o[5] = lid.z;
  o[6] = group.x; o[7] = group.y; o[8] = group.z;
  o[9] = tpt.x; o[10] = tpt.y; o[11] = tpt.z;
  o[12] = dtpt.x; o[13] = dtpt.y; o[14] = dtpt.z;
  o[15] = groups.x; o[16] = groups.y; o[17] = groups.z;
  o[18] = tpg.x * tpg.y * tpg.z;
  o[19] = index; o[20] = lane; o[21] = sg; o[22] = sgs; o[23] = width + 1;
}
