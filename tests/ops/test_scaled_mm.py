"""Scaled matrix products with float8 operands (kernels_metal/scaled_mm.metal):
_scaled_mm and _scaled_mm_v2 (tensor-wise, row-wise, block-wise) against a
float64 reference of torch's contract (fp8_oracle.scaled_mm_reference), the
kernels' memory traffic from the executor's counters, and quantize_fp8.

torch's CPU _scaled_mm is no oracle here: on a CPU with AMX it is oneDNN's
matmul, which turns an overflowing fp8 output into NaN and takes a float64
scale, and capped at AVX2 (ONEDNN_MAX_CPU_ISA) it cannot run these calls at
all; elsewhere it is an emulation that saturates. The contract
(shared/reference/semantics.md): the float32 result converted as the float8
conversion does (e4m3fn saturates to +-448, as CUDA's does), float32
scales, K == 0 gives zeros."""

import contextlib
import io
import math

import pytest
import torch
from torch import nn

import mps_ext
from fp8_oracle import BLOCKWISE_1X128, BLOCKWISE_128X128, scaled_mm_reference
from mps_ext import _policy
import mps_ext_executor as cpu_metal
from host_names import host_names

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
g = torch.Generator().manual_seed(0)
OUTS = [torch.float32, torch.float16, torch.bfloat16]


def fp8(*shape, dtype=E4, scale=100.0):
    return (torch.randn(shape, generator=g) * scale).clamp(-440, 440).to(dtype)


def run(op, *args, device="executor", **kwargs):
    before = mps_ext.stats()["scaled_mm"]["ran"]
    if device == "executor":
        out = getattr(torch.ops.mps_ext, op)(*args, **kwargs)
    else:
        mv = [a.to("mps") if isinstance(a, torch.Tensor) else [t.to("mps") for t in a] if isinstance(a, list) else a
              for a in args]
        out = getattr(torch.ops.aten, op)(*mv, **kwargs).cpu()
    assert mps_ext.stats()["scaled_mm"]["ran"] == before + 1, mps_ext.stats()["scaled_mm"]
    return out


def close(got, want, k):
    if got.dtype in (E4, E5):  # one step of the fp8 grid at most (rounding of a float sum)
        g64, w64 = got.double(), want.double()
        step = w64.abs().clamp(min=2**-6) * (2**-3 if got.dtype == E4 else 2**-2)
        assert ((g64 - w64).abs() <= step).all()
        return
    eps = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[got.dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=eps, atol=eps * math.sqrt(max(k, 1)) * 50)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 40, 70])
@pytest.mark.parametrize("out", OUTS + [E4])
def test_tensorwise_and_rowwise_against_float64(device, m, out):
    k, n = 160, 72
    a, b = fp8(m, k), fp8(n, k).t()
    bias = torch.randn(n, generator=g).to(out if out != E4 and out != torch.float32 else torch.bfloat16)
    for recipe, sa, sb in [(0, torch.tensor(0.02), torch.tensor(0.003)),
                           (1, torch.rand(m, 1, generator=g) / 50, torch.rand(1, n, generator=g) / 50)]:
        kw = dict(out_dtype=out, bias=bias)
        if out == E4:
            kw["scale_result"] = torch.tensor(0.25)
        close(run("_scaled_mm", a, b, sa, sb, device=device, **kw), scaled_mm_reference(a, b, sa, sb, **kw), k)
        if out != E4:
            close(run("_scaled_mm_v2", a, b, [sa], [recipe], [], [sb], [recipe], [], bias, out, [], False,
                      device=device), scaled_mm_reference(a, b, sa, sb, bias, out_dtype=out, recipe_a=recipe,
                                                             recipe_b=recipe), k)


@pytest.mark.parametrize("case", ["k=0", "m=0", "n=0", "k=17", "n=17", "row-major mat2", "e5m2", "mixed formats",
                                  "misaligned offsets", "strided rows", "default out dtype", "fast accum"])
def test_shapes_and_layouts_torch_accepts(device, case):
    m, k, n = 4, 64, 48
    a, b = fp8(m, k), fp8(n, k).t()
    one = torch.tensor(1.0)
    kw = {"out_dtype": torch.float32}
    if case == "k=0":
        a, b = fp8(m, 0), fp8(n, 0).t()
    elif case == "m=0":
        a = fp8(0, k)
    elif case == "n=0":
        b = fp8(0, k).t()
    elif case == "k=17":
        a, b = fp8(m, 17), fp8(n, 17).t()
    elif case == "n=17":
        b = fp8(17, k).t()
    elif case == "row-major mat2":
        b = fp8(k, n)
    elif case == "e5m2":
        a, b = fp8(m, k, dtype=E5), fp8(n, k, dtype=E5).t()
    elif case == "mixed formats":
        b = fp8(n, k, dtype=E5).t()
    elif case == "misaligned offsets":
        a = fp8(m * k + 3)[3:].view(m, k)
        b = fp8(n * k + 1)[1:].view(n, k).t()
    elif case == "strided rows":
        a = fp8(m, 2 * k)[:, :k]
    elif case == "default out dtype":
        kw = {}
    elif case == "fast accum":
        kw["use_fast_accum"] = True
    with cpu_metal.record() as rec:
        got = run("_scaled_mm", a, b, one, one, device=device, **kw)
    close(got, scaled_mm_reference(a, b, one, one, **kw), k)
    if device == "executor" and case in ("misaligned offsets", "row-major mat2"):
        assert all(d.kernel.endswith("_scalar") for d in rec.dispatches)  # no 16-byte loads where not aligned


