"""The arithmetic of short_conv_decode's contract (csrc/ops/short_conv.cpp,
kernels_metal/short_conv.metal), computed here for tests/ops and
tests/models: a depthwise convolution's taps summed in order in float32
with fused multiply-adds (one rounding a tap), from the bias (float32,
bfloat16) or with the bias added last (float16), rounded to the dtype once.
That is torch's CPU convolution where oneDNN's AVX2 or AVX-512 kernels run
it, not with oneDNN capped at SSE4.1 (no fma) nor necessarily on other
CPUs: so torch's CPU conv1d is no oracle for the last bit."""

import numpy as np
import torch


def fma32(a, b, c):
    """fma(a, b, c) of float32 arrays, rounded once to float32: a * b is
    exact in float64; the float64 sum's own error (TwoSum) tells which way
    to move a sum that rounded onto a float32 tie (its low 29 bits 1 then
    0s), the only case where rounding twice differs from rounding once."""
    p = a.astype(np.float64) * b
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)
    tie = (s.view(np.uint64) & np.uint64((1 << 29) - 1)) == np.uint64(1 << 28)
    s = np.where(tie & (err != 0), np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def conv1d_of_the_contract(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """F.conv1d as causal_conv1d_update calls it (depthwise, no padding), in
    the kernel's arithmetic."""
    assert groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1 and (stride, padding, dilation) == (1, 0, 1)
    x32, w = x.detach().float().numpy(), weight.detach()[:, 0].float().numpy()
    k, outputs = w.shape[-1], x.shape[-1] - w.shape[-1] + 1
    bias_first = bias is not None and x.dtype != torch.float16
    acc = np.zeros((*x.shape[:2], outputs), dtype=np.float32)
    if bias_first:
        acc += bias.detach().float().numpy()[:, None]
    for tap in range(k):
        acc = fma32(w[:, tap, None], x32[..., tap:tap + outputs], acc)
    if bias is not None and not bias_first:
        acc = acc + bias.detach().float().numpy()[:, None]
    return torch.from_numpy(acc).to(x.dtype)
