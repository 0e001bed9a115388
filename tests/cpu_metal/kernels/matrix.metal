// simdgroup_matrix: C = A * B + C for 8x8 tiles, one simdgroup per tile.
#include <metal_stdlib>
using namespace metal;

// A is M x K, B is K x N, C is M x N, row-major; M, N, K multiples of 8.
// One simdgroup computes one 8x8 tile of C.
template <typename T>
kernel void matmul_tiles(device float* C [[buffer(0)]],
                         const device T* A [[buffer(1)]],
                         const device T* B [[buffer(2)]],
                         constant uint3& mnk [[buffer(3)]],
                         uint2 tile [[threadgroup_position_in_grid]]) {
  uint N = mnk.y, K = mnk.z;
  simdgroup_float8x8 acc;
  simdgroup_load(acc, C, N, ulong2(tile.x * 8, tile.y * 8));
  for (uint k = 0; k < K; k += 8) {
    simdgroup_matrix<T, 8, 8> a, b;
    simdgroup_load(a, A, K, ulong2(k, tile.y * 8));
    simdgroup_load(b, B, N, ulong2(tile.x * 8, k));
    simdgroup_multiply_accumulate(acc, a, b, acc);
  }
  simdgroup_store(acc, C, N, ulong2(tile.x * 8, tile.y * 8));
}
template [[host_name("matmul_float")]] kernel decltype(matmul_tiles<float>) matmul_tiles<float>;
template [[host_name("matmul_half")]] kernel decltype(matmul_tiles<half>) matmul_tiles<half>;
template [[host_name("matmul_bfloat")]] kernel decltype(matmul_tiles<bfloat>) matmul_tiles<bfloat>;

// Loads A transposed from a column-major copy, through threadgroup memory.
kernel void transpose_load(device float* out [[buffer(0)]],
                           const device float* At [[buffer(1)]],
                           uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  for (uint i = lane; i < 64; i += 32) tile[i] = At[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 a;
  simdgroup_load(a, tile, 8, ulong2(0, 0), true);
  simdgroup_float8x8 identity(1.0f);
  simdgroup_float8x8 r;
  simdgroup_multiply(r, a, identity);
  simdgroup_store(r, out, 8);
}
