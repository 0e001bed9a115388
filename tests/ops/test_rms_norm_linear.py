"""torch.ops.mps_ext.rms_norm_linear (csrc/ops/linear.cpp, linear.metal's
rms_norm_gemv_rows): a decoder layer's input norm and the projection that
reads it in one dispatch. Its contract is the two ops it replaces, to the
bit: (rms_norm(x), F.linear(rms_norm(x), W, b)) as mps_ext runs them
(torch.ops.mps_ext.rms_norm, then mps_ext's GEMV); so the oracle here is
those two ops (themselves tested against transformers' modules, float64
and torch: test_norm.py, test_linear.py), compared with torch.equal, and
the fused dispatch reads what it must."""

import math

import pytest
import torch

import mps_ext
from host_names import host_names
import mps_ext_executor as cpu_metal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DEVICES = ["executor"] + ([pytest.param("mps", marks=pytest.mark.mac)] if mps_ext.is_available() else [])
X, W, NORMED, NORM_W = 1, 2, 5, 6  # buffer indices of rms_norm_gemv_rows
# (rows, outputs per simdgroup) of the variants, as test_linear.py's GEMV_ROWS_RQ.
RQ = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 2)]


def randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def aligned(rows, cols, dtype, vec, seed, scale=1.0):
    """[rows, cols] whose rows start 16-byte aligned (vec) or one element off."""
    step = (cols + 15) // 16 * 16 + 16
    base = randn(rows * step + 16, dtype=dtype, seed=seed, scale=scale)
    start = 0 if vec else 1
    return base[start:start + rows * step].view(rows, step)[:, :cols]


def norm_weight(k, dtype, variant, seed=7):
    # Trained weights: around 1 (weight variant) or around 0 (zero-centred).
    return (randn(k, dtype=torch.float32, seed=seed, scale=0.2) + (1 if variant == "weight" else 0)).to(dtype)


def both(device, x, nw, eps, variant, w, b):
    """(fused, unfused), each (normed, y), on `device`, back on the CPU."""
    if device == "mps":
        x, nw, w, b = (t.to("mps") if t is not None else None for t in (x, nw, w, b))
    fused = torch.ops.mps_ext.rms_norm_linear(x, nw, eps, variant, w, b)
    normed = torch.ops.mps_ext.rms_norm(x, nw, eps, variant)
    linear = torch.nn.functional.linear if device == "mps" else torch.ops.mps_ext.linear
    return tuple(t.cpu() for t in fused), (normed.cpu(), linear(normed, w, b).cpu())


def assert_equal(fused, unfused):
    for got, want, what in zip(fused, unfused, ("normed", "y")):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert torch.equal(got, want), (what, (got.double() - want.double()).abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["weight", "zero_centred"])
