"""Decode-time linear layers (aten::linear, mm, addmm with 1 to 8 rows)
against torch's CPU matmul in float64, rounded once."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mps_ext
from host_names import host_names
import mps_ext_executor as cpu_metal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gen = torch.Generator().manual_seed(0)

X, W, BIAS = 1, 2, 4  # buffer indices of the gemv kernels


def tol(dtype, k):
    # float32: accumulation order; half/bfloat: one rounding of the output.
    eps = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    return dict(
        rtol=eps * (1 if dtype != torch.float32 else max(1, math.sqrt(k))), atol=eps * math.sqrt(max(k, 1)) * 0.2
    )


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def linear_ref(x, w, b=None):
    y = x.double() @ w.double().t()
    return (y + b.double() if b is not None else y).to(x.dtype)


def weight(n, k, dtype, layout):
    """A [N, K] weight in F.linear's layout, transposed in memory ([K, N]
    contiguous, as x @ W stores it), or strided."""
    if layout == "nk":
        return randn(n, k, dtype=dtype, scale=k ** -0.5)
    if layout == "kn":
        return randn(k, n, dtype=dtype, scale=k ** -0.5).t()
    return randn(n, 2 * k, dtype=dtype, scale=k ** -0.5)[:, ::2]  # strided along K


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("layout", ["nk", "kn", "strided"])
def test_linear_rows_layouts_dtypes(run, dtype, rows, layout):
    for n, k in [(300, 1031), (5, 7), (64, 8)]:
        x = randn(rows, k, dtype=dtype)
        w = weight(n, k, dtype, layout)
        b = randn(n, dtype=dtype)
        got = run("linear", x, w, b, family="linear")
        torch.testing.assert_close(got, linear_ref(x, w, b), **tol(dtype, k))


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 255, 257])
@pytest.mark.parametrize("n", [1, 2, 33])
def test_any_k_and_n(run, k, n):
    x = randn(3, k, dtype=torch.float16)
    w = randn(n, k, dtype=torch.float16)
    torch.testing.assert_close(run("linear", x, w, None, family="linear"), linear_ref(x, w), **tol(torch.float16, k))


def test_k_zero_with_many_rows_goes_to_the_stock_kernel():
    x, w = randn(20, 0), randn(5, 0)
    mps_ext.reset_stats()
    assert torch.equal(torch.ops.mps_ext.linear(x, w, None), torch.zeros(20, 5))
    assert mps_ext.stats()["linear"]["ran"] == 0


@pytest.mark.parametrize("shape", [(1, 1, 96), (4, 1, 96), (2, 4, 96), (96,), (8, 96)])
def test_decode_shaped_activations(run, shape):
    x = randn(*shape)
    w = randn(40, 96)
    b = randn(40)
    got = run("linear", x, w, b, family="linear")
    assert got.shape == (*shape[:-1], 40)
    torch.testing.assert_close(got, linear_ref(x, w, b), **tol(torch.float32, 96))


def test_strided_and_offset_activations_and_weights(run, device):
    base_x = randn(20, 130, dtype=torch.float16)
    base_w = randn(70, 131, dtype=torch.float16)
    cases = {
        "offset breaks 16-byte alignment": (base_x[1:4, 1:129], base_w.reshape(-1)[1:1 + 64 * 128].view(64, 128)),
        "row-strided activations": (base_x[::5, :128], base_w[:64, :128]),
        "transposed activation": (randn(128, 3, dtype=torch.float16).t(), base_w[:64, :128]),
        "weight rows 131 apart": (base_x[:2, :128], base_w[:64, :128]),
    }
    for name, (x, w) in cases.items():
        with cpu_metal.record() as rec:
            got = run("linear", x, w, None, family="linear")
        torch.testing.assert_close(got, linear_ref(x, w), **tol(torch.float16, 128), msg=name)
        if device == "executor":
            (d,) = rec.dispatches
            assert d.kernel.endswith("_scalar"), (name, d.kernel)  # no 16-byte loads where not aligned
            assert d.bytes_read[W] == w.shape[0] * w.shape[1] * 2, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8])
def test_each_weight_byte_is_read_once_with_16_byte_loads(run, device, dtype, rows):
    n, k = 2048, 768
    x = randn(rows, k, dtype=dtype)
    w = randn(n, k, dtype=dtype)
    with cpu_metal.record() as rec:
        run("linear", x, w, None, family="linear")
    if device == "executor":
        (d,) = rec.dispatches
        assert d.bytes_read[W] == w.nbytes
        assert d.read_widths[W] == {16: w.nbytes // 16}
        # 4 threadgroups per core of the executor's 80-core GPU; from 5 rows
        # fewer, larger ones (decode_geometry: at least `rows` outputs each,
        # up to a power of two, 8), so that the activation bytes they stage
        # stay within the weight's: still at least one per core.
        assert d.total_threadgroups >= (4 * 80 if rows <= 4 else 80)
        assert d.bytes_read[X] <= d.bytes_read[W]
        assert d.kernel.endswith("_vec")


def test_transposed_weight_layout_reads_once_with_16_byte_loads(run, device):
    n, k = 1000, 512
    x = randn(4, k, dtype=torch.bfloat16)
    wt = randn(k, n, dtype=torch.bfloat16)  # x @ wt: the weight stored [K, N]
    with cpu_metal.record() as rec:
        got = run("mm", x, wt, family="linear")
    torch.testing.assert_close(got, (x.double() @ wt.double()).to(torch.bfloat16), **tol(torch.bfloat16, k))
    if device == "executor":
        # 16 blocks of 64 columns: K is split over 16 threadgroups each,
        # one chunk of 32 rows each (the partial sums stay within half the
        # weight's bytes), then added up.
        d, finish = rec.dispatches
        assert (d.kernel, finish.kernel) == ("gemv_cols_bf16_r4_vec", "gemv_cols_finish_bf16")
        assert d.threadgroups == (16, 16, 1)
        assert d.bytes_read[W] == wt.nbytes
        assert d.read_widths[W] == {16: wt.nbytes // 16}
        partial_bytes = 16 * 4 * n * 4
        assert d.bytes_written[5] == partial_bytes and finish.bytes_read[5] == partial_bytes


@pytest.mark.parametrize("m,k,n", [(1, 64, 100), (8, 33, 20), (50, 40, 3), (300, 16, 1), (5, 9, 7), (2, 0, 6)])
def test_mm_with_few_rows_or_few_columns(run, m, k, n):
    a, b = randn(m, k), randn(k, n)
    got = run("mm", a, b, family="linear")
    torch.testing.assert_close(got, (a.double() @ b.double()).float(), **tol(torch.float32, k))
    # and with a transposed second operand, as x @ W.t()
    bt = randn(n, k).t()
    torch.testing.assert_close(run("mm", a, bt, family="linear"), (a.double() @ bt.double()).float(),
                               **tol(torch.float32, k))


@pytest.mark.parametrize("bias_shape", [(30,), (4, 30), (1, 30), (4, 1), ()])
@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (-1, 0.25)])
def test_addmm_bias_alpha_beta(run, bias_shape, beta, alpha):
    a, b = randn(4, 50), randn(50, 30)
    bias = randn(*bias_shape)
    got = run("addmm", bias, a, b, beta=beta, alpha=alpha, family="linear")
    want = (beta * bias.double() + alpha * (a.double() @ b.double())).float()
    torch.testing.assert_close(got, want, **tol(torch.float32, 50))


def test_addmm_transposed_output_with_bias(run):
    # mat2 has 3 columns: the weight is mat1 and y is written transposed.
    a, b = randn(40, 25), randn(25, 3)
    bias = randn(40, 3)
    got = run("addmm", bias, a, b, beta=2.0, alpha=1.0, family="linear")
    torch.testing.assert_close(got, (2 * bias.double() + a.double() @ b.double()).float(), **tol(torch.float32, 25))


def test_addmm_beta_zero_does_not_read_the_bias(run, device):
    a, b = randn(2, 64), randn(64, 40)
    bias = torch.full((40,), math.nan)
    with cpu_metal.record() as rec:
        got = run("addmm", bias, a, b, beta=0, alpha=1, family="linear")
    assert not got.isnan().any()
    torch.testing.assert_close(got, (a.double() @ b.double()).float(), **tol(torch.float32, 64))
    if device == "executor":
        assert BIAS not in rec.dispatches[0].bytes_read


def test_weight_beyond_2_31_elements(run, device):
    # Row n of the weight starts n * (2^29 + 8) elements in: the last rows sit
    # past 2^31 elements, so 32-bit offsets would wrap.
    if device != "executor":
        pytest.skip("a 4 GiB weight is a CPU-side test; the kernel is the same")
    n, k, stride = 5, 64, 2**29 + 8
    storage = torch.empty((n - 1) * stride + k, dtype=torch.float16)
    w = storage.as_strided((n, k), (stride, 1))
    w.copy_(randn(n, k, dtype=torch.float16))
    x = randn(2, k, dtype=torch.float16)
    torch.testing.assert_close(run("linear", x, w, None, family="linear"), linear_ref(x, w), **tol(torch.float16, k))


@pytest.mark.parametrize("case", ["9 rows", "float64", "mixed dtypes", "3-D weight"])
def test_outside_the_fast_path_goes_to_the_stock_kernel(case):
    x, w = randn(3, 16), randn(8, 16)
    if case == "9 rows":
        x = randn(9, 16)
    elif case == "float64":
        x, w = x.double(), w.double()
    elif case == "mixed dtypes":
        w = w.half()
    mps_ext.reset_stats()
    if case == "3-D weight":
        w3 = randn(2, 16, 8)
        with pytest.raises(RuntimeError):
            torch.ops.mps_ext.mm(x, w3)  # torch's own error, from the stock kernel
        assert mps_ext.stats()["linear"]["ran"] == 0
        return
    try:
        want = torch.nn.functional.linear(x, w)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e)[:30]):
            torch.ops.mps_ext.linear(x, w, None)
    else:
        assert torch.equal(torch.ops.mps_ext.linear(x, w, None), want)
    s = mps_ext.stats()["linear"]
    assert s["ran"] == 0 and sum(s["fallbacks"].values()) == 1


@pytest.mark.parametrize("m,n", [(1, 40), (8, 40), (50, 3)])
def test_out_forms_write_into_out(run, device, m, n):
    # What torch.compile's inductor calls for a matmul: mm/addmm with out=.
    k = 64
    a, b, bias = randn(m, k), randn(k, n), randn(n)
    out = torch.full((m, n), math.nan)
    got = run("mm", a, b, out=out, family="linear")
    torch.testing.assert_close(got, (a.double() @ b.double()).float(), **tol(torch.float32, k))
    if device == "executor":
        assert got is out
    out = torch.full((m, n), math.nan)
    got = run("addmm", bias, a, b, beta=0.5, alpha=2.0, out=out, family="linear")
    want = (0.5 * bias.double() + 2.0 * (a.double() @ b.double())).float()
    torch.testing.assert_close(got, want, **tol(torch.float32, k))


@pytest.mark.parametrize("case", ["needs resizing", "non-contiguous", "another dtype", "overlaps an input"])
def test_out_forms_leave_other_outs_to_the_stock_kernel(case):
    a, b = randn(3, 16), randn(16, 8)
    out = {"needs resizing": torch.empty(0), "non-contiguous": torch.empty(8, 3).t(),
           "another dtype": torch.empty(3, 8, dtype=torch.float64), "overlaps an input": None}[case]
    want_a, want_out = a.clone(), out.clone() if out is not None else None
    if out is None:  # the product written over the start of its own left operand, as aten does it
        out, want_out = a.view(-1)[:24].view(3, 8), want_a.view(-1)[:24].view(3, 8)
    mps_ext.reset_stats()
    try:
        want = torch.mm(want_a, b, out=want_out)
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e)[:30]):
            torch.ops.mps_ext.mm(a, b, out=out)
    else:
        got = torch.ops.mps_ext.mm(a, b, out=out)
        assert got is out and torch.equal(got, want) and got.stride() == want.stride()
    s = mps_ext.stats()["linear"]
    assert s["ran"] == 0 and list(s["fallbacks"]) == [f"an out tensor that {case}" if case in (
        "needs resizing", "overlaps an input") else f"a {case} out tensor" if case == "non-contiguous"
        else "an out tensor of another dtype"]


def test_shape_errors_are_torchs(run):
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        torch.ops.mps_ext.mm(randn(2, 3), randn(4, 5))


class _AtenLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(4, 1, 64), (1, 1, 64), (1, 64), (64,)])
def test_matmul_of_decode_activations_reaches_mm(shape):
    # torch.matmul folds a [B, 1, K] or [1, 1, K] activation into one mm with
    # the weight (with or without W.t()), which mps_ext overrides; so does x @ W.
    w = randn(32, 64)
    for rhs in (w.t(), w.t().contiguous()):
        with _AtenLog() as log:
            torch.matmul(randn(*shape), rhs)
        assert "aten.mm" in log.ops and "aten.bmm" not in log.ops, log.ops


# ------------------------------------------------------------ variants --
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def padded(rows, cols, dtype, vec, scale=1.0):
    """A [rows, cols] tensor whose rows start 16-byte aligned (vec: every
    piece of 16 bytes can be loaded as one) or one element off (not vec)."""
    step = (cols + 15) // 16 * 16 + 16
    base = randn(rows * step + 16, dtype=dtype, scale=scale)
    start = 0 if vec else 1
    return base[start:start + rows * step].view(rows, step)[:, :cols]


# (rows, outputs per simdgroup) of the gemv_rows variants: one output per
# simdgroup up to 2 rows only (a threadgroup has at least `rows` outputs up
# to a power of two, decode_geometry, and 2 a simdgroup from 4 outputs on).
GEMV_ROWS_RQ = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (8, 2)]


@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r,q", GEMV_ROWS_RQ)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_gemv_rows_variant(run, device, dtype, r, q, vec):
    # q: outputs per simdgroup, 2 from 4 outputs per threadgroup (on the
    # executor's 80-core GPU, N >= 1280, or 3 rows or more: decode_geometry;
    # 3 rows take the 4-row variant with 4 outputs a threadgroup). K = 75:
    # the vector variants' last elements are fewer than a piece.
    n, k = (300, 75) if q == 1 else (1300, 75)
    x = padded({1: 1, 2: 2, 4: 3, 8: 7}[r], k, dtype, vec)  # 3 rows take the 4-row variant, 7 the 8-row one
    w = padded(n, k, dtype, vec, scale=k ** -0.5)
    b = randn(n, dtype=dtype)
    with cpu_metal.record() as rec:
        got = run("linear", x, w, b, family="linear")
    torch.testing.assert_close(got, linear_ref(x, w, b), **tol(dtype, k))
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == f"gemv_rows_{SHORT[dtype]}_r{r}_q{q}_{'vec' if vec else 'scalar'}"


@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r", [1, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_rows_over_several_activation_tiles(run, device, dtype, r, vec):
    # gemv_rows stages 8 KB of activations at a time (DECODE_TILE_BYTES;
    # without 16-byte loads as floats, so more tiles):
    # two full tiles, a partial one that is not a whole number of lanes'
    # pieces, and (vec) 3 elements past the last 16-byte piece.
    tile = 8192 // (r * dtype.itemsize)
    k = 2 * tile + 40 * (16 // dtype.itemsize) + 3
    n = 1300  # 2 outputs per simdgroup
    x = padded(r, k, dtype, vec)
    w = padded(n, k, dtype, vec, scale=k ** -0.5)
    with cpu_metal.record() as rec:
        got = run("linear", x, w, None, family="linear")
    torch.testing.assert_close(got, linear_ref(x, w), **tol(dtype, k))
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == f"gemv_rows_{SHORT[dtype]}_r{r}_q2_{'vec' if vec else 'scalar'}"
        assert d.bytes_read[W] == n * k * dtype.itemsize


@pytest.mark.parametrize("k", [24, 1031])
@pytest.mark.parametrize("vec", [True, False], ids=["vec", "scalar"])
@pytest.mark.parametrize("r", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_gemv_cols_variant(run, device, dtype, r, vec, k):
    # x @ W with W [K, N]: K = 24 fits one threadgroup per column block, K =
    # 1031 (odd: lane pairs with a row past K) is split and finished.
    n = 300  # not a whole number of column blocks
    x = randn(r, k, dtype=dtype)
    wt = padded(k, n, dtype, vec, scale=k ** -0.5)
    with cpu_metal.record() as rec:
        got = run("mm", x, wt, family="linear")
    torch.testing.assert_close(got, (x.double() @ wt.double()).to(dtype), **tol(dtype, k))
    if device == "executor":
        kernels = [d.kernel for d in rec.dispatches]
        main = f"gemv_cols_{SHORT[dtype]}_r{r}_{'vec' if vec else 'scalar'}"
        assert kernels == ([main] if k == 24 else [main, f"gemv_cols_finish_{SHORT[dtype]}"])
        assert rec.dispatches[0].bytes_read[W] == wt.shape[0] * wt.shape[1] * wt.element_size()


def test_every_gemv_kernel_is_tested():
    types, rows = SHORT.values(), (1, 2, 4, 8)
    tested = {f"gemv_rows_{t}_r{r}_q{q}_{v}" for t in types for r, q in GEMV_ROWS_RQ for v in ("vec", "scalar")}
    tested |= {f"gemv_cols_{t}_r{r}_{v}" for t in types for r in rows for v in ("vec", "scalar")}
    tested |= {f"gemv_cols_finish_{t}" for t in types}
    # (rms_norm_gemv_rows, the norm in the GEMV: test_rms_norm_linear.py's; add_rms_norm_gemv_rows, with the
    # residual add: test_add_rms_norm_moe_layer.py's; sigmoid_gate_gemv_rows, the attention's output gate in the
    # GEMV: test_sigmoid_gate_linear.py's.)
    fused = ("rms_norm_gemv_rows_", "add_rms_norm_gemv_rows_", "sigmoid_gate_gemv_rows_")
    assert {k for k in host_names("linear") if not k.startswith(fused)} == tested


@pytest.mark.parametrize("rows,k", [(1, 2560), (8, 2560), (8, 768)])
def test_transposed_weight_keeps_every_core_busy(run, device, rows, k):
    # N >= 2048: at least 4 threadgroups per core of an 80-core GPU (K = 768
    # at 8 rows: a Qwen3 expert's down projection), every weight byte read
    # once with 16-byte loads, the activations read once per threadgroup
    # (staged in threadgroup memory); every access coalesced and the
    # partial sums through threadgroup memory without bank conflicts.
    n = 2048
    x = randn(rows, k, dtype=torch.float16)
    wt = randn(k, n, dtype=torch.float16, scale=k ** -0.5)
    with cpu_metal.record(counters=True) as rec:
        got = run("mm", x, wt, family="linear")
    torch.testing.assert_close(got, (x.double() @ wt.double()).half(), **tol(torch.float16, k))
    if device == "executor":
        d, finish = rec.dispatches
        assert d.total_threadgroups >= 4 * 80
        assert d.read_widths[W] == {16: wt.nbytes // 16}
        assert d.bytes_read[X] == d.threadgroups[0] * x.nbytes
        assert finish.kernel == "gemv_cols_finish_f16"
        for stats in (d, finish):
            assert stats.bank_conflict_cycles == 0, stats.kernel
            assert max(stats.coalescing.values()) <= 1.1, (stats.kernel, stats.coalescing)


def test_activations_are_read_once_per_threadgroup(run, device):
    # Staged in threadgroup memory, not read by every simdgroup: 12 outputs
    # per threadgroup at N = 4096.
    x, w = randn(8, 512, dtype=torch.float16), randn(4096, 512, dtype=torch.float16)
    with cpu_metal.record() as rec:
        run("linear", x, w, None, family="linear")
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == "gemv_rows_f16_r8_q2_vec" and d.threads_per_threadgroup == (192, 1, 1)
        assert d.bytes_read[X] == d.total_threadgroups * x.nbytes == 342 * x.nbytes