# float32 products -> the fp8 code the contract gives (semantics.md): round to
# nearest even; e4m3fn saturates to +-448 (0x7E) for finite overflow (464 is
# the tie between 448 and the next step up: 448's code is even), e5m2
# overflows to its infinity (0x7C) from 61440 on, the tie above 57344 (0x7B);
# below the smallest subnormal (2^-9, 2^-16) ties go to zero.
FP8_OUTPUTS = {
    E4: [(448.0, 0x7E), (464.0, 0x7E), (465.0, 0x7E), (480.0, 0x7E), (1000.0, 0x7E), (-1000.0, 0xFE),
         (1e30, 0x7E), (-1e30, 0xFE), (2**-10, 0x00), (1.5 * 2**-10, 0x01), (2**-9, 0x01)],
    E5: [(57344.0, 0x7B), (60000.0, 0x7B), (61440.0, 0x7C), (1e30, 0x7C), (-1e30, 0xFC), (2**-17, 0x00),
         (1.5 * 2**-17, 0x01), (2**-16, 0x01)],
}


@pytest.mark.parametrize("m", [1, 40])  # the decode GEMV and the prefill tile
@pytest.mark.parametrize("fmt", [E4, E5])
def test_fp8_outputs_round_and_saturate_as_the_conversion(device, fmt, m):
    # Row-wise: a of ones times the identity, so output column j is exactly
    # scale_b[j], whatever the order of the sum; its code is the contract's.
    values, codes = zip(*FP8_OUTPUTS[fmt])
    n = 16
    sb = torch.ones(1, n)
    sb[0, : len(values)] = torch.tensor(values)
    a, b = torch.ones(m, 16).to(E4), torch.eye(16).to(E4).t()
    got = run("_scaled_mm", a, b, torch.ones(m, 1), sb, out_dtype=fmt, device=device)
    assert got.view(torch.uint8)[:, : len(codes)].tolist() == [list(codes)] * m