@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r,q", RQ)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_is_rms_norm_then_linear(device, dtype, r, q, vec, variant):
    """Every kernel variant (rows, outputs per simdgroup, 16-byte or element
    loads) gives rms_norm's normed rows and the GEMV's product of them to the
    bit, with a bias. K = 75 at one row: the vector variant's last elements
    are fewer than a piece; at more rows K = 200 (a normed row of 16-byte
    multiples, which the vector variant needs beyond one row). A norm team of
    one simdgroup (K <= 256)."""
    rows = {1: 1, 2: 2, 4: 3, 8: 7}[r]  # 3 rows take the 4-row variant, 7 the 8-row one
    k = 75 if r == 1 else 200
    n = 300 if q == 1 else 1300  # 2 outputs a simdgroup from N >= 1280 (decode_geometry)
    x = randn(rows, k, dtype=dtype, seed=1, scale=3)
    w = aligned(n, k, dtype, vec, seed=2, scale=k ** -0.5)
    b = randn(n, dtype=dtype, seed=3)
    with cpu_metal.record() as rec:
        fused, unfused = both(device, x, norm_weight(k, dtype, variant), 1e-6, variant, w, b)
    assert_equal(fused, unfused)
    if device == "executor":
        assert rec.dispatches[0].kernel == f"rms_norm_gemv_rows_{SHORT[dtype]}_r{r}_q{q}_{'vec' if vec else 'scalar'}"
        assert len(rec.dispatches) == 3  # the fused one, then rms_norm and the GEMV


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k,variant", [(1, 2048, "zero_centred"), (1, 2048, "weight"), (2, 1000, "weight"),
                                            (1, 8192 // 2, "zero_centred")])
def test_decode_shapes_with_a_team_of_several_simdgroups(device, dtype, rows, k, variant):
    """A decode token's hidden state (2048: Qwen3.6 and LFM2.5; rms_norm's
    team is 256 threads, 8 simdgroups whose sums add in order, which the
    GEMV's simdgroups run one after another), a row whose team has idle
    slots (1000), the widest normed row a threadgroup keeps in half and
    bfloat (4096), over several activation tiles."""
    if dtype == torch.float32 and rows * k * 4 > 8192:
        pytest.skip("past the kernel's normed bytes in float32 (test_larger_calls_are_the_two_ops)")
    x = randn(rows, k, dtype=dtype, seed=4, scale=3)
    w = randn(640, k, dtype=dtype, seed=5, scale=k ** -0.5)
    with cpu_metal.record() as rec:
        fused, unfused = both(device, x, norm_weight(k, dtype, variant), 1e-6, variant, w, None)
    assert_equal(fused, unfused)
    if device == "executor":
        d = rec.dispatches[0]
        assert d.kernel.startswith("rms_norm_gemv_rows_")
        # Every weight byte once; per threadgroup (from the caches after the
        # first) x twice (its squares, then the normed values) and the norm
        # weight once a row; normed written once, by one threadgroup.
        groups = math.prod(d.threadgroups)
        assert d.bytes_read[W] == w.nbytes
        assert d.bytes_read[X] == 2 * x.nbytes * groups and d.bytes_read[NORM_W] == rows * k * dtype.itemsize * groups
        assert d.bytes_written[NORMED] == x.nbytes


def test_leading_dimensions_and_a_strided_input():
    """x [batch, tokens, K] as the decoder layer passes it, and rows of a
    wider tensor: the normed output has x's shape, the product [..., N]."""
    dtype, k = torch.bfloat16, 256
    w, nw = randn(96, k, dtype=dtype, seed=6, scale=k ** -0.5), norm_weight(k, dtype, "weight")
    for x in (randn(1, 1, k, dtype=dtype, seed=8), randn(2, 1, 2 * k, dtype=dtype, seed=9)[..., :k]):
        fused, unfused = both("executor", x, nw, 1e-6, "weight", w, None)
        assert fused[0].shape == x.shape and fused[1].shape == (*x.shape[:-1], 96)
        assert_equal(fused, unfused)


def test_larger_calls_are_the_two_ops():
    """More than 8 rows (a prefill), or normed rows past the kernel's
    threadgroup memory: rms_norm and the linear layer, the same results."""
    for rows, k, dtype in ((9, 64, torch.bfloat16), (1, 4096, torch.float32)):
        x = randn(rows, k, dtype=dtype, seed=10)
        w = randn(32, k, dtype=dtype, seed=11, scale=k ** -0.5)
        nw = norm_weight(k, dtype, "weight")
        with cpu_metal.record() as rec:
            normed, y = torch.ops.mps_ext.rms_norm_linear(x, nw, 1e-6, "weight", w, None)
        assert not any(d.kernel.startswith("rms_norm_gemv_rows_") for d in rec.dispatches)
        want = torch.ops.mps_ext.rms_norm(x, nw, 1e-6, "weight")
        assert torch.equal(normed, want) and torch.equal(y, torch.nn.functional.linear(want, w))


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.zeros(1, 64, dtype=torch.int32)), "x must be float32, float16 or bfloat16"),
    (dict(norm_weight=torch.ones(63, dtype=torch.bfloat16)), "weight must be 1-D of x's last dimension"),
    (dict(variant="gemma"), "variant must be 'weight'"),
    (dict(weight=torch.zeros(8, 63, dtype=torch.bfloat16)), r"weight must be \[N, 64\]"),
    (dict(weight=torch.zeros(8, 64, dtype=torch.float32)), "weight must be x's dtype and device"),
    (dict(weight=torch.zeros(64, 8, dtype=torch.bfloat16).t()), "weight must be contiguous along K"),
    (dict(bias=torch.zeros(7, dtype=torch.bfloat16)), "bias must be 1-D of N = 8"),
])
def test_bad_input(change, message):
    args = dict(x=torch.ones(1, 64, dtype=torch.bfloat16), norm_weight=torch.ones(64, dtype=torch.bfloat16), eps=1e-6,
                variant="weight", weight=torch.zeros(8, 64, dtype=torch.bfloat16), bias=None)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.rms_norm_linear(**args)


def test_meta_kernel_gives_shapes_and_dtypes():
    x = torch.empty(1, 1, 64, dtype=torch.bfloat16, device="meta")
    normed, y = torch.ops.mps_ext.rms_norm_linear(x, torch.empty(64, dtype=torch.bfloat16, device="meta"), 1e-6,
                                                  "weight", torch.empty(40, 64, dtype=torch.bfloat16, device="meta"),
                                                  None)
    assert normed.shape == x.shape and y.shape == (1, 1, 40) and normed.dtype == y.dtype == torch.bfloat16


def test_every_kernel_is_tested():
    # test_every_variant_is_rms_norm_then_linear runs each of these.
    fused = {k for k in host_names("linear") if k.startswith("rms_norm_gemv_rows_")}
    assert fused == {f"rms_norm_gemv_rows_{t}_r{r}_q{q}_{v}" for t in SHORT.values() for r, q in RQ
                     for v in ("vec", "scalar")}
