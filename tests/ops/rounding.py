"""Rounding written out for test oracles, independent of the kernels and of
the machine: a float32 fused multiply-add from float64 arithmetic."""

import torch


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c rounded once to float32, as Metal's fma() gives it (a, b
    and c hold float32 values: float32, float16 or bfloat16 tensors).

    The product of two float32 values is exact in float64 (48 of its 53
    bits); the sum is not always, and rounding it to float64 and then to
    float32 can round twice the wrong way (a sum just off a float32
    midpoint that float64 rounds onto it). So the sum is rounded to odd:
    the float64 nearest it, moved one step toward the exact sum when it is
    inexact and its last bit is even (the exact error from the two-sum
    identity); rounding that to float32 is then the one correct rounding
    (float64 keeps more than two bits beyond float32's: Boldo and
    Melquiond, "When double rounding is odd", 2005)."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)  # s + err == p + c exactly (Knuth's two-sum)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where((err != 0) & even & torch.isfinite(s), torch.nextafter(s, toward), s)
    return s.float()


EXP_ULPS = 4  # Metal's precise exp: within 4 ulp of the exact value (MSL 4, section 8.4, Table 8.1)


def sigmoid_reach(x: torch.Tensor, dtype: torch.dtype, ulps: int = EXP_ULPS):
    """The lowest and highest value float(T(1 / (1 + exp(-x)))), T = dtype,
    takes in float32 arithmetic (the kernels' sigmoid, rounded to T) over
    every float32 exp(-x) within `ulps` ulps of the exact one (ulps of the
    exact value's binade, as the specification counts them): what an exp as
    accurate as Metal promises may give. Float32 tensors. numpy's float32
    arithmetic rounds as the GPU's."""
    import numpy as np
    with np.errstate(over="ignore", invalid="ignore"):
        exact = np.exp(-x.double().numpy())
        ulp = np.ldexp(1.0, np.frexp(exact)[1] - 24)

        def score(e):
            return torch.from_numpy(np.float32(1) / (np.float32(1) + e)).to(dtype).float().numpy()
        e0 = exact.astype(np.float32)  # the nearest float: within the bound, or inf where exp(-x) overflows
        lo, hi = score(e0), score(e0)
        normal = np.abs(exact) >= 2.0 ** -126  # (a subnormal exp flushes to 0 on the GPU: no ulps to move)
        for direction in (np.float32(np.inf), np.float32(0)):
            e = np.nextafter(e0, direction)
            for _ in range(2 * ulps + 1):  # (a step down a binade is half an ulp of the one above)
                inside = normal & np.isfinite(e) & (np.abs(e.astype(np.float64) - exact) <= ulps * ulp)
                s = score(e)
                lo, hi = np.where(inside, np.minimum(lo, s), lo), np.where(inside, np.maximum(hi, s), hi)
                e = np.nextafter(e, direction)
    return torch.from_numpy(lo), torch.from_numpy(hi)
