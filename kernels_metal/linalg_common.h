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
inline float one<float>() {
  return 1.0f;
}
template <>
inline float2 one<float2>() {
  return float2(1.0f, 0.0f);
}

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

// How getf2 / getrf2 scale the column below a nonzero pivot d: times 1 / d
// (rounded once) when |d| >= sfmin, the smallest normal number, else
// divided by d. x * (1 / d) and x / d may differ in the last bit, and so
// then do the updates and which later pivot comes out exactly zero (info).
template <typename T>
struct PivotScale {
  T d, reciprocal;
  bool by_reciprocal;
  T apply(T x) const { return by_reciprocal ? cmul(x, reciprocal) : cdiv(x, d); }
};
template <typename T>
inline PivotScale<T> pivot_scale(T d) {
  return PivotScale<T>{d, cdiv(one<T>(), d), modulus(d) >= FLT_MIN};
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
  T det;  // det, or the sign for slogdet
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

// ------------------------------------------- staging a run of matrices --
// Threads that each own E consecutive elements of a run in device memory
// (lu_small: a thread's matrix when the operand is a block,
// LinalgOperand::block; lu_solve: a row's C right-hand sides of a
// row-major B) would put the lanes of an access E elements apart, a cache
// line per lane. Instead the threadgroup copies the run between device and
// threadgroup memory with lanes on consecutive elements, and each thread
// reads or writes its own elements in threadgroup memory.
// Element q of the run sits at q + q / period, period = the elements of 32
// banks (32 or 16) times the odd part of E. A copy instruction covers 32
// consecutive elements from a multiple of 32, never across a multiple of
// the period: consecutive words, no bank conflict. Lane t on element
// t E + e of its own: with E = 2^s o, the lanes fall into 2^s groups
// whose words t E mod 32 are the same set, and the groups are exactly one
// period apart, so the padding element shifts each group onto other banks.
// (Checked for every E up to 31 and both element sizes by enumeration.)
struct Staging {
  uint period;
  uint at(uint q) const { return q + q / period; }
};

template <typename T>
inline Staging staging(uint E) {
  return Staging{128u / uint(sizeof(T)) * (E >> ctz(E))};
}

// Copies `count` elements of a run, the threadgroup's LINALG_SMALL_THREADS
// threads on consecutive elements.
template <typename T>
inline void stage_in(threadgroup T* s, Staging st, const device T* run, uint count, uint tid) {
  for (uint q = tid; q < count; q += LINALG_SMALL_THREADS) s[st.at(q)] = run[q];
}
template <typename T>
inline void stage_out(device T* run, const threadgroup T* s, Staging st, uint count, uint tid) {
  for (uint q = tid; q < count; q += LINALG_SMALL_THREADS) run[q] = s[st.at(q)];
}
