"""torch.ops.mps_ext.short_conv_decode (an LFM2 conv layer's decode step,
csrc/ops/short_conv.cpp) on the executor, against transformers' own code
for the step (B * x, causal_conv1d_update's torch fallback, C * y) with its
convolution in the arithmetic of the kernel's contract
(tests/short_conv_oracle.py: the taps summed in order in float32 with fused
multiply-adds; torch's CPU convolution where oneDNN's AVX2 or AVX-512
kernels run it, not with oneDNN capped at SSE4.1). Bit for bit in
float32, float16 and bfloat16, the output and the window left in the
state; within float32 rounding of float64; every kernel variant; bad
input."""

import pytest
import torch
import torch.nn.functional as F

from transformers.models.lfm2_moe.modeling_lfm2_moe import causal_conv1d_update

import mps_ext  # noqa: F401  (registers the ops)
import mps_ext_executor as cpu_metal
from decode_steps import short_conv, short_conv_inputs as inputs
from host_names import host_names
from short_conv_oracle import conv1d_of_the_contract

# torch's CPU ops run the rest of transformers' step (and the float64
# conv1d); torch's float32 conv1d, no longer the oracle, changed with
# ONEDNN_MAX_CPU_ISA. scripts/test.sh runs this file again with torch's CPU
# kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

KERNEL = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def transformers_step(BCx, conv_state, weight, bias, conv1d=conv1d_of_the_contract):
    """Lfm2ShortConv.forward's decode lines from in_proj's output to out_proj's
    input, with torch's CPU ops but `conv1d` for the convolution."""
    B, C, x = BCx.transpose(-1, -2).chunk(3, dim=-2)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(F, "conv1d", conv1d)
        y = causal_conv1d_update(B * x, conv_state, weight, bias)
    return (C * y).transpose(-1, -2).contiguous()


def float64_step(BCx, conv_state, weight, bias):
    """The step in float64 (the window as the step leaves it)."""
    d = {k: v.double() if v is not None else None for k, v in dict(BCx=BCx, weight=weight, bias=bias).items()}
    return transformers_step(d["BCx"], conv_state.double(), d["weight"], d["bias"], conv1d=F.conv1d)


# (batch, hidden, k): LFM2's window of 3 over a partial second threadgroup of channels; 2 and 4 taps; one
# channel; batch 3 with a bias-free conv.
SHAPES = [(2, 200, 3), (1, 130, 2), (1, 64, 4), (1, 1, 3), (3, 40, 1)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_h{}_k{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_transformers_torch_code_bit_for_bit(shape, dtype, bias):
    batch, hidden, k = shape
    d = inputs(batch, hidden, k, dtype, bias, row_extra=5)  # a row stride past 3 * hidden
    state_before = d["conv_state"].clone()
    want_state = d["conv_state"].clone()
    want = transformers_step(d["BCx"], want_state, d["weight"], d["bias"])
    with cpu_metal.record() as rec:
        out = short_conv(d)
    assert [r.kernel for r in rec.dispatches] == ["short_conv_decode_" + KERNEL[dtype]]
    assert out.shape == (batch, 1, hidden) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(d["conv_state"], want_state)
    assert torch.equal(out, want), float((out.double() - want.double()).abs().max())
    if dtype == torch.float32:  # the contract's arithmetic is the convolution, to float32 rounding
        torch.testing.assert_close(out.double(), float64_step(d["BCx"], state_before, d["weight"], d["bias"]),
                                   rtol=1e-6, atol=1e-6)


def test_every_kernel_is_tested():
    """The parametrised test above runs short_conv_decode_<t> for each of these (it checks the kernel's name)."""
    assert host_names("short_conv") == {"short_conv_decode_" + t for t in KERNEL.values()}


def test_many_values_bit_for_bit():
    """Wide rows of every dtype: enough sums for a different summation order
    or bias position to show (it did for float32's and float16's bias)."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        d = inputs(2, 4096, 3, dtype, seed=3)
        want_state = d["conv_state"].clone()
        want = transformers_step(d["BCx"], want_state, d["weight"], d["bias"])
        out = short_conv(d)
        assert torch.equal(out, want), dtype
        assert torch.equal(d["conv_state"], want_state), dtype


def test_steps_chain_through_the_state():
    """Several decode steps, each reading the window the last one wrote."""
    d = inputs(1, 48, 3, torch.bfloat16)
    theirs = d["conv_state"].clone()
    for step in range(4):
        BCx = inputs(1, 48, 3, torch.bfloat16, seed=10 + step)["BCx"]
        assert torch.equal(torch.ops.mps_ext.short_conv_decode(BCx, d["conv_state"], d["weight"], d["bias"]),
                           transformers_step(BCx, theirs, d["weight"], d["bias"]))
    assert torch.equal(d["conv_state"], theirs)


def test_empty_batch():
    d = inputs(0, 8, 3, torch.float32)
    assert short_conv(d).shape == (0, 1, 8)


def _bad(**changes):
    d = inputs(1, 8, 3, torch.float32)
    d.update(changes)
    return d


@pytest.mark.parametrize("d, match", [
    (_bad(BCx=torch.zeros(1, 2, 24)), r"\[batch, 1, 3 \* hidden\]"),
    (_bad(BCx=torch.zeros(1, 1, 25)), r"\[batch, 1, 3 \* hidden\]"),
    (_bad(BCx=torch.zeros(1, 1, 48)[..., ::2]), r"contiguous rows"),
    (_bad(BCx=torch.zeros(1, 1, 24, dtype=torch.float64)), "float32, float16 or bfloat16"),
    (_bad(conv_state=torch.zeros(1, 3, 8).transpose(1, 2)), r"conv_state must be contiguous .*not contiguous"),
    (_bad(conv_state=torch.zeros(2, 8, 3)), r"conv_state must be contiguous \[1, 8, kernel size\]"),
    (_bad(conv_state=torch.zeros(1, 8, 3, dtype=torch.bfloat16)), "in Float"),
    (_bad(conv_state=torch.zeros(1, 8, 5), weight=torch.zeros(8, 5)), "windows .* of 1 to 4 taps, got 5"),
    (_bad(weight=torch.zeros(8, 1, 3)), r"weight must be contiguous \[8, 3\]"),
    (_bad(weight=torch.zeros(8, 2)), r"weight must be contiguous \[8, 3\]"),
    (_bad(bias=torch.zeros(7)), r"bias must be None or contiguous \[8\]"),
    (_bad(conv_state=None), "the layer's cache after a prefill"),
], ids=["not_one_token", "not_thirds", "strided_rows", "float64", "state_not_contiguous", "state_batch",
        "state_dtype", "window_too_long", "weight_3d", "weight_taps", "bias_size", "no_state"])
def test_bad_input_is_a_clear_error(d, match):
    with pytest.raises(RuntimeError, match=match):
        short_conv(d)
