// Prefix scans: within a simdgroup, and across a threadgroup.
#include <metal_stdlib>
using namespace metal;

kernel void simd_scans(device float* out [[buffer(0)]],
                       const device float* in [[buffer(1)]],
                       uint tid [[thread_position_in_grid]]) {
  float v = in[tid];
  out[4 * tid + 0] = simd_prefix_inclusive_sum(v);
  out[4 * tid + 1] = simd_prefix_exclusive_sum(v);
  out[4 * tid + 2] = simd_prefix_inclusive_product(v);
  out[4 * tid + 3] = simd_prefix_exclusive_product(v);
}

// Inclusive scan of a whole threadgroup (up to 1024 integers): scan in each
// simdgroup, scan the simdgroup totals, add.
kernel void block_scan(device uint* out [[buffer(0)]],
                       const device uint* in [[buffer(1)]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]],
                       uint sg [[simdgroup_index_in_threadgroup]],
                       uint sg_count [[simdgroups_per_threadgroup]],
                       uint base [[threadgroup_position_in_grid]],
                       uint size [[threads_per_threadgroup]]) {
  threadgroup uint totals[32];
  uint i = base * size + tid;
  uint v = in[i];
  uint s = simd_prefix_inclusive_sum(v);
  if (lane == 31 || tid == size - 1) totals[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    uint t = lane < sg_count ? totals[lane] : 0u;
    t = simd_prefix_exclusive_sum(t);
    if (lane < sg_count) totals[lane] = t;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = s + totals[sg];
}
