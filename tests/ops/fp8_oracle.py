"""An independent float64 model of float8_e4m3fn and float8_e5m2 in numpy:
codes decoded by formula, values encoded by round-to-nearest-even over the
exhaustive list of representable values, overflow as the contract says
(shared/reference/semantics.md: e4m3fn saturates to +-448 on every torch
release, e5m2 overflows to its infinity). And the float64 value of a
scaled matrix product (_scaled_mm, _scaled_mm_v2) by that contract: torch's
CPU _scaled_mm is not an oracle, it is oneDNN's matmul on some machines and
changes with their instruction set."""

from __future__ import annotations

import numpy as np
import torch

FORMATS = {torch.float8_e4m3fn: (4, 3, 7), torch.float8_e5m2: (5, 2, 15)}  # exponent bits, mantissa bits, bias


def decode(codes: np.ndarray, dtype) -> np.ndarray:
    """float64 values of fp8 codes (uint8), NaN and inf included."""
    ebits, mbits, bias = FORMATS[dtype]
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> mbits) & ((1 << ebits) - 1)
    m = c & ((1 << mbits) - 1)
    normal = (1 + m / 2**mbits) * np.exp2(e - bias)
    sub = m * 2.0 ** (1 - bias - mbits)
    v = np.where(e == 0, sub, normal)
    emax = (1 << ebits) - 1
    if dtype == torch.float8_e4m3fn:  # no infinities; only S.1111.111 is NaN
        v = np.where((e == emax) & (m == 7), np.nan, v)
    else:
        v = np.where(e == emax, np.where(m == 0, np.inf, np.nan), v)
    return sign * v


def saturates(dtype) -> bool:
    """Does conversion clamp overflow to the largest finite value? The
    contract, not the installed torch's answer: older releases gave NaN."""
    return dtype == torch.float8_e4m3fn


def encode(x: np.ndarray, dtype) -> np.ndarray:
    """fp8 codes of float64 values: round to nearest, ties to the even code."""
    x = np.asarray(x, dtype=np.float64)
    codes = np.arange(128, dtype=np.uint8)
    vals = decode(codes, dtype)
    finite = np.isfinite(vals)
    pos_codes, pos_vals = codes[finite], vals[finite]  # ascending with the code
    top = pos_vals[-1]
    ulp = top - pos_vals[-2]
    # One step past the largest finite value: the infinity (or, saturating,
    # the largest finite value again).
    past = (top + ulp) if not saturates(dtype) else np.inf
    grid = np.append(pos_vals, past)
    grid_codes = np.append(pos_codes, 0x7C if dtype == torch.float8_e5m2 else pos_codes[-1])
    a = np.abs(x)
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, len(grid) - 1)
    with np.errstate(invalid="ignore"):  # inf - inf, NaN: their codes are set below
        d_lo, d_hi = np.abs(a - grid[lo]), np.abs(grid[hi] - a)
    tie = d_lo == d_hi
    pick_hi = (d_hi < d_lo) | (tie & (grid_codes[hi] % 2 == 0) & (grid_codes[lo] % 2 == 1))
    out = np.where(pick_hi, grid_codes[hi], grid_codes[lo]).astype(np.int64)
    beyond = a > grid[-1] if np.isfinite(grid[-1]) else np.zeros_like(a, dtype=bool)
    big = np.isinf(a) | beyond | (a > top)
    if saturates(dtype):
        out = np.where(big, pos_codes[-1], out)
    else:
        out = np.where(np.isinf(a) | (a >= top + ulp), 0x7C, out)
    out = np.where(np.signbit(x), out | 0x80, out)
    out = np.where(np.isnan(x), np.where(np.signbit(x), 0xFF, 0x7F), out)
    return out.astype(np.uint8)


# _scaled_mm_v2's ScalingType values (torch.nn.functional.ScalingType).
TENSORWISE, ROWWISE, BLOCKWISE_1X128, BLOCKWISE_128X128 = 0, 1, 4, 5


def _dequantize(x: torch.Tensor, scale: torch.Tensor, recipe: int, operand: str) -> torch.Tensor:
    """float64 x times its scales as the contract lays them out. x is mat_a
    [M, K] (operand "a") or mat2 [K, N] ("b"); kb = ceil(K / 128).
    Row-wise: a's scale [M, 1], b's [1, N]. 1x128: a's [M, kb], b's
    [N, kb]. 128x128 (b only): [round_up(kb, 4), ceil(N / 128)]."""
    x64, s64 = x.double(), scale.double()
    if recipe == TENSORWISE:
        return x64 * s64.reshape(())
    if recipe == ROWWISE:
        return x64 * s64
    k = x.shape[1] if operand == "a" else x.shape[0]
    kblock = torch.arange(k) // 128
    if recipe == BLOCKWISE_1X128:
        return x64 * s64[:, kblock] if operand == "a" else x64 * s64[:, kblock].t()
    if recipe == BLOCKWISE_128X128 and operand == "b":
        return x64 * s64[kblock][:, torch.arange(x.shape[1]) // 128]
    raise ValueError(f"no reference for recipe {recipe} of operand {operand}")


def to_dtype(y: torch.Tensor, dtype) -> torch.Tensor:
    """float64 values converted as the contract converts a float result:
    fp8 by encode() (e4m3fn saturating), others by torch's rounding."""
    if dtype in FORMATS:
        return torch.from_numpy(encode(y.numpy(), dtype)).view(dtype)
    return y.to(dtype)


def scaled_mm_reference(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                        use_fast_accum=False, recipe_a=None, recipe_b=None) -> torch.Tensor:
    """_scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype) by
    the contract, in float64: (a * scale_a) @ (b * scale_b) + bias, divided
    by scale_result for an fp8 output (as torch's CPU emulation in
    Blas.cpp and mps_ext's kernel do), converted once to out_dtype (a's dtype
    by default). K == 0 gives zeros (plus bias). Recipes default to v1's:
    tensor-wise for one-element scales, else row-wise. use_fast_accum is
    a speed hint (the value is the same)."""
    def v1_recipe(s):
        return TENSORWISE if s.numel() == 1 else ROWWISE
    out_dtype = out_dtype or a.dtype
    y = _dequantize(a, scale_a, v1_recipe(scale_a) if recipe_a is None else recipe_a, "a") @ \
        _dequantize(b, scale_b, v1_recipe(scale_b) if recipe_b is None else recipe_b, "b")
    if bias is not None:
        y = y + bias.double()
    if scale_result is not None and out_dtype in FORMATS:
        y = y / scale_result.double()
    return to_dtype(y, out_dtype)