def block_scales(m, k, n, recipe_b, layout="torch"):
    """Scales of a 1x128 x (1x128 | 128x128) product as torch's contract lays
    them out: column-major (strides (1, rows)), or row-major."""
    kb = -(-k // 128)
    sa = torch.rand(m, kb, generator=g) / 100 + 1e-3
    sb = torch.rand(n, kb, generator=g) if recipe_b == 4 else torch.rand((kb + 3) // 4 * 4, -(-n // 128), generator=g)
    sb = sb / 100 + 1e-3
    if layout == "torch":
        sa, sb = sa.t().contiguous().t(), sb.t().contiguous().t()
    return sa, sb


@pytest.mark.parametrize("m,k,n", [(1, 256, 256), (3, 384, 200), (8, 130, 129), (40, 256, 160), (33, 300, 64),
                                   (5, 384, 3), (40, 256, 2)])
@pytest.mark.parametrize("recipe_b", [5, 4])
@pytest.mark.parametrize("layout", ["torch", "row-major"])
def test_blockwise_recipes_against_float64(device, m, k, n, recipe_b, layout):
    # (5, 384, 3) and (40, 256, 2): N == ceil(K / 128), where scale_b of
    # 1x128 x 1x128 read as its transpose has the right shape and wrong values.
    a, w = fp8(m, k), fp8(n, k)
    sa, sb = block_scales(m, k, n, recipe_b, layout)
    bias = torch.randn(n, generator=g).bfloat16()
    got = run("_scaled_mm_v2", a, w.t(), [sa], [4], [], [sb], [recipe_b], [], bias, torch.bfloat16, [], False,
              device=device)
    close(got, scaled_mm_reference(a, w.t(), sa, sb, bias, out_dtype=torch.bfloat16, recipe_a=BLOCKWISE_1X128,
                                   recipe_b=recipe_b), k)


@pytest.mark.parametrize("case", ["1x128 transposed", "128x128 unpadded", "floor K/128", "strided scale_b"])
def test_blockwise_scales_outside_torchs_contract_are_refused(case):
    # Shapes and strides torch's contract does not take raise (torch's CPU
    # kernel's error here; on MPS mps_ext's, naming the layouts it takes),
    # and mps_ext's kernel does not run on them.
    m, k, n = 4, 300, 200  # kb = ceil(K / 128) = 3, padded to 4 rows for 128x128
    a, w = fp8(m, k), fp8(n, k)
    recipe_b = 5 if case == "128x128 unpadded" else 4
    sa, sb = block_scales(m, k, n, recipe_b)
    if case == "1x128 transposed":
        sb = sb.t()                                  # [kb, N], the layout mps_ext used to take
    elif case == "128x128 unpadded":
        sb = sb[:3]                                  # [kb, ceil(N/128)], mps_ext's old 128x128 layout
    elif case == "floor K/128":
        sa = sa[:, : k // 128]                       # K // 128 as torch 2.10-2.13's meta function writes it
    elif case == "strided scale_b":
        sb = torch.rand(n, 6)[:, ::2]                # [N, kb] with a column stride of 2
    mps_ext.reset_stats()
    with pytest.raises((ValueError, RuntimeError)):
        torch.ops.mps_ext._scaled_mm_v2(a, w.t(), [sa], [4], [], [sb], [recipe_b], [], None, torch.bfloat16, [],
                                        False)
    assert mps_ext.stats()["scaled_mm"]["ran"] == 0


@pytest.mark.parametrize("sa_layout", ["row-major", "M-major"])
@pytest.mark.parametrize("path", ["vec", "scalar"])
def test_prefill_blockwise_scales_past_32_blocks(sa_layout, path):
    # fp8_mm_tile stages the activation scales of 32 K blocks at a time,
    # along whichever of their dimensions is contiguous: K of 33 blocks (the
    # last one partial) takes a second chunk. Rows of K % 16 != 0 bytes are
    # not 16-byte aligned: element loads.
    m, k, n = 40, 32 * 128 + (112 if path == "vec" else 100), 72
    a, w = fp8(m, k), fp8(n, k)
    sa, sb = block_scales(m, k, n, 5)
    if sa_layout == "row-major":
        sa = sa.contiguous()
    with cpu_metal.record() as rec:
        got = run("_scaled_mm_v2", a, w.t(), [sa], [4], [], [sb], [5], [], None, torch.float32, [], False)
    assert rec.dispatches[0].kernel == f"fp8_mm_tile_fp8_{path}"
    close(got, scaled_mm_reference(a, w.t(), sa, sb, out_dtype=torch.float32, recipe_a=BLOCKWISE_1X128,
                                   recipe_b=BLOCKWISE_128X128), k)


@pytest.mark.parametrize("fmt", [E4, E5])
@pytest.mark.parametrize("operand", ["activation", "weight"])
def test_every_fp8_code_decodes_exactly(fmt, operand):
    # Code c alone in row c of one operand, a 1 at the same K in the other:
    # output c is the code's value (NaN codes: NaN), through the decode GEMV
    # (8 rows at a time) and the prefill tile (all 256 rows).
    codes = torch.zeros(256, 16, dtype=torch.uint8)
    codes[:, 0] = torch.arange(256, dtype=torch.uint8)
    codes = codes.view(fmt)
    one = torch.zeros(16, 16, dtype=torch.uint8).view(fmt)
    one[0, 0] = 1.0
    want = codes.float()[:, 0]
    t1 = torch.tensor(1.0)

    def product(rows):
        if operand == "activation":
            return run("_scaled_mm", codes[rows], one.t(), t1, t1, out_dtype=torch.float32)[:, 0]
        return run("_scaled_mm", one[:8], codes[rows].t(), t1, t1, out_dtype=torch.float32)[0]

    got = torch.cat([product(slice(s, s + 8)) for s in range(0, 256, 8)] +
                    ([product(slice(0, 256))] if operand == "activation" else []))
    want = want.repeat(2) if operand == "activation" else want
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


# What torch's contract rejects, and mps_ext's error for it: the type and the
# first line of torch's CPU kernel's own (aten/src/ATen/native/Blas.cpp, the
# path every CPU without AMX takes), written here, not asked of the installed
# torch: with AMX its CPU kernel is oneDNN's matmul, which takes a float64
# scale. Where torch's meta function checks it too (what torch.compile and
# every device's kernel follow), it must reject the input as well.
BAD_INPUTS = {
    "wrong scale shape": (ValueError, "Invalid scaling configuration.", True),
    "double scale": (ValueError, "Invalid scaling configuration.", True),   # meta: scales are float32
    "non-fp8 operand": (ValueError, "Invalid scaling configuration.", True),
    "3-D": (RuntimeError, "mat1 must be a matrix", True),
    "shapes": (RuntimeError, "mat_a and mat_b shapes cannot be multiplied (4x32 and 16x16)", False),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_give_torchs_errors(case):
    a, b = fp8(4, 32), fp8(16, 32).t()
    one = torch.tensor(1.0)
    args = {"wrong scale shape": (a, b, torch.ones(4, 1), torch.ones(16, 1)),
            "double scale": (a, b, one.double(), one),
            "non-fp8 operand": (a.half(), b, one, one),
            "3-D": (a[None], b, one, one),
            "shapes": (a, fp8(16, 16).t(), one, one)}[case]
    error, message, meta_checks = BAD_INPUTS[case]
    if meta_checks:
        with pytest.raises(RuntimeError):
            torch._scaled_mm(*[t.to("meta") for t in args])
    mps_ext.reset_stats()
    with pytest.raises(error) as ours:
        torch.ops.mps_ext._scaled_mm(*args)
    assert str(ours.value).split("\n")[0] == message
    assert mps_ext.stats()["scaled_mm"]["ran"] == 0


def test_blockwise_with_wrong_scale_shape_gives_torchs_error():
    a, b = fp8(4, 256), fp8(128, 256).t()
    with pytest.raises(ValueError, match="Invalid scaling configuration"):
        torch.ops.mps_ext._scaled_mm_v2(a, b, [torch.ones(4, 3)], [4], [], [torch.ones(2, 1)], [5], [], None,
                                       torch.bfloat16, [], False)


ACTS = {"fp8": E4, "f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def test_every_matrix_kernel_runs():
    """Each [[host_name]] of scaled_mm.metal, through _scaled_mm (fp8
    activations) or fp8_linear (the others), against float64; the GEMVs
    with the input norm (rms_norm_fp8_gemv_*) run in
    test_rms_norm_fp8_linear.py, which checks it runs each."""
    seen = set()
    for act, dtype in ACTS.items():
        for m in (1, 2, 3, 5, 40):
            for aligned in (True, False):
                k, n = 64, 24
                w = fp8(n, k)
                ws = torch.rand(n, 1, generator=g) / 100
                if dtype in (E4,):
                    x = fp8(m, k) if aligned else fp8(m * k + 1)[1:].view(m, k)
                    with cpu_metal.record() as rec:
                        got = torch.ops.mps_ext._scaled_mm(x, w.t(), torch.ones(m, 1), ws.t().contiguous(),
                                                           out_dtype=torch.float32)
                    want = (x.double() @ (w.double() * ws.double()).t())
                else:
                    x = torch.randn(m, k, generator=g).to(dtype)
                    if not aligned:
                        x = torch.randn(m * k + 1, generator=g).to(dtype)[1:].view(m, k)
                    # A bias keeps 16-bit prefill on fp8_mm_tile (without one, row-wise
                    # scales take gmm_tiled_dense_<act>_e4m3w: test_fp8_linear_prefill_on_the_dense_tile)
                    bias = torch.randn(n, generator=g).to(dtype) if m > 8 else None
                    with cpu_metal.record() as rec:
                        got = torch.ops.mps_ext.fp8_linear(x, w, ws, "row", bias)
                    want = (x.double() @ (w.double() * ws.double()).t())
                    if bias is not None:
                        want = want + bias.double()
                close(got, want.to(got.dtype), k)
                seen.update(d.kernel for d in rec.dispatches)
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    import embed_shaders
    lib = cpu_metal.compile_library(embed_shaders.source("scaled_mm"), filename="scaled_mm.metal")
    matrix = {f for f in lib.function_names if not f.startswith("rms_norm_fp8_gemv_")}
    assert matrix == seen, sorted(matrix ^ seen)


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("recipe", ["row", "block"])
def test_decode_reads_each_weight_byte_once_with_16_byte_loads(rows, recipe):
    n, k = 2048, 512
    a, w = fp8(rows, k), fp8(n, k)
    if recipe == "row":
        args = ([torch.ones(rows, 1)], [1], [], [torch.ones(1, n)], [1], [])
    else:
        args = ([torch.ones(rows, k // 128)], [4], [], [torch.ones(k // 128, n // 128)], [5], [])
    with cpu_metal.record() as rec:
        torch.ops.mps_ext._scaled_mm_v2(a, w.t(), *args, None, torch.bfloat16, [], False)
    (d,) = rec.dispatches
    wi = d.buffer("w")
    assert d.bytes_read[wi] == w.nbytes
    assert d.read_widths[wi] == {16: w.nbytes // 16}
    # 4 threadgroups per core of the executor's 80-core GPU; at 8 rows fewer,
    # larger ones (decode_geometry), so that the activation bytes they stage
    # stay within the weight's: still at least one per core.
    assert d.total_threadgroups >= (320 if rows < 8 else 80)
    assert d.bytes_read[d.buffer("x")] <= d.bytes_read[wi]


@pytest.mark.parametrize("m", [64, 96])
def test_prefill_reads_weights_once_per_64_rows(m):
    # A 64-row tile reads each weight byte once: rows / 64 times, rounded up
    n, k = 256, 256
    a, w = fp8(m, k), fp8(n, k)
    one = torch.tensor(1.0)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext._scaled_mm(a, w.t(), one, one, out_dtype=torch.bfloat16)
    (d,) = rec.dispatches
    assert d.kernel == "fp8_mm_tile_fp8_vec"
    wi = d.buffer("w")
    assert d.bytes_read[wi] == w.nbytes * -(-m // 64)
    assert set(d.read_widths[wi]) == {16}


@pytest.mark.parametrize("path", ["vec", "scalar"])
@pytest.mark.parametrize("act", ["fp8", "f16", "bf16", "f32"])
def test_prefill_decodes_each_weight_once_in_18_kib(act, path):
    # Issue 21: the tile kernels held 18-31 KiB of threadgroup memory (1-2
    # threadgroups a core on M1/M2) and two simdgroups decoded each weight.
    # Issue 32: a 64 x 64 tile decodes each weight byte once a threadgroup,
    # into a float tile beside the activations' (64 rows x 32 of K each, 18
    # KiB: 3 threadgroups a core still), every K stage of 32 written whole
    # (the last one partial here: zeros past K), then the outputs.
    m, n, k = 64, 128, 320  # the last K block partial
    misaligned = int(path == "scalar")
    w, ws = fp8(n, k), torch.rand(n, 1, generator=g) / 100
    if act == "fp8":
        x = fp8(m * k + misaligned)[misaligned:].view(m, k)
        with cpu_metal.record(counters=True) as rec:
            got = torch.ops.mps_ext._scaled_mm(x, w.t(), torch.ones(m, 1), ws.t().contiguous(), out_dtype=torch.float32)
    else:
        x = torch.randn(m * k + misaligned, generator=g).to(ACTS[act])[misaligned:].view(m, k)
        # (a zero bias keeps 16-bit activations on fp8_mm_tile)
        bias = torch.zeros(n, dtype=x.dtype) if act in ("f16", "bf16") else None
        with cpu_metal.record(counters=True) as rec:
            got = torch.ops.mps_ext.fp8_linear(x, w, ws, "row", bias)
    close(got, (x.double() @ (w.double() * ws.double()).t()).to(got.dtype), k)
    (d,) = rec.dispatches
    assert d.kernel == f"fp8_mm_tile_{act}_{path}"
    tiles = d.total_threadgroups
    assert d.threadgroup_memory <= 18 * 1024, d.threadgroup_memory
    assert d.threadgroups_per_core >= 3, d.threadgroups_per_core
    assert d.bytes_read[d.buffer("w")] == w.nbytes * m // 64
    assert set(d.read_widths[d.buffer("w")]) == {16}  # aligned weights: 16 bytes a load, also beside element loads
    stages = -(-k // 32)
    assert d.threadgroup_bytes_written == tiles * ((64 + 64) * stages * 32 * 4 + 64 * 64 * 4)


@pytest.mark.parametrize("act", ["fp8", "f16", "bf16", "f32"])
def test_prefill_element_loads_give_the_16_byte_loads_bits(act):
    # fp8_mm_tile's element-load variant (activations one element off 16-byte
    # alignment) stages the same decoded, scaled activations as the 16-byte
    # one, and both sum in the same order: the same bits. fp8 with block-wise
    # scales (a scale_a per row and 128 of K, has_scale_a), float activations
    # without an activation scale (fp8_linear); 70 rows (a second tile with 6,
    # simdgroups past M), K = 2 blocks + 80 (a partial block and stage).
    m, k, n = 70, 336, 72
    w = fp8(n, k)
    if act == "fp8":
        x = fp8(m * k + 1)
        sa, sb = block_scales(m, k, n, 5)

        def product(a):
            return torch.ops.mps_ext._scaled_mm_v2(a, w.t(), [sa], [4], [], [sb], [5], [], None, torch.float32, [],
                                                   False)
    else:
        x = torch.randn(m * k + 1, generator=g).to(ACTS[act])
        ws = torch.rand(n, 1, generator=g) / 100
        bias = torch.zeros(n, dtype=x.dtype) if act in ("f16", "bf16") else None  # keeps them on fp8_mm_tile

        def product(a):
            return torch.ops.mps_ext.fp8_linear(a, w, ws, "row", bias)
    shifted = x[1:].view(m, k)  # one element off 16-byte alignment
    with cpu_metal.record() as rec:
        vec, scalar = product(shifted.clone()), product(shifted)
    assert [d.kernel for d in rec.dispatches] == [f"fp8_mm_tile_{act}_vec", f"fp8_mm_tile_{act}_scalar"]
    assert torch.equal(scalar, vec)


# ------------------------------------------- fp8_linear's prefill tile --
# Past 8 rows, 16-bit activations on e4m3 weights with a tensor-wise or
# row-wise scale and no bias run gmm_tiled_dense_<act>_e4m3w (grouped_mm.metal:
# gmm_tiled's dense tile, each weight decoded once a K stage), the scale
# applied to the float sums. The bound (stated, not measured): each product
# x_k * w_k (bf16 or f16 times e4m3, decoded as w / 256) is exact in float32
# (at most 11 + 4 significant bits); the kernel sums them in float32 in some
# order (at most K roundings of relative 2^-24 each on partial sums bounded by
# sum |x_k w_k|), multiplies by 256 * scale (two roundings) and rounds once to
# the output's type: |got - exact| <= u * |exact| + (1 + u) (K + 2) 2^-24
# sum_k |x_k w_k scale| (+ the smallest subnormal), u the output type's unit
# roundoff (2^-11 half, 2^-8 bfloat).
DENSE_UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
DENSE_TINY = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def dense_tile_check(got, x, w, ws, granularity):
    x64 = x.double()
    w64 = w.double() * (ws.double().reshape(-1, 1) if granularity == "row" else ws.double().reshape(()))
    exact = x64 @ w64.t()
    k, u = x.shape[-1], DENSE_UNIT[got.dtype]
    bound = u * exact.abs() + (1 + u) * (k + 2) * 2.0**-24 * (x64.abs() @ w64.abs().t()) + DENSE_TINY[got.dtype]
    err = (got.double() - exact).abs()
    assert got.shape == exact.shape and bool((err <= bound).all()), f"max error / bound {(err / bound).max():.3f}"


def dense_scale(granularity, n):
    return torch.rand(n, 1, generator=g) / 50 + 1e-3 if granularity == "row" else torch.tensor(0.0123)


# Rows, N and K past the 64 x 64 tile and the 32-deep stage: 9 rows (one past the GEMVs), 70 = 64 + 6 rows,
# N = 72 = 64 + 8, K = 96 (16-byte rows of both operands: 16-byte loads) and K = 40 (32 + 8: e4m3 rows of 40
# bytes, element loads of the weights).
@pytest.mark.parametrize("m,k,n", [(70, 96, 72), (9, 40, 24)])
@pytest.mark.parametrize("layout", ["contiguous", "strided rows", "misaligned"])
@pytest.mark.parametrize("granularity", ["tensor", "row"])
@pytest.mark.parametrize("act", ["f16", "bf16"])
def test_fp8_linear_prefill_on_the_dense_tile(act, granularity, layout, m, k, n):
    dtype = ACTS[act]
    w, ws = fp8(n, k), dense_scale(granularity, n)
    if layout == "contiguous":
        x = torch.randn(m, k, generator=g).to(dtype)
    elif layout == "strided rows":  # every other 16 bytes of a wider row: K strided rows, still aligned
        x = torch.randn(m, k + 8, generator=g).to(dtype)[:, :k]
    else:  # one element off 16-byte alignment: element loads of the activations
        x = torch.randn(m * k + 1, generator=g).to(dtype)[1:].view(m, k)
    with cpu_metal.record(counters=True) as rec:
        got = torch.ops.mps_ext.fp8_linear(x, w, ws, granularity, None)
    dense_tile_check(got, x, w, ws, granularity)
    (d,) = rec.dispatches
    assert d.kernel == f"gmm_tiled_dense_{act}_e4m3w"
    wi = d.buffer("w")
    assert d.bytes_read[wi] == w.nbytes * -(-m // 64)  # each weight byte once per 64-row tile
    if k % 16 == 0:
        assert set(d.read_widths[wi]) == {16}  # e4m3 rows of whole 16-byte pieces: 16-byte loads only


def test_fp8_linear_dense_tile_against_fp8_mm_tile_bit_for_bit():
    # With power-of-two scales every partial sum of the dense tile (scale
    # after the sums, weights as w / 256) is fp8_mm_tile's (scale on each
    # weight) times a power of two, exactly; both tiles sum in the same
    # order (2 x 2 simdgroups of 4 x 4 fragments, 32-deep stages, the same
    # 8-deep steps): the same bits. A zero bias runs fp8_mm_tile.
    m, k, n = 70, 208, 72  # K = 6 stages + 16: a partial last stage
    for act in ("f16", "bf16"):
        dtype = ACTS[act]
        x, w = torch.randn(m, k, generator=g).to(dtype), fp8(n, k, scale=1.0)
        for granularity, ws in (("tensor", torch.tensor(2.0**-7)),
                                ("row", 2.0 ** -torch.randint(4, 12, (n, 1), generator=g).float())):
            with cpu_metal.record() as rec:
                dense = torch.ops.mps_ext.fp8_linear(x, w, ws, granularity, None)
                tile = torch.ops.mps_ext.fp8_linear(x, w, ws, granularity, torch.zeros(n, dtype=dtype))
            assert [d.kernel for d in rec.dispatches] == [f"gmm_tiled_dense_{act}_e4m3w", f"fp8_mm_tile_{act}_vec"]
            assert torch.equal(dense, tile), (act, granularity)


def test_fp8_linear_prefill_what_stays_on_fp8_mm_tile():
    """The calls the dense tile does not take, and why (scaled_mm.cpp,
    dense_tile_scale), each against float64."""
    m, k, n = 20, 64, 40
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w, ws = fp8(n, k), torch.rand(n, 1, generator=g) / 50
    block = torch.rand(1, 1, generator=g) / 50
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    strided_ws = (torch.rand(n, 2, generator=g) / 50)[:, :1]  # a row-wise scale whose elements are 2 apart
    cases = [  # (what, input, weight, scale, granularity, bias, kernel)
        ("a bias (the tile's epilogue has none)", x, w, ws, "row", bias, "fp8_mm_tile_bf16_vec"),
        ("block scales (inside the sums)", x, w, block, "block", None, "fp8_mm_tile_bf16_vec"),
        ("e5m2 weights (the tile decodes e4m3)", x, fp8(n, k, dtype=E5), ws, "row", None, "fp8_mm_tile_bf16_vec"),
        ("float32 activations", x.float(), w, ws, "row", None, "fp8_mm_tile_f32_vec"),
        ("a strided row-wise scale", x, w, strided_ws, "row", None, "fp8_mm_tile_bf16_vec"),
        ("8 rows: the GEMV", x[:8], w, ws, "row", None, "fp8_gemv_bf16_r8_vec"),
    ]
    for what, xi, wi, si, gran, b, kernel in cases:
        with cpu_metal.record() as rec:
            got = torch.ops.mps_ext.fp8_linear(xi, wi, si, gran, b)
        assert [d.kernel for d in rec.dispatches] == [kernel], what
        scale = si.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k] if gran == "block" else \
            si.double().reshape(-1, 1)
        want = xi.double() @ (wi.double() * scale).t() + (b.double() if b is not None else 0)
        close(got, want.to(got.dtype), k)


def test_every_fp8_dense_tile_is_tested():
    assert {k for k in host_names("grouped_mm") if k.endswith("_e4m3w") and k.startswith("gmm_tiled_dense_")} == {
        f"gmm_tiled_dense_{a}_e4m3w" for a in ("f16", "bf16")}


def torchs_cpu_kernel_runs():
    """Can torch's CPU _scaled_mm_v2 run here, for the policy tests to leave
    calls to? Not on a CPU with AMX whose oneDNN is capped below it
    (ONEDNN_MAX_CPU_ISA=AVX2): it then raises "could not create a primitive
    descriptor" for every call."""
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key("aten::_scaled_mm_v2", "CPU"):
        return False
    a, one = torch.ones(16, 16).to(E4), torch.ones(1)
    try:
        torch._scaled_mm_v2(a, a.t(), [one], [0], [], [one], [0], [], None, torch.float32, [], False)
    except RuntimeError:
        return False
    return True


def test_torch_2_15_keeps_what_its_kernel_rejects(cpu_policy):
    # The policy of a torch whose _scaled_mm_v2 runs tensor-wise and row-wise
    # e4m3fn products (applied to the CPU key here, where aten::_scaled_mm_v2
    # has a kernel to leave them to; mps_ext applies it to MPS on torch 2.15).
    if not torchs_cpu_kernel_runs():
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for aten::_scaled_mm_v2 that runs here")
    mps_ext._leave_to_torch("scaled_mm", _policy.left_to_torch("scaled_mm", "2.15.0"), "CPU")
    a, b, b5 = fp8(3, 32), fp8(16, 32).t(), fp8(16, 32, dtype=E5).t()
    sa, sb = torch.rand(3, 1, generator=g), torch.rand(1, 16, generator=g)
    bias16 = torch.randn(16, generator=g).bfloat16()

    def v2(b, bias, out, recipe=1):
        return torch.ops.mps_ext._scaled_mm_v2(a, b, [sa], [recipe], [], [sb], [recipe], [], bias, out, [], False)

    v2(b, None, torch.bfloat16)                             # torch's
    v2(b, bias16, torch.bfloat16)                           # torch's
    v2(b5, None, torch.bfloat16)                            # ours: e5m2
    v2(b, bias16.float(), torch.bfloat16)                   # ours: f32 bias
    v2(b, bias16, torch.float32)                            # ours: bias, f32 out
    v2(b, None, E5)                                         # ours: e5m2 out
    torch.ops.mps_ext._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16)  # ours: no rule for _scaled_mm (v1)
    assert mps_ext.stats()["scaled_mm"] == {
        "ran": 5, "fallbacks": {"policy: torch 2.15's _scaled_mm_v2 runs tensor-wise and row-wise float8_e4m3fn "
                                "products on MPS": 2}, "unavailable": {}}


def test_torch_2_15_keeps_operands_its_kernel_cannot_align(cpu_policy):
    # torch 2.15's kernel raises unless K, N, each operand's storage offset
    # and leading stride are multiples of 16 (kernels/ScaledMM.h,
    # scaled_mm_alignment); torch 2.14 has no kernel of its own and mps_ext
    # runs them all: they stay with mps_ext.
    if not torchs_cpu_kernel_runs():
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for aten::_scaled_mm_v2 that runs here")
    mps_ext._leave_to_torch("scaled_mm", _policy.left_to_torch("scaled_mm", "2.15.0"), "CPU")
    m, k, n = 3, 32, 16
    cases = [  # (a, b = mat2, torch's kernel takes it)
        (fp8(m, k), fp8(n, k).t(), True),
        (fp8(m, 2 * k)[:, :k], fp8(n, k).t(), True),                    # row stride 64
        (fp8(m, k), fp8(k, n), True),                                   # row-major mat2, row stride 16
        (fp8(m, 40), fp8(n, 40).t(), False),                            # K = 40
        (fp8(m, k), fp8(24, k).t(), False),                             # N = 24
        (fp8(m * k + 8)[8:].view(m, k), fp8(n, k).t(), False),          # a's storage offset 8
        (fp8(m, k), fp8(n * k + 4)[4:].view(n, k).t(), False),          # b's storage offset 4
        (fp8(m, k + 8)[:, :k], fp8(n, k).t(), False),                   # a's row stride 40
        (fp8(m, k), fp8(n, k + 8)[:, :k].t(), False),                   # b's column stride 40
        (fp8(m, k), fp8(k, 2 * n)[:, ::2], False),                      # b contiguous along neither dimension
    ]
    for i, (a, b, torchs) in enumerate(cases):
        mps_ext.reset_stats()
        sa, sb = torch.rand(a.shape[0], 1, generator=g), torch.rand(1, b.shape[1], generator=g)
        got = torch.ops.mps_ext._scaled_mm_v2(a, b, [sa], [1], [], [sb], [1], [], None, torch.float32, [], False)
        # (the routing is the point; torch's CPU kernel rounds through lower precision on some layouts)
        torch.testing.assert_close(got, scaled_mm_reference(a, b, sa, sb, out_dtype=torch.float32), rtol=1e-3,
                                   atol=1e-3)
        assert mps_ext.stats()["scaled_mm"]["ran"] == int(not torchs), i


def dequantized(layer):
    """The float64 weight an FP8Linear stands for (weight * its scale group)."""
    w = layer.weight.double()
    s = layer.weight_scale.double()
    if layer.granularity == "block":
        s = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    return w * s


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@cpu_metal.request()  # FP8Linear on CPU tensors: through the kernels, not torch's CPU ops
def test_fp8_linear_without_its_kernels(granularity):
    """Turned off, or its Metal library failing to build: fp8_linear gives
    the same product through torch's ops (torch has no kernel to fall back
    to), and says why in stats()."""
    layer = mps_ext.FP8Linear.from_linear(nn.Linear(300, 130).bfloat16(), granularity)
    x = torch.randn(3, 2, 300, generator=g).bfloat16()
    want = (x.double() @ dequantized(layer).t() + layer.bias.double()).to(torch.bfloat16)
    mps_ext.reset_stats()
    ours = layer(x)
    with mps_ext.disabled("scaled_mm"):
        off = layer(x)
    cpu_metal._C._simulate_failure("scaled_mm", "", "library", 0)
    try:
        failed = layer(x)
        assert mps_ext.stats()["scaled_mm"]["unavailable"] == {"CPU": "scaled_mm.metal failed to compile (simulated)"}
    finally:
        cpu_metal._C._simulate_failure("", "", "none", 0)
        mps_ext._C._clear_unavailable("scaled_mm")
    for got in (ours, off, failed):
        assert got.shape == (3, 2, 130)
        torch.testing.assert_close(got.double(), want.double(), rtol=2e-2, atol=2e-2)
    assert mps_ext.stats()["scaled_mm"]["fallbacks"] == {"turned off": 1, "kernels unavailable on this device": 1}


class Tiny(nn.Module):
    def __init__(self, d=256, vocab=300):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        return self.lm_head(self.down(torch.relu(self.up(x))))


@pytest.mark.parametrize("granularity", ["tensor", "row", "block"])
@cpu_metal.request()
def test_quantize_fp8(granularity):
    torch.manual_seed(0)
    ref = Tiny().bfloat16()
    model = Tiny().bfloat16()
    model.load_state_dict(ref.state_dict())
    mps_ext.quantize_fp8(model, granularity=granularity)
    assert isinstance(model.up, mps_ext.FP8Linear) and isinstance(model.down, mps_ext.FP8Linear)
    assert isinstance(model.lm_head, nn.Linear)  # the LM head is kept by default
    assert f"granularity={granularity}" in repr(model) and "float8_e4m3fn" in repr(model)
    fp8_bytes = sum(b.nbytes for n, b in model.named_buffers() if "lm_head" not in n)
    bf16_bytes = ref.up.weight.nbytes + ref.down.weight.nbytes
    assert fp8_bytes <= 0.51 * bf16_bytes
    x = torch.randn(5, 256).bfloat16()
    mps_ext.reset_stats()
    y, want = model(x), ref(x)
    assert mps_ext.stats()["scaled_mm"]["ran"] == 2
    # e4m3 keeps 3 mantissa bits: each weight is off by at most 2^-4 of its
    # group's scale; through two layers the output moves by a few percent.
    rel = (y.float() - want.float()).norm() / want.float().norm()
    assert rel < 0.06, rel
    # The kernels compute what the stored fp8 weights say (no more error than bf16 rounding).
    exact = nn.functional.linear(torch.relu(nn.functional.linear(x.float(), dequantized(model.up).float(),
                                                                 model.up.bias.float())).bfloat16().float(),
                                 dequantized(model.down).float())
    torch.testing.assert_close(model.down(torch.relu(model.up(x))).float(), exact, rtol=2e-2, atol=2e-2)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    again = mps_ext.quantize_fp8(Tiny().bfloat16(), granularity=granularity)
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert torch.equal(again(x), y)


def test_quantize_fp8_filter_and_errors():
    model = mps_ext.quantize_fp8(Tiny(), filter=lambda name, m: name == "up")
    assert isinstance(model.up, mps_ext.FP8Linear) and isinstance(model.down, nn.Linear)
    with pytest.raises(ValueError, match="granularity must be one of"):
        mps_ext.quantize_fp8(Tiny(), granularity="channel")
    for path in (contextlib.nullcontext(), cpu_metal.request()):  # torch's CPU ops, the kernels
        with path, pytest.raises(RuntimeError, match="input must be float32, float16 or bfloat16"):
            model.up(torch.ones(2, 256, dtype=torch.float64))
