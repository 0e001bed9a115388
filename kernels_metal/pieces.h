// 16-byte pieces of a row, as the kernels load and store them: the bits of 4
// floats or 8 halves / bfloats in a uint4, and the floats they hold. Metal
// only (kernels_metal/*.metal include it after shared_types.h).
#pragma once
#include "shared_types.h"

// The floats of a piece's bits: 4 for float, 8 for half and bfloat (the last
// argument only picks the element type).
MPS_EXT_INLINE void unpack16(uint4 bits, thread float* v, float) {
  MPS_EXT_UNROLL for (int i = 0; i < 4; ++i) v[i] = metal::as_type<float>(bits[i]);
}
template <typename H>
MPS_EXT_INLINE void unpack16_pairs(uint4 bits, thread float* v) {
  MPS_EXT_UNROLL for (int i = 0; i < 4; ++i) {
    metal::vec<H, 2> pair = metal::as_type<metal::vec<H, 2>>(bits[i]);
    v[2 * i] = float(pair.x);
    v[2 * i + 1] = float(pair.y);
  }
}
MPS_EXT_INLINE void unpack16(uint4 bits, thread float* v, half) { unpack16_pairs<half>(bits, v); }
MPS_EXT_INLINE void unpack16(uint4 bits, thread float* v, bfloat) { unpack16_pairs<bfloat>(bits, v); }

// ... and back: N floats as the bits of N elements: 4 for float (N must be
// 4), 4 or 8 for half and bfloat (N = 4 fills the first 8 bytes). Qualified
// names: a kernel file includes this before `using namespace metal`.
template <int N>
MPS_EXT_INLINE uint4 pack16(thread const float* v, float) {
  return uint4(metal::as_type<uint>(v[0]), metal::as_type<uint>(v[1]), metal::as_type<uint>(v[2]),
               metal::as_type<uint>(v[3]));
}
template <int N, typename H>
MPS_EXT_INLINE uint4 pack16_pairs(thread const float* v) {
  uint4 bits = uint4(0u);
  MPS_EXT_UNROLL for (int i = 0; i < N / 2; ++i) {
    bits[i] = metal::as_type<uint>(metal::vec<H, 2>(H(v[2 * i]), H(v[2 * i + 1])));
  }
  return bits;
}
template <int N>
MPS_EXT_INLINE uint4 pack16(thread const float* v, half) { return pack16_pairs<N, half>(v); }
template <int N>
MPS_EXT_INLINE uint4 pack16(thread const float* v, bfloat) { return pack16_pairs<N, bfloat>(v); }
