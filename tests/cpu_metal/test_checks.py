"""Every check of the executor, each shown failing on a kernel with that bug."""

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal
from tests.cpu_metal.conftest import KERNELS


def line_of(fragment: str, file: str = "checks.metal") -> int:
    for i, line in enumerate((KERNELS / file).read_text().splitlines(), 1):
        if fragment in line:
            return i
    raise AssertionError(fragment)


def test_off_by_one_read_names_kernel_buffer_and_offset(kernels):
    n = 16
    x, out = torch.zeros(n), torch.zeros(n)
    with pytest.raises(cpu_metal.OutOfBoundsError) as e:
        kernels("checks").dispatch("off_by_one", [out, x, np.uint32(n)], threads=n + 1, threads_per_threadgroup=32)
    msg = str(e.value)
    assert "kernel 'off_by_one'" in msg
    assert "read of 4 bytes at byte offset 64 of buffer 1 ('in', 64 bytes bound)" in msg
    assert f"checks.metal:{line_of('out[i % n] = in[i];')}:" in msg
    assert isinstance(e.value, cpu_metal.KernelError)


def test_out_of_bounds_is_caught_even_when_another_buffer_follows(kernels):
    # Two views of one storage: reading past the first lands in memory that
    # is bound as the second argument, but not as this one.
    storage = torch.zeros(64)
    inp, out = storage[:16], storage[32:48]
    with pytest.raises(cpu_metal.OutOfBoundsError, match="buffer 1"):
        kernels("checks").dispatch("off_by_one", [out, inp[:16].clone(), np.uint32(16)], threads=17,
                                   threads_per_threadgroup=32)


def test_nothing_is_written_back_when_a_kernel_fails(kernels):
    x, out = torch.ones(16), torch.full((16,), 7.0)
    with pytest.raises(cpu_metal.OutOfBoundsError):
        kernels("checks").dispatch("off_by_one", [out, x, np.uint32(16)], threads=17, threads_per_threadgroup=32)
    assert torch.equal(out, torch.full((16,), 7.0))


def test_divergent_barrier(kernels):
    out = torch.zeros(64)
    with pytest.raises(cpu_metal.BarrierDivergenceError) as e:
        kernels("checks").dispatch("divergent_barrier", [out, np.uint32(40)], threads=64, threads_per_threadgroup=64)
    msg = str(e.value)
    assert "threadgroup_barrier" in msg and "had returned" in msg
    assert f"at checks.metal:{line_of('if (i >= n) return;') + 2}:" in msg  # the barrier's line
    # with every thread in range it runs
    kernels("checks").dispatch("divergent_barrier", [out, np.uint32(64)], threads=64, threads_per_threadgroup=64)
    assert out.tolist() == [float(63 - i) for i in range(64)]


def test_missing_barrier_is_a_race(kernels):
    x = torch.arange(128, dtype=torch.float32)
    out = torch.zeros(128)
    kernels("checks").dispatch("reverse_with_barrier", [out, x], threadgroups=2, threads_per_threadgroup=64)
    assert torch.equal(out, x.view(2, 64).flip(1).reshape(-1))
    with pytest.raises(cpu_metal.RaceError) as e:
        kernels("checks").dispatch("reverse_missing_barrier", [out, x], threadgroups=2, threads_per_threadgroup=64)
    assert "threadgroup variable 't'" in str(e.value)
    assert "reverse_missing_barrier" in str(e.value)


def test_write_write_race(kernels):
    with pytest.raises(cpu_metal.RaceError, match="wrote byte 0 of threadgroup variable 'slot'"):
        kernels("checks").dispatch("write_race", [torch.zeros(32)], threadgroups=1, threads_per_threadgroup=32)


def test_barrier_without_threadgroup_memory_flag_does_not_order_memory(kernels):
    with pytest.raises(cpu_metal.RaceError):
        kernels("checks").dispatch("barrier_without_memory_flag", [torch.zeros(32)], threadgroups=1,
                                   threads_per_threadgroup=32)


def test_simdgroup_barrier_orders_lanes_of_one_simdgroup(kernels):
    out = torch.zeros(64)
    kernels("checks").dispatch("simdgroup_exchange", [out], threadgroups=1, threads_per_threadgroup=64)
    expected = [float(sg * 32 + 31 - lane) for sg in range(2) for lane in range(32)]
    assert out.tolist() == expected


def test_divergent_simdgroup_barrier(kernels):
    with pytest.raises(cpu_metal.BarrierDivergenceError, match="simdgroup_barrier .* 16 of the 32 threads"):
        kernels("checks").dispatch("divergent_simdgroup_barrier", [torch.zeros(32)], threadgroups=1,
                                   threads_per_threadgroup=32)


def test_misaligned_vector_load(kernels):
    with pytest.raises(cpu_metal.MisalignedAccessError, match="16-byte alignment"):
        kernels("checks").dispatch("misaligned_vector", [torch.zeros(4), torch.zeros(32)], threads=4,
                                   threads_per_threadgroup=4)


def test_misalignment_of_the_binding_is_kept(kernels):
    # A view starting one float in: a float4 kernel on it is misaligned, as
    # it would be with that buffer offset on a Mac.
    lib = cpu_metal.compile_library(
        "#include <metal_stdlib>\nusing namespace metal;\n"
        "kernel void k(device float* out [[buffer(0)]], const device float4* in [[buffer(1)]],"
        " uint i [[thread_position_in_grid]]) { float4 v = in[i]; out[i] = v.x + v.y + v.z + v.w; }",
        filename="align.metal")
    base = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(4)
    lib.dispatch("k", [out, base[4:]], threads=4, threads_per_threadgroup=4)
    assert out.tolist() == [22.0, 38.0, 54.0, 70.0]
    with pytest.raises(cpu_metal.MisalignedAccessError):
        lib.dispatch("k", [out, base[1:]], threads=4, threads_per_threadgroup=4)


