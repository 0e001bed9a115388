"""constant_pad_nd against torch's CPU kernel: bit-exact, it only moves bits."""

import pytest
import torch
from host_names import host_names

import mps_ext_executor as cpu_metal

gen = torch.Generator().manual_seed(0)

ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
              torch.uint8, torch.bool, torch.complex64]


def sample(shape, dtype):
    x = torch.randn(*shape, generator=gen) * 50
    if dtype == torch.complex64:
        return torch.complex(x, -x)
    return x.to(dtype)


def check(run, x, pad, value=0):
    want = torch.constant_pad_nd(x, pad, value)
    got = run("constant_pad_nd", x, pad, value, family="pad")
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    return got


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_dtypes_and_fill_values(run, dtype):
    x = sample((3, 5), dtype)
    for value in (0, 1, 2.9, True) + ((-2.9,) if dtype != torch.uint8 else ()):
        check(run, x, [1, 2, 2, 0], value)


def test_fill_value_cast_like_torch(run):
    check(run, torch.tensor([1, 2], dtype=torch.uint8), [1, 1], -1)  # wraps to 255, as torch
    check(run, torch.tensor([1.0], dtype=torch.float16), [2, 2], 1.00048828125)  # rounds to 1.0
    check(run, torch.tensor([1.0], dtype=torch.bfloat16), [1, 0], 3.14159)
    check(run, torch.tensor([1], dtype=torch.int64), [1, 0], 2**62 + 1)
    check(run, torch.tensor([1 + 1j], dtype=torch.complex64), [1, 0], 2 - 3j)


@pytest.mark.parametrize("dtype,value", [(torch.uint8, 300.7), (torch.float16, 1e6), (torch.int8, float("nan"))])
def test_fill_value_overflow_is_torchs_error(run, dtype, value):
    with pytest.raises(RuntimeError, match="value cannot be converted to type .* without overflow"):
        run("constant_pad_nd", torch.zeros(2, dtype=dtype), [1, 1], value, family="pad")


@pytest.mark.parametrize("shape,pad", [
    ((7,), [3, 1]),
    ((4, 6), [1, 1, 2, 2]),
    ((2, 3, 4), [0, 0, 1, 0, 2, 5]),
    ((2, 3, 4, 5), [1, 2]),
    ((1, 2, 3, 4, 5), [1, 1, 1, 1, 1, 1]),
    ((1, 1, 1, 1, 1, 1, 2, 3), [1, 1, 0, 2]),
])
def test_ranks(run, shape, pad):
    check(run, sample(shape, torch.float32), pad, 0.5)


@pytest.mark.parametrize("pad", [[-1, -1], [-2, 3], [1, -4, -1, 2], [-1, 0, 0, -2], [-5, 5], [-5, 0]])
def test_negative_pads_crop(run, pad):
    check(run, sample((4, 5), torch.float32), pad, 9)


def test_crop_only_gives_a_copy_not_a_view(run):
    x = sample((4, 5), torch.float32)
    out = check(run, x, [-1, -1, 0, -2])
    out.fill_(0)
    assert not torch.equal(x, torch.zeros_like(x))


def test_empty_pad_copies(run):
    x = sample((3, 2), torch.int32)
    out = check(run, x, [])
    assert out.data_ptr() != x.data_ptr()


def test_zero_size(run):
    check(run, sample((0, 3), torch.float32), [1, 1])
    check(run, sample((2, 3), torch.float32), [-3, 0, 1, 0])  # a 3 x 0 result
    check(run, sample((0,), torch.float32), [2, 3])


def test_scalar_input(run):
    check(run, torch.tensor(5.0), [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])
def test_strided_and_offset_inputs(run, dtype):
    base = sample((6, 7, 8), dtype)
    for v in (base.transpose(0, 2), base[1:, ::2, 3:], base.reshape(-1)[3:3 + 35].view(5, 7), base[:, 2]):
        check(run, v, [1, 2, 0, 1], 7)


