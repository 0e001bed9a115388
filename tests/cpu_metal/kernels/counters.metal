// Kernels for the executor's cost counters (test_counters.py): for each
// counter, access patterns that are bad on purpose and good ones.
#include <metal_stdlib>
using namespace metal;

// ------------------------------------------------------------- coalescing --
// Consecutive lanes read consecutive floats: a simdgroup's load is 128
// contiguous bytes.
kernel void copy_contiguous(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                            uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid];
}

// Each lane reads a float 128 bytes from its neighbour's: one cache line per
// lane.
kernel void copy_strided(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                         uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid * 32];
}

// 16 bytes a lane, consecutive.
kernel void copy_float4(device float4* out [[buffer(0)]], const device float4* in [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid];
}

// Every lane reads the same float (a broadcast) and writes its own.
kernel void broadcast(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                      uint gid [[thread_position_in_grid]]) {
  out[gid] = in[0];
}

// One lane at a time writes, in successive iterations of a loop around a
// simd operation: each store instruction has one active lane, one line.
kernel void write_in_turn(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]]) {
  for (uint i = 0; i < 4; ++i) {
    float s = simd_sum(float(lane));
    if (lane == i) out[(sg * 4 + i) * 32] = s;
  }
}

// An 8x8 float tile per simdgroup through simdgroup_load and
// simdgroup_store: each lane moves two adjacent floats, one 8-byte access
// on a GPU, so a contiguous tile is 256 bytes in two lines.
kernel void copy_matrix(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, in + gid / 32 * 64);
  simdgroup_store(m, out + gid / 32 * 64);
}

// -------------------------------------------------- 64-bit integer work --
struct IntParams {
  ulong divisor;
  ulong factor;
  uint divisor32;
  uint pad;
};

