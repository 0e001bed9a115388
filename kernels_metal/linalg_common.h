// What the linear-algebra kernels share (Metal only): arithmetic that is the
// same code for float (real) and float2 (complex64: .x real, .y imaginary;
// Metal has no complex type), LAPACK's pivot magnitude, and where a batch's
// matrices live.
#pragma once
#include <metal_stdlib>
#include "linalg_params.h"
using namespace metal;

// ------------------------------------------------------------ arithmetic --
inline float cmul(float a, float b) { return a * b; }
inline float2 cmul(float2 a, float2 b) { return float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }

inline float conj_if(float a, bool) { return a; }
inline float2 conj_if(float2 a, bool c) { return c ? float2(a.x, -a.y) : a; }

inline bool is_zero(float a) { return a == 0.0f; }
inline bool is_zero(float2 a) { return a.x == 0.0f && a.y == 0.0f; }

template <typename T>
inline T one();
template <>
inline float one<float>() { return 1.0f; }
template <>
inline float2 one<float2>() { return float2(1.0f, 0.0f); }

// The magnitude LAPACK compares to choose a pivot: |x| (isamax) for real,
// |re| + |im| (icamax, scabs1) for complex, not the modulus.
inline float abs1(float a) { return fabs(a); }
inline float abs1(float2 a) { return fabs(a.x) + fabs(a.y); }

// The modulus, without overflow or underflow of re^2 + im^2.
inline float modulus(float a) { return fabs(a); }
inline float modulus(float2 a) {
  float big = max(fabs(a.x), fabs(a.y)), small = min(fabs(a.x), fabs(a.y));
  if (big == 0.0f || isinf(big)) return big;
  float r = small / big;
  return big * sqrt(1.0f + r * r);
}

// a / b; for complex by Smith's method, so |b|^2 is never formed.
inline float cdiv(float a, float b) { return a / b; }
inline float2 cdiv(float2 a, float2 b) {
  if (fabs(b.x) >= fabs(b.y)) {
    float r = b.y / b.x, d = b.x + b.y * r;
    return float2((a.x + a.y * r) / d, (a.y - a.x * r) / d);
  }
  float r = b.x / b.y, d = b.x * r + b.y;
  return float2((a.x * r + a.y) / d, (a.y * r - a.x) / d);
}

// The sign of a nonzero pivot as torch's sgn gives it: x / |x|; 0 for 0.
inline float sign_of(float a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : a); }
inline float2 sign_of(float2 a) {
  float m = modulus(a);
  return m == 0.0f ? float2(0.0f) : a / m;
}

// ------------------------------------------------------------- indexing --
// Offset of matrix `index` of a batch in an operand with these batch
// strides. The outermost dimension needs no division; after the host merged
// contiguous dimensions there is usually only one.
inline long batch_offset(constant LinalgBatch& b, constant int64_t* strides, long index) {
  if (b.rank == 0) return 0;
  long offset = 0;
  for (int d = int(b.rank) - 1; d > 0; --d) {
    long c = index % b.sizes[d];
    index /= b.sizes[d];
    offset += c * strides[d];
  }
  return offset + index * strides[0];
}

// Running determinant of an LU: the product of the pivots U[j, j] and the
// permutation's sign (det), or sign and log|det| (slogdet), as torch's
// _linalg_det and _linalg_slogdet compute them from the factors.
template <typename T>
struct DetAccumulator {
  T det;        // det, or the sign for slogdet
  float log_abs;

  void init() {
    det = one<T>();
    log_abs = 0.0f;
  }
  void add(T pivot, bool swapped, uint mode) {
    if (mode == LINALG_SLOGDET) {
      det = cmul(det, sign_of(pivot));
      log_abs += log(modulus(pivot));
    } else {
      det = cmul(det, pivot);
    }
    if (swapped) det = -det;
  }
};
