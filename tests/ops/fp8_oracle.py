"""An independent float64 model of float8_e4m3fn and float8_e5m2 in numpy:
codes decoded by formula, values encoded by round-to-nearest-even over the
exhaustive list of representable values. Whether overflow saturates is
found by asking the installed torch, not assumed."""

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
    """Does the installed torch clamp overflow to the largest finite value?"""
    return bool(torch.isfinite(torch.tensor([1e30]).to(dtype).float()).item())


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
