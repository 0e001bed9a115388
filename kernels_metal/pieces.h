// 16-byte pieces of a row, as the kernels load and store them: the bits of 4
// floats or 8 halves / bfloats in a uint4, and the floats they hold. Metal
// only (kernels_metal/*.metal include it after shared_types.h).
#pragma once
#include "shared_types.h"

// The elements of a 32-bit word as floats: one float, or two halves /
// bfloats (the last argument only picks the element type).
MPS_EXT_INLINE void word_floats(uint bits, thread float* v, float) { v[0] = metal::as_type<float>(bits); }
template <typename H>
MPS_EXT_INLINE void word_floats_pairs(uint bits, thread float* v) {
  const metal::vec<H, 2> pair = metal::as_type<metal::vec<H, 2>>(bits);
  v[0] = float(pair.x);
  v[1] = float(pair.y);
}
MPS_EXT_INLINE void word_floats(uint bits, thread float* v, half) { word_floats_pairs<half>(bits, v); }
MPS_EXT_INLINE void word_floats(uint bits, thread float* v, bfloat) { word_floats_pairs<bfloat>(bits, v); }

// The floats of a piece's bits: 4 for float, 8 for half and bfloat.
template <typename T>
MPS_EXT_INLINE void unpack16(uint4 bits, thread float* v, T) {
  constexpr int N = 4 / sizeof(T);  // elements of a word
  MPS_EXT_UNROLL
  for (int i = 0; i < 4; ++i) word_floats(bits[i], v + i * N, T(0));
}

// decode.h's decode_rows (gemv_rows, fp8_gemv, gmm_decode_rows): the
// weight pieces of one output a lane loads before it uses the first (U per
// output, U * Q in all): 4 pieces of 16 bytes in flight where the
// accumulators leave room, so that R * Q accumulators + 4 * U * Q registers
// of pieces stay within `budget` (24, or less where the kernel keeps more
// of its own live; the rest of the full-occupancy budget: the activation
// words, the products, the pointers); at most a tile's pieces per lane.
// A power of two, so that a tile is whole steps of 32 * U pieces. (Metal's
// min and max are not constexpr.)
constexpr int clamp_constexpr(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }
constexpr int floor_pow2(int v) { return v >= 4 ? 4 : v >= 2 ? 2 : 1; }
constexpr int rows_pieces_per_output(int R, int Q, int tile_pieces, int budget = 24) {
  return floor_pow2(
      clamp_constexpr((budget - R * Q) / (4 * Q), 1, 4 / Q < tile_pieces / 32 ? 4 / Q : tile_pieces / 32));
}

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
  MPS_EXT_UNROLL
  for (int i = 0; i < N / 2; ++i) {
    bits[i] = metal::as_type<uint>(metal::vec<H, 2>(H(v[2 * i]), H(v[2 * i + 1])));
  }
  return bits;
}
template <int N>
MPS_EXT_INLINE uint4 pack16(thread const float* v, half) {
  return pack16_pairs<N, half>(v);
}
template <int N>
MPS_EXT_INLINE uint4 pack16(thread const float* v, bfloat) {
  return pack16_pairs<N, bfloat>(v);
}