def test_keeps_channels_last(run):
    x = sample((2, 3, 4, 5), torch.float32).contiguous(memory_format=torch.channels_last)
    out = check(run, x, [1, 1, 2, 2])
    assert out.is_contiguous(memory_format=torch.channels_last)
    y = sample((2, 3, 4, 5, 6), torch.float16).contiguous(memory_format=torch.channels_last_3d)
    out = check(run, y, [1, 1, 1, 1, 1, 1])
    assert out.is_contiguous(memory_format=torch.channels_last_3d)


def test_video_vae_shape_with_inner_extent_past_2_16(run, device):
    # MPSGraph's pad overwrote the input with the fill value once H*W reached
    # 2^16: a [N, C, T, H, W] latent of 256 x 256.
    x = sample((1, 2, 2, 256, 256), torch.float32)
    with cpu_metal.record() as rec:
        check(run, x, [1, 1, 1, 1, 1, 1], 0)
    if device == "executor":
        (d,) = rec.dispatches  # one dispatch per call
        assert d.kernel == "constant_pad_4_i32"
        out_bytes = 1 * 2 * 4 * 258 * 258 * 4
        assert d.bytes_written == {0: out_bytes}  # each output element written once
        assert d.bytes_read[1] == x.nbytes  # each input element read once


def test_one_dispatch_and_no_state_per_shape(run, device):
    with cpu_metal.record() as rec:
        for n in range(1, 6):
            check(run, sample((n, n + 1), torch.float32), [n, 1])
    if device == "executor":
        assert [d.kernel for d in rec.dispatches] == ["constant_pad_4_i32"] * 5


def test_64_bit_indexing_past_2_31_elements(run, device):
    # The input has more than 2^31 elements; cropping its tail keeps the test
    # small while every offset the kernel computes is beyond 2^31.
    if device != "executor":
        pytest.skip("2 GiB of input is a CPU-side test; the kernel is the same")
    n = 2**31 + 100
    x = torch.empty(n, dtype=torch.uint8)
    x[-100:] = torch.arange(100, dtype=torch.uint8)
    with cpu_metal.record() as rec:
        out = run("constant_pad_nd", x, [-(2**31), 3], 7, family="pad")
    assert rec.dispatches[0].kernel == "constant_pad_1_i64"
    assert torch.equal(out, torch.cat([torch.arange(100, dtype=torch.uint8), torch.full((3,), 7, dtype=torch.uint8)]))


# One dtype per element size, the kernel's only type parameter.
BY_SIZE = {1: torch.uint8, 2: torch.float16, 4: torch.float32, 8: torch.int64}


@pytest.mark.parametrize("width", [1, 3, 15, 16, 17, 63, 64, 65, 255, 256, 257, 600])
@pytest.mark.parametrize("size", sorted(BY_SIZE))
def test_rows_against_aligned_segments(run, device, size, width):
    # A simdgroup writes a 512-byte segment of a row, from a 128-byte line, with
    # vector stores, and the elements at either end of the row one at a time:
    # rows shorter, longer, and not a multiple of the 16 bytes, starting at
    # every alignment (5 rows), with the input cropped, padded and both.
    x = sample((5, width), BY_SIZE[size])
    with cpu_metal.record() as rec:
        for pad in ([1, 2, 0, 0], [3, 0, 1, 1], [0, 17, 2, 0], [-1, 5, 0, 1]):
            if width + pad[0] + pad[1] > 0:
                check(run, x, pad, 3)
    if device == "executor":
        assert {d.kernel for d in rec.dispatches} == {f"constant_pad_{size}_i32"}


@pytest.mark.parametrize("shape,pad,view", [
    ((2, 3, 4, 5, 6), [1, 1, 0, 0, 0, 0, 1, 0], "contiguous"),  # unpadded middle dims merge
    ((2, 3, 4, 5, 6), [0, 0, 2, 1], "contiguous"),              # ... and the last one into them
    ((2, 3, 4, 5, 6), [0, 0, 0, 0, 0, 0, 0, 0, 1, 1], "contiguous"),  # only the outermost padded
    ((2, 3, 4, 5, 6), [1, 0, 0, 0, 1, 0], "sliced"),            # strides that do not merge
    ((1, 1, 3, 1, 7), [2, 2], "contiguous"),                    # size-1 dimensions dropped
    ((4, 1, 6), [0, 0, 1, 1], "contiguous"),                    # a padded size-1 dimension kept
    ((3, 0, 5), [1, 1, 0, 2], "contiguous"),                    # an empty input dimension
    ((2, 2, 2, 2, 2, 2, 2, 3), [1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1], "contiguous"),  # 8 dims, none merge
])
def test_dimensions_the_host_merges(run, shape, pad, view):
    x = sample(shape, torch.float16)
    if view == "sliced":
        x = sample((2, 3, 8, 5, 6), torch.float16)[:, :, ::2]
    check(run, x, pad, -1)


