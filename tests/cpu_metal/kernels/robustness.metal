// Kernel bugs that must be errors, not crashes or hangs; next to each, a
// GPU-valid kernel that computes the same way.
#include <metal_stdlib>
using namespace metal;

// An 8x8 product per simdgroup, written by lane 0 of each: with a threadgroup
// of 48 threads the second simdgroup has 16 lanes, and a simdgroup_matrix
// needs 32.
kernel void matrix_per_simdgroup(device float* out [[buffer(0)]],
                                 const device float* a [[buffer(1)]],
                                 uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 A, P;
  simdgroup_load(A, a);
  simdgroup_multiply(P, A, A);
  simdgroup_store(P, out + 64 * sg);
}

// Thread-private arrays: N floats per thread, filled and summed.
template <uint N>
kernel void private_array(device float* out [[buffer(0)]],
                          uint i [[thread_position_in_grid]]) {
  float buf[N];
  for (uint k = 0; k < N; ++k) buf[k] = float(k % 7) + float(i);
  float s = 0.0f;
  for (uint k = 0; k < N; ++k) s += buf[(k * 13) % N];
  out[i] = s;
}
template [[host_name("private_array_1k")]] kernel decltype(private_array<1024>) private_array<1024>;
template [[host_name("private_array_400k")]] kernel decltype(private_array<102400>) private_array<102400>;
template [[host_name("private_array_80m")]] kernel decltype(private_array<20000000>) private_array<20000000>;

// The second simdgroup waits on a threadgroup atomic that the first sets.
kernel void wait_for_other_simdgroup(device uint* out [[buffer(0)]],
                                     uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint flag;
  if (lid == 0) atomic_store_explicit(&flag, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint seen = 0;
  if (lid < 32) {
    if (lid == 0) atomic_store_explicit(&flag, 7u, memory_order_relaxed);
  } else {
    while ((seen = atomic_load_explicit(&flag, memory_order_relaxed)) == 0) {
    }
  }
  out[lid] = seen;
}

// The same wait on a counter: every lane of the first simdgroup adds 1, and
// the second waits until all 32 have.
kernel void wait_for_counter(device uint* out [[buffer(0)]],
                             uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint count;
  if (lid == 0) atomic_store_explicit(&count, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint seen = 0;
  if (lid < 32) {
    atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
  } else {
    while ((seen = atomic_load_explicit(&count, memory_order_relaxed)) < 32) {
    }
  }
  out[lid] = seen;
}

// A spin on a flag no thread ever sets.
kernel void wait_forever(device uint* out [[buffer(0)]],
                         uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint flag;
  if (lid == 0) atomic_store_explicit(&flag, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  while (atomic_load_explicit(&flag, memory_order_relaxed) == 0) {
  }
  out[lid] = 1;
}

// A spin without atomics, on device memory no thread changes.
kernel void spin_on_memory(device uint* out [[buffer(0)]],
                           const device uint* flag [[buffer(1)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  while (flag[0] == 0) {
  }
  out[lid] = 1;
}

// A transposed load or store with a non-zero matrix_origin: the MSL
// specification does not say whether the origin then counts in memory or in
// matrix coordinates, so the two readings address different elements. With
// origin 0 they agree: offset the pointer instead (transposed_at_pointer).
// a and out are 16 x 16, row-major.
kernel void transposed_origin_load(device float* out [[buffer(0)]], const device float* a [[buffer(1)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a, 16, ulong2(8, 1), true);
  simdgroup_store(m, out, 16);
}
kernel void transposed_origin_store(device float* out [[buffer(0)]], const device float* a [[buffer(1)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a, 16);
  simdgroup_store(m, out, 16, ulong2(3, 2), true);
}
// Memory row 1, column 8 of a, transposed, to memory row 2, column 3 of out,
// transposed back.
kernel void transposed_at_pointer(device float* out [[buffer(0)]], const device float* a [[buffer(1)]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a + 1 * 16 + 8, 16, ulong2(0), true);
  simdgroup_store(m, out + 2 * 16 + 3, 16, ulong2(0), true);
}
