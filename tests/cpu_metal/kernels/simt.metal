// Simd operations in divergent code: the active lanes are those on the same
// control-flow path, and they reconverge after an if, a loop or a call.
// Each kernel writes what every lane saw; test_fidelity.py computes what a
// GPU gives from the rules of SIMT execution.
#include <metal_stdlib>
using namespace metal;

// A helper defined above the kernel, called after a divergent simd_sum.
inline float warp_sum(float v) { return simd_sum(v); }

kernel void helper_after_divergent_if(device float* out [[buffer(0)]],
                                      uint lane [[thread_index_in_simdgroup]]) {
  float a = 0.0f;
  if (lane < 8) a = simd_sum(1.0f);
  out[lane] = a + 100.0f * warp_sum(1.0f);
}

// The same, with the helper two calls deep and the divergent sum in a
// helper too (METAL_FUNC: always inlined on a GPU, a call here).
METAL_FUNC float count_lanes() { return simd_sum(1.0f); }
METAL_FUNC float count_twice() { return count_lanes() + count_lanes(); }

kernel void helpers_nested(device float* out [[buffer(0)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  float a = 0.0f;
  if (lane >= 20) a = count_lanes();
  out[lane] = a + 100.0f * count_twice();
}

// One helper called from both branches of an if: two different sums.
kernel void helper_in_both_branches(device float* out [[buffer(0)]],
                                    uint lane [[thread_index_in_simdgroup]]) {
  float x;
  if (lane < 8) x = warp_sum(1.0f);
  else x = warp_sum(2.0f);
  out[lane] = x;
}

// Two instantiations of one template, one per branch: an int and a float
// sum, which must not be merged (nor read each other's bytes).
template <typename T> T tsum(T v) { return simd_sum(v); }

kernel void template_in_both_branches(device float* out [[buffer(0)]],
                                      uint lane [[thread_index_in_simdgroup]]) {
  float x;
  if (lane % 2 == 0) x = float(tsum<int>(3));
  else x = tsum<float>(0.5f);
  out[lane] = x;
}

// Both branches in one macro: the two calls have the same line and column.
#define EITHER_SUM(c) ((c) ? simd_sum(1.0f) : simd_sum(2.0f))
kernel void branches_in_one_macro(device float* out [[buffer(0)]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  out[lane] = EITHER_SUM(lane < 8);
}

// The GPU-valid variant of the three above: the branches written out.
kernel void branches_inline(device float* out [[buffer(0)]],
                            uint lane [[thread_index_in_simdgroup]]) {
  float x;
  if (lane < 8) x = simd_sum(1.0f);
  else x = simd_sum(2.0f);
  out[lane] = x;
}

// A loop with a per-lane trip count and a continue: in iteration k the sum
// runs over the lanes with k <= lane / 8 that did not skip it.
kernel void loop_trip_count_continue(device float* out [[buffer(0)]],
                                     uint lane [[thread_index_in_simdgroup]]) {
  float total = 0.0f;
  for (uint k = 0; k <= lane / 8; ++k) {
    if (k == lane % 3) continue;
    total += float(k + 1) * simd_sum(1.0f);
  }
  out[lane] = total + 1000.0f * simd_sum(1.0f);
}

// The same iterations as a while loop with break, and the count from a
// ballot instead of a sum.
kernel void loop_while_break(device float* out [[buffer(0)]],
                             uint lane [[thread_index_in_simdgroup]]) {
  float total = 0.0f;
  uint k = 0;
  while (true) {
    if (k > lane / 8) break;
    if (k != lane % 3) total += float(k + 1) * float(popcount(uint(ulong(simd_ballot(true)))));
    ++k;
  }
  out[lane] = total + 1000.0f * float(popcount(uint(ulong(simd_ballot(true)))));
}

// Work until every lane is done: each pass sums over the lanes with work left.
kernel void work_until_all_done(device float* out [[buffer(0)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  int left = int(lane % 5) + 1;
  bool todo = true;
  float total = 0.0f;
  uint passes = 0;  // every lane stays until all are done
  while (simd_any(todo)) {
    if (todo) {
      total += simd_sum(1.0f);
      todo = --left > 0;
    }
    ++passes;
  }
  out[lane] = total + 1000.0f * float(passes);
}

// The same passes with a fixed trip count (the largest, 5) and the lanes
// with work left selected by the if.
kernel void work_fixed_passes(device float* out [[buffer(0)]],
                              uint lane [[thread_index_in_simdgroup]]) {
  int left = int(lane % 5) + 1;
  float total = 0.0f;
  for (int pass = 0; pass < 5; ++pass) {
    if (left > 0) {
      total += simd_sum(1.0f);
      --left;
    }
  }
  out[lane] = total + 1000.0f * 5.0f;
}

// A simd operation in the increment of a for loop: written before the body,
// run after it, by every lane of the iteration (those that continued too).
kernel void simd_in_for_increment(device float* out [[buffer(0)]],
                                  uint lane [[thread_index_in_simdgroup]]) {
  float total = 0.0f, inc = 0.0f;
  for (uint k = 0; k < 3; ++k, inc += simd_sum(1.0f)) {
    if (lane % 2 == 0) continue;
    total += simd_sum(1.0f);
  }
  out[lane] = total + 1000.0f * inc;
}

// A simd prefix sum inside a nested loop whose inner trip count depends on
// the lane: the scan runs over the lanes still in the inner loop.
kernel void nested_loop_scan(device float* out [[buffer(0)]],
                             uint lane [[thread_index_in_simdgroup]]) {
  float total = 0.0f;
  for (uint i = 0; i < 2; ++i)
    for (uint j = 0; j < (lane + i) % 4; ++j) total += simd_prefix_inclusive_sum(1.0f);
  out[lane] = total;
}

// Every thread reaches the barrier once, but the first simdgroup in
// iteration 0 and the second in iteration 1: not the same barrier.
kernel void barrier_in_other_iteration(device float* out [[buffer(0)]],
                                       uint lid [[thread_position_in_threadgroup]]) {
  for (uint k = 0; k < 2; ++k)
    if ((k == 0) == (lid < 32)) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = 1.0f;
}

// The GPU-valid variant: every thread runs the loop the same number of
// times and the uneven work is inside it.
kernel void barrier_in_even_loop(device float* out [[buffer(0)]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  float x = 0.0f;
  for (uint k = 0; k < 2; ++k) {
    if (k < 1 + lid / 32) x += 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = x;
}
