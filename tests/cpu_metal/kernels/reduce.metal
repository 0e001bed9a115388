// Threadgroup reductions: the building block of softmax and GEMV.
#include <metal_stdlib>
using namespace metal;

// Sum of each threadgroup's slice of `in`, in two levels: simd_sum inside a
// simdgroup, then the simdgroups' partial sums through threadgroup memory.
// `partial` is a function-scope threadgroup array, `scratch` is sized by the
// host ([[threadgroup(0)]]).
kernel void block_sum(device float* out [[buffer(0)]],
                      const device float* in [[buffer(1)]],
                      constant uint& n [[buffer(2)]],
                      threadgroup float* scratch [[threadgroup(0)]],
                      uint tid [[thread_index_in_threadgroup]],
                      uint group [[threadgroup_position_in_grid]],
                      uint group_size [[threads_per_threadgroup]],
                      uint lane [[thread_index_in_simdgroup]],
                      uint sg [[simdgroup_index_in_threadgroup]],
                      uint sg_count [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[32];
  uint i = group * group_size + tid;
  float v = i < n ? in[i] : 0.0f;
  scratch[tid] = v;  // read back below by another thread: needs the barrier
  float s = simd_sum(v);
  if (lane == 0) partial[sg] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    float t = lane < sg_count ? partial[lane] : 0.0f;
    t = simd_sum(t);
    if (lane == 0) out[group] = t;
  }
  // Every thread checks its neighbour's value survived in threadgroup memory.
  if (scratch[(tid + 1) % group_size] != ((group * group_size + (tid + 1) % group_size) < n ? in[group * group_size + (tid + 1) % group_size] : 0.0f))
    out[group] = NAN;
}

// The maximum, with a tree over threadgroup memory and a barrier per level.
kernel void tree_max(device float* out [[buffer(0)]],
                     const device float* in [[buffer(1)]],
                     uint tid [[thread_position_in_threadgroup]],
                     uint group [[threadgroup_position_in_grid]]) {
  threadgroup float buf[256];
  buf[tid] = in[group * 256 + tid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 128; stride > 0; stride /= 2) {
    if (tid < stride) buf[tid] = max(buf[tid], buf[tid + stride]);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (tid == 0) out[group] = buf[0];
}

// Every simd reduction of an integer over the active lanes.
kernel void simd_reductions(device int* out [[buffer(0)]],
                            const device int* in [[buffer(1)]],
                            uint tid [[thread_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]]) {
  int v = in[tid];
  int r[7] = {simd_sum(v), simd_product((v & 1) ? -1 : 1), simd_min(v), simd_max(v),
              simd_and(v), simd_or(v), simd_xor(v)};
  if (lane == 0)
    for (int k = 0; k < 7; ++k) out[tid / 32 * 7 + k] = r[k];
}
