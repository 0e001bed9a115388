// Conversions between float8 (e4m3fn, e5m2) and float32 / float16 /
// bfloat16, bit-exact with torch's CPU conversions (fp8_codec.h has the
// rules). One thread converts FP8_CONVERT_PER_THREAD elements.
//   fp8_convert_dense_<src>_<dst>    both contiguous, numel < 2^31: 32-bit index
//   fp8_convert_strided_<src>_<dst>  any strides (0 broadcasts), 64-bit offsets;
//                                    transposing copies by tiles
#include <metal_stdlib>
#include "fp8_codec.h"
#include "fp8_params.h"
using namespace metal;

// Each element type reads into float32 bits and writes from them.
struct F32 {
  typedef float T;
  static uint bits(T v) { return as_type<uint>(v); }
  static T from_bits(uint f) { return as_type<float>(f); }
};
struct F16 {
  typedef half T;
  static uint bits(T v) { return as_type<uint>(float(v)); }
  static T from_bits(uint f) { return half_from_exact_bits(f); }
};
struct BF16 {
  typedef bfloat T;
  // A bfloat is the top half of a float32: no conversion, so nothing a GPU
  // could flush.
  static uint bits(T v) { return uint(as_type<ushort>(v)) << 16; }
  static T from_bits(uint f) { return bfloat_from_exact_bits(f); }
};
struct E4M3 {
  typedef uchar T;
  static uint bits(T v) { return e4m3_to_bits(v); }
  static T from_bits(uint f) { return e4m3_from_bits(f); }
};
struct E5M2 {
  typedef uchar T;
  static uint bits(T v) { return e5m2_to_bits(v); }
  static T from_bits(uint f) { return e5m2_from_bits(f); }
};

// Thread tid of a threadgroup converts FP8_CONVERT_PER_THREAD (4)
// consecutive elements with one vector load and one vector store: 4 bytes a
// lane on the fp8 side (a simdgroup instruction covers 128 consecutive bytes,
// one cache line), 8 or 16 on the other. A lone byte a lane would take four
// times the load and store instructions for the same lines. The host picks
// this kernel only when both tensors start on a multiple of the vector's
// size (csrc/ops/fp8.cpp); the last thread's partial run goes element by
// element.
template <typename S, typename D>
[[max_total_threads_per_threadgroup(FP8_CONVERT_THREADS)]]
kernel void fp8_convert_dense(device typename D::T* dst [[buffer(0)]],
                              const device typename S::T* src [[buffer(1)]],
                              constant Fp8ConvertParams& p [[buffer(2)]],
                              uint group [[threadgroup_position_in_grid]],
                              uint tid [[thread_position_in_threadgroup]]) {
  constexpr uint N = FP8_CONVERT_PER_THREAD;
  typedef vec<typename S::T, N> SrcN;
  typedef vec<typename D::T, N> DstN;
  // numel < 2^31 - N (the host's condition), so this does not wrap.
  const uint first = (group * FP8_CONVERT_THREADS + tid) * N;
  const uint numel = uint(p.numel);
  if (first + N <= numel) {
    const SrcN v = *reinterpret_cast<const device SrcN*>(src + first);
    DstN r;
    MPS_EXT_UNROLL
    for (uint j = 0; j < N; ++j) r[j] = D::from_bits(S::bits(v[j]));
    *reinterpret_cast<device DstN*>(dst + first) = r;
  } else {
    MPS_EXT_UNROLL
    for (uint j = 0; j < N; ++j)
      if (first + j < numel) dst[first + j] = D::from_bits(S::bits(src[first + j]));
  }
}

// The coordinates of element `index` in the row-major order of p.sizes (0
// past the rank). I: the index type of the divisions, uint whenever numel
// fits (a 64-bit division is a software loop on a GPU). The loops run over
// every dimension a tensor may have, unrolled, so that `coord` stays in
// registers.
template <typename I>
MPS_EXT_INLINE void coords_of(long index, constant Fp8ConvertParams& p, thread long* coord) {
  I rest = I(index);
  MPS_EXT_UNROLL
  for (int d = MPS_EXT_MAX_DIMS - 1; d >= 0; --d) {
    coord[d] = 0;
    if (d < int(p.rank)) {
      const I size = I(p.sizes[d]);
      coord[d] = long(rest % size);
      rest /= size;
    }
  }
}

