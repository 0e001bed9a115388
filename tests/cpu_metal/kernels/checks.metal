// Kernels with the bugs the executor must catch (and one that is right).
#include <metal_stdlib>
using namespace metal;

// Reads one element past the end when n is the buffer's length.
kernel void off_by_one(device float* out [[buffer(0)]],
                       const device float* in [[buffer(1)]],
                       constant uint& n [[buffer(2)]],
                       uint i [[thread_position_in_grid]]) {
  if (i > n) return;  // should be i >= n
  out[i % n] = in[i];
}

// Threads past n return before the barrier the others wait at.
kernel void divergent_barrier(device float* out [[buffer(0)]],
                              constant uint& n [[buffer(1)]],
                              uint i [[thread_position_in_grid]],
                              uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  if (i >= n) return;
  t[lid] = float(i);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = t[63 - lid];
}

// Reverses a block through threadgroup memory: with `fixed` the barrier is
// there, without it a thread reads a slot another thread has not written.
template <bool fixed>
kernel void reverse_block(device float* out [[buffer(0)]],
                          const device float* in [[buffer(1)]],
                          uint lid [[thread_position_in_threadgroup]],
                          uint group [[threadgroup_position_in_grid]]) {
  threadgroup float t[64];
  t[lid] = in[group * 64 + lid];
  if (fixed) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[group * 64 + lid] = t[63 - lid];
}
template [[host_name("reverse_with_barrier")]] kernel decltype(reverse_block<true>) reverse_block<true>;
template [[host_name("reverse_missing_barrier")]] kernel decltype(reverse_block<false>) reverse_block<false>;

// Every thread writes the same threadgroup slot.
kernel void write_race(device float* out [[buffer(0)]],
                       uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float slot[1];
  slot[0] = float(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = slot[0];
}

// A barrier that orders execution but not threadgroup memory.
kernel void barrier_without_memory_flag(device float* out [[buffer(0)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32];
  t[lid] = float(lid);
  threadgroup_barrier(mem_flags::mem_none);
  out[lid] = t[31 - lid];
}

// Lanes talk through threadgroup memory with only a simdgroup barrier: right
// within one simdgroup.
kernel void simdgroup_exchange(device float* out [[buffer(0)]],
                               uint lid [[thread_position_in_threadgroup]],
                               uint lane [[thread_index_in_simdgroup]],
                               uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float t[64];
  t[lid] = float(lid);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[sg * 32 + (31 - lane)];
}

// A float4 load from a pointer that is only 4-byte aligned.
kernel void misaligned_vector(device float* out [[buffer(0)]],
                              const device float* in [[buffer(1)]],
                              uint i [[thread_position_in_grid]]) {
  const device float4* v = (const device float4*)(in + 1);
  out[i] = v[i].x;
}

// Half of a simdgroup skips a simdgroup_barrier.
kernel void divergent_simdgroup_barrier(device float* out [[buffer(0)]],
                                        uint lane [[thread_index_in_simdgroup]]) {
  if (lane < 16) simdgroup_barrier(mem_flags::mem_none);
  out[lane] = 1;
}

// Writes through a buffer bound from bytes.
kernel void write_constant(device float* out [[buffer(0)]],
                           uint i [[thread_position_in_grid]]) {
  out[i] = 1;
}

// Over Metal's 32 KiB of threadgroup memory. The sizes depend on a template
// parameter, which check mode does not evaluate: the engine's check at
// dispatch is what catches it (with literal sizes check mode would).
template <int N>
kernel void too_much_threadgroup_memory(device float* out [[buffer(0)]],
                                        uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float big[N];
  threadgroup float more[N / 2];
  big[lid] = 1;
  more[lid] = 2;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = big[lid] + more[lid];
}
template [[host_name("too_much_threadgroup_memory")]] kernel decltype(too_much_threadgroup_memory<6000>)
    too_much_threadgroup_memory<6000>;

// Reads past a threadgroup array into the next one.
kernel void threadgroup_overflow(device float* out [[buffer(0)]],
                                 uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float a[32];
  threadgroup float b[32];
  a[lid] = 1;
  b[lid] = 2;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = a[lid + 1];
}

// Integer division by a zero read from memory.
kernel void divide(device int* out [[buffer(0)]],
                   const device int* in [[buffer(1)]],
                   uint i [[thread_position_in_grid]]) {
  out[i] = 100 / in[i];
}
