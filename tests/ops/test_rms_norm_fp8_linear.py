"""torch.ops.mps_ext.rms_norm_fp8_linear (csrc/ops/scaled_mm.cpp,
scaled_mm.metal's rms_norm_fp8_gemv): a decoder layer's input norm and the
FP8Linear projection that reads it (mps_ext.quantize_fp8) in one dispatch.
Its contract is the two ops it replaces, to the bit: (rms_norm(x),
fp8_linear(rms_norm(x), W, scale, granularity, b)) as mps_ext runs them
(torch.ops.mps_ext.rms_norm, then torch.ops.mps_ext.fp8_linear's fp8_gemv);
so the oracle here is those two ops (themselves tested against float64 and
torch: test_norm.py, test_scaled_mm.py), compared with torch.equal, and
the fused dispatch reads what it must."""

import math

import pytest
import torch

from host_names import host_names
import mps_ext_executor as cpu_metal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
X, W, NORMED, NORM_W = 1, 2, 8, 9  # buffer indices of rms_norm_fp8_gemv
BLOCK = 128


def randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def fp8_weight(n, k, fmt, vec, seed):
    """[n, k] float8 whose rows start 16-byte aligned (vec) or one byte off."""
    step = (k + 15) // 16 * 16 + 16
    base = randn(n * step + 16, dtype=torch.float32, seed=seed, scale=8).to(fmt)
    start = 0 if vec else 1
    return base[start:start + n * step].view(n, step)[:, :k]


