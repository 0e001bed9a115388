"""torch.ops.mps_ext.sigmoid_gate_linear (csrc/ops/linear.cpp, linear.metal's
sigmoid_gate_gemv_rows): an attention layer's output gate (Qwen3.5/3.6,
Qwen3-Next: x * sigmoid(gate), the gate read where q_proj left it) and the
o_proj that reads it in one dispatch. Its contract is the two ops it
replaces, to the bit: F.linear(sigmoid_gate(x, gate), W, b) as mps_ext runs
them (torch.ops.mps_ext.sigmoid_gate, then mps_ext's GEMV); so the oracle
here is those two ops (themselves tested against the model's line, float64
and torch: test_attention_gate.py, test_linear.py), compared with
torch.equal, and the fused dispatch reads what it must."""

import math

import pytest
import torch

from host_names import host_names
import mps_ext_executor as cpu_metal
from test_rms_norm_linear import DEVICES, DTYPES, RQ, SHORT, aligned, randn  # (its variants are this op's)

X, W, GATE = 1, 2, 5  # buffer indices of sigmoid_gate_gemv_rows


def attention_output(lead, heads, d, dtype, seed):
    """(x [*lead, heads * d], gate [*lead, heads, d]) as the attention forward
    has them: x contiguous, gate each head's second half of q_proj's output
    (a strided view)."""
    x = randn(*lead, heads * d, dtype=dtype, seed=seed, scale=2)
    q = randn(*lead, heads, 2 * d, dtype=dtype, seed=seed + 100, scale=3)
    return x, torch.chunk(q, 2, dim=-1)[1]


def both(device, x, gate, w, b):
    """(fused, unfused) products on `device`, back on the CPU."""
    if device == "mps":
        x, gate, w, b = (t.to("mps") if t is not None else None for t in (x, gate, w, b))
    fused = torch.ops.mps_ext.sigmoid_gate_linear(x, gate, w, b)
    gated = torch.ops.mps_ext.sigmoid_gate(x.reshape(gate.shape), gate).view(x.shape)
    linear = torch.nn.functional.linear if device == "mps" else torch.ops.mps_ext.linear
    return fused.cpu(), linear(gated, w, b).cpu()


def assert_equal(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want), (got.double() - want.double()).abs().max()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r,q", RQ)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_is_sigmoid_gate_then_linear(device, dtype, r, q, vec, bias):
    """Every kernel variant (rows, outputs per simdgroup, 16-byte or element
    loads) gives the GEMV's product of sigmoid_gate's rows to the bit, with
    and without a bias. K = 75 (3 heads of 25) at one row: the vector
    variant's last elements are fewer than a piece; at more rows K = 200 (5
    heads of 40: a row of 16-byte multiples, which the vector variant needs
    beyond one row)."""
    rows = {1: 1, 2: 2, 4: 3, 8: 7}[r]  # 3 rows take the 4-row variant, 7 the 8-row one
    heads, d = (3, 25) if r == 1 else (5, 40)
    k = heads * d
    n = 300 if q == 1 else 1300  # 2 outputs a simdgroup from N >= 1280 (decode_geometry)
    x, gate = attention_output((rows,), heads, d, dtype, seed=1)
    w = aligned(n, k, dtype, vec, seed=2, scale=k ** -0.5)
    b = randn(n, dtype=dtype, seed=3) if bias else None
    with cpu_metal.record() as rec:
        fused, unfused = both(device, x, gate, w, b)
    assert_equal(fused, unfused)
    if device == "executor":
        kind = f"_{SHORT[dtype]}_r{r}_q{q}_{'vec' if vec else 'scalar'}"
        assert [d.kernel for d in rec.dispatches] == ["sigmoid_gate_gemv_rows" + kind, "sigmoid_gate_" + SHORT[dtype],
                                                      "gemv_rows" + kind]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,heads,d", [(1, 16, 256), (2, 8, 128), (1, 3, 100)])
def test_decode_shapes(device, dtype, rows, heads, d):
    """Qwen3.6's full-attention layer at a decode token (16 heads of 256,
    the widest row a threadgroup keeps in half and bfloat: 8 KB), two rows
    of 8 heads of 128, and a head whose row is not of 16-byte pieces: the
    two ops' bits, each weight byte read once, x and the gate once a
    threadgroup (from the caches after the first), and within float
    rounding of float64's product of the gated rows."""
    if rows * heads * d * dtype.itemsize > 8192:
        pytest.skip("past the kernel's staged bytes (test_larger_calls_are_the_two_ops)")
    k = heads * d
    x, gate = attention_output((1, rows), heads, d, dtype, seed=4)
    w = randn(640, k, dtype=dtype, seed=5, scale=k ** -0.5)
    with cpu_metal.record() as rec:
        fused, unfused = both(device, x, gate, w, None)
    assert_equal(fused, unfused)
    gated = torch.ops.mps_ext.sigmoid_gate(x.reshape(gate.shape), gate).view(x.shape)
    want = torch.nn.functional.linear(gated.double(), w.double())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(fused.double(), want, rtol=tol, atol=tol)
    if device == "executor":
        dsp = rec.dispatches[0]
        assert dsp.kernel.startswith("sigmoid_gate_gemv_rows_")
        groups = math.prod(dsp.threadgroups)
        assert dsp.bytes_read[W] == w.nbytes
        assert dsp.bytes_read[X] == x.nbytes * groups and dsp.bytes_read[GATE] == x.nbytes * groups


