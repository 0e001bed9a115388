// float8_e4m3fn to half, exactly, without a table: the 7 exponent and
// mantissa bits of e4m3 placed at the top of half's 15 give a half whose
// value is the e4m3 value / 256 (the exponent biases differ by 8: 15 - 7),
// subnormals included. The caller multiplies by 256 once, after
// accumulating (folded into a scale). e4m3fn has no infinity; 0x7F and 0xFF
// are NaN and stay NaN.
#pragma once
#include <metal_stdlib>

inline half e4m3_to_half_div256(uchar bits) {
  ushort h = ushort(ushort(bits & 0x80) << 8) | ushort(ushort(bits & 0x7F) << 7);
  return (bits & 0x7F) == 0x7F ? metal::as_type<half>(ushort(h | 0x7E00)) : metal::as_type<half>(h);
}
