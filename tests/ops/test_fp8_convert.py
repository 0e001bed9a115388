"""FP8 conversions (kernels_metal/fp8.metal through torch.ops.mps_ext.copy_)
and the fp8 tensor ops, against torch's CPU conversions (bit for bit, but
for the payload of a NaN) and the float64 numpy model in fp8_oracle.py."""

import contextlib

import numpy as np
import pytest
import torch

import mps_ext
from mps_ext import _policy
import mps_ext_executor as cpu_metal

from fp8_oracle import decode, encode

# The oracle is torch's CPU conversions bit for bit (a NaN's payload changes
# with ATEN_CPU_CAPABILITY); scripts/test.sh runs this file again with torch's
# CPU kernels capped.
pytestmark = pytest.mark.torch_cpu_oracle

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def convert(src, dtype, device):
    """src converted to dtype by mps_ext's kernel on `device`."""
    if device == "executor":
        out = torch.empty(src.shape, dtype=dtype)
        mps_ext.reset_stats()
        torch.ops.mps_ext.copy_(out, src)
        assert mps_ext.stats()["fp8"]["ran"] == 1, mps_ext.stats()["fp8"]
        return out
    return src.to("mps").to(dtype).cpu()


def bits(t):
    return t.view(torch.uint8) if t.dtype in FP8 else t.view(BITS[t.dtype])


def same_as_torchs(got, want):
    """got has want's bits, but where want is NaN: there a NaN of the same
    sign. A NaN's payload is no contract: torch's own CPU conversion of an
    fp8 NaN code to float16 gives one payload on its AVX2 path and another
    with ATEN_CPU_CAPABILITY=default."""
    nan = want.float().isnan()
    return (torch.equal(bits(got)[~nan], bits(want)[~nan]) and bool(got.float()[nan].isnan().all())
            and torch.equal(got.float()[nan].signbit(), want.float()[nan].signbit()))


@pytest.mark.parametrize("src_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", FP8)
def test_every_half_and_bfloat_to_fp8(device, src_dtype, fmt):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(src_dtype)
    got = convert(x, fmt, device)
    assert same_as_torchs(got, x.to(fmt))
    finite = torch.isfinite(x)
    want = encode(x.double().numpy(), fmt)
    assert np.array_equal(got.view(torch.uint8).numpy()[finite.numpy()], want[finite.numpy()])


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("dst_dtype", FLOATS + FP8)
def test_every_fp8_code_converts(device, fmt, dst_dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)
    got = convert(codes, dst_dtype, device)
    assert same_as_torchs(got, codes.to(dst_dtype))
    want = decode(np.arange(256, dtype=np.uint8), fmt)
    if dst_dtype in FP8 and dst_dtype != fmt:
        ok = ~np.isnan(want)
        assert np.array_equal(got.view(torch.uint8).numpy()[ok], encode(want, dst_dtype)[ok])
    if dst_dtype in FLOATS:
        np.testing.assert_array_equal(got.double().numpy(), want)  # exact (NaN == NaN here)


def float32_samples(n=1_000_000, seed=0):
    """Random bit patterns over every exponent, plus the values where fp8
    rounding changes: each midpoint between neighbouring fp8 values and one
    float32 step either side, saturation and subnormal boundaries."""
    g = np.random.default_rng(seed)
    rnd = g.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = []
    for fmt in FP8:
        v = np.unique(np.abs(decode(np.arange(256, dtype=np.uint8), fmt)))
        v = v[np.isfinite(v)]
        mids = np.concatenate([(v[:-1] + v[1:]) / 2, [v[-1] * 1.0625, v[-1] * 1.125, v[-1] * 2]]).astype(np.float32)
        edges += [mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0)), v.astype(np.float32)]
    e = np.concatenate(edges)
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e-45, 2.0**-126, 3e38], dtype=np.float32)
    both = np.concatenate([e, -e, special])
    return torch.from_numpy(np.concatenate([both, rnd[: n - len(both)]]))


@pytest.mark.parametrize("fmt", FP8)
def test_float32_samples_to_fp8(device, fmt):
    x = float32_samples()
    got = convert(x, fmt, device)
    assert same_as_torchs(got, x.to(fmt))
    ok = torch.isfinite(x).numpy()
    assert np.array_equal(got.view(torch.uint8).numpy()[ok], encode(x.double().numpy(), fmt)[ok])
    nan = torch.isnan(x)
    assert torch.equal(got.view(torch.uint8)[nan] & 0x7F, torch.full_like(got.view(torch.uint8)[nan], 0x7F))


