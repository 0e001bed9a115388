"""_softmax, _log_softmax and their backward against torch's CPU kernels."""

import math

import pytest
import torch
from host_names import host_names

import mps_ext_executor as cpu_metal

# The oracle is torch's CPU softmax (vectorised exp: it changes with
# ATEN_CPU_CAPABILITY); scripts/test.sh runs this file again with torch's CPU
# kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp32: torch's vectorised exp and the Metal one differ by an ulp or so;
# fp16/bf16: one rounding of the fp32 result, both sides.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=1e-3, atol=1e-5),
       torch.bfloat16: dict(rtol=8e-3, atol=1e-5)}
WIDTHS = [1, 2, 3, 31, 32, 33, 100, 127, 128, 129, 1000, 4096, 8192, 8193, 20000]

gen = torch.Generator().manual_seed(0)


def reference(x, dim, log, half_to_float=False):
    """torch's CPU softmax, computed in float64 and rounded once. (torch's
    float32 kernel itself loses up to 6e-5 relative on long rows, by summing
    in float: a worse oracle than the kernels under test.)"""
    out = (torch._log_softmax if log else torch._softmax)(x.double(), dim, False)
    return out.float() if half_to_float else out.to(x.dtype)


def check(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[want.dtype])


def fwd_name(log):
    return "_log_softmax" if log else "_softmax"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_row_widths(run, dtype, width):
    rows = 3 if width < 10000 else 1
    x = (torch.randn(rows, width, generator=gen) * 4).to(dtype)
    for log in (False, True):
        check(run(fwd_name(log), x, 1, False, family="softmax"), reference(x, 1, log))


def test_one_vocabulary_row_is_split_over_many_threadgroups(run, device):
    x = torch.randn(1, 128256, generator=gen)
    with cpu_metal.record() as rec:
        out = run("_softmax", x, -1, False, family="softmax")
    check(out, reference(x, -1, False))
    if device == "executor":
        assert len(rec.dispatches) == 2  # partials, then finish
        assert all(d.total_threadgroups >= 60 for d in rec.dispatches)


def test_short_rows_pack_into_one_threadgroup(run, device):
    x = torch.randn(100, 16, generator=gen)
    with cpu_metal.record() as rec:
        out = run("_softmax", x, 1, False, family="softmax")
    check(out, reference(x, 1, False))
    if device == "executor":
        (d,) = rec.dispatches
        assert d.total_threadgroups == 2  # 4 lanes per row: 64 rows per threadgroup
        assert d.bytes_read[1] == x.nbytes and d.bytes_written[0] == x.nbytes  # each element read once


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (7, 1, 3), (1,), (4, 300, 2)])
def test_every_dim(run, shape):
    x = torch.randn(*shape, generator=gen)
    for dim in range(-len(shape), len(shape)):
        for log in (False, True):
            check(run(fwd_name(log), x, dim, False, family="softmax"), reference(x, dim, log))


def test_scalar_and_empty(run):
    s = torch.tensor(2.5)
    check(run("_softmax", s, 0, False, family="softmax"), reference(s, 0, False))
    check(run("_log_softmax", s, -1, False, family="softmax"), reference(s, -1, True))
    for shape, dim in [((0, 5), 1), ((3, 0), 1), ((3, 0), 0), ((2, 0, 4), 2)]:
        e = torch.randn(*shape)
        out = run("_softmax", e, dim, False, family="softmax")
        assert out.shape == e.shape and out.dtype == e.dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_and_offset_views(run, dtype):
    base = torch.randn(9, 40, 50, generator=gen).to(dtype)
    views = {
        "transposed": base.transpose(1, 2),
        "sliced": base[1::2, 3:, ::3],
        "offset by one element": base.reshape(-1)[1:1 + 37 * 41].view(37, 41),
        "expanded": torch.randn(1, 50, generator=gen).to(dtype).expand(6, 50),
        "channels last": base[:2].reshape(2, 4, 10, 50).contiguous(memory_format=torch.channels_last),
    }
    for name, v in views.items():
        for dim in range(v.dim()):
            check(run("_softmax", v, dim, False, family="softmax"), reference(v, dim, False))


def test_half_to_float(run):
    x = torch.randn(4, 3000, generator=gen).half()
    for log in (False, True):
        out = run(fwd_name(log), x, 1, True, family="softmax")
        assert out.dtype == torch.float32
        check(out, reference(x, 1, log, half_to_float=True))


def test_half_to_float_needs_half(run):
    with pytest.raises(RuntimeError, match="conversion is supported for Half type only"):
        run("_softmax", torch.randn(2, 3), 1, True, family="softmax")


