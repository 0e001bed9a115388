"""Prefill linear layers: aten::linear, mm and addmm with more than 8 rows in
float16 and bfloat16 run gmm_tiled's dense instantiation (gmm_tiled_dense_*,
grouped_mm.cpp's dense_tiled), against float64 products.

The bound (stated, not measured): the kernel accumulates in float32 and
rounds the product once to the output's type; a bias is added to the rounded
product and the sum rounded again (as torch's MPS kernels add it). So
|got - exact| <= u * (|product| + |exact|) + K * 2^-23 * sum_k |x_k w_k|
(+ the smallest subnormal), u the unit roundoff of the output's type
(2^-11 half, 2^-8 bfloat)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mps_ext
import mps_ext_executor as cpu_metal
from host_names import host_names

DTYPES = [torch.float16, torch.bfloat16]
SHORT = {torch.float16: "f16", torch.bfloat16: "bf16"}
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TINY = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
gen = torch.Generator().manual_seed(32)


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def check(got, a, b, bias=None):
    """got against a @ b (+ bias) in float64, within the module's bound."""
    a64, b64 = a.double(), b.double()
    product = a64 @ b64
    exact = product + bias.double() if bias is not None else product
    k = a.shape[-1]
    u = UNIT[got.dtype]
    bound = u * (product.abs() + exact.abs()) + k * 2.0**-23 * (a64.abs() @ b64.abs()) + TINY[got.dtype]
    err = (got.double() - exact).abs()
    assert got.shape == exact.shape
    assert bool((err <= bound).all()), f"max error over bound {(err / bound).max().item():.3f}"


def tiled_kernels(rec):
    return [d.kernel for d in rec.dispatches if d.kernel.startswith("gmm_tiled")]


def weight(n, k, dtype, layout):
    """F.linear's [N, K] weight: contiguous, stored [K, N] (x @ W's), or strided along K."""
    if layout == "nk":
        return randn(n, k, dtype=dtype, scale=k**-0.5)
    if layout == "kn":
        return randn(k, n, dtype=dtype, scale=k**-0.5).t()
    return randn(n, 2 * k, dtype=dtype, scale=k**-0.5)[:, ::2]


