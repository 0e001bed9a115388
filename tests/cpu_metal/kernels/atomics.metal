// Atomics on device and threadgroup memory.
#include <metal_stdlib>
using namespace metal;

kernel void histogram(device atomic_uint* bins [[buffer(0)]],
                      const device uint* in [[buffer(1)]],
                      constant uint& bin_count [[buffer(2)]],
                      uint tid [[thread_position_in_grid]],
                      uint lid [[thread_position_in_threadgroup]],
                      uint size [[threads_per_threadgroup]]) {
  // Count in threadgroup memory first, then add the counts to the device.
  threadgroup atomic_uint local[64];
  for (uint b = lid; b < bin_count; b += size) atomic_store_explicit(&local[b], 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&local[in[tid] % bin_count], 1u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint b = lid; b < bin_count; b += size)
    atomic_fetch_add_explicit(&bins[b], atomic_load_explicit(&local[b], memory_order_relaxed), memory_order_relaxed);
}

kernel void min_max_sum(device atomic_int* result [[buffer(0)]],
                        device atomic_float* fsum [[buffer(1)]],
                        const device int* in [[buffer(2)]],
                        uint tid [[thread_position_in_grid]]) {
  atomic_fetch_min_explicit(&result[0], in[tid], memory_order_relaxed);
  atomic_fetch_max_explicit(&result[1], in[tid], memory_order_relaxed);
  atomic_fetch_or_explicit(&result[2], 1 << (in[tid] & 15), memory_order_relaxed);
  // A compare-and-swap loop: add only if the sum stays below a cap.
  int old = atomic_load_explicit(&result[3], memory_order_relaxed);
  while (old + 1 <= 1000 &&
         !atomic_compare_exchange_weak_explicit(&result[3], &old, old + 1, memory_order_relaxed, memory_order_relaxed)) {
  }
  atomic_fetch_add_explicit(fsum, 0.5f, memory_order_relaxed);
}