def weight_scale(n, k, granularity, seed):
    """Scales of each granularity, around 1/16 (the weight is around 8),
    none a power of two (each product rounds)."""
    shape = {"tensor": (), "row": (n, 1), "block": (-(-n // BLOCK), -(-k // BLOCK))}[granularity]
    return randn(*shape, dtype=torch.float32, seed=seed, scale=0.01).abs() + 0.0537


def norm_weight(k, dtype, variant, seed=7):
    # Trained weights: around 1 (weight variant) or around 0 (zero-centred).
    return (randn(k, dtype=torch.float32, seed=seed, scale=0.2) + (1 if variant == "weight" else 0)).to(dtype)


def both(x, nw, eps, variant, w, s, granularity, b):
    """(fused, unfused), each (normed, y)."""
    fused = torch.ops.mps_ext.rms_norm_fp8_linear(x, nw, eps, variant, w, s, granularity, b)
    normed = torch.ops.mps_ext.rms_norm(x, nw, eps, variant)
    return fused, (normed, torch.ops.mps_ext.fp8_linear(normed, w, s, granularity, b))


def assert_equal(fused, unfused):
    for got, want, what in zip(fused, unfused, ("normed", "y")):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        assert torch.equal(got, want), (what, (got.double() - want.double()).abs().max())


def run_case(dtype, rows, k, n, fmt, granularity, variant, vec, bias=True, x=None):
    x = randn(rows, k, dtype=dtype, seed=1, scale=3) if x is None else x
    w = fp8_weight(n, k, fmt, vec, seed=2)
    s = weight_scale(n, k, granularity, seed=3)
    b = randn(n, dtype=dtype, seed=4) if bias else None
    with cpu_metal.record() as rec:
        fused, unfused = both(x, norm_weight(k, dtype, variant), 1e-6, variant, w, s, granularity, b)
    assert_equal(fused, unfused)
    assert len(rec.dispatches) == 3  # the fused one, then rms_norm and fp8_gemv
    assert rec.dispatches[2].kernel.startswith("fp8_gemv_")
    # The same variant as fp8_linear picked for the normed rows, with the norm.
    assert rec.dispatches[0].kernel == "rms_norm_" + rec.dispatches[2].kernel
    return rec.dispatches[0]


@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_variant_is_rms_norm_then_fp8_linear(dtype, r, vec):
    """Every kernel variant (rows, 16-byte or element loads) gives rms_norm's
    normed rows and fp8_linear's product of them to the bit, with a bias;
    the variants take turns at the granularity, the weight's format and the
    norm's variant. K = 75 at one row (odd: the vector variant's last
    elements are fewer than a piece), 200 at more rows (normed rows of
    16-byte multiples, which the vector variant needs beyond one row); a
    norm team of one simdgroup (K <= 256)."""
    rows = {1: 1, 2: 2, 4: 3, 8: 7}[r]  # 3 rows take the 4-row variant, 7 the 8-row one
    i = DTYPES.index(dtype) + r + vec
    d = run_case(dtype, rows, 75 if r == 1 else 200, 300, FORMATS[i % 2], ("row", "tensor", "block")[i % 3],
                 ("weight", "zero_centred")[(i // 2) % 2], vec)
    assert d.kernel == f"rms_norm_fp8_gemv_{SHORT[dtype]}_r{r}_{'vec' if vec else 'scalar'}"


@pytest.mark.parametrize("variant", ["weight", "zero_centred"])
@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_every_granularity_format_and_norm(fmt, granularity, variant):
    """Each weight scale a fused FP8Linear carries (a tensor's, a row's, a
    128 x 128 block's), e4m3 and e5m2 weights, both norms; bfloat16 at one
    row and 2 rows (K = 384: three scale blocks), N past a block."""
    for rows in (1, 2):
        run_case(torch.bfloat16, rows, 384, 260, fmt, granularity, variant, vec=True, bias=rows == 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k,variant,granularity", [(1, 2048, "zero_centred", "row"),
                                                        (1, 2048, "weight", "block"), (2, 1000, "weight", "row"),
                                                        (1, 8192 // 2, "zero_centred", "tensor")])
def test_decode_shapes_with_a_team_of_several_simdgroups(dtype, rows, k, variant, granularity):
    """A decode token's hidden state (2048: Qwen3.6 and LFM2.5; rms_norm's
    team is 256 threads, 8 simdgroups whose sums add in order, which the
    GEMV's simdgroups run one after another), a row whose team has idle
    slots (1000), the widest normed row a threadgroup keeps in half and
    bfloat (4096), over several activation tiles."""
    if dtype == torch.float32 and rows * k * 4 > 8192:
        pytest.skip("past the kernel's normed bytes in float32 (test_larger_calls_are_the_two_ops)")
    x = randn(rows, k, dtype=dtype, seed=4, scale=3)
    d = run_case(dtype, rows, k, 640, torch.float8_e4m3fn, granularity, variant, vec=True, bias=False, x=x)
    # Every weight byte once; per threadgroup (from the caches after the
    # first) x twice (its squares, then the normed values) and the norm
    # weight once a row; normed written once, by one threadgroup.
    groups = math.prod(d.threadgroups)
    assert d.bytes_read[W] == 640 * k
    assert d.bytes_read[X] == 2 * x.nbytes * groups and d.bytes_read[NORM_W] == rows * k * dtype.itemsize * groups
    assert d.bytes_written[NORMED] == x.nbytes


def test_leading_dimensions_and_strided_rows():
    """x [batch, tokens, K] as the decoder layer passes it, and rows of a
    wider tensor (their stride is not K): the normed output has x's shape
    (contiguous), the product [..., N]."""
    dtype, k = torch.bfloat16, 256
    w, s = fp8_weight(96, k, torch.float8_e4m3fn, True, seed=6), weight_scale(96, k, "row", seed=5)
    nw = norm_weight(k, dtype, "weight")
    for x in (randn(1, 1, k, dtype=dtype, seed=8), randn(2, 1, 2 * k, dtype=dtype, seed=9)[..., :k],
              randn(3, 3 * k, dtype=dtype, seed=10)[:, k:2 * k]):
        fused, unfused = both(x, nw, 1e-6, "weight", w, s, "row", None)
        assert fused[0].shape == x.shape and fused[0].is_contiguous() and fused[1].shape == (*x.shape[:-1], 96)
        assert_equal(fused, unfused)


def test_larger_calls_are_the_two_ops():
    """More than 8 rows (a prefill), or normed rows past the kernel's
    threadgroup memory: rms_norm and fp8_linear, the same results."""
    for rows, k, dtype in ((9, 64, torch.bfloat16), (1, 4096, torch.float32)):
        x = randn(rows, k, dtype=dtype, seed=10)
        w, s = fp8_weight(32, k, torch.float8_e4m3fn, True, seed=11), weight_scale(32, k, "row", seed=12)
        nw = norm_weight(k, dtype, "weight")
        with cpu_metal.record() as rec:
            normed, y = torch.ops.mps_ext.rms_norm_fp8_linear(x, nw, 1e-6, "weight", w, s, "row", None)
        assert not any(d.kernel.startswith("rms_norm_fp8_gemv_") for d in rec.dispatches)
        want = torch.ops.mps_ext.rms_norm(x, nw, 1e-6, "weight")
        assert torch.equal(normed, want) and torch.equal(y, torch.ops.mps_ext.fp8_linear(want, w, s, "row", None))


E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("change,message", [
    (dict(x=torch.zeros(1, 64, dtype=torch.int32)), "x must be float32, float16 or bfloat16"),
    (dict(norm_weight=torch.ones(63, dtype=torch.bfloat16)), "weight must be 1-D of x's last dimension"),
    (dict(variant="gemma"), "variant must be 'weight'"),
    (dict(weight=torch.zeros(8, 64, dtype=torch.bfloat16)), "weight must be a 2-D float8 tensor"),
    (dict(weight=torch.zeros(8, 63, dtype=E4M3)), r"input's last dimension \(64\) must equal the weight's K \(63\)"),
    (dict(weight_scale=torch.ones(7, 1)), "a row-wise weight_scale has N = 8 elements"),
    (dict(weight_scale=torch.ones(8, 1, dtype=torch.float16)), "weight_scale must be float32"),
    (dict(granularity="column"), "granularity must be 'tensor', 'row' or 'block'"),
    (dict(bias=torch.zeros(7, dtype=torch.bfloat16)), "bias must have N = 8 elements"),
])
def test_bad_input(change, message):
    args = dict(x=torch.ones(1, 64, dtype=torch.bfloat16), norm_weight=torch.ones(64, dtype=torch.bfloat16), eps=1e-6,
                variant="weight", weight=torch.zeros(8, 64, dtype=E4M3), weight_scale=torch.ones(8, 1),
                granularity="row", bias=None)
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext.rms_norm_fp8_linear(**args)


def test_meta_kernel_gives_shapes_and_dtypes():
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    x = meta(1, 1, 64)
    normed, y = torch.ops.mps_ext.rms_norm_fp8_linear(x, meta(64), 1e-6, "weight", meta(40, 64, dtype=E4M3),
                                                      meta(40, 1, dtype=torch.float32), "row", None)
    assert normed.shape == x.shape and y.shape == (1, 1, 40) and normed.dtype == y.dtype == torch.bfloat16


def test_every_kernel_is_tested():
    # test_every_variant_is_rms_norm_then_fp8_linear runs each of these.
    fused = {k for k in host_names("scaled_mm") if k.startswith("rms_norm_fp8_gemv_")}
    assert fused == {f"rms_norm_fp8_gemv_{t}_r{r}_{v}" for t in SHORT.values() for r in (1, 2, 4, 8)
                     for v in ("vec", "scalar")}