template <typename S, typename D>
[[max_total_threads_per_threadgroup(FP8_CONVERT_THREADS)]]
kernel void fp8_convert_strided(device typename D::T* dst [[buffer(0)]],
                                const device typename S::T* src [[buffer(1)]],
                                constant Fp8ConvertParams& p [[buffer(2)]],
                                uint gid [[thread_position_in_grid]],
                                uint group [[threadgroup_position_in_grid]],
                                uint tid [[thread_position_in_threadgroup]]) {
  constexpr int T = FP8_CONVERT_TILE, ROWS = FP8_CONVERT_THREADS / T;
  // A transposing copy: each simdgroup instruction reads T consecutive
  // elements of src (along dimension 0) and writes T consecutive elements of
  // dst (along dimension 1), through a tile of float32 bits whose rows are
  // T + 1 words apart (both the column writes and the row reads hit T banks).
  threadgroup uint tile[T * (T + 1)];
  if (p.tiles) {
    const long i0 = long(group / p.tiles) * T, j0 = long(group % p.tiles) * T;
    const int lo = int(tid) % T, hi = int(tid) / T;
    MPS_EXT_UNROLL
    for (int q = 0; q < T / ROWS; ++q) {  // src: i0 + lo along dimension 0, j0 + j along 1
      const int j = hi + q * ROWS;
      if (i0 + lo < p.sizes[0] && j0 + j < p.sizes[1])
        tile[j * (T + 1) + lo] = S::bits(src[(i0 + lo) * p.src_strides[0] + (j0 + j) * p.src_strides[1]]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    MPS_EXT_UNROLL
    for (int q = 0; q < T / ROWS; ++q) {  // dst: i0 + i along dimension 0, j0 + lo along 1
      const int i = hi + q * ROWS;
      if (i0 + i < p.sizes[0] && j0 + lo < p.sizes[1])
        dst[(i0 + i) * p.dst_strides[0] + (j0 + lo) * p.dst_strides[1]] = D::from_bits(tile[lo * (T + 1) + i]);
    }
    return;
  }
  const long first = long(gid) * FP8_CONVERT_PER_THREAD;
  if (first >= p.numel) return;
  const int rank = int(p.rank);
  // Coordinates of the first element, then stepped like an odometer.
  long coord[MPS_EXT_MAX_DIMS];
  if (p.numel <= long(0xFFFFFFFFu)) coords_of<uint>(first, p, coord);
  else coords_of<ulong>(first, p, coord);
  const long last = min(first + FP8_CONVERT_PER_THREAD, p.numel);
  for (long index = first; index < last; ++index) {
    long d_off = 0, s_off = 0;
    MPS_EXT_UNROLL
    for (int d = 0; d < MPS_EXT_MAX_DIMS; ++d) {
      d_off += coord[d] * p.dst_strides[d];
      s_off += coord[d] * p.src_strides[d];
    }
    dst[d_off] = D::from_bits(S::bits(src[s_off]));
    bool carry = true;
    MPS_EXT_UNROLL
    for (int d = MPS_EXT_MAX_DIMS - 1; d >= 0; --d) {
      if (carry && d < rank) {
        carry = ++coord[d] == p.sizes[d];
        if (carry) coord[d] = 0;
      }
    }
  }
}

// clang-format off
#define INSTANTIATE_FP8_CONVERT(sname, S, dname, D)                                            \
  template [[host_name("fp8_convert_dense_" #sname "_" #dname)]] kernel                        \
      decltype(fp8_convert_dense<S, D>) fp8_convert_dense<S, D>;                               \
  template [[host_name("fp8_convert_strided_" #sname "_" #dname)]] kernel                      \
      decltype(fp8_convert_strided<S, D>) fp8_convert_strided<S, D>;
// clang-format on
#define INSTANTIATE_TO_FP8(sname, S)            \
  INSTANTIATE_FP8_CONVERT(sname, S, e4m3, E4M3) \
  INSTANTIATE_FP8_CONVERT(sname, S, e5m2, E5M2)
#define INSTANTIATE_FROM_FP8(sname, S)        \
  INSTANTIATE_FP8_CONVERT(sname, S, f32, F32) \
  INSTANTIATE_FP8_CONVERT(sname, S, f16, F16) \
  INSTANTIATE_FP8_CONVERT(sname, S, bf16, BF16)

INSTANTIATE_TO_FP8(f32, F32)
INSTANTIATE_TO_FP8(f16, F16)
INSTANTIATE_TO_FP8(bf16, BF16)
// Same-format copies move bytes (torch keeps NaN payloads); no kernel.
INSTANTIATE_FP8_CONVERT(e4m3, E4M3, e5m2, E5M2)
INSTANTIATE_FP8_CONVERT(e5m2, E5M2, e4m3, E4M3)
INSTANTIATE_FROM_FP8(e4m3, E4M3)
INSTANTIATE_FROM_FP8(e5m2, E5M2)
