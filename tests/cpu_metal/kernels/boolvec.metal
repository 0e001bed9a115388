// Vector comparisons give bool vectors, and a bool converts to 0 or 1.
#include <metal_stdlib>
using namespace metal;

kernel void comparisons_convert_to_one(device int4* ints [[buffer(0)]],
                                       device float4* floats [[buffer(1)]],
                                       const device float4* a [[buffer(2)]],
                                       const device float4* b [[buffer(3)]],
                                       uint i [[thread_position_in_grid]]) {
  ints[i] = int4(a[i] > b[i]);
  floats[i] = float4(a[i] <= b[i]) + float4(a[i] == b[i]);
}

// Counting with a comparison, as an expert router counts tokens per expert.
kernel void count_matches(device uint4* counts [[buffer(0)]],
                          const device uint4* ids [[buffer(1)]],
                          constant uint& n [[buffer(2)]],
                          uint e [[thread_position_in_grid]]) {
  uint4 acc = 0;
  for (uint k = 0; k < n; ++k) acc += uint4(ids[k] == e);
  counts[e] = acc;
}

// The GPU-valid variant of both: the same counts from scalar comparisons.
kernel void count_matches_scalar(device uint4* counts [[buffer(0)]],
                                 const device uint4* ids [[buffer(1)]],
                                 constant uint& n [[buffer(2)]],
                                 uint e [[thread_position_in_grid]]) {
  uint4 acc = 0;
  for (uint k = 0; k < n; ++k)
    acc += uint4(ids[k].x == e ? 1u : 0u, ids[k].y == e ? 1u : 0u, ids[k].z == e ? 1u : 0u, ids[k].w == e ? 1u : 0u);
  counts[e] = acc;
}

// bool vectors as values: declared from a comparison, stored (4 bytes for a
// bool4), combined, reduced with all/any, used by select.
kernel void bool_vectors(device bool4* masks [[buffer(0)]],
                         device float4* picked [[buffer(1)]],
                         device uint* facts [[buffer(2)]],
                         const device float4* a [[buffer(3)]],
                         const device float4* b [[buffer(4)]],
                         uint i [[thread_position_in_grid]]) {
  bool4 gt = a[i] > b[i];
  bool4 lt = a[i] < b[i];
  masks[i] = gt;
  picked[i] = select(a[i], b[i], lt);
  bool3 three = bool3(gt.x, lt.y, true);
  vec<bool, 2> two = bool2(!gt.z, lt.w);
  facts[4 * i + 0] = all(gt || lt || a[i] == b[i]);
  facts[4 * i + 1] = any(gt && lt);
  facts[4 * i + 2] = sizeof(bool2) * 100 + sizeof(bool3) * 10 + sizeof(bool4);
  facts[4 * i + 3] = uint(three.x) + 2 * uint(three.y) + 4 * uint(three.z) + 8 * uint(two.x) + 16 * uint(two.y);
}
