"""What Metal leaves undefined or unspecified, flagged by the executor (or,
where the specification defines it unlike C++, computed as Metal does):
each planted bug next to the correct code (kernels/undefined.metal)."""

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal
from tests.cpu_metal.conftest import KERNELS
from tests.cpu_metal.test_checks import line_of

FILE = "undefined.metal"


def lib(kernels):
    return kernels("undefined")


# ------------------------------------------------ device memory races --
def run_neighbour(kernels, mode, groups=2, n=64):
    a, out = torch.zeros(groups * n), torch.zeros(groups * n)
    lib(kernels).dispatch("neighbour", [a, out, np.uint32(mode)], threadgroups=groups, threads_per_threadgroup=n)
    return out


def test_device_write_read_by_another_thread_without_barrier_is_a_race(kernels):
    with pytest.raises(cpu_metal.RaceError) as e:
        run_neighbour(kernels, 0)
    msg = str(e.value)
    assert "data race on device memory in kernel 'neighbour'" in msg
    assert "of buffer 0 ('a')" in msg
    # whichever of the two ran second is named: the write or the read
    site = [f"{FILE}:{line_of(f, FILE)}:" for f in ("mine[i] = float(g * n + i)", "out[g * n + i] = mine[")]
    assert any(s in msg for s in site), msg
    assert "with no threadgroup_barrier(mem_flags::mem_device) between them" in msg


def test_threadgroup_barrier_without_mem_device_does_not_order_device_memory(kernels):
    with pytest.raises(cpu_metal.RaceError) as e:
        run_neighbour(kernels, 1)
    msg = str(e.value)
    assert f"{FILE}:{line_of('out[g * n + i] = mine[', FILE)}:" in msg
    assert "after a threadgroup_barrier without mem_flags::mem_device" in msg


def test_device_barrier_orders_the_threads_of_a_threadgroup(kernels):
    groups, n = 2, 64
    out = run_neighbour(kernels, 2, groups, n)
    written = np.arange(groups * n, dtype=np.float32) * 2
    expected = written.reshape(groups, n)[:, (np.arange(n) + 1) % n].reshape(-1)
    np.testing.assert_array_equal(out.numpy(), expected)


def test_read_modify_write_of_one_address_is_a_race(kernels):
    with pytest.raises(cpu_metal.RaceError, match=rf"shared_sum'.* byte [0-3] of buffer 0 \('sum'\).*{FILE}:"
                                                  rf"{line_of('sum[0] += x[i];', FILE)}:"):
        lib(kernels).dispatch("shared_sum", [torch.zeros(1), torch.ones(32)], threads=32, threads_per_threadgroup=32)


def test_reduction_after_a_device_barrier_runs(kernels):
    x = torch.arange(32, dtype=torch.float32)
    partial, s = torch.zeros(32), torch.zeros(1)
    lib(kernels).dispatch("shared_sum_after_barrier", [partial, s, x], threads=32, threads_per_threadgroup=32)
    assert s.item() == float((x.double() ** 2).sum())


def test_simdgroup_barrier_with_mem_device_orders_a_simdgroup(kernels):
    a, out = torch.zeros(32), torch.zeros(32)
    with pytest.raises(cpu_metal.RaceError, match="device memory in kernel 'simd_exchange'"):
        lib(kernels).dispatch("simd_exchange", [a, out, np.uint32(0)], threads=32, threads_per_threadgroup=32)
    lib(kernels).dispatch("simd_exchange", [a, out, np.uint32(1)], threads=32, threads_per_threadgroup=32)
    assert out.tolist() == [float(31 - i) for i in range(32)]


def test_read_only_inputs_and_other_threadgroups_are_not_this_check(kernels):
    # Reading one input element from every thread is no race, and neither are
    # two threadgroups writing their own halves.
    x = torch.ones(64)
    partial, s = torch.zeros(64), torch.zeros(1)
    lib(kernels).dispatch("shared_sum_after_barrier", [partial, s, x], threads=32, threads_per_threadgroup=32)
    assert s.item() == 32.0


# ---------------------------------------------------- integer division --
def ints(*v):
    return torch.tensor(v, dtype=torch.int32)


@pytest.mark.parametrize(
    "kernel,a,b,what",
    [
        ("quotients", ints(7, 9, 5), ints(2, 0, 1), "divides a 32-bit signed integer by zero"),
        ("quotients", ints(7, -(2**31), 5), ints(2, -1, 1), "divides the smallest 32-bit signed integer by -1"),
        ("remainders", ints(7, 9, 5), ints(2, 0, 1), "divides a 32-bit signed integer by zero"),
        (
            "remainders",
            ints(7, -9, 5),
            ints(2, 4, 1),
            "takes the remainder (%) of a negative 32-bit signed integer or by a negative one",
        ),
        (
            "remainders",
            ints(7, 9, 5),
            ints(2, -4, 1),
            "takes the remainder (%) of a negative 32-bit signed integer or by a negative one",
        ),
        ("unsigned_quotients", ints(7, 9, 5), ints(2, 0, 1), "divides a 32-bit unsigned integer by zero"),
    ],
)
def test_undefined_integer_division_names_the_line(kernels, kernel, a, b, what):
    with pytest.raises(cpu_metal.KernelError) as e:
        lib(kernels).dispatch(kernel, [torch.zeros(3, dtype=torch.int32), a, b], threads=3, threads_per_threadgroup=3)
    msg = str(e.value)
    assert f"kernel '{kernel}' {what}" in msg
    fragment = "q[i] = a[i] / b[i];" if "quotients" in kernel else "r[i] = a[i] % b[i];"
    assert f"at {FILE}:{line_in(kernel, fragment)}:" in msg
    assert "thread 1 " in msg