@pytest.mark.parametrize("size", sorted(BY_SIZE))
def test_64_bit_variants(run, device, wide_index, size):
    # The 64-bit variants on small views (test_64_bit_indexing_past_2_31_elements
    # runs one past 2^31 elements): rows segments, crops, several dimensions.
    dtype = BY_SIZE[size]
    base = sample((3, 9, 70), dtype)
    with cpu_metal.record() as rec:
        for x, pad in [(base, [1, 2, 0, 1, 1, 0]), (base[:, ::2, 5:], [-1, 3, 2, 0]), (base.transpose(0, 2), [4, 4])]:
            check(run, x, pad, 5)
    if device == "executor":
        assert {d.kernel for d in rec.dispatches} == {f"constant_pad_{size}_i64"}


@pytest.mark.parametrize("shape,dtype,pad", [((2, 3, 40, 100), torch.float32, [1, 1, 1, 1]),
                                             ((4, 64, 64), torch.bfloat16, [0, 1, 0, 1])])
def test_what_a_gpu_pays_beyond_bytes(run, device, shape, dtype, pad):
    # Contiguous input: every load and store instruction of a simdgroup
    # touches the fewest cache lines its bytes fit in (to 10%: a 130-byte
    # row is split between simdgroups where it crosses a line), no bank
    # conflicts in the staging, no stack arrays, no 64-bit division, and
    # the output's interior stored 16 bytes at a time (a 130-byte row has
    # about 16 bytes at its ends that are not a whole aligned piece).
    x = sample(shape, dtype)
    with cpu_metal.record(counters=True) as rec:
        check(run, x, pad, 3)
    if device == "executor":
        (d,) = rec.dispatches
        assert max(d.coalescing.values()) <= 1.1, d.coalescing
        assert d.bank_conflict_cycles == 0
        assert d.kernel_info.private_bytes == 0 and d.int64_divisions == 0
        widths = d.write_widths[0]
        assert widths[16] * 16 >= 0.85 * sum(w * n for w, n in widths.items()), widths


def test_every_pad_kernel_is_tested():
    # The tests above run constant_pad_<size>_i32 (test_rows_against_aligned_segments)
    # and constant_pad_<size>_i64 (test_64_bit_variants) for
    # every element size: that is all the library has.
    assert host_names("pad") == {f"constant_pad_{s}_{w}" for s in BY_SIZE for w in ("i32", "i64")}


def test_rows_are_written_with_vector_stores(run, device):
    x = sample((3, 64, 255, 255), torch.uint8)
    with cpu_metal.record() as rec:
        check(run, x, [1, 2, 3, 4], 0)
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == "constant_pad_1_i32"
        stored = sum(w * n for w, n in d.write_widths[0].items())
        assert d.write_widths[0].get(16, 0) * 16 / stored > 0.9  # 1-byte elements, 16 at a time
        assert d.bytes_read[1] == x.nbytes


@pytest.mark.parametrize("pad,message", [
    ([1], "Length of pad must be even but instead it equals 1"),
    ([1, 1, 1, 1, 1, 1], "Length of pad should be no more than twice the number of dimensions of the input. "
                         "Pad length is 6while the input has 2dimensions."),
    ([-6, 1], r"narrow\(\): length must be non-negative."),
    ([0, -6], r"narrow\(\): length must be non-negative."),
])
def test_bad_pads_raise_torchs_errors(run, pad, message):
    x = torch.zeros(3, 5)
    with pytest.raises(RuntimeError, match=message):
        torch.constant_pad_nd(x, pad)  # torch says so itself
    with pytest.raises(RuntimeError, match=message):
        run("constant_pad_nd", x, pad, 0, family="pad")
