"""The executor's math library against numpy in float64, and poisoned
threadgroup memory."""

import numpy as np
import torch


def test_float_math(kernels):
    x = np.concatenate([np.linspace(-8, 8, 61), [0.0, -0.0, 1e-30, 0.5, -2.5]]).astype(np.float32)
    out = torch.zeros(len(x) * 16)
    kernels("math").dispatch("float_math", [out, torch.from_numpy(x)], threads=len(x), threads_per_threadgroup=32)
    v = x.astype(np.float64)
    a = np.abs(v)
    want = np.stack([
        np.exp(v), np.exp(v), np.exp(v), np.log(a + 1), np.sqrt(a), 1 / np.sqrt(a + 1), np.tanh(v),
        np.sin(v) + np.cos(v), np.exp2(v) - np.log2(a + 1), a ** 1.5,
        np.floor(v) + np.ceil(v) + np.trunc(v) + np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5)),
        v - np.floor(v), np.arctan2(v, 2), np.fmin(v, 0.5) + np.fmax(v, -0.5) + np.copysign(1, v), v * 3 + 1,
        v / 7 + np.sqrt(a),
    ], axis=1)
    np.testing.assert_allclose(out.numpy().reshape(-1, 16), want, rtol=2e-6, atol=2e-6)


def test_half_math_rounds_once_from_float(kernels):
    x = (np.linspace(-6, 6, 97)).astype(np.float16)
    out = torch.zeros(len(x) * 4, dtype=torch.float16)
    kernels("math").dispatch("half_math", [out, torch.from_numpy(x)], threads=len(x), threads_per_threadgroup=32)
    v = x.astype(np.float64)
    want = np.stack([np.exp(v), np.sqrt(np.abs(v)), np.tanh(v), np.log(np.abs(v) + 1)], axis=1).astype(np.float16)
    got = out.numpy().reshape(-1, 4)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-3, atol=1e-4)


def test_threadgroup_memory_is_poisoned_for_every_threadgroup(kernels):
    out = torch.zeros(3 * 32, dtype=torch.int32)
    kernels("math").dispatch("poisoned", [out], threadgroups=3, threads_per_threadgroup=32)
    bits = out.numpy().view(np.uint32)
    assert (bits == 0xFFFFFFFF).all()  # NaN as float, -1 as int: never 12345 from a previous threadgroup
    assert np.isnan(out.numpy().view(np.float32)).all()
