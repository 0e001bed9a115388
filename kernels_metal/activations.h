// Elementwise functions of several kernels, in float32 as torch's CPU ops
// compute them, so that each kernel rounds where the model's torch code
// does. Metal only (kernels_metal/*.metal include it after shared_types.h).
// Their exp and log are Metal's precise ones (mps_ext compiles with precise
// functions: csrc/backend/metal.mm), accurate to 4 ulp (MSL 4, Table 8.1),
// not to torch's 1: what that allows the kernels' results is stated where
// they are tested (docs/dev/contributing.md, "Math mode").
#pragma once
#include "shared_types.h"

// torch.sigmoid's formula: 1 / (1 + exp(-x)).
MPS_EXT_INLINE float sigmoid(float x) { return 1.0f / (1.0f + metal::precise::exp(-x)); }

// An attention layer's output gate, x * torch.sigmoid(gate), rounded where
// torch rounds it: the sigmoid to T, then the product of two T in float32
// to T (attention_gate.metal's sigmoid_gate; linear.metal's
// sigmoid_gate_gemv_rows, which must give the same bits).
template <typename T>
MPS_EXT_INLINE T sigmoid_gated(T x, T gate) {
  const T s = T(sigmoid(float(gate)));
  return T(float(x) * float(s));
}

// F.silu's: x / (1 + exp(-x)).
MPS_EXT_INLINE float silu(float x) { return x / (1.0f + metal::precise::exp(-x)); }

// log(1 + x) for x > -1, which Metal's library lacks (Table 8.1 has no
// log1p). log(1 + x) as written keeps only the digits of x that 1 + x does
// (at x = 3e-7, 2 of its 24 bits; at x < 2^-24 none). u = 1 + x rounded,
// then log(u) times x / (u - 1): u - 1 is exact, so the ratio is exactly
// what the rounding of 1 + x took from x, and the result is within a few
// ulps (Goldberg, "What every computer scientist should know about
// floating-point arithmetic", 1991, theorem 4).
MPS_EXT_INLINE float log1p_accurate(float x) {
  const float u = 1.0f + x;
  if (u == 1.0f || metal::isinf(u)) return u == 1.0f ? x : u;
  return metal::precise::log(u) * x / (u - 1.0f);
}

// F.softplus (beta 1): x above the threshold, else log1p(exp(x)), as torch
// computes it (its CPU kernel's log1p; not log(1 + exp(x)), which loses the
// digits above: 3% at x = -15, and 0 below x = -17).
MPS_EXT_INLINE float softplus(float x, float threshold) {
  return x > threshold ? x : log1p_accurate(metal::precise::exp(x));
}