# Rows, N and K with tails past the 64 x 64 tile and the 32-deep stage: 9 rows (one past the GEMVs), 70 = 64 + 6,
# 72 = 64 + 8, K = 40 = 32 + 8 and K = 33 (odd: element loads), N = 5 (one partial column tile).
SHAPES = [(9, 72, 40), (70, 5, 33), (130, 72, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn", "strided"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_rows_past_8(run, device, dtype, layout, with_bias):
    for rows, n, k in SHAPES:
        x = randn(rows, k, dtype=dtype)
        w = weight(n, k, dtype, layout)
        b = randn(n, dtype=dtype) if with_bias else None
        with cpu_metal.record() as rec:
            got = run("linear", x, w, b, family="linear")
        check(got, x, w.t(), b)
        if device == "executor":
            assert tiled_kernels(rec) == [f"gmm_tiled_dense_{SHORT[dtype]}"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_leading_dims_and_strided_rows(run, dtype):
    # [2, 9, K] rows, and every other row of a [2, 18, K] (rows that flatten with a stride of 2K).
    w = weight(24, 40, dtype, "nk")
    for x in (randn(2, 9, 40, dtype=dtype), randn(36, 40, dtype=dtype).view(2, 18, 40)[:, ::2]):
        got = run("linear", x, w, None, family="linear")
        check(got.reshape(-1, 24), x.reshape(-1, 40), w.t())
        assert got.shape == (2, 9, 24)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mat2_layout", ["kn", "nk.t", "strided"])
@pytest.mark.parametrize("mat1_layout", ["contiguous", "transposed", "strided"])
def test_mm_layouts(run, device, dtype, mat1_layout, mat2_layout):
    # autograd's backward calls mm on transposes: grad_w = grad_y^T @ x, grad_x = grad_y @ w.
    m, k, n = 70, 40, 72
    mat1 = {"contiguous": lambda: randn(m, k, dtype=dtype),
            "transposed": lambda: randn(k, m, dtype=dtype).t(),
            "strided": lambda: randn(m, 2 * k, dtype=dtype)[:, 1::2]}[mat1_layout]()
    mat2 = {"kn": lambda: randn(k, n, dtype=dtype),
            "nk.t": lambda: randn(n, k, dtype=dtype).t(),
            "strided": lambda: randn(2 * k, n, dtype=dtype)[::2]}[mat2_layout]()
    with cpu_metal.record() as rec:
        got = run("mm", mat1, mat2, family="linear")
    check(got, mat1, mat2)
    if device == "executor":
        assert tiled_kernels(rec) == [f"gmm_tiled_dense_{SHORT[dtype]}"]


@pytest.mark.parametrize("bias_shape", [(72,), (1, 72), (20, 72), (20, 1), ()])
@pytest.mark.parametrize("beta", [1, 0])
def test_addmm_bias(run, device, bias_shape, beta):
    dtype = torch.bfloat16
    mat1, mat2 = randn(20, 40, dtype=dtype), randn(40, 72, dtype=dtype)
    bias = randn(*bias_shape, dtype=dtype)
    if beta == 0:
        bias = torch.full(bias_shape, float("nan"), dtype=dtype)  # not read: torch's beta = 0
    with cpu_metal.record() as rec:
        got = run("addmm", bias, mat1, mat2, beta=beta, alpha=1, family="linear")
    check(got, mat1, mat2, bias.expand(20, 72) if beta else None)
    if device == "executor":
        assert tiled_kernels(rec) == ["gmm_tiled_dense_bf16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_k_zero_and_empty(run, dtype):
    x, w = randn(20, 0, dtype=dtype), randn(5, 0, dtype=dtype)
    b = randn(5, dtype=dtype)
    assert torch.equal(run("linear", x, w, None, family="linear"), torch.zeros(20, 5, dtype=dtype))
    assert torch.equal(run("linear", x, w, b, family="linear"), b.expand(20, 5))
    assert torch.equal(run("mm", randn(20, 0, dtype=dtype), randn(0, 30, dtype=dtype), family="linear"),
                       torch.zeros(20, 30, dtype=dtype))
    assert run("linear", randn(20, 8, dtype=dtype), randn(0, 8, dtype=dtype), None, family="linear").shape == (20, 0)


def test_out_forms(run, device):
    mat1, mat2 = randn(33, 40, dtype=torch.float16), randn(40, 65, dtype=torch.float16)
    bias = randn(65, dtype=torch.float16)
    for name, args in (("mm", (mat1, mat2)), ("addmm", (bias, mat1, mat2))):
        out = torch.full((33, 65), 7.0, dtype=torch.float16)
        mps_ext.reset_stats()
        with cpu_metal.record() as rec:
            getattr(torch.ops.mps_ext, name).out(*args, out=out)
        assert mps_ext.stats()["linear"]["ran"] == 1
        assert tiled_kernels(rec) == ["gmm_tiled_dense_f16"]
        check(out, mat1, mat2, bias if name == "addmm" else None)


@pytest.mark.parametrize("case", ["float32", "alpha", "beta"])
def test_what_the_tile_leaves_to_torch(case):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    bias, mat1, mat2 = randn(72, dtype=dtype), randn(20, 40, dtype=dtype), randn(40, 72, dtype=dtype)
    kwargs = {"alpha": 0.5} if case == "alpha" else {"beta": 2} if case == "beta" else {}
    mps_ext.reset_stats()
    got = torch.ops.mps_ext.addmm(bias, mat1, mat2, **kwargs)
    assert torch.equal(got, torch.addmm(bias, mat1, mat2, **kwargs))
    s = mps_ext.stats()["linear"]
    reason = ("float32 with more than 8 rows (a general matmul)" if case == "float32"
              else "beta or alpha other than 1 with more than 8 rows")
    assert s["ran"] == 0 and s["fallbacks"] == {reason: 1}


class ToMpsExt(TorchDispatchMode):
    """aten's mm / addmm / linear, as the autograd engine calls them below
    autograd (forward and backward), sent to mps_ext's: on a Mac the MPS
    overrides are reached so; here CPU tensors reach only torch.ops.mps_ext."""

    OPS = {torch.ops.aten.mm.default: torch.ops.mps_ext.mm, torch.ops.aten.addmm.default: torch.ops.mps_ext.addmm,
           torch.ops.aten.linear.default: torch.ops.mps_ext.linear}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.OPS.get(func, func)(*args, **(kwargs or {}))


def test_backward_through_linear_matches_float64():
    # F.linear at 16 rows: aten's linear is addmm(b, x, w.t()) on CPU; its
    # backward's products are mm(g, w) and mm(g.t(), x), on transposed views.
    dtype = torch.bfloat16
    x = randn(16, 40, dtype=dtype).requires_grad_()
    w = randn(72, 40, dtype=dtype, scale=40**-0.5).requires_grad_()
    b = randn(72, dtype=dtype).requires_grad_()
    g = randn(16, 72, dtype=dtype)
    mps_ext.reset_stats()
    with ToMpsExt(), cpu_metal.record() as rec:
        y = torch.nn.functional.linear(x, w, b)
        y.backward(g)
    assert tiled_kernels(rec) == ["gmm_tiled_dense_bf16"] * 3  # the forward, grad_x and grad_w
    assert mps_ext.stats()["linear"]["ran"] == 3
    check(y.detach(), x.detach(), w.detach().t(), b.detach())
    check(x.grad, g, w.detach())
    check(w.grad, g.t(), x.detach())


def test_every_dense_kernel_is_tested():
    # (_e4m3w: fp8_linear's, tests/ops/test_scaled_mm.py)
    assert {k for k in host_names("grouped_mm") if k.startswith("gmm_tiled_dense_") and not k.endswith("_e4m3w")} == {
        f"gmm_tiled_dense_{t}" for t in SHORT.values()}