SPECIAL_ROWS = {
    "-inf among finite": [-math.inf, 0.0, 1.0, -math.inf],
    "all -inf": [-math.inf] * 4,
    "nan": [1.0, math.nan, 2.0, 3.0],
    "+inf": [1.0, math.inf, 2.0, 3.0],
    "two +inf": [math.inf, math.inf, 0.0, 0.0],
    "huge range": [3e38, -3e38, 0.0, 1.0],
    "all equal": [7.0] * 4,
}


@pytest.mark.parametrize("width", [4, 300, 9000])  # segment, block, split
def test_special_values_as_torch(run, width):
    rows = []
    for vals in SPECIAL_ROWS.values():
        row = torch.full((width,), -5.0)
        row[: len(vals)] = torch.tensor(vals)
        rows.append(row)
    x = torch.stack(rows)
    for log in (False, True):
        out = run(fwd_name(log), x, 1, False, family="softmax")
        want = reference(x, 1, log)
        assert torch.equal(out.isnan(), want.isnan()), f"NaN pattern, log={log}"
        assert torch.equal(out.isinf(), want.isinf())
        check(out, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 5, 128, 1000, 9000])
def test_backward(run, dtype, width):
    x = torch.randn(3, width, generator=gen)
    g = torch.randn(3, width, generator=gen).to(dtype)
    for log in (False, True):
        y = reference(x.to(dtype), 1, log)
        name = "_log_softmax_backward_data" if log else "_softmax_backward_data"
        want = getattr(torch.ops.aten, name)(g.double(), y.double(), 1, torch.float64).to(dtype)
        got = run(name, g, y, 1, dtype, family="softmax")
        torch.testing.assert_close(got, want, **{k: v * 4 for k, v in TOL[dtype].items()})


def test_backward_strided_every_dim(run):
    x = torch.randn(5, 6, 7, generator=gen)
    for dim in range(3):
        y = torch._softmax(x, dim, False).transpose(0, 2)
        g = torch.randn(7, 6, 5, generator=gen)
        want = torch._softmax_backward_data(g, y, 2 - dim, torch.float32)
        torch.testing.assert_close(run("_softmax_backward_data", g, y, 2 - dim, torch.float32, family="softmax"),
                                   want, rtol=1e-5, atol=1e-6)


def test_backward_after_half_to_float(run):
    x = torch.randn(2, 700, generator=gen).half()
    y = reference(x, 1, False, half_to_float=True)  # float output of a half input
    g = torch.randn(2, 700, generator=gen)
    got = run("_softmax_backward_data", g, y, 1, torch.float16, family="softmax")
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, torch._softmax_backward_data(g, y, 1, torch.float32).half(), rtol=1e-3, atol=1e-5)


def test_autograd_matches_cpu():
    # Through torch.ops.mps_ext the backward kernel is reachable only directly;
    # on a Mac, the aten overrides carry autograd. Check the formula end to end
    # on the executor against torch's autograd on the CPU.
    x = torch.randn(4, 50, generator=gen, requires_grad=True)
    g = torch.randn(4, 50, generator=gen)
    y = torch.log_softmax(x, 1)
    y.backward(g)
    ours = torch.ops.mps_ext._log_softmax_backward_data(g, y.detach(), 1, torch.float32)
    torch.testing.assert_close(ours, x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [2, -4])
def test_dim_out_of_range(run, dim):
    with pytest.raises(IndexError, match=r"Dimension out of range \(expected to be in range of \[-2, 1\]"):
        run("_softmax", torch.randn(2, 3), dim, False, family="softmax")


def test_backward_device_and_shape_mismatch(run, device):
    g, y = torch.randn(2, 3), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="same shape"):
        run("_softmax_backward_data", g, y, 1, torch.float32, family="softmax")


# ------------------------------------------------------------ variants --
# (input dtype, output dtype) of each kernel's name: forward (a half input
# may give a float output, half_to_float) and backward (a float gradient may
# give a half grad_input, after half_to_float).
FORWARD_TYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                 (torch.float16, torch.float32)]
BACKWARD_TYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                  (torch.float32, torch.float16)]
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# Rows of each shape; the last is softmax'ed. Strided: dim 1 of [3, D, inner].
SHAPES = {"segment": (5, 40), "block": (3, 1000), "split": (2, 9000), "strided": (3, 40, 5)}
VARIANTS = ["i32_vec", "i32", "i64"]


