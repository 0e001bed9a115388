// Atomics as MSL 3.1 has them, threadgroups in no particular order, and
// device memory shared across threadgroups only when the writer publishes it.
#include <metal_stdlib>
using namespace metal;

// Every atomic function of a device atomic_float (Metal 3.0+).
kernel void float_atomics(device atomic_float* f [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  // f[0]: a sum; f[1]: a maximum by compare-exchange; f[2], f[3]: exchange
  atomic_fetch_add_explicit(&f[0], 0.25f, memory_order_relaxed);
  atomic_fetch_sub_explicit(&f[0], 0.125f, memory_order_relaxed);
  float v = float(i);
  float seen = atomic_load_explicit(&f[1], memory_order_relaxed);
  while (seen < v &&
         !atomic_compare_exchange_weak_explicit(&f[1], &seen, v, memory_order_relaxed, memory_order_relaxed)) {
  }
  if (i == 5) out[0] = atomic_exchange_explicit(&f[2], 42.0f, memory_order_relaxed);
  if (i == 6) atomic_store_explicit(&f[3], -1.5f, memory_order_relaxed);
}

// The GPU-valid variant: the same maximum on the bits of an atomic_uint
// (for non-negative floats the bit patterns order as the values do).
kernel void float_max_as_uint(device atomic_uint* bits [[buffer(0)]],
                              uint i [[thread_position_in_grid]]) {
  atomic_fetch_max_explicit(bits, as_type<uint>(float(i)), memory_order_relaxed);
}

// The order in which threadgroups start: each takes a ticket.
kernel void start_order(device atomic_uint* next [[buffer(0)]],
                        device uint* order [[buffer(1)]],
                        uint group [[threadgroup_position_in_grid]],
                        uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 0) order[atomic_fetch_add_explicit(next, 1u, memory_order_relaxed)] = group;
}

// A reduction in one pass: every threadgroup writes its partial sum, and the
// last one to finish adds the partials. FENCE 0 forgets the device fence
// between the partial and the counter; 1 has threadgroup_barrier(mem_device);
// 2 has atomic_thread_fence (MSL 3.2).
#ifndef FENCE
#define FENCE 1
#endif
kernel void last_group_sums(device float* partial [[buffer(0)]],
                            device atomic_uint* done [[buffer(1)]],
                            device float* total [[buffer(2)]],
                            const device float* x [[buffer(3)]],
                            uint group [[threadgroup_position_in_grid]],
                            uint groups [[threadgroups_per_grid]],
                            uint lid [[thread_position_in_threadgroup]],
                            uint tid [[thread_position_in_grid]]) {
  threadgroup bool last;
  float s = simd_sum(x[tid]);
  if (lid == 0) {
    partial[group] = s;
#if FENCE == 2
    atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
#endif
  }
#if FENCE == 1
  threadgroup_barrier(mem_flags::mem_device);
#endif
  if (lid == 0) last = atomic_fetch_add_explicit(done, 1u, memory_order_relaxed) == groups - 1;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (last && lid == 0) {
    float t = 0.0f;
    for (uint g = 0; g < groups; ++g) t += partial[g];
    total[0] = t;
  }
}

// The GPU-valid variant in two dispatches: partial sums, then their sum.
kernel void partial_sums(device float* partial [[buffer(0)]],
                         const device float* x [[buffer(1)]],
                         uint group [[threadgroup_position_in_grid]],
                         uint lid [[thread_position_in_threadgroup]],
                         uint tid [[thread_position_in_grid]]) {
  float s = simd_sum(x[tid]);
  if (lid == 0) partial[group] = s;
}
kernel void sum_partials(device float* total [[buffer(0)]],
                         const device float* partial [[buffer(1)]],
                         constant uint& groups [[buffer(2)]]) {
  float t = 0.0f;
  for (uint g = 0; g < groups; ++g) t += partial[g];
  total[0] = t;
}