def line_in(kernel: str, fragment: str) -> int:
    """The line of `fragment` in kernel `kernel` of undefined.metal."""
    start = line_of(f"kernel void {kernel}(", FILE)
    lines = (KERNELS / FILE).read_text().splitlines()
    return next(i for i in range(start, len(lines) + 1) if fragment in lines[i - 1])


def test_vector_division_by_zero_in_one_element(kernels):
    a, b = ints(7, 8, 9, 10), ints(2, 3, 0, 5)
    with pytest.raises(cpu_metal.KernelError, match="divides a 32-bit signed integer by zero"):
        lib(kernels).dispatch("vector_quotients", [torch.zeros(4, dtype=torch.int32), a, b], threads=2,
                              threads_per_threadgroup=2)


def test_defined_divisions_give_truncated_quotients(kernels):
    a, b = ints(7, -7, 7, -7, 2 ** 31 - 1, -2 ** 31), ints(2, 2, -2, -2, 3, 2)
    q = torch.zeros(6, dtype=torch.int32)
    lib(kernels).dispatch("quotients", [q, a, b], threads=6, threads_per_threadgroup=6)
    assert torch.equal(q, torch.div(a, b, rounding_mode="trunc"))
    a, b = ints(7, 0, 13, 2 ** 31 - 1), ints(2, 5, 13, 10)
    r = torch.zeros(4, dtype=torch.int32)
    lib(kernels).dispatch("remainders", [r, a, b], threads=4, threads_per_threadgroup=4)
    assert torch.equal(r, torch.remainder(a, b))
    q2 = torch.zeros(4, dtype=torch.int32)
    lib(kernels).dispatch("vector_quotients", [q2, ints(7, -8, 9, 10), ints(2, 3, -4, 5)], threads=2,
                          threads_per_threadgroup=2)
    assert q2.tolist() == [3, -2, -2, 2]


# ---------------------------------------------------------------- shifts --
def test_shifts_use_the_low_bits_of_the_amount_as_metal_defines(kernels):
    # MSL specification 3.1: E1 << E2 shifts by the log2(N) least significant
    # bits of E2 viewed as unsigned; N is E1's width (its element's, for a
    # vector). C++ leaves these undefined.
    x = np.array([0x80000001, 0x12345678, 0xF0F0F0F0, 0x00000003, 0x7FFFFFFF, 0xFFFFFFFF], dtype=np.uint32)
    s = np.array([0, 31, 32, 33, -1, 40], dtype=np.int32)
    n = len(x)
    left, right = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
    narrow = torch.zeros(2 * n, dtype=torch.int16)
    lib(kernels).dispatch("shifts", [left, right, narrow, torch.from_numpy(x.view(np.int32)), torch.from_numpy(s)],
                          threads=n, threads_per_threadgroup=n)
    amount32 = s.view(np.uint32) & 31
    np.testing.assert_array_equal(left.numpy().view(np.uint32), (x.astype(np.uint64) << amount32) & 0xFFFFFFFF)
    np.testing.assert_array_equal(right.numpy(), x.view(np.int32) >> amount32.astype(np.int32))
    amount16 = s.astype(np.uint16) & 15
    expected16 = ((x.astype(np.uint16).astype(np.uint32) << amount16) & 0xFFFF).astype(np.uint16)
    np.testing.assert_array_equal(narrow.numpy().view(np.uint16), np.repeat(expected16, 2))


# ---------------------------------------------------------------- bfloat --
def to_bfloat(kernels, x):
    n = len(x)
    b, b4 = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(4 * n, dtype=torch.bfloat16)
    lib(kernels).dispatch("to_bfloat", [b, b4, torch.from_numpy(x)], threads=n, threads_per_threadgroup=n)
    return b, b4


DENORMALS = np.array([1e-39, -1e-39, 2.0 ** -133, -1.1e-38], dtype=np.float32)
NORMALS = np.array([1.17549435e-38, -3.0e-38, 1.0, 1.00390625, 1.01171875, -2.5, 3.0e38, np.inf], dtype=np.float32)


def test_float_denormals_convert_to_a_bfloat_zero_of_their_sign(kernels):
    b, b4 = to_bfloat(kernels, DENORMALS)
    assert b.float().tolist() == [0.0] * len(DENORMALS)
    assert torch.equal(torch.signbit(b), torch.from_numpy(DENORMALS < 0))
    assert b4.float().tolist() == [0.0] * (4 * len(DENORMALS))
    # torch's own conversion keeps them: the flush is the GPU's, not rounding
    assert (torch.from_numpy(DENORMALS).bfloat16() != 0).all()


def test_normal_floats_convert_to_bfloat_rounding_to_nearest_even(kernels):
    b, b4 = to_bfloat(kernels, NORMALS)
    expected = torch.from_numpy(NORMALS).bfloat16()
    assert torch.equal(b.view(torch.int16), expected.view(torch.int16))
    assert torch.equal(b4.view(torch.int16), expected.repeat_interleave(4).view(torch.int16))


def test_bfloat_denormals_are_kept_when_denormals_are_kept(kernels, monkeypatch):
    monkeypatch.setenv("MPS_EXT_EXECUTOR_DENORMALS", "keep")
    b, _ = to_bfloat(kernels, DENORMALS)
    assert torch.equal(b.view(torch.int16), torch.from_numpy(DENORMALS).bfloat16().view(torch.int16))
