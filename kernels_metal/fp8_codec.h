// FP8 encoding and decoding for the Metal kernels (fp8.metal, scaled_mm.metal),
// self-contained (metal_stdlib only) so that any shader can include it.
//
// Everything goes through the bits of a float32, in integer arithmetic:
// no float-to-int conversion (undefined out of range on a GPU), and no
// float arithmetic on values that could be float denormals (Apple GPUs
// flush those). Every fp16 and bf16 value is exact in float32, so
// converting from them through float32 bits rounds once, like torch.
//
// The NaN and overflow rules are torch's (CPU, checked exhaustively by
// tests/ops/test_fp8_convert.py):
//   to e4m3fn: round to nearest even; finite overflow and +-inf saturate
//              to +-448 (0x7E / 0xFE); NaN -> 0x7F with the NaN's sign.
//   to e5m2:   round to nearest even; overflow gives +-inf (0x7C / 0xFC);
//              NaN -> 0x7F with the NaN's sign.
//   from fp8:  exact; NaN keeps its sign and becomes a quiet NaN whose
//              payload is the fp8 mantissa (as a hardware conversion
//              through half or float leaves it); bf16 NaN is 0x7FC0.
#pragma once
#include <metal_stdlib>
using namespace metal;

// float32 bits -> fp8 byte. MAN mantissa bits, exponent bias BIAS; FN: no
// infinities (e4m3fn saturates), else overflow goes to the infinity code.
template <int MAN, int BIAS, bool FN>
inline uchar fp8_encode(uint f) {
  const uint sign = (f >> 24) & 0x80u;
  const uint a = f & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uchar(sign | 0x7Fu);
  uint r;
  if (a >= (uint(128 - BIAS) << 23)) {
    // Normal in the target: round the float's exponent-and-mantissa bits
    // to MAN mantissa bits (a carry moves into the exponent, as it should),
    // then rebias. a <= 0x7F800000, so the sum cannot overflow.
    const uint shift = 23 - MAN;
    r = (a + ((1u << (shift - 1)) - 1u) + ((a >> shift) & 1u)) >> shift;
    r -= uint(127 - BIAS) << MAN;
  } else {
    const uint e = a >> 23;
    if (e == 0) {
      r = 0;  // a float denormal or zero: far below the smallest fp8 step
    } else {
      // Subnormal in the target: count units of its smallest step,
      // 2^(1 - BIAS - MAN), rounding to nearest even.
      const uint mant = (a & 0x7FFFFFu) | 0x800000u;
      const uint shift = uint(151 - BIAS - MAN) - e;  // > 23 - MAN here
      r = shift > 25 ? 0u : (mant + (1u << (shift - 1)) - 1u + ((mant >> shift) & 1u)) >> shift;
    }
  }
  const uint top = FN ? 0x7Eu : 0x7Cu;  // largest finite, or the infinity code
  return uchar(sign | min(r, top));
}

inline uchar e4m3_from_bits(uint f) { return fp8_encode<3, 7, true>(f); }
inline uchar e5m2_from_bits(uint f) { return fp8_encode<2, 15, false>(f); }