def test_saturation_and_nan_rules_match_torch():
    # The rules semantics.md reports, asked of the installed torch.
    x = torch.tensor([464.0, 465.0, 480.0, 1000.0, float("inf"), -float("inf"), float("nan"), 2**-10, 1.5 * 2**-10])
    got = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    torch.ops.mps_ext.copy_(got, x)
    assert got.view(torch.uint8).tolist() == x.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    e5 = torch.empty(1, dtype=torch.float8_e5m2)
    torch.ops.mps_ext.copy_(e5, torch.tensor([float("inf")]))
    assert e5.view(torch.uint8).item() == 0x7C


PAIRS = [(s, d) for s in FLOATS + FP8 for d in FP8 if s != d] + [(s, d) for s in FP8 for d in FLOATS]


def _flattened(library):
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tools"))
    import embed_shaders
    return embed_shaders.source(library)


def test_every_conversion_kernel_runs_dense_and_strided():
    seen = set()
    g = torch.Generator().manual_seed(1)
    for src_dtype, dst_dtype in PAIRS:
        base = (torch.randn(6, 10, generator=g) * 50).to(src_dtype)
        for src, dst in [
            (base, torch.empty(6, 10, dtype=dst_dtype)),                       # dense
            (base.t(), torch.empty(10, 6, dtype=dst_dtype)),                   # transposed source
            (base[:, ::3], torch.empty(4, 6, dtype=dst_dtype).t()),             # both strided
            (base[:1].expand(5, 10), torch.empty(5, 10, dtype=dst_dtype)),      # broadcast source
        ]:
            with cpu_metal.record() as rec:
                torch.ops.mps_ext.copy_(dst, src)
            want = torch.empty_like(dst).copy_(src)
            assert torch.equal(bits(dst), bits(want)), (src_dtype, dst_dtype, src.stride())
            seen.update(d.kernel for d in rec.dispatches)
    lib = cpu_metal.compile_library(_flattened("fp8"), filename="fp8.metal")
    assert set(lib.function_names) <= seen, sorted(set(lib.function_names) - seen)


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS)
def test_transposing_copies_by_tiles(src_dtype, dst_dtype):
    # Sources contiguous along the first dimension, destinations along the
    # second: fp8_convert_strided's tiles (32 x 32), whole and partial,
    # strided rows on both sides and a broadcast column.
    g = torch.Generator().manual_seed(2)
    base = (torch.randn(70, 100, generator=g) * 50).to(src_dtype)
    cases = [(base.t(), torch.empty(100, 70, dtype=dst_dtype), 4 * 3),                  # partial edge tiles
             (base[::2, :64].t(), torch.empty(64, 96, dtype=dst_dtype)[:, 16:51], 2 * 2),  # strided rows
             (base[:1].t().expand(100, 33), torch.empty(100, 33, dtype=dst_dtype), 4 * 2)]  # broadcast along dim 1
    for src, dst, tiles in cases:
        with cpu_metal.record() as rec:
            torch.ops.mps_ext.copy_(dst, src)
        (d,) = rec.dispatches
        assert d.kernel.startswith("fp8_convert_strided_") and d.total_threadgroups == tiles
        want = torch.empty_like(dst).copy_(src)
        assert torch.equal(bits(dst), bits(want)), (src_dtype, dst_dtype, src.stride(), dst.stride())


def test_copy_to_and_from_other_dtypes_goes_through_float32(device):
    if device != "executor":
        pytest.skip("the same code on MPS runs through the mps overrides")
    x = torch.tensor([1.0, -3.5, 1000.0, 0.1], dtype=torch.float64)
    for fmt in FP8:
        out = torch.empty(4, dtype=fmt)
        torch.ops.mps_ext.copy_(out, x)
        assert torch.equal(out.view(torch.uint8), x.to(fmt).view(torch.uint8))
        ints = torch.empty(4, dtype=torch.int32)
        torch.ops.mps_ext.copy_(ints, out)
        assert torch.equal(ints, out.to(torch.int32))


def test_copy_between_overlapping_views_gives_torchs_error():
    base = torch.randn(40).to(torch.float8_e4m3fn)
    for src in (base[:-1], base.view(torch.float8_e5m2)[:-1]):
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            base[1:].copy_(src)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            torch.ops.mps_ext.copy_(base[1:], src)


