"""rounding.fma32, the float32 fma the bit-exact oracles use, against exact
rational arithmetic."""

from fractions import Fraction

import numpy as np
import torch

from rounding import fma32


def nearest_float32(v: Fraction) -> np.float32:
    """The float32 nearest the rational v, ties to even."""
    f = np.float32(float(v))
    around = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(around, key=lambda c: (abs(Fraction(float(c)) - v), int(np.float32(c).view(np.uint32)) & 1))


def test_fma32_rounds_once():
    # 1 + 2^-23 + 2^-24 - 2^-70: float64 rounds it onto the midpoint 1 + 2^-23 + 2^-24, which
    # float32 then rounds to even, 1 + 2^-22; the one rounding gives 1 + 2^-23.
    a, b, c = (torch.tensor([v], dtype=torch.float32) for v in (1 + 2**-23, (1 - 2**-23) * 2**-24, 1 + 2**-23))
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2**-22  # rounded twice
    assert fma32(a, b, c).item() == 1 + 2**-23
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2000, generator=g), torch.randn(2000, generator=g).bfloat16()
    c = -(a.double() * b.double() * (1 + 1e-4 * torch.randn(2000, generator=g, dtype=torch.float64))).float()
    want = [nearest_float32(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in
            zip(a.tolist(), b.float().tolist(), c.tolist())]
    np.testing.assert_array_equal(fma32(a, b, c).numpy(), np.array(want, np.float32))