def variant_input(shape, variant, dtype, gen_dtype=None):
    """An input of `shape` that the host sends to `variant`: contiguous with
    16-byte-aligned rows (i32_vec); its data one element off 16 bytes, so
    rows are not aligned (i32); any (i64, with the wide_index fixture)."""
    n = math.prod(shape)
    base = (torch.randn(n + 8, generator=gen) * 3).to(dtype)
    if variant == "i32":
        return base[1:1 + n].view(shape)
    return base[:n].view(shape)


def variant_cases():
    for kind in SHAPES:
        for variant in VARIANTS if kind != "strided" else ["i32", "i64"]:
            for backward, types in ((False, FORWARD_TYPES), (True, BACKWARD_TYPES)):
                for t_in, t_out in types:
                    yield pytest.param(
                        kind,
                        variant,
                        backward,
                        t_in,
                        t_out,
                        id=f"{'bwd' if backward else 'fwd'}-{kind}-{SHORT[t_in]}_{SHORT[t_out]}-{variant}",
                    )


def kernels_of(kind, variant, backward, t_in, t_out):
    pre = "softmax_backward_" if backward else "softmax_"
    types = f"{SHORT[t_in]}_{SHORT[t_out]}"
    if kind == "split":
        return [f"{pre}partial_{SHORT[t_in]}_{variant}", f"{pre}finish_{types}_{variant}"]
    return [f"{pre}{kind}_{types}_{variant}"]


@pytest.mark.parametrize("kind,variant,backward,t_in,t_out", list(variant_cases()))
def test_every_kernel_variant(run, device, request, kind, variant, backward, t_in, t_out):
    if variant == "i64":
        request.getfixturevalue("wide_index")
    shape = SHAPES[kind]
    dim = 1
    x = variant_input(shape, variant, t_in)
    with cpu_metal.record() as rec:
        if not backward:
            half_to_float = t_in != t_out
            for log in (False, True):
                check(
                    run(fwd_name(log), x, dim, half_to_float, family="softmax"), reference(x, dim, log, half_to_float)
                )
        else:
            for log in (False, True):
                y = reference(torch.randn(shape, generator=gen), dim, log).to(t_in)
                y = variant_input(shape, variant, t_in).copy_(y)
                name = "_log_softmax_backward_data" if log else "_softmax_backward_data"
                want = getattr(torch.ops.aten, name)(x.double(), y.double(), dim, torch.float64).to(t_out)
                got = run(name, x, y, dim, t_out, family="softmax")
                assert got.dtype == t_out
                torch.testing.assert_close(got, want, **{k: v * 4 for k, v in TOL[t_out].items()})
    if device == "executor":
        assert [d.kernel for d in rec.dispatches] == kernels_of(kind, variant, backward, t_in, t_out) * 2


@pytest.mark.parametrize("length", [45, 1005, 9005])  # segment, block, split
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_vector_variants_end_rows_with_a_partial_piece(run, device, length, backward):
    # One row (its start is the only one, aligned): 16-byte pieces, of the
    # wider of the two types (fp16 in, fp32 out: 4 elements), the last one
    # partial. Every dtype pair.
    for t_in, t_out in BACKWARD_TYPES if backward else FORWARD_TYPES:
        x = (torch.randn(1, length, generator=gen) * 3).to(t_in)
        with cpu_metal.record() as rec:
            if not backward:
                check(run("_softmax", x, 1, t_in != t_out, family="softmax"), reference(x, 1, False, t_in != t_out))
            else:
                y = reference(torch.randn(1, length, generator=gen), 1, False).to(t_in)
                want = torch.ops.aten._softmax_backward_data(x.double(), y.double(), 1, torch.float64).to(t_out)
                got = run("_softmax_backward_data", x, y, 1, t_out, family="softmax")
                torch.testing.assert_close(got, want, **{k: v * 4 for k, v in TOL[t_out].items()})
        if device == "executor":
            assert all(d.kernel.endswith("_i32_vec") for d in rec.dispatches), [d.kernel for d in rec.dispatches]


def test_every_softmax_kernel_is_tested():
    covered = set()
    for case in variant_cases():
        covered.update(kernels_of(*case.values))
    assert host_names("softmax") == covered


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner,length", [(16, 1024), (5, 40), (1, 300), (2, 3000), (32, 2000), (100, 7), (64, 600)])
def test_strided_dimension(run, device, dtype, inner, length):
    # softmax over dim 1 of [outer, D, inner]: lanes walk the contiguous inner
    # dimension. inner 1 is a contiguous row; (32, 2000) takes fewer inner
    # rows per threadgroup than 32 so that its rows fit.
    x = (torch.randn(3, length, inner, generator=gen) * 4).to(dtype)
    with cpu_metal.record() as rec:
        for log in (False, True):
            check(run(fwd_name(log), x, 1, False, family="softmax"), reference(x, 1, log))
        g = torch.randn(3, length, inner, generator=gen).to(dtype)
        y = reference(x, 1, False)
        want = torch.ops.aten._softmax_backward_data(g.double(), y.double(), 1, torch.float64).to(dtype)
        torch.testing.assert_close(run("_softmax_backward_data", g, y, 1, dtype, family="softmax"), want,
                                   **{k: v * 4 for k, v in TOL[dtype].items()})
    if device == "executor":
        strided = inner > 1
        assert all(("strided" in d.kernel) == strided for d in rec.dispatches), [d.kernel for d in rec.dispatches]