// fp8 byte -> float32 bits, exact. Subnormals go through float(m) times a
// power of two: small integers, normal results, no rounding.
inline uint e4m3_to_bits(uchar b) {
  const uint sign = uint(b & 0x80u) << 24;
  const uint e = (b >> 3) & 0xFu, m = b & 7u;
  if (e == 15 && m == 7) return sign | 0x7FF00000u;
  if (e == 0) return sign | as_type<uint>(float(m) * 0.001953125f);  // m * 2^-9
  return sign | ((e + 120u) << 23) | (m << 20);
}
inline uint e5m2_to_bits(uchar b) {
  const uint sign = uint(b & 0x80u) << 24;
  const uint e = (b >> 2) & 0x1Fu, m = b & 3u;
  if (e == 31) return m == 0 ? (sign | 0x7F800000u) : (sign | 0x7FC00000u | (m << 21));
  if (e == 0) return sign | as_type<uint>(float(m) * 0.0000152587890625f);  // m * 2^-16
  return sign | ((e + 112u) << 23) | (m << 21);
}
// float32 bits of an exactly representable value (or NaN) -> half / bfloat.
inline half half_from_exact_bits(uint f) {
  if ((f & 0x7FFFFFFFu) > 0x7F800000u)
    return as_type<half>(ushort(((f >> 16) & 0x8000u) | 0x7E00u | ((f >> 13) & 0x3FFu)));
  return half(as_type<float>(f));
}
inline bfloat bfloat_from_exact_bits(uint f) {
  return as_type<bfloat>(ushort((f & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : (f >> 16)));
}

// Four fp8 bytes packed in a uint (little end first) -> four floats, for
// matrix kernels that decode weights in registers. e4m3: the values divided
// by 256 (the caller multiplies that back in, once per sum): e4m3 bits
// placed into half bits give x / 256 exactly, and the e4m3 NaN codes (0x7F,
// 0xFF), which are not halves of any value, are restored explicitly. e5m2:
// the bits are the top byte of a half.
// The NaN codes become the half NaN 0x7E00 (float NaN 0x7FC00000) in the
// half bits, two bytes at a time: integer operations on the word.
inline uint e4m3x2_to_half_bits(uint magnitudes, uint signs) {  // bytes 0 and 2 of each argument
  // 0x80 in each 16-bit half whose magnitude is 0x7F (magnitudes <= 0x7F: no carry out)
  const uint nan = (magnitudes + 0x00010001u) & 0x00800080u;
  const uint mask = (nan >> 7) * 0xFFFFu;
  return (((magnitudes << 7) | (signs << 8)) & ~mask) | (0x7E007E00u & mask);
}
inline float4 e4m3x4_to_float_div256(uint u) {
  const half2 even = as_type<half2>(e4m3x2_to_half_bits(u & 0x007F007Fu, u & 0x00800080u));               // bytes 0, 2
  const half2 odd = as_type<half2>(e4m3x2_to_half_bits((u >> 8) & 0x007F007Fu, (u >> 8) & 0x00800080u));  // bytes 1, 3
  return float4(float(even.x), float(odd.x), float(even.y), float(odd.y));
}
// The same for bytes known to hold no NaN code: the bits placed into half
// bits and nothing more. e4m3x4_has_nan: whether some byte of the word has
// the magnitude 0x7F (the NaN codes).
inline bool e4m3x4_has_nan(uint u) { return (((u & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u) != 0; }
inline float4 e4m3x4_finite_to_float_div256(uint u) {
  const half2 even = as_type<half2>(((u & 0x007F007Fu) << 7) | ((u & 0x00800080u) << 8));  // bytes 0, 2
  const half2 odd = as_type<half2>(((u & 0x7F007F00u) >> 1) | (u & 0x80008000u));          // bytes 1, 3
  return float4(float(even.x), float(odd.x), float(even.y), float(odd.y));
}
inline float4 e5m2x4_to_float(uint u) {
  const half2 even = as_type<half2>((u & 0x00FF00FFu) << 8), odd = as_type<half2>(u & 0xFF00FF00u);
  return float4(float(even.x), float(odd.x), float(even.y), float(odd.y));
}

// Either format, chosen at run time (e5m2 or e4m3fn): four bytes as floats
// and one byte as a float, both in the convention above (e4m3 values divided
// by 256, e5m2 values as they are), and the unit that multiplies the 256 back.
inline float4 fp8x4_decode(uint u, bool e5m2) { return e5m2 ? e5m2x4_to_float(u) : e4m3x4_to_float_div256(u); }
inline float fp8_unit_of(bool e5m2) { return e5m2 ? 1.0f : 256.0f; }
inline float fp8_decode(uchar b, bool e5m2) {
  return e5m2 ? as_type<float>(e5m2_to_bits(b)) : as_type<float>(e4m3_to_bits(b)) * 0.00390625f;  // exact: / 256
}
