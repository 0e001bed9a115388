"""The executor validated against real Metal: on a Mac with an Apple GPU, run
the executor's own test kernels on both and compare.

On machines without MPS (CI) these tests are skipped: there is nothing to
compare against. Every kernel here is also run, and checked against numpy,
by the other executor tests.
"""

import numpy as np
import pytest
import torch

from tests.cpu_metal.conftest import run_through_mps_ext

pytestmark = [
    pytest.mark.mac,
    pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU to compare against"),
]

rng = np.random.default_rng(7)


def run_both(kernels, file, name, args, threads, group):
    """Run kernel `name` on the executor (CPU tensors) and on MPS, and return
    both outputs. On MPS it is built as mps_ext builds its own kernels
    (fastMathEnabled = NO, MSL 3.1), not with torch.mps.compile_shader, which
    takes no options and builds with fast math: what is validated is what
    ships."""
    cpu_args = [a.clone() for a in args]
    kernels(file).dispatch(name, cpu_args, threads=threads, threads_per_threadgroup=group)
    return cpu_args, run_through_mps_ext(file, name, [a.to("mps") for a in args], threads, group)


def test_rounding_conversions(kernels):
    x = torch.from_numpy((rng.standard_normal(1024) * 10.0 ** rng.integers(-8, 8, 1024)).astype(np.float32))
    cpu, mps = run_both(kernels, "rounding", "to_half_and_bfloat",
                        [torch.zeros(1024, dtype=torch.float16), torch.zeros(1024, dtype=torch.bfloat16), x],
                        1024, 64)
    assert torch.equal(cpu[0].view(torch.int16), mps[0].view(torch.int16))
    assert torch.equal(cpu[1].view(torch.int16), mps[1].view(torch.int16))


@pytest.mark.parametrize("name,dtype", [("mul_add_half", torch.float16), ("mul_add_bfloat", torch.bfloat16)])
def test_arithmetic_rounding(kernels, name, dtype):
    a, b, c = (torch.randn(4096).to(dtype) for _ in range(3))
    cpu, mps = run_both(kernels, "rounding", name, [torch.zeros(4096, dtype=dtype), a, b, c], 4096, 256)
    assert torch.equal(cpu[0].view(torch.int16), mps[0].view(torch.int16))


def test_scans_and_reductions(kernels):
    v = torch.from_numpy(rng.choice(np.array([1.0, 2.0, 0.5, -1.0, 3.0], dtype=np.float32), 64))
    cpu, mps = run_both(kernels, "scan", "simd_scans", [torch.zeros(256), v], 64, 64)
    assert torch.equal(cpu[0], mps[0])
    ints = torch.from_numpy(rng.integers(-1000, 1000, 64).astype(np.int32))
    cpu, mps = run_both(kernels, "reduce", "simd_reductions", [torch.zeros(14, dtype=torch.int32), ints], 64, 64)
    assert torch.equal(cpu[0], mps[0])
    x = torch.randn(768)
    cpu, mps = run_both(kernels, "reduce", "tree_max", [torch.zeros(3), x], 768, 256)
    assert torch.equal(cpu[0], mps[0])


def test_votes_and_divergence(kernels):
    v = torch.from_numpy(rng.integers(-20, 100, 64).astype(np.int32))
    cpu, mps = run_both(kernels, "shuffle", "votes", [torch.zeros(512, dtype=torch.int32), v], 64, 64)
    assert torch.equal(cpu[0], mps[0])
    cpu, mps = run_both(kernels, "shuffle", "divergent_loop", [torch.zeros(32, dtype=torch.int32)], 32, 32)
    assert torch.equal(cpu[0], mps[0])


def test_vectors(kernels):
    a = torch.from_numpy(rng.uniform(-4, 4, (8, 4)).astype(np.float32))
    p = torch.from_numpy(rng.uniform(-2, 2, (8, 3)).astype(np.float32))
    h = torch.from_numpy(rng.uniform(-2, 2, (8, 4)).astype(np.float16))
    cpu, mps = run_both(kernels, "vectors", "vector_ops", [torch.zeros(8 * 24), a, p, h], 8, 8)
    torch.testing.assert_close(cpu[0], mps[0], rtol=1e-5, atol=1e-5)


def test_simdgroup_matrix_layout(kernels):
    # thread_elements() layout and load/store offsets must match the hardware
    A = torch.from_numpy(rng.standard_normal((8, 8)).astype(np.float32))
    cpu, mps = run_both(kernels, "matrix", "transpose_load", [torch.zeros(64), A.t().contiguous().view(-1)], 32, 32)
    assert torch.equal(cpu[0], mps[0])


def test_math(kernels):
    x = torch.linspace(-8, 8, 64)
    cpu, mps = run_both(kernels, "math", "float_math", [torch.zeros(64 * 16), x], 64, 32)
    # Metal's math functions are not all correctly rounded, even without fast math
    torch.testing.assert_close(cpu[0], mps[0], rtol=1e-4, atol=1e-5)


SIMT_KERNELS = ["helper_after_divergent_if", "helpers_nested", "helper_in_both_branches", "branches_in_one_macro",
                "template_in_both_branches", "branches_inline", "loop_trip_count_continue", "loop_while_break",
                "work_until_all_done", "work_fixed_passes", "nested_loop_scan", "simd_in_for_increment"]


@pytest.mark.parametrize("name", SIMT_KERNELS)
def test_divergent_simd_operations(kernels, name):
    # which lanes take part in a simd operation in divergent code (issue 12)
    cpu, mps = run_both(kernels, "simt", name, [torch.zeros(32)], 32, 32)
    assert torch.equal(cpu[0], mps[0])


def test_bool_vectors_and_denormals(kernels):
    a = torch.from_numpy(rng.integers(-3, 4, (64, 4)).astype(np.float32))
    b = torch.from_numpy(rng.integers(-3, 4, (64, 4)).astype(np.float32))
    cpu, mps = run_both(kernels, "boolvec", "comparisons_convert_to_one",
                        [torch.zeros(64, 4, dtype=torch.int32), torch.zeros(64, 4), a, b], 64, 32)
    assert torch.equal(cpu[0], mps[0]) and torch.equal(cpu[1], mps[1])
    x = torch.tensor([1e-38, 2.35e-38, 1.4e-45, -3e-39])
    hx = torch.tensor([2 ** -14, 2 ** -22, 2 ** -23, -(2 ** -20)], dtype=torch.float16)
    cpu, mps = run_both(kernels, "numerics", "denormals",
                        [torch.zeros(8), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.float16),
                         x, hx], 4, 4)
    for c, m in zip(cpu[:3], mps[:3]):
        assert torch.equal(c.view(torch.int8), m.view(torch.int8))