// One division and one remainder by a run-time value per thread, each on
// its own operands.
kernel void div_mod_64(device ulong* out [[buffer(0)]], const device ulong* in [[buffer(1)]],
                       constant IntParams& p [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  out[2 * gid] = in[2 * gid] / p.divisor;
  out[2 * gid + 1] = in[2 * gid + 1] % p.divisor;
}

// The same in 32 bits: no 64-bit work (the ulong index arithmetic of the
// addresses is not a multiply instruction).
kernel void div_mod_32(device uint* out [[buffer(0)]], const device uint* in [[buffer(1)]],
                       constant IntParams& p [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  ulong i = 2 * ulong(gid);
  out[i] = in[i] / p.divisor32;
  out[i + 1] = in[i + 1] % p.divisor32;
}

// A multiplication by a run-time value, one by 8 (a shift), a division by 8
// (a shift) and one by 7 (a multiplication by its reciprocal).
kernel void mul_64(device ulong* out [[buffer(0)]], const device ulong* in [[buffer(1)]],
                   constant IntParams& p [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  ulong a = in[4 * gid], b = in[4 * gid + 1], c = in[4 * gid + 2], d = in[4 * gid + 3];
  out[4 * gid] = a * p.factor;
  out[4 * gid + 1] = b * 8;
  out[4 * gid + 2] = c / 8;
  out[4 * gid + 3] = d / 7;
}

// A vector of two: two multiplications.
kernel void mul_64_vector(device ulong2* out [[buffer(0)]], const device ulong2* in [[buffer(1)]],
                          uint gid [[thread_position_in_grid]]) {
  out[gid] = in[2 * gid] * in[2 * gid + 1];
}

// Only the first three threads divide.
kernel void div_some(device ulong* out [[buffer(0)]], const device ulong* in [[buffer(1)]],
                     constant IntParams& p [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = gid < 3 ? in[gid] / p.divisor : in[gid];
}

// -------------------------------------------------------------- registers --
// 64 floats loaded before the first is used: all 64 live at once.
kernel void hold_64_floats(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  float v[64];
  for (int i = 0; i < 64; ++i) v[i] = in[gid * 64 + i];
  float s = 0.0f;
  for (int i = 0; i < 64; ++i) s += v[63 - i] * v[i];
  out[gid] = s;
}

// The same with halves: 16-bit values take half a register.
kernel void hold_64_halves(device half* out [[buffer(0)]], const device half* in [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  half v[64];
  for (int i = 0; i < 64; ++i) v[i] = in[gid * 64 + i];
  half s = 0.0h;
  for (int i = 0; i < 64; ++i) s += v[63 - i] * v[i];
  out[gid] = s;
}

// Streaming: a few values live at a time.
kernel void scale(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                  uint gid [[thread_position_in_grid]]) {
  out[gid] = in[gid] * 2.0f;
}

// Sixteen 64-bit parameters from a constant buffer, all live across the
// loop: the same for every thread, so uniform registers, not per-thread ones
// (the loop counter is uniform too; the sum, from gid, is per thread).
struct ManyParams {
  ulong v[16];
  uint n;
  uint pad;
};
kernel void uniform_params(device ulong* out [[buffer(0)]], constant ManyParams& p [[buffer(1)]],
                           uint gid [[thread_position_in_grid]]) {
  ulong acc = gid;
  for (uint k = 0; k < p.n; ++k)
    acc += (k ^ p.v[0]) + (k ^ p.v[1]) + (k ^ p.v[2]) + (k ^ p.v[3]) + (k ^ p.v[4]) + (k ^ p.v[5]) +
           (k ^ p.v[6]) + (k ^ p.v[7]) + (k ^ p.v[8]) + (k ^ p.v[9]) + (k ^ p.v[10]) + (k ^ p.v[11]) +
           (k ^ p.v[12]) + (k ^ p.v[13]) + (k ^ p.v[14]) + (k ^ p.v[15]);
  out[gid] = acc;
}

// --------------------------------------------------------- private memory --
// A thread-private array indexed by a run-time value stays in memory.
kernel void private_dynamic(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                            constant uint& index [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = in[gid * 16 + i];
  out[gid] = a[index & 15];
}

// Indexed only by constants once the loops are unrolled: registers.
kernel void private_constant(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                             uint gid [[thread_position_in_grid]]) {
  float a[16];
  for (int i = 0; i < 16; ++i) a[i] = in[gid * 16 + i];
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += a[i];
  out[gid] = s;
}

// A simd reduction hands its value to the executor by address; on a GPU it
// is a register.
kernel void simd_reduce(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                        uint gid [[thread_position_in_grid]]) {
  float a[4];
  for (int i = 0; i < 4; ++i) a[i] = in[gid * 4 + i];
  out[gid] = simd_sum(a[0]) + simd_sum(a[1]) + simd_sum(a[2]) + simd_sum(a[3]);
}

// ----------------------------------------------------------- bank conflicts --
// Threads store to and load from threadgroup memory `stride` floats apart
// (the threadgroup has 64 threads), then write what they read back.
kernel void threadgroup_stride(device float* out [[buffer(0)]], constant uint& stride [[buffer(1)]],
                               uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tg[64 * 33];
  tg[tid * stride] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tg[tid * stride];
}

// Every thread reads one word: a broadcast.
kernel void threadgroup_broadcast(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tg[64];
  tg[tid] = float(tid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tg[0];
}

// 16 bytes a thread, consecutive: four words in each bank, the least a
// 512-byte access needs.
kernel void threadgroup_float4(device float4* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float4 tg[64];
  tg[tid] = float4(float(tid));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tg[63 - tid];
}

// --------------------------------------------------------- loads in flight --
// Pointer chasing: each load's address comes from the previous load.
kernel void chase(device uint* out [[buffer(0)]], const device uint* next [[buffer(1)]],
                  constant uint& steps [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  uint j = gid;
  for (uint k = 0; k < steps; ++k) j = next[j];
  out[gid] = j;
}

// Four independent loads per iteration, and a parameter from a constant
// buffer (not device memory).
kernel void four_streams(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                         const device float* b [[buffer(2)]], const device float* c [[buffer(3)]],
                         const device float* d [[buffer(4)]], constant uint& n [[buffer(5)]],
                         uint gid [[thread_position_in_grid]]) {
  float acc = 0.0f;
  for (uint k = gid; k < n; k += 64) acc += a[k] * b[k] + c[k] * d[k];
  out[gid] = acc;
}

// One 16-byte load per iteration is one load, not four.
kernel void one_float4_stream(device float* out [[buffer(0)]], const device float4* a [[buffer(1)]],
                              constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  float acc = 0.0f;
  for (uint k = gid; k < n; k += 64) acc += dot(a[k], float4(1.0f));
  out[gid] = acc;
}

// Two loops: the second, with three loads, is the hot one.
kernel void two_loops(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                      const device float* b [[buffer(2)]], const device float* c [[buffer(3)]],
                      constant uint& n [[buffer(4)]], uint gid [[thread_position_in_grid]]) {
  float acc = 0.0f;
  for (uint k = gid; k < n; k += 64) acc += a[k];
  for (uint k = gid; k < n; k += 64) acc += a[k] * b[k] * c[k];  // the hot loop
  out[gid] = acc;
}

// ------------------------------------------------ re-reads by threadgroups --
// Every threadgroup reads the whole of `in` (64 floats), as a GEMV's
// threadgroups each stage the whole activation; each thread reads its float
// twice (the second read is a cache hit inside the threadgroup).
kernel void every_group_reads_all(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                                  uint gid [[thread_position_in_grid]], uint tid [[thread_index_in_threadgroup]]) {
  out[gid] = in[tid] + in[tid];
}

// ------------------------------------------------- threadgroup memory size --
// 24 KiB of threadgroup memory: two threadgroups fit a core's 64 KiB.
kernel void threadgroup_24k(device float* out [[buffer(0)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float tg[6 * 1024];
  for (uint k = tid; k < 6 * 1024; k += 64) tg[k] = float(k);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = tg[tid * 64];
}

// A [[threadgroup(0)]] buffer of the size the dispatch gives, and a small
// threadgroup variable beside it.
kernel void threadgroup_dynamic(device float* out [[buffer(0)]], threadgroup float* dyn [[threadgroup(0)]],
                                uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float fixed[64];
  fixed[tid] = float(tid);
  dyn[tid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = fixed[63 - tid] + dyn[63 - tid];
}

// ------------------------------------------------------------- divisions --
// A 32-bit division and a remainder by a run-time value per thread.
kernel void div_mod_32_constant(device uint* out [[buffer(0)]], const device uint* in [[buffer(1)]],
                                uint gid [[thread_position_in_grid]]) {
  out[2 * gid] = in[2 * gid] / 7u;  // a multiply-high, not a division
  out[2 * gid + 1] = in[2 * gid + 1] % 16u;  // a mask
}

// An IEEE float division and a half one per thread.
kernel void divide_floats(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                          const device float* b [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = a[gid] / b[gid] + float(half(a[gid]) / half(b[gid]));
}

// Division by a power of two is a multiplication; fast::divide is not the
// IEEE sequence.
kernel void divide_cheaply(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                           const device float* b [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  out[gid] = a[gid] / 4.0f + fast::divide(a[gid], b[gid]);
}

// ------------------------------------------------- registers: CPU artefacts --
// Eight per-thread addresses (64-bit pointers in the CPU's IR, 32-bit
// offsets from the buffer's uniform base on a GPU) and eight comparisons
// that only pick values, all live across the loop.
kernel void eight_pointers(device float* out [[buffer(0)]], const device float* in [[buffer(1)]],
                           const device uint* at [[buffer(2)]], constant uint& n [[buffer(3)]],
                           uint gid [[thread_position_in_grid]]) {
  const device float* p0 = in + at[gid * 8 + 0]; const device float* p1 = in + at[gid * 8 + 1];
  const device float* p2 = in + at[gid * 8 + 2]; const device float* p3 = in + at[gid * 8 + 3];
  const device float* p4 = in + at[gid * 8 + 4]; const device float* p5 = in + at[gid * 8 + 5];
  const device float* p6 = in + at[gid * 8 + 6]; const device float* p7 = in + at[gid * 8 + 7];
  const bool f0 = at[gid * 8 + 0] & 1, f1 = at[gid * 8 + 1] & 1, f2 = at[gid * 8 + 2] & 1, f3 = at[gid * 8 + 3] & 1;
  const bool f4 = at[gid * 8 + 4] & 1, f5 = at[gid * 8 + 5] & 1, f6 = at[gid * 8 + 6] & 1, f7 = at[gid * 8 + 7] & 1;
  float acc = 0.0f;
  for (uint k = 0; k < n; ++k)
    acc += (f0 ? p0[k] : 2.0f) + (f1 ? p1[k] : 3.0f) + (f2 ? p2[k] : 5.0f) + (f3 ? p3[k] : 7.0f) +
           (f4 ? p4[k] : 11.0f) + (f5 ? p5[k] : 13.0f) + (f6 ? p6[k] : 17.0f) + (f7 ? p7[k] : 19.0f);
  out[gid] = acc;
}

// ------------------------------------------------ loads after a barrier --
// Each step publishes a value, waits at a barrier, then loads its operand
// and uses it: the load's latency follows every barrier.
kernel void load_after_barrier(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                               constant uint& n [[buffer(2)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float pub[2];
  float acc = 0.0f;
  for (uint t = 0; t < n; ++t) {
    if (tid == t % 64) pub[t & 1] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += a[t * 64 + tid] * pub[t & 1];
  }
  out[tid] = acc;
}

// The same with the operand loaded a step ahead, before the barrier.
kernel void load_before_barrier(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                                constant uint& n [[buffer(2)]], uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float pub[2];
  float acc = 0.0f;
  float e = n > 0 ? a[tid] : 0.0f;
  for (uint t = 0; t < n; ++t) {
    if (tid == t % 64) pub[t & 1] = acc;
    const float e_next = t + 1 < n ? a[(t + 1) * 64 + tid] : 0.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += e * pub[t & 1];
    e = e_next;
  }
  out[tid] = acc;
}

// ------------------------------------------------------ compute counters --
// Each simdgroup of a 64-thread threadgroup (two simdgroups) loads an 8x8
// half matrix from device memory and one from threadgroup memory, runs
// `steps` half multiply-accumulates and one with float operands, and stores
// its result once to threadgroup memory and once to device memory: per
// simdgroup 1 + 1 loads, steps + 1 MMAs (1 of them 32-bit), 1 + 1 stores.
kernel void matrix_counts(device float* out [[buffer(0)]], const device half* a [[buffer(1)]],
                          constant uint& steps [[buffer(2)]], uint tid [[thread_index_in_threadgroup]],
                          uint sg [[simdgroup_index_in_threadgroup]], uint group [[threadgroup_position_in_grid]]) {
  threadgroup half staged[64];
  threadgroup float result[2 * 64];
  staged[tid] = a[tid];  // 64 threads, 64 elements
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_half8x8 x, y;
  simdgroup_load(x, a, 8);
  simdgroup_load(y, staged, 8);
  simdgroup_float8x8 acc(0.0f);
  for (uint s = 0; s < steps; ++s) simdgroup_multiply_accumulate(acc, x, y, acc);
  simdgroup_float8x8 one(1.0f);
  simdgroup_multiply_accumulate(acc, one, one, acc);
  simdgroup_store(acc, result + 64 * sg, 8);
  simdgroup_store(acc, out + 64 * (2 * group + sg), 8);
}

// A loop of `n` steps of plain arithmetic per thread: its instruction count
// grows by the same amount for every step.
kernel void instruction_loop(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                             constant uint& n [[buffer(2)]], uint tid [[thread_position_in_grid]]) {
  float acc = 0.0f;
  for (uint i = 0; i < n; ++i) acc = acc * x[i] + float(i);
  out[tid] = acc;
}
