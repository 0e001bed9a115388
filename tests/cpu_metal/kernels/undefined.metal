// Kernels with behaviour Metal leaves undefined or unspecified, each next to
// the correct code (tests/cpu_metal/test_undefined.py).
#include <metal_stdlib>
using namespace metal;

// ------------------------------------------------ device memory races --
// Each thread writes its element, then reads its neighbour's. MODE 0: no
// barrier; 1: a barrier for threadgroup memory only; 2: mem_device.
kernel void neighbour(device float* a [[buffer(0)]],
                      device float* out [[buffer(1)]],
                      constant uint& mode [[buffer(2)]],
                      uint i [[thread_position_in_threadgroup]],
                      uint n [[threads_per_threadgroup]],
                      uint g [[threadgroup_position_in_grid]]) {
  device float* mine = a + g * n;
  mine[i] = float(g * n + i) * 2.0f;
  if (mode == 1) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (mode == 2) threadgroup_barrier(mem_flags::mem_device);
  out[g * n + i] = mine[(i + 1) % n];  // the neighbour's element
}

// Every thread adds into one sum: a read-modify-write race.
kernel void shared_sum(device float* sum [[buffer(0)]],
                       const device float* x [[buffer(1)]],
                       uint i [[thread_position_in_grid]]) {
  sum[0] += x[i];
}

// The same done right: one thread adds, after the others wrote.
kernel void shared_sum_after_barrier(device float* partial [[buffer(0)]],
                                     device float* sum [[buffer(1)]],
                                     const device float* x [[buffer(2)]],
                                     uint i [[thread_position_in_grid]],
                                     uint n [[threads_per_threadgroup]]) {
  partial[i] = x[i] * x[i];
  threadgroup_barrier(mem_flags::mem_device);
  if (i == 0) {
    float s = 0.0f;
    for (uint k = 0; k < n; ++k) s += partial[k];
    sum[0] = s;
  }
}

// Lanes of one simdgroup exchange through device memory, ordered by a
// simdgroup_barrier with mem_device (MODE 1) or not ordered (MODE 0).
kernel void simd_exchange(device float* a [[buffer(0)]],
                          device float* out [[buffer(1)]],
                          constant uint& mode [[buffer(2)]],
                          uint i [[thread_index_in_simdgroup]]) {
  a[i] = float(i);
  if (mode == 1) simdgroup_barrier(mem_flags::mem_device);
  out[i] = a[31 - i];
}

// ---------------------------------------------------- integer division --
kernel void quotients(device int* q [[buffer(0)]],
                      const device int* a [[buffer(1)]],
                      const device int* b [[buffer(2)]],
                      uint i [[thread_position_in_grid]]) {
  q[i] = a[i] / b[i];
}

kernel void remainders(device int* r [[buffer(0)]],
                       const device int* a [[buffer(1)]],
                       const device int* b [[buffer(2)]],
                       uint i [[thread_position_in_grid]]) {
  r[i] = a[i] % b[i];
}

kernel void unsigned_quotients(device uint* q [[buffer(0)]],
                               const device uint* a [[buffer(1)]],
                               const device uint* b [[buffer(2)]],
                               uint i [[thread_position_in_grid]]) {
  q[i] = a[i] / b[i];
}

kernel void vector_quotients(device int2* q [[buffer(0)]],
                             const device int2* a [[buffer(1)]],
                             const device int2* b [[buffer(2)]],
                             uint i [[thread_position_in_grid]]) {
  q[i] = a[i] / b[i];
}

// ---------------------------------------------------------------- shifts --
// Metal shifts by the amount's low log2(N) bits.
kernel void shifts(device uint* left [[buffer(0)]],
                   device int* right [[buffer(1)]],
                   device ushort2* narrow [[buffer(2)]],
                   const device uint* x [[buffer(3)]],
                   const device int* s [[buffer(4)]],
                   uint i [[thread_position_in_grid]]) {
  left[i] = x[i] << s[i];
  right[i] = int(x[i]) >> s[i];
  narrow[i] = ushort2(ushort(x[i])) << ushort2(ushort(s[i]));
}

// ---------------------------------------------------------------- bfloat --
kernel void to_bfloat(device bfloat* b [[buffer(0)]],
                      device bfloat4* b4 [[buffer(1)]],
                      const device float* x [[buffer(2)]],
                      uint i [[thread_position_in_grid]]) {
  b[i] = bfloat(x[i]);
  b4[i] = bfloat4(float4(x[i]));
}