def test_copy_into_an_expanded_destination_gives_torchs_error():
    # Elements of the destination that share memory would be written by
    # several threads at once; torch refuses on every device, before
    # broadcasting the source.
    msg = "more than one element of the written-to tensor refers to a single memory location"
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    for dst, src in [(torch.empty(1, dtype=e4).expand(3), torch.randn(3)),       # a conversion
                     (torch.empty(2, 1, dtype=e5).expand(2, 4), torch.randn(2, 4).to(e5)),  # bytes
                     (torch.empty(1, dtype=e4).expand(3), torch.randn(3).to(e5)),  # between formats
                     (torch.empty(1, dtype=torch.int32).expand(3), torch.randn(3).to(e4)),  # through float32
                     (torch.empty(1, dtype=e4).expand(3), torch.randn(2))]:       # and before the broadcast
        with pytest.raises(RuntimeError, match=msg):
            dst.copy_(src)
        mps_ext.reset_stats()
        with pytest.raises(RuntimeError, match=msg):
            torch.ops.mps_ext.copy_(dst, src)
        assert mps_ext.stats()["fp8"]["ran"] == 0


def test_large_offsets_use_64_bit_indexing():
    # The destination's last element sits 2^31 + 8 bytes in: 32-bit offsets would wrap.
    storage = torch.zeros(2**31 + 16, dtype=torch.uint8)
    dst = storage.view(torch.float8_e4m3fn).as_strided((3,), (2**30 + 4,))
    src = torch.tensor([1.0, 2.0, -448.0])
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.copy_(dst, src)
    assert rec.dispatches[0].kernel == "fp8_convert_strided_f32_e4m3"
    assert dst.float().tolist() == [1.0, 2.0, -448.0]