def test_strided_rows_too_long_for_registers_take_the_row_kernels(run, device):
    x = torch.randn(2, 9000, 16, generator=gen)
    with cpu_metal.record() as rec:
        check(run("_softmax", x, 1, False, family="softmax"), reference(x, 1, False))
    if device == "executor":
        assert [d.kernel for d in rec.dispatches] == ["softmax_partial_f32_i32", "softmax_finish_f32_f32_i32"]


def test_strided_loads_walk_the_inner_dimension(run, device):
    # Each dispatch reads the input once and writes the output once, and a
    # threadgroup owns all 16 inner rows of an outer row (coalescing itself
    # is measured by the executor's counters, not here).
    x = torch.randn(32, 1024, 16, generator=gen)
    with cpu_metal.record() as rec:
        check(run("_softmax", x, 1, False, family="softmax"), reference(x, 1, False))
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == "softmax_strided_f32_f32_i32"
        assert d.threadgroups == (1, 32, 1) and d.threads_per_threadgroup == (512, 1, 1)
        assert d.bytes_read[1] == x.nbytes and d.bytes_written[0] == x.nbytes


@pytest.mark.parametrize("layout", ["strided", "misaligned", "vector tail"])
@pytest.mark.parametrize("width", [4, 300, 9000])
def test_special_values_in_every_layout(run, device, layout, width):
    # test_special_values_as_torch runs the vector variants on whole pieces;
    # here the strided and element variants, and single rows (the only rows
    # with 16-byte accesses whose length is not a whole number of 16-byte
    # pieces: the output is contiguous) ending in a partial piece.
    rows = []
    for vals in SPECIAL_ROWS.values():
        row = torch.full((width + (layout == "vector tail"),), -5.0)
        row[-len(vals):] = torch.tensor(vals)  # at the end: the partial piece
        rows.append(row)
    x = torch.stack(rows)
    if layout == "strided":
        x = x.t().contiguous().unsqueeze(0)  # [1, width, rows]: the rows are the inner dimension
    elif layout == "misaligned":
        x = torch.cat([torch.zeros(1), x.reshape(-1)])[1:].view(x.shape)
    else:  # every row 16-byte aligned
        x = torch.cat([x, torch.zeros(len(x), 7)], 1)[:, :width + 1]
    for log in (False, True):
        with cpu_metal.record() as rec:
            if layout == "vector tail":
                out = torch.cat([run(fwd_name(log), x[i:i + 1], 1, False, family="softmax") for i in range(len(x))])
            else:
                out = run(fwd_name(log), x, 1, False, family="softmax")
        want = reference(x, 1, log)
        assert torch.equal(out.isnan(), want.isnan()), f"NaN pattern, log={log}"
        assert torch.equal(out.isinf(), want.isinf())
        check(out, want)
        if device == "executor":
            kernels = {d.kernel for d in rec.dispatches}
            assert all(k.endswith("_vec") == (layout == "vector tail") for k in kernels), kernels
            assert any("strided" in k for k in kernels) == (layout == "strided" and width < 9000), kernels


def test_vector_rows_need_aligned_pointers(run, device):
    # Same values, one copy 8 bytes off a 16-byte boundary (numpy, frombuffer,
    # memory-mapped data): element accesses there.
    x = torch.randn(4, 512, generator=gen)
    raw = bytearray(x.nbytes + 32)
    base = torch.frombuffer(raw, dtype=torch.uint8).data_ptr()
    off = (8 - base % 16) % 16
    x8 = torch.frombuffer(raw, dtype=torch.float32, offset=off, count=x.numel()).view(x.shape)
    x8.copy_(x)
    with cpu_metal.record() as rec:
        a = run("_softmax", x, 1, False, family="softmax")
        b = run("_softmax", x8, 1, False, family="softmax")
    check(a, reference(x, 1, False))
    check(b, reference(x, 1, False))
    if device == "executor":
        assert [d.kernel for d in rec.dispatches] == ["softmax_block_f32_f32_i32_vec", "softmax_block_f32_f32_i32"]