def test_layouts_of_x_and_the_gate():
    """x [batch, tokens, K] as the attention passes it, rows of a wider
    tensor, and a gate of x's own shape, contiguous or not: the product
    [..., N], the two ops' bits."""
    dtype, heads, d = torch.bfloat16, 4, 32
    k = heads * d
    w = randn(96, k, dtype=dtype, seed=6, scale=k ** -0.5)
    x, gate = attention_output((2, 1), heads, d, dtype, seed=8)
    wide = randn(3, 2 * k, dtype=dtype, seed=9)[:, :k]
    x4, gate4 = attention_output((2, 2), heads, d, dtype, seed=14)
    cases = [(x, gate),  # (batch, token) rows of a strided gate
             (wide, randn(3, k, dtype=dtype, seed=10)),  # rows of a wider x, a gate of its shape
             (wide, randn(3, 2 * k, dtype=dtype, seed=11)[:, k:]),  # a strided gate of x's shape
             (x4, gate4.transpose(0, 1).contiguous().transpose(0, 1)),  # a gate whose rows do not flatten
             (x[:, :, :1], gate[:, :, :1, :1])]  # K = 1
    for xx, g in cases:
        ww = w[:, :xx.shape[-1]].contiguous()
        with cpu_metal.record() as rec:
            fused, unfused = both("executor", xx, g, ww, None)
        assert fused.shape == (*xx.shape[:-1], 96)
        assert_equal(fused, unfused)
        assert rec.dispatches[0].kernel.startswith("sigmoid_gate_gemv_rows_bf16")


def test_larger_calls_are_the_two_ops():
    """More than 8 rows (a prefill), rows past the kernel's threadgroup
    memory, no rows: sigmoid_gate and the linear layer, the same results."""
    for rows, heads, d, dtype in ((9, 2, 32, torch.bfloat16), (1, 16, 256, torch.float32), (0, 2, 8, torch.float16)):
        x, gate = attention_output((rows,), heads, d, dtype, seed=12)
        w = randn(32, heads * d, dtype=dtype, seed=13, scale=(heads * d) ** -0.5)
        with cpu_metal.record() as rec:
            y = torch.ops.mps_ext.sigmoid_gate_linear(x, gate, w, None)
        assert not any(dsp.kernel.startswith("sigmoid_gate_gemv_rows_") for dsp in rec.dispatches)
        gated = torch.ops.mps_ext.sigmoid_gate(x.reshape(gate.shape), gate).view(x.shape)
        assert y.shape == (rows, 32) and torch.equal(y, torch.nn.functional.linear(gated, w))


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.zeros(1, 64, dtype=torch.int32)), "x must be float32, float16 or bfloat16"),
    (dict(gate=torch.zeros(1, 64, dtype=torch.float16)), "gate must be x's dtype and device"),
    (dict(gate=torch.zeros(1, 3, 16, dtype=torch.bfloat16)), r"gate must be x's shape \[1, 64\]"),
    (dict(gate=torch.zeros(2, 64, dtype=torch.bfloat16)), r"gate must be x's shape"),
    (dict(weight=torch.zeros(8, 63, dtype=torch.bfloat16)), r"weight must be \[N, 64\]"),
    (dict(weight=torch.zeros(8, 64, dtype=torch.float32)), "weight must be x's dtype and device"),
    (dict(weight=torch.zeros(64, 8, dtype=torch.bfloat16).t()), "weight must be contiguous along K"),
    (dict(bias=torch.zeros(7, dtype=torch.bfloat16)), "bias must be 1-D of N = 8"),
    (dict(x=torch.tensor(1.0, dtype=torch.bfloat16), gate=torch.tensor(1.0, dtype=torch.bfloat16)),
     "x must have a last dimension"),
])
def test_bad_input(change, message):
    args = dict(x=torch.ones(1, 64, dtype=torch.bfloat16), gate=torch.ones(1, 4, 16, dtype=torch.bfloat16),
                weight=torch.zeros(8, 64, dtype=torch.bfloat16), bias=None)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.sigmoid_gate_linear(**args)


def test_meta_kernel_gives_shapes_and_dtypes():
    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")
    y = torch.ops.mps_ext.sigmoid_gate_linear(meta(1, 1, 64), meta(1, 1, 4, 16), meta(40, 64), None)
    assert y.shape == (1, 1, 40) and y.dtype == torch.bfloat16 and y.device.type == "meta"


def test_every_kernel_is_tested():
    # test_every_variant_is_sigmoid_gate_then_linear runs each of these.
    fused = {k for k in host_names("linear") if k.startswith("sigmoid_gate_gemv_rows_")}
    assert fused == {f"sigmoid_gate_gemv_rows_{t}_r{r}_q{q}_{v}" for t in SHORT.values() for r, q in RQ
                     for v in ("vec", "scalar")}