def other_dtype_calls():
    """Calls of each fp8-family op with no float8 tensor: (op, args, aten's result)."""
    a, b = torch.empty(3), torch.randn(3).double()
    x, idx = torch.randn(4, 5), torch.tensor([2, 0])
    return [
        (torch.ops.mps_ext.copy_, (a, b), b.float()),
        (torch.ops.mps_ext.fill_.Scalar, (torch.empty(4, dtype=torch.int64), 7), torch.full((4,), 7)),
        (torch.ops.mps_ext.fill_.Tensor, (torch.empty(2, 2), torch.tensor(2.5)), torch.full((2, 2), 2.5)),
        (torch.ops.mps_ext.zero_, (torch.ones(3, dtype=torch.bfloat16),), torch.zeros(3, dtype=torch.bfloat16)),
        (torch.ops.mps_ext.cat, ([x, x.half()], 0), torch.cat([x, x.half()], 0)),
        (torch.ops.mps_ext.index_select, (x, 1, idx), x.index_select(1, idx)),
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_other_dtypes_pass_through_uncounted(enabled):
    # The fp8 family overrides these ops for every dtype (on MPS: every
    # float32 .to("mps") is a copy_): the others go to torch's kernel and are
    # neither runs nor fallbacks, whatever the family's switch says.
    mps_ext.reset_stats()
    torch.ops.mps_ext.copy_(torch.empty(2, dtype=torch.float8_e5m2), torch.ones(2))  # one counted call
    before = mps_ext.stats()["fp8"]
    assert before["ran"] == 1
    with mps_ext.disabled() if not enabled else contextlib.nullcontext():
        for op, args, want in other_dtype_calls():
            assert torch.equal(op(*args), want), op
    assert mps_ext.stats()["fp8"] == before


@pytest.mark.parametrize("fmt", FP8)
def test_fill_zero_cat_index_select(fmt):
    mps_ext.reset_stats()
    t = torch.randn(4, 6).to(fmt)
    for value in [1.5, -400.0, -1000.0, 1e6, 3, float("nan"), 2**-12]:
        try:
            want = t.clone().fill_(value)
        except RuntimeError as e:  # torch's overflow check: the same error
            with pytest.raises(RuntimeError, match=str(e)[:40]):
                torch.ops.mps_ext.fill_(t.clone(), value)
            continue
        got = torch.ops.mps_ext.fill_(t.clone(), value)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    got = torch.ops.mps_ext.fill_(t.clone()[:, ::2], torch.tensor(0.3))
    assert torch.equal(got.view(torch.uint8), torch.full((4, 3), 0.3).to(fmt).view(torch.uint8))
    with pytest.raises(RuntimeError, match="fill_ only supports 0-dimension value tensor"):
        torch.ops.mps_ext.fill_(t.clone(), torch.ones(2))
    z = torch.ops.mps_ext.zero_(t.clone().t())
    assert not z.view(torch.uint8).any()
    u = torch.randn(2, 6).to(fmt)
    got = torch.ops.mps_ext.cat([t, u], 0)
    assert got.dtype == fmt and torch.equal(got.view(torch.uint8), torch.cat([t, u]).view(torch.uint8))
    with pytest.raises(RuntimeError, match="Promotion for Float8 Types is not supported"):
        torch.ops.mps_ext.cat([t, torch.randn(1, 6)], 0)  # as torch.cat
    idx = torch.tensor([3, 0, 3])
    got = torch.ops.mps_ext.index_select(t, 1, idx)
    assert torch.equal(got.view(torch.uint8), torch.index_select(t, 1, idx).view(torch.uint8))
    assert mps_ext.stats()["fp8"]["ran"] >= 9


def test_cat_of_two_fp8_formats_gives_torchs_error():
    a, b = torch.zeros(2).to(torch.float8_e4m3fn), torch.zeros(2).to(torch.float8_e5m2)
    with pytest.raises(RuntimeError) as ours:
        torch.ops.mps_ext.cat([a, b])
    with pytest.raises(RuntimeError) as theirs:
        torch.cat([a, b])
    assert str(theirs.value).split("\n")[0] in str(ours.value)


def test_torch_2_15_keeps_e5m2_only(cpu_policy):
    # The policy of a torch with float8_e4m3fn kernels of its own (applied to
    # the CPU key here; mps_ext applies it to MPS on torch 2.15).
    mps_ext._leave_to_torch("fp8", _policy.left_to_torch("fp8", "2.15.0"), "CPU")
    e4, e5 = torch.randn(4, 3).to(torch.float8_e4m3fn), torch.randn(4, 3).to(torch.float8_e5m2)
    torch.ops.mps_ext.copy_(torch.empty(3, dtype=torch.float8_e4m3fn), torch.randn(3))  # torch's
    torch.ops.mps_ext.zero_(e4.clone())                                                  # torch's
    torch.ops.mps_ext.index_select(e4, 0, torch.tensor([1]))                             # torch's
    torch.ops.mps_ext.cat([e4, e4])                                                       # torch's
    torch.ops.mps_ext.copy_(torch.empty(3, dtype=torch.float8_e5m2), torch.randn(3))     # ours
    got = torch.ops.mps_ext.copy_(torch.empty(4, 3, dtype=torch.float8_e5m2), e4)      # ours: e5m2 on one side
    assert torch.equal(got.view(torch.uint8), e4.to(torch.float8_e5m2).view(torch.uint8))
    torch.ops.mps_ext.cat([e5, e5])                                                       # ours
    assert mps_ext.stats()["fp8"] == {
        "ran": 3, "fallbacks": {"policy: torch 2.15 has float8_e4m3fn tensors on MPS": 4}, "unavailable": {}}


@pytest.mark.mac
def test_mps_flows():
    if not mps_ext.is_available():
        pytest.skip("needs an Apple GPU")
    x = torch.randn(8, 33)
    for fmt in FP8:
        c = x.to(fmt)
        m = c.to("mps")
        assert torch.equal(m.cpu().view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(x.to("mps").to(fmt).cpu().view(torch.uint8), c.view(torch.uint8))
        assert torch.equal(m.float().cpu(), c.float())
        assert torch.equal(m.t().contiguous().cpu().view(torch.uint8), c.t().contiguous().view(torch.uint8))
        assert torch.equal(torch.cat([m, m]).cpu().view(torch.uint8), torch.cat([c, c]).view(torch.uint8))
        assert torch.equal(m.index_select(0, torch.tensor([2, 1], device="mps")).cpu().view(torch.uint8),
                           c.index_select(0, torch.tensor([2, 1])).view(torch.uint8))
        assert not torch.zeros(3, dtype=fmt, device="mps").cpu().view(torch.uint8).any()
        assert "device='mps:0'" in repr(m)


@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float8_e4m3fn, torch.float32),
                                                 (torch.bfloat16, torch.float8_e5m2),
                                                 (torch.float8_e5m2, torch.float8_e4m3fn)])
def test_dense_conversion_moves_four_elements_a_lane(src_dtype, dst_dtype):
    # 1002 elements: 250 lanes convert 4 each with one load and one store,
    # the last lane's 2 go one by one.
    x = (torch.randn(1002, generator=torch.Generator().manual_seed(3)) * 50).to(src_dtype)
    y = torch.empty(1002, dtype=dst_dtype)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.copy_(y, x)
    (d,) = rec.dispatches
    assert d.kernel.startswith("fp8_convert_dense_")
    assert torch.equal(bits(y), bits(x.to(dst_dtype)))
    s, o = x.element_size(), y.element_size()
    assert d.read_widths[d.buffer("src")] == {4 * s: 250, s: 2}
    assert d.write_widths[d.buffer("dst")] == {4 * o: 250, o: 2}


def test_a_view_off_the_vector_alignment_takes_the_strided_kernel():
    base = (torch.randn(65, generator=torch.Generator().manual_seed(4)) * 50).to(torch.float8_e4m3fn)
    x, y = base[1:], torch.empty(64, dtype=torch.float32)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.copy_(y, x)
    (d,) = rec.dispatches
    assert d.kernel.startswith("fp8_convert_strided_")
    assert torch.equal(bits(y), bits(x.to(torch.float32)))