def test_threadgroup_overflow_into_the_next_array(kernels):
    with pytest.raises(cpu_metal.OutOfBoundsError, match="threadgroup memory next to threadgroup variable 'a'"):
        kernels("checks").dispatch("threadgroup_overflow", [torch.zeros(32)], threadgroups=1,
                                   threads_per_threadgroup=32)


def test_more_than_32k_of_threadgroup_memory(kernels):
    with pytest.raises(cpu_metal.KernelError, match="32 KiB"):
        kernels("checks").dispatch("too_much_threadgroup_memory", [torch.zeros(32)], threadgroups=1,
                                   threads_per_threadgroup=32)


def test_integer_division_by_zero_is_an_error_not_a_crash(kernels):
    # Metal gives an unspecified value; the CPU would trap. More cases in
    # test_undefined.py.
    d = torch.tensor([1, 2, 0, 4, 5], dtype=torch.int32)
    out = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(cpu_metal.KernelError, match=rf"divides a 32-bit signed integer by zero at checks.metal:"
                                                    rf"{line_of('out[i] = 100 / in[i];')}:.*thread 2 "):
        kernels("checks").dispatch("divide", [out, d], threads=5, threads_per_threadgroup=5)
    d[2] = 3
    kernels("checks").dispatch("divide", [out, d], threads=5, threads_per_threadgroup=5)
    assert out.tolist() == [100, 50, 33, 25, 20]


# ------------------------------------------------------------ arguments --
def test_writable_buffer_bound_from_bytes(kernels):
    with pytest.raises(cpu_metal.DispatchError, match="'out' .* writable device buffer; bind a tensor"):
        kernels("checks").dispatch("write_constant", [np.float32(0)], threads=1, threads_per_threadgroup=1)


def test_wrong_number_of_arguments(kernels):
    with pytest.raises(cpu_metal.DispatchError, match=r"takes 3 buffer arguments .* 2 given"):
        kernels("checks").dispatch("off_by_one", [torch.zeros(4), torch.zeros(4)], threads=4,
                                   threads_per_threadgroup=4)


def test_struct_size_mismatch_names_the_parameter(kernels):
    with pytest.raises(cpu_metal.DispatchError, match=r"'n' .*4-byte struct, but 8 bytes"):
        kernels("checks").dispatch("off_by_one", [torch.zeros(4), torch.zeros(4), np.uint64(4)], threads=4,
                                   threads_per_threadgroup=4)


def test_python_scalar_has_no_size(kernels):
    with pytest.raises(TypeError, match=r"argument 2 \('n'\) is a Python int.*np.uint32\(4\)"):
        kernels("checks").dispatch("off_by_one", [torch.zeros(4), torch.zeros(4), 4], threads=4,
                                   threads_per_threadgroup=4)


def test_tensor_not_on_the_cpu(kernels):
    with pytest.raises(TypeError, match="tensor on meta"):
        kernels("checks").dispatch("off_by_one", [torch.zeros(4, device="meta"), torch.zeros(4), np.uint32(4)],
                                   threads=4, threads_per_threadgroup=4)


@pytest.mark.parametrize("tpt,msg", [((1025,), "1 to 1024"), ((32, 32, 2), "1 to 1024"), ((0,), "1 to 1024")])
def test_threadgroup_size_limits(kernels, tpt, msg):
    with pytest.raises(cpu_metal.DispatchError, match=msg):
        kernels("checks").dispatch("write_constant", [torch.zeros(4)], threads=4, threads_per_threadgroup=tpt)


def test_threadgroup_memory_sizes(kernels):
    lib = kernels("reduce")
    args = [torch.zeros(1), torch.zeros(32), np.uint32(32)]
    with pytest.raises(cpu_metal.DispatchError, match="multiple of 16"):
        lib.dispatch("block_sum", args, threadgroups=1, threads_per_threadgroup=32, threadgroup_memory=[100])
    with pytest.raises(cpu_metal.DispatchError, match="32768"):
        lib.dispatch("block_sum", args, threadgroups=1, threads_per_threadgroup=32, threadgroup_memory=[40000])
    with pytest.raises(cpu_metal.DispatchError, match="threadgroup_memory gives 0 sizes"):
        lib.dispatch("block_sum", args, threadgroups=1, threads_per_threadgroup=32)


def test_unknown_kernel_lists_the_known_ones(kernels):
    with pytest.raises(cpu_metal.DispatchError, match="no kernel named 'nope'.*tree_max"):
        kernels("reduce").dispatch("nope", [], threadgroups=1)


def test_grid_must_be_given_once(kernels):
    with pytest.raises(ValueError, match="exactly one"):
        kernels("reduce").dispatch("tree_max", [], threadgroups=1, threads=1)


def test_in_place_mode_runs_and_still_catches_an_overrun(kernels):
    # isolate=False runs on the caller's memory (for buffers too large to copy);
    # bounds are then checked near each buffer.
    x = torch.arange(128, dtype=torch.float32)
    out = torch.zeros(128)
    kernels("checks").dispatch("reverse_with_barrier", [out, x], threadgroups=2, threads_per_threadgroup=64,
                               isolate=False)
    assert torch.equal(out, x.view(2, 64).flip(1).reshape(-1))
    with pytest.raises(cpu_metal.OutOfBoundsError, match="byte offset 64 of buffer 1"):
        kernels("checks").dispatch("off_by_one", [torch.zeros(16), torch.zeros(16), np.uint32(16)], threads=17,
                                   threads_per_threadgroup=32, isolate=False)
