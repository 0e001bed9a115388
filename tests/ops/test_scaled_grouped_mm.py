"""_scaled_grouped_mm (fp8 experts: float8_e4m3fn operands, float32 row-wise
scales, bfloat16 output) against a float64 reference. torch has no CPU (or
MPS) kernel for it, so the reference is computed from the fp8 values, which
torch decodes exactly."""

import math

import pytest
import torch

import mps_ext_executor as cpu_metal

FP8 = torch.float8_e4m3fn
gen = torch.Generator().manual_seed(1)


def randn(*shape, scale=1.0):
    return torch.randn(shape, generator=gen) * scale


def quantize_rows(x, dim):
    """fp8 values and float32 de-quantisation scales, one per slice along `dim`."""
    amax = x.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (x / scale).to(FP8), scale.squeeze(dim).float()


def ref_rows(a8, sa, b8, sb, offs):
    """2D x 3D: rows [s, e) of a against group g of b, in float64."""
    out = torch.zeros(a8.shape[0], b8.shape[-1], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = (a8[start:end].double() @ b8[g].double()) * sa[start:end, None].double() * sb[g][None].double()
        start = end
    return out


def check(got, exp, k, rows=None):
    assert got.dtype == torch.bfloat16
    got, exp = (got[:rows], exp[:rows]) if rows is not None else (got, exp)
    # bf16 rounding of the output plus float accumulation.
    torch.testing.assert_close(got.double(), exp, rtol=8e-3, atol=1e-3 * math.sqrt(k))


def experts_fp8(e, n, k):
    """W[E, N, K] quantised per output row, passed as [E, K, N] column-major."""
    w = randn(e, n, k, scale=k ** -0.5)
    w8, sw = quantize_rows(w, 2)  # scales [E, N]
    return w8.transpose(-2, -1), sw


def moe_forward_operands(counts, k=96, n=40):
    """fp8 rows sorted by expert (three past offs[-1]) and experts, with their
    row-wise scales, and offs."""
    a8, sa = quantize_rows(randn(sum(counts) + 3, k), 1)
    b8, sb = experts_fp8(len(counts), n, k)
    return a8, sa, b8, sb, torch.tensor(counts, dtype=torch.int32).cumsum(0).int()


@pytest.mark.parametrize("counts", [[1, 0, 2, 0, 3, 0], [0, 30, 5, 0, 40, 1]], ids=["decode", "tiles"])
def test_2d_3d(run, device, counts):
    a8, sa, b8, sb, offs = moe_forward_operands(counts)
    m, k = a8.shape
    with cpu_metal.record() as rec:
        got = run("_scaled_grouped_mm", a8, b8, sa, sb, offs, family="grouped_mm")
    check(got, ref_rows(a8, sa, b8, sb, offs), k, rows=sum(counts))
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == ("gmm_decode_rows_e4m3_vec" if m <= 64 else "gmm_tiled_e4m3")


@pytest.mark.parametrize("k,offset", [(256, 0), (255, 0), (256, 1)], ids=["16-byte", "tail", "unaligned"])
def test_every_e4m3_value_decodes_exactly(run, device, k, offset):
    # diag(codes) @ I = diag(codes): every output is one fp8 code times 1,
    # exact in bfloat16, for all 256 codes (a NaN code makes its row NaN, as
    # NaN * 0 does in torch); 64 rows at a time through the decode kernel,
    # with 16-byte loads, the scalar tail, and (A 1 byte off 16-byte
    # alignment) element loads.
    b8 = torch.eye(256).to(FP8)[:, :k].unsqueeze(0).transpose(-2, -1)  # W[1, N, K] as [1, K, N]
    for first in range(0, 256, 64):
        codes = torch.arange(first, first + 64, dtype=torch.uint8)
        store = torch.zeros(64 * 256 + offset, dtype=torch.uint8)
        rows = store[offset:].view(64, 256)
        rows[torch.arange(64), codes.long()] = codes
        a8 = rows.view(FP8)[:, :k]
        with cpu_metal.record() as rec:
            got = run("_scaled_grouped_mm", a8, b8, torch.ones(64), torch.ones(1, 256),
                      torch.tensor([64], dtype=torch.int32), family="grouped_mm")
        exp = (a8.double() @ b8[0].double()).to(torch.bfloat16)
        torch.testing.assert_close(got, exp, rtol=0, atol=0, equal_nan=True)
        if device == "executor":
            assert rec.dispatches[0].kernel == "gmm_decode_rows_e4m3_" + ("scalar" if offset else "vec")


def test_3d_2d(run):
    g, m, k, cols = 3, 16, 64, 20
    counts = [7, 0, 12]
    a8, sa = quantize_rows(randn(g, m, k), 2)  # scale_a [G, M]
    bt8, sb = quantize_rows(randn(cols, k), 1)  # scale_b [cols]
    b8 = bt8.t()  # [K, cols] column-major
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
    got = run("_scaled_grouped_mm", a8, b8, sa, sb, offs, family="grouped_mm")
    exp = torch.zeros(m, cols, dtype=torch.float64)
    start = 0
    for i, end in enumerate(offs.tolist()):
        exp[:, start:end] = (a8[i].double() @ b8[:, start:end].double()) * sa[i][:, None] * sb[None, start:end]
        start = end
    check(got[:, :19], exp[:, :19], k)


def test_2d_2d(run):
    m, n = 12, 24
    counts = [16, 0, 32]
    ktot = sum(counts)
    a8 = randn(m, ktot).to(FP8)
    b8 = randn(n, ktot).to(FP8).t()
    sa, sb = randn(len(counts) * m).abs().float(), randn(len(counts) * n).abs().float()
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0).int()
    got = run("_scaled_grouped_mm", a8, b8, sa, sb, offs, family="grouped_mm")
    exp = torch.zeros(len(counts), m, n, dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        exp[g] = (
            (a8[:, start:end].double() @ b8[start:end].double())
            * sa[g * m : (g + 1) * m, None]
            * sb[None, g * n : (g + 1) * n]
        )
        start = end
    check(got, exp, 32)


def test_3d_3d(run):
    g, m, k, n = 2, 9, 48, 16
    a8, sa = quantize_rows(randn(g, m, k), 2)
    b8, sb = experts_fp8(g, n, k)
    got = run("_scaled_grouped_mm", a8, b8, sa, sb, None, family="grouped_mm")
    exp = (a8.double() @ b8.double()) * sa[:, :, None] * sb[:, None, :]
    check(got, exp, k)


def test_decode_reads_each_chosen_fp8_expert_once_with_16_byte_loads(run, device):
    e, k, n = 64, 512, 64
    ids = torch.tensor([3, 9, 17, 40, 41, 42, 60, 61])  # one token, top-8
    counts = torch.bincount(ids, minlength=e)
    a8, sa = quantize_rows(randn(8, k), 1)
    b8, sb = experts_fp8(e, n, k)
    offs = counts.cumsum(0).int()
    with cpu_metal.record() as rec:
        got = run("_scaled_grouped_mm", a8, b8, sa, sb, offs, family="grouped_mm")
    check(got, ref_rows(a8, sa, b8, sb, offs), k)
    if device == "executor":
        (d,) = rec.dispatches
        assert d.bytes_read[d.buffer("w")] == 8 * n * k  # one byte per weight, chosen experts only
        assert d.read_widths[d.buffer("w")] == {16: 8 * n * k // 16}


ERRORS = [
    (dict(a=lambda a8: a8.float()), "Expected inputs of E4M3 FP8 type"),
    (dict(b=lambda b8: b8.contiguous()), "Expected mat_b tensor to be column major"),
    (dict(sa=lambda sa: sa[:-1]), "Expected scale_a to have 8 elements"),
    (dict(sb=lambda sb: sb.double()), "For FP8 scales must both be float32"),
    (dict(sb=lambda sb: sb[:, :-1]), "Expected scale_b non-batch dimension to be 16"),
    (dict(kw={"bias": torch.zeros(16, dtype=torch.bfloat16)}), "Bias tensor provided, but it is not supported yet"),
    (dict(kw={"out_dtype": torch.float32}), "If output dtype provided, it must be torch.bfloat16"),
    (dict(kw={"scale_result": torch.ones(1)}), "Scale result tensor provided"),
    (dict(offs=lambda o: o.long()), r"Offsets tensor must be integer \(int32\)"),
]


@pytest.mark.parametrize("case", range(len(ERRORS)))
def test_torchs_checks_and_messages(case):
    change, message = ERRORS[case]
    a8, sa = quantize_rows(randn(8, 32), 1)
    b8, sb = experts_fp8(2, 16, 32)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    a8 = change.get("a", lambda t: t)(a8)
    b8 = change.get("b", lambda t: t)(b8)
    sa = change.get("sa", lambda t: t)(sa)
    sb = change.get("sb", lambda t: t)(sb)
    offs = change.get("offs", lambda t: t)(offs)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext._scaled_grouped_mm(a8, b8, sa, sb, offs, **change.get("kw", {}))
    # torch's own checks (its meta function) say the same.
    to_meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t  # noqa: E731
    kw = {key: to_meta(v) for key, v in change.get("kw", {}).items()}
    with pytest.raises(RuntimeError, match=message):
        torch.ops.aten._scaled_grouped_mm(*map(to_meta, (a8, b8, sa, sb, offs)), **kw)


def test_meta_kernel_gives_the_kernels_sizes_and_strides():
    # torch.compile traces torch.ops.mps_ext._scaled_grouped_mm (and _v2)
    # through mps_ext's Meta kernels (mps_ext/_meta.py).
    a8, sa = quantize_rows(randn(10, 32), 1)
    b8, sb = experts_fp8(3, 13, 32)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)
    got = torch.ops.mps_ext._scaled_grouped_mm(a8, b8, sa, sb, offs)
    assert (got.shape, got.stride(), got.dtype) == ((10, 13), (16, 1), torch.bfloat16)
    a, b, s_a, s_b, o = (t.to("meta") for t in (a8, b8, sa, sb, offs))
    for meta in (torch.ops.mps_ext._scaled_grouped_mm(a, b, s_a, s_b, o),
                 torch.ops.mps_ext._scaled_grouped_mm_v2(a, b, [s_a], [1], [], [s_b], [1], [], o)):
        assert meta.device.type == "meta"
        assert (meta.shape, meta.stride(), meta.dtype) == (got.shape, got.stride(), got.dtype)


# ------------------------------------------------- _scaled_grouped_mm_v2 --
# F.scaled_grouped_mm (torch 2.10 on) calls _scaled_grouped_mm_v2 with a list
# of scales and a recipe (torch's ScalingType) per operand.
ROW_WISE = 1


@pytest.mark.parametrize("counts", [[1, 0, 2, 0, 3, 0], [0, 30, 5, 0, 40, 1]], ids=["decode", "tiles"])
def test_v2_row_wise_is_the_v1_product(run, device, counts):
    a8, sa, b8, sb, offs = moe_forward_operands(counts)
    k = a8.shape[1]
    got = run("_scaled_grouped_mm_v2", a8, b8, [sa], [ROW_WISE], [], [sb], [ROW_WISE], [], offs, family="grouped_mm")
    check(got, ref_rows(a8, sa, b8, sb, offs), k, rows=sum(counts))
    v1 = run("_scaled_grouped_mm", a8, b8, sa, sb, offs, family="grouped_mm")
    assert torch.equal(got[:sum(counts)], v1[:sum(counts)])
    # The same with every optional argument spelled out as F.scaled_grouped_mm passes them.
    got = run("_scaled_grouped_mm_v2", a8, b8, [sa], [ROW_WISE], [0], [sb], [ROW_WISE], [0], offs, None,
              torch.bfloat16, [-1, -2], False, family="grouped_mm")
    assert torch.equal(got[:sum(counts)], v1[:sum(counts)])


V2_REFUSED = {  # what the call changes -> what the error names
    "tensor-wise": (dict(recipe_a=[0], recipe_b=[0]), r"scale recipes a=\[0\] b=\[0\]"),
    "two scales": (dict(scale_a=2), r"RowWise \(1\) for both, one float32 scale tensor each"),
    "swizzled": (dict(swizzle_b=[1]), r"swizzles a=\[\] b=\[1\]"),
    "contraction_dim": (dict(contraction_dim=[0, 1]), r"contraction_dim \[0, 1\]; mps_ext takes \[\] or \[-1, -2\]"),
}


@pytest.mark.parametrize("case", V2_REFUSED)
def test_v2_says_what_it_takes(case):
    change, message = V2_REFUSED[case]
    a8, sa = quantize_rows(randn(8, 32), 1)
    b8, sb = experts_fp8(2, 16, 32)
    offs = torch.tensor([3, 8], dtype=torch.int32)
    kw = dict(scale_a=[sa], recipe_a=[ROW_WISE], swizzle_a=[], scale_b=[sb], recipe_b=[ROW_WISE], swizzle_b=[],
              contraction_dim=[])
    kw.update({k: v for k, v in change.items() if k != "scale_a"})
    if "scale_a" in change:
        kw["scale_a"], kw["recipe_a"] = [sa, sa], [ROW_WISE, ROW_WISE]
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext._scaled_grouped_mm_v2(a8, b8, kw["scale_a"], kw["recipe_a"], kw["swizzle_a"], kw["scale_b"],
                                                kw["recipe_b"], kw["swizzle_b"], offs, None, None,
                                                kw["contraction_dim"])
    # and the v1 checks still apply
    with pytest.raises(RuntimeError, match="Expected scale_a to have 8 elements"):
        torch.ops.mps_ext._scaled_grouped_mm_v2(a8, b8, [sa[:-1]], [ROW_WISE], [], [sb], [ROW_WISE], [], offs)
