"""The executor gives the answer an Apple GPU gives (issue 12): one kernel per
finding that the executor used to get wrong, next to a GPU-valid kernel that
computes the same thing another way. Expected values come from the rules of
SIMT execution, numpy and the Metal specification, never from the executor."""

import subprocess
import sys

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal
from tests.cpu_metal.conftest import KERNELS

rng = np.random.default_rng(12)


def line_of(fragment: str, file: str) -> int:
    for i, line in enumerate((KERNELS / file).read_text().splitlines(), 1):
        if fragment in line:
            return i
    raise AssertionError(fragment)


def run32(lib, name, lanes=32):
    out = torch.zeros(lanes)
    lib.dispatch(name, [out], threadgroups=1, threads_per_threadgroup=lanes)
    return out.tolist()


# ------------------------------------------------- 1. divergent simd ops --
# A GPU runs the lanes on one control-flow path together: the sum in a
# branch or an iteration is over the lanes that are there.
def test_helper_after_a_divergent_if(kernels):
    lib = kernels("simt")
    assert run32(lib, "helper_after_divergent_if") == [8 + 3200.0] * 8 + [3200.0] * 24
    assert run32(lib, "helpers_nested") == [6400.0] * 20 + [12 + 6400.0] * 12


def test_one_helper_in_both_branches_sums_each_branch(kernels):
    lib = kernels("simt")
    expected = [8.0] * 8 + [48.0] * 24
    assert run32(lib, "helper_in_both_branches") == expected
    assert run32(lib, "branches_in_one_macro") == expected
    assert run32(lib, "branches_inline") == expected
    assert run32(lib, "template_in_both_branches") == [48.0 if l % 2 == 0 else 8.0 for l in range(32)]


def test_loops_with_per_lane_trip_counts_and_continue(kernels):
    lib = kernels("simt")
    expected = []
    for lane in range(32):
        total = 0
        for k in range(lane // 8 + 1):
            active = [l for l in range(32) if k <= l // 8 and k != l % 3]
            if lane in active:
                total += (k + 1) * len(active)
        expected.append(total + 1000.0 * 32)
    assert run32(lib, "loop_trip_count_continue") == expected
    assert run32(lib, "loop_while_break") == expected


def test_simd_operation_in_a_for_increment(kernels):
    # the increment runs after the body, with every lane of the iteration
    expected = [(0.0 if l % 2 == 0 else 3 * 16.0) + 1000.0 * 3 * 32 for l in range(32)]
    assert run32(kernels("simt"), "simd_in_for_increment") == expected


def test_work_until_every_lane_is_done(kernels):
    lib = kernels("simt")
    left = [l % 5 + 1 for l in range(32)]
    expected = [float(sum(sum(1 for m in left if m > p) for p in range(left[l]))) + 1000.0 * max(left)
                for l in range(32)]
    assert run32(lib, "work_until_all_done") == expected
    assert run32(lib, "work_fixed_passes") == expected


def test_prefix_scan_in_a_nested_uneven_loop(kernels):
    expected = []
    for lane in range(32):
        total = 0
        for i in range(2):
            for j in range((lane + i) % 4):
                active = [l for l in range(32) if j < (l + i) % 4]
                total += sum(1 for l in active if l <= lane)
        expected.append(float(total))
    assert run32(kernels("simt"), "nested_loop_scan") == expected


def test_a_barrier_in_another_iteration_is_another_barrier(kernels):
    lib = kernels("simt")
    out = torch.zeros(64)
    with pytest.raises(cpu_metal.BarrierDivergenceError) as e:
        lib.dispatch("barrier_in_other_iteration", [out], threadgroups=1, threads_per_threadgroup=64)
    msg = str(e.value)
    assert "on the same path" in msg and "iteration 2 of the loop" in msg and "iteration 1 of the loop" in msg
    lib.dispatch("barrier_in_even_loop", [out], threadgroups=1, threads_per_threadgroup=64)
    assert out.tolist() == [1.0] * 32 + [2.0] * 32


# ----------------------------------------------------- 2. bool vectors --
def test_vector_comparisons_convert_to_one(kernels):
    lib = kernels("boolvec")
    n = 64
    a = rng.integers(-3, 4, (n, 4)).astype(np.float32)
    b = rng.integers(-3, 4, (n, 4)).astype(np.float32)
    ints, floats = torch.zeros(n, 4, dtype=torch.int32), torch.zeros(n, 4)
    lib.dispatch("comparisons_convert_to_one", [ints, floats, torch.from_numpy(a), torch.from_numpy(b)], threads=n,
                 threads_per_threadgroup=32)
    np.testing.assert_array_equal(ints.numpy(), (a > b).astype(np.int32))
    np.testing.assert_array_equal(floats.numpy(), (a <= b).astype(np.float32) + (a == b).astype(np.float32))


def test_counting_with_a_comparison(kernels):
    lib = kernels("boolvec")
    n, experts = 100, 8
    ids = rng.integers(0, experts, (n, 4)).astype(np.uint32)
    expected = np.stack([(ids == e).sum(axis=0) for e in range(experts)]).astype(np.int32)
    for name in ("count_matches", "count_matches_scalar"):
        counts = torch.zeros(experts, 4, dtype=torch.int32)
        lib.dispatch(name, [counts, torch.from_numpy(ids.view(np.int32)), np.uint32(n)], threads=experts,
                     threads_per_threadgroup=experts)
        np.testing.assert_array_equal(counts.numpy(), expected, err_msg=name)


def test_bool_vectors_are_metal_bool_vectors(kernels):
    n = 32
    a = rng.integers(-2, 3, (n, 4)).astype(np.float32)
    b = rng.integers(-2, 3, (n, 4)).astype(np.float32)
    masks = torch.full((n, 4), 7, dtype=torch.uint8)
    picked, facts = torch.zeros(n, 4), torch.zeros(n * 4, dtype=torch.int32)
    kernels("boolvec").dispatch("bool_vectors", [masks, picked, facts, torch.from_numpy(a), torch.from_numpy(b)],
                                threads=n, threads_per_threadgroup=n)
    np.testing.assert_array_equal(masks.numpy(), (a > b).astype(np.uint8))  # one byte per element, 0 or 1
    np.testing.assert_array_equal(picked.numpy(), np.where(a < b, b, a))
    f = facts.numpy().reshape(n, 4)
    assert (f[:, 0] == 1).all() and (f[:, 1] == 0).all()
    assert (f[:, 2] == 244).all()  # sizeof: bool2 2, bool3 4, bool4 4
    gt, lt = a > b, a < b
    np.testing.assert_array_equal(f[:, 3], gt[:, 0] + 2 * lt[:, 1] + 4 + 8 * ~gt[:, 2] + 16 * lt[:, 3])


# ---------------------------------------- 3. errors, not crashes or hangs --
def test_simdgroup_matrix_in_a_partial_simdgroup_is_an_error(kernels):
    lib = kernels("robustness")
    a = torch.from_numpy(rng.integers(-3, 4, 64).astype(np.float32))
    out = torch.zeros(128)
    with pytest.raises(cpu_metal.KernelError) as e:
        lib.dispatch("matrix_per_simdgroup", [out, a], threadgroups=1, threads_per_threadgroup=48)
    msg = str(e.value)
    assert "kernel 'matrix_per_simdgroup'" in msg and "16 threads" in msg and "needs all 32" in msg
    assert f"robustness.metal:{line_of('simdgroup_load(A, a);', 'robustness.metal')}:" in msg
    # with whole simdgroups it computes A @ A twice
    lib.dispatch("matrix_per_simdgroup", [out, a], threadgroups=1, threads_per_threadgroup=64)
    A = a.numpy().reshape(8, 8)
    np.testing.assert_array_equal(out.numpy().reshape(2, 8, 8), np.stack([A @ A, A @ A]))


@pytest.mark.parametrize("name,call", [("transposed_origin_load", "simdgroup_load(m, a, 16, ulong2(8, 1), true);"),
                                       ("transposed_origin_store", "simdgroup_store(m, out, 16, ulong2(3, 2), true);")])
def test_a_transposed_matrix_with_a_non_zero_origin_is_an_error(kernels, name, call):
    a, out = torch.randn(256), torch.zeros(256)
    with pytest.raises(cpu_metal.KernelError) as e:
        kernels("robustness").dispatch(name, [out, a], threadgroups=1, threads_per_threadgroup=32)
    msg = str(e.value)
    assert "transpose_matrix" in msg and "origin" in msg and "offset the pointer" in msg
    assert f"robustness.metal:{line_of(call, 'robustness.metal')}:" in msg


def test_a_transposed_matrix_at_an_offset_pointer(kernels):
    a, out = torch.randn(16, 16), torch.zeros(16, 16)
    kernels("robustness").dispatch("transposed_at_pointer", [out.view(-1), a.view(-1)],
                                   threadgroups=1, threads_per_threadgroup=32)
    # Loaded transposed from row 1, column 8 and stored transposed at row 2,
    # column 3: the 8 x 8 block moves unchanged.
    expected = torch.zeros(16, 16)
    expected[2:10, 3:11] = a[1:9, 8:16]
    assert torch.equal(out, expected)


@pytest.mark.parametrize("name,n", [("private_array_1k", 1024), ("private_array_400k", 102400)])
def test_large_private_arrays_run(kernels, name, n):
    out = torch.zeros(64)
    kernels("robustness").dispatch(name, [out], threads=64, threads_per_threadgroup=64)
    k = np.arange(n)
    order = (k * 13) % n
    expected = [np.add.accumulate(((order % 7) + i).astype(np.float32))[-1] for i in range(64)]  # in float, in order
    np.testing.assert_array_equal(out.numpy(), expected)


def test_private_array_beyond_the_limit_is_an_error(kernels):
    with pytest.raises(
        cpu_metal.KernelError, match="kernel 'private_array_80m' needs about 78125 KiB of thread-private"
    ):
        kernels("robustness").dispatch("private_array_80m", [torch.zeros(1)], threads=1, threads_per_threadgroup=1)


@pytest.mark.parametrize("name,seen", [("wait_for_other_simdgroup", 7), ("wait_for_counter", 32)])
def test_a_simdgroup_waits_for_another_through_an_atomic(kernels, name, seen):
    out = torch.full((64,), -1, dtype=torch.int32)
    kernels("robustness").dispatch(name, [out], threadgroups=1, threads_per_threadgroup=64)
    assert out.tolist() == [0] * 32 + [seen] * 32


@pytest.mark.parametrize("name", ["wait_forever", "spin_on_memory"])
def test_a_spin_that_never_ends_is_an_error(kernels, monkeypatch, name):
    monkeypatch.setenv("MPS_EXT_EXECUTOR_WATCHDOG_SECONDS", "0.5")
    args = [torch.zeros(64, dtype=torch.int32)] + (
        [torch.zeros(1, dtype=torch.int32)] if name == "spin_on_memory" else []
    )
    with pytest.raises(cpu_metal.KernelError, match=f"kernel '{name}' made no progress for 0.5 s"):
        kernels("robustness").dispatch(name, args, threadgroups=1, threads_per_threadgroup=64)


# ------------------------------------------------------------ 4. atomics --
def test_device_atomic_float_has_every_msl_function(kernels):
    lib = kernels("atomics31")
    n = 200
    f = torch.tensor([0.0, -1.0, 3.0, 0.0])
    out = torch.zeros(1)
    lib.dispatch("float_atomics", [f, out], threads=n, threads_per_threadgroup=64)
    assert f.tolist() == [n * 0.125, n - 1.0, 42.0, -1.5]
    assert out.item() == 3.0
    bits = torch.zeros(1, dtype=torch.int32)
    lib.dispatch("float_max_as_uint", [bits], threads=n, threads_per_threadgroup=64)
    assert bits.view(torch.float32).item() == n - 1.0


THREADGROUP_FLOAT_ATOMIC = """
#include <metal_stdlib>
using namespace metal;
kernel void k(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_%s acc;
  if (lid == 0) atomic_store_explicit(&acc, 0, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  atomic_fetch_add_explicit(&acc, 1, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 0) out[0] = atomic_load_explicit(&acc, memory_order_relaxed);
}
"""


def test_threadgroup_atomic_float_is_rejected(tmp_path):
    with pytest.raises(cpu_metal.CompileError, match=r"tg_float.metal:6:.*unavailable: Metal has no such atomic"):
        cpu_metal.compile_library(THREADGROUP_FLOAT_ATOMIC % "float", filename="tg_float.metal")
    path = tmp_path / "tg_float.metal"
    path.write_text(THREADGROUP_FLOAT_ATOMIC % "float")
    r = subprocess.run([sys.executable, "-m", "mps_ext_executor", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 1 and f"{path}:6:" in r.stdout
    # the same counter as an atomic_uint is Metal
    out = torch.zeros(1)
    cpu_metal.compile_library(THREADGROUP_FLOAT_ATOMIC % "uint", filename="tg_uint.metal").dispatch(
        "k", [out], threadgroups=1, threads_per_threadgroup=64)
    assert out.item() == 64.0


def test_threadgroups_start_in_a_seeded_random_order(kernels):
    lib = kernels("atomics31")
    groups = 64

    def order(seed):
        nxt, order = torch.zeros(1, dtype=torch.int32), torch.zeros(groups, dtype=torch.int32)
        lib.dispatch("start_order", [nxt, order], threadgroups=groups, threads_per_threadgroup=32, seed=seed)
        return order.tolist()

    a = order(1)
    assert sorted(a) == list(range(groups))
    assert a == order(1) or cpu_metal.worker_count() > 1  # workers interleave, but each takes the permutation
    assert a[:8] != list(range(8))  # not ascending
    assert len({tuple(order(s)[:8]) for s in range(4)}) > 1  # the seed changes it


@pytest.mark.parametrize("groups", [2, 37])
def test_last_threadgroup_reads_partials_only_after_a_device_fence(kernels, groups):
    x = torch.from_numpy(rng.standard_normal(groups * 32).astype(np.float32))
    # two dispatches: the GPU-valid way
    partial, total2 = torch.zeros(groups), torch.zeros(1)
    lib = kernels("atomics31")
    lib.dispatch("partial_sums", [partial, x], threadgroups=groups, threads_per_threadgroup=32)
    lib.dispatch("sum_partials", [total2, partial, np.uint32(groups)], threads=1, threads_per_threadgroup=1)
    np.testing.assert_allclose(total2.item(), x.double().sum().item(), rtol=1e-5, atol=1e-5)
    source = (KERNELS / "atomics31.metal").read_text()
    for fence, defines in [(1, {}), (2, {"__METAL_VERSION__": 320})]:
        fenced = cpu_metal.compile_library(source, defines={"FENCE": fence, **defines}, filename="atomics31.metal")
        # Threadgroups run concurrently on the machine's cores, in an order the
        # seed shuffles: a correct kernel must pass in every order and
        # interleaving (an executor that numbered each atomic before it ran
        # raised a false RaceError in about 2% of these).
        for seed in range(300 if groups > 2 else 1):
            p, done, total = torch.zeros(groups), torch.zeros(1, dtype=torch.int32), torch.zeros(1)
            fenced.dispatch("last_group_sums", [p, done, total, x], threadgroups=groups, threads_per_threadgroup=32,
                            seed=seed)
            assert total.item() == total2.item(), f"FENCE={fence}, seed {seed}"
    unfenced = cpu_metal.compile_library(source, defines={"FENCE": 0}, filename="atomics31.metal")
    with pytest.raises(cpu_metal.RaceError) as e:
        unfenced.dispatch("last_group_sums", [torch.zeros(groups), torch.zeros(1, dtype=torch.int32),
                                              torch.zeros(1), x], threadgroups=groups, threads_per_threadgroup=32)
    msg = str(e.value)
    assert "buffer 0 ('partial')" in msg and "without making it visible" in msg
    assert f"atomics31.metal:{line_of('for (uint g = 0; g < groups; ++g) t += partial[g];', 'atomics31.metal')}:" in msg


# ---------------------------------------------------------- 5. denormals --
def f32(bits):
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def test_fp32_and_bfloat_denormals_flush_half_keeps_them(kernels):
    x = np.array([1e-38, 2 * 1.17549435e-38, f32(0x00000001), -3e-39], dtype=np.float32)
    hx = np.array([2 ** -14, 2 ** -24 * 4, 2 ** -24 * 2, -(2 ** -20)], dtype=np.float16)  # halving gives denormals
    n = len(x)
    f, b, h = torch.zeros(2 * n), torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.float16)
    lib = kernels("numerics")
    lib.dispatch("denormals", [f, b, h, torch.from_numpy(x), torch.from_numpy(hx)], threads=n,
                 threads_per_threadgroup=n)
    tiny = np.finfo(np.float32).tiny
    expected = np.where(np.abs(x * np.float32(0.5)) < tiny, 0.0, x * np.float32(0.5))
    np.testing.assert_array_equal(f.numpy()[0::2], expected)
    np.testing.assert_array_equal(f.numpy()[1::2], np.where(np.abs(x) < tiny, 0.0, x))
    assert f.numpy()[0] == 0.0 and f.numpy()[1] == 0.0  # 1e-38 is itself a denormal
    assert f.numpy()[2] == np.float32(1.17549435e-38)
    bx = torch.from_numpy(x).bfloat16().float().numpy()
    np.testing.assert_array_equal(b.float().numpy(), np.where(np.abs(bx) < tiny, 0.0, bx + bx))
    assert b[1].item() != 0.0
    np.testing.assert_array_equal(h.numpy(), hx * np.float16(0.5))  # numpy's float16 keeps denormals
    assert h.numpy()[1] != 0
    # the same computed without denormals
    g = torch.zeros(n)
    lib.dispatch("scaled_products", [g, torch.from_numpy(x)], threads=n, threads_per_threadgroup=n)
    np.testing.assert_array_equal(g.numpy(), expected)
    # the CPU's own arithmetic keeps denormals after a dispatch (the worker
    # restores its floating-point state)
    assert (torch.tensor([1e-38]) * 0.5).item() != 0.0


def test_denormals_can_be_kept_for_debugging(kernels, monkeypatch):
    monkeypatch.setenv("MPS_EXT_EXECUTOR_DENORMALS", "keep")
    x = np.array([1e-38], dtype=np.float32)
    f, b, h = torch.zeros(2), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float16)
    kernels("numerics").dispatch("denormals", [f, b, h, torch.from_numpy(x), torch.zeros(1, dtype=torch.float16)],
                                 threads=1, threads_per_threadgroup=1)
    assert f.tolist() == [float(np.float32(1e-38) * np.float32(0.5)), float(np.float32(1e-38))]


# ---------------------------------------------------------- 6. precision --
PI_ARGS = np.array([0.0, -0.0, 1.0, -1.0, 2.0, 0.5, 1.5, -0.5, 2.5, 0.25, 1000000.5, 1000001.0, 16777216.0,
                    1e-30, np.nan, np.inf], dtype=np.float32)


def test_sinpi_cospi_tanpi_exact_at_integers_and_halves_and_sign(kernels):
    n = len(PI_ARGS)
    out = torch.zeros(4 * n)
    kernels("numerics").dispatch("pi_functions", [out, torch.from_numpy(PI_ARGS)], threads=n,
                                 threads_per_threadgroup=n)
    got = dict(zip(["sinpi", "cospi", "tanpi", "sign"], out.numpy().reshape(n, 4).T))
    bits = lambda v: np.array(v, dtype=np.float32).view(np.uint32).tolist()
    # sinpi: +-0 at integers (the sign of x), +-1 at halves
    assert bits(got["sinpi"][:5]) == bits([0.0, -0.0, 0.0, -0.0, 0.0])
    assert got["sinpi"][5:9].tolist() == [1.0, -1.0, -1.0, 1.0]
    assert got["sinpi"][10] == 1.0 and got["sinpi"][11] == 0.0 and got["sinpi"][12] == 0.0
    assert got["cospi"][[0, 2, 3, 4, 11]].tolist() == [1.0, -1.0, -1.0, 1.0, -1.0]
    assert bits(got["cospi"][[5, 6, 7, 8, 10]]) == bits([0.0] * 5)
    assert got["tanpi"][9] == 1.0 and got["tanpi"][5] == np.inf and got["tanpi"][6] == -np.inf
    assert got["tanpi"][7] == -np.inf
    assert got["sinpi"][13] == np.float32(np.pi * 1e-30)
    assert np.isnan(got["sinpi"][14:]).all() and np.isnan(got["cospi"][14:]).all()
    # sign: -0.0 for -0.0, +0.0 for NaN
    assert bits(got["sign"][:4]) == bits([0.0, -0.0, 1.0, -1.0]) and bits(got["sign"][14:]) == bits([0.0, 1.0])


def test_pi_functions_match_float64_within_an_ulp(kernels):
    x = np.concatenate([rng.uniform(-4, 4, 200), rng.uniform(-1e5, 1e5, 100)]).astype(np.float32)
    n = len(x)
    out = torch.zeros(4 * n)
    kernels("numerics").dispatch("pi_functions", [out, torch.from_numpy(x)], threads=n, threads_per_threadgroup=64)
    got = out.numpy().reshape(n, 4)
    xd = x.astype(np.float64)
    r = np.fmod(xd, 2.0)  # exact; the float64 functions then see a small argument
    for col, ref in [(0, np.sin(np.pi * r)), (1, np.cos(np.pi * r))]:
        np.testing.assert_allclose(got[:, col], ref, rtol=0, atol=float(np.spacing(np.float32(1.0))))
    ok = np.abs(np.cos(np.pi * r)) > 1e-3
    np.testing.assert_allclose(got[ok, 2], np.tan(np.pi * r[ok]), rtol=4e-7 * 2)
    np.testing.assert_array_equal(got[:, 3], np.sign(x))
    # half vectors round the float results once
    h = x[:64].astype(np.float16).reshape(16, 4)
    hout = torch.zeros(64, 4, dtype=torch.float16)
    kernels("numerics").dispatch("pi_functions_half4", [hout, torch.from_numpy(h)], threads=16,
                                 threads_per_threadgroup=16)
    hd = np.fmod(h.astype(np.float64), 2.0)
    hgot = hout.numpy().reshape(16, 4, 4)
    np.testing.assert_allclose(hgot[:, 0].astype(np.float64), np.sin(np.pi * hd), atol=2 ** -11)
    np.testing.assert_array_equal(hgot[:, 3], np.sign(h))


def test_half_geometry_rounds_once_within_the_documented_bound(kernels):
    n = 256
    a = rng.uniform(-4, 4, (n, 4)).astype(np.float16)
    b = rng.uniform(-4, 4, (n, 4)).astype(np.float16)
    out = torch.zeros(n * 3, dtype=torch.float16)
    kernels("numerics").dispatch("half_geometry", [out, torch.from_numpy(a), torch.from_numpy(b)], threads=n,
                                 threads_per_threadgroup=64)
    got = out.numpy().reshape(n, 3).astype(np.float64)
    ad, bd = a.astype(np.float64), b.astype(np.float64)
    d = (a - b).astype(np.float64)  # a - b is a half vector (numpy rounds it, as Metal does)
    exact = [(ad * bd).sum(1), np.sqrt((ad * ad).sum(1)), np.sqrt((d * d).sum(1))]
    # what the executor documents: float accumulation, one rounding to half
    np.testing.assert_array_equal(got[:, 0], exact[0].astype(np.float16))
    for k in (1, 2):  # the square root of that: half the relative error, plus its own rounding
        np.testing.assert_allclose(got[:, k], exact[k], rtol=1.5 * 2 ** -11 * 1.01)
    # and a GPU that rounds each step differs by at most (n + 1) 2^-11 sum|a b|
    steps = np.zeros(n, dtype=np.float16)
    for i in range(4):
        steps = (steps.astype(np.float32) + a[:, i].astype(np.float32) * b[:, i].astype(np.float32)).astype(np.float16)
    bound = 5 * 2 ** -11 * np.abs(ad * bd).sum(1)
    assert (np.abs(got[:, 0] - steps.astype(np.float64)) <= bound).all()


# ------------------------------------------- 7. invalid and undefined code --
def test_simdgroup_load_of_another_element_type_is_rejected():
    path = KERNELS / "matrix_mismatch.metal"
    with pytest.raises(cpu_metal.CompileError, match=r"matrix_mismatch.metal:8:.*element type of the memory differs"):
        cpu_metal.compile_library(path.read_text(), filename=path.name)
    r = subprocess.run([sys.executable, "-m", "mps_ext_executor", "check", str(path)], capture_output=True, text=True)
    assert r.returncode == 1 and f"{path}:8:" in r.stdout


@pytest.mark.parametrize("name,values,dtype,bits", [
    ("to_int", [1.5, -2.5, np.nan], torch.int32, "32-bit signed"),
    ("to_int", [3e9], torch.int32, "32-bit signed"),
    ("to_uchar", [255.9, 256.0], torch.uint8, "8-bit unsigned"),
    ("to_uchar", [-1.0], torch.uint8, "8-bit unsigned"),
], ids=["nan", "int_overflow", "uchar_overflow", "uchar_negative"])
def test_float_to_int_conversion_out_of_range_is_an_error(kernels, name, values, dtype, bits):
    x = torch.tensor(values, dtype=torch.float32)
    with pytest.raises(cpu_metal.KernelError) as e:
        kernels("conversions").dispatch(name, [torch.zeros(len(values), dtype=dtype), x], threads=len(values),
                                        threads_per_threadgroup=len(values))
    msg = str(e.value)
    line = line_of(f"kernel void {name}(", "conversions.metal") + 3
    assert f"kernel '{name}' converts a NaN or out-of-range floating-point value to a {bits} integer" in msg
    assert f"conversions.metal:{line}:" in msg


def test_vector_and_implicit_conversions_are_checked_too(kernels):
    lib = kernels("conversions")
    x4 = torch.tensor([[1.0, 2.0, -3.0, 4.0], [0.0, np.inf, 1.0, 1.0]])
    line = line_of("out[i] = int4(x[i]);", "conversions.metal")
    with pytest.raises(cpu_metal.KernelError, match=rf"to a 32-bit signed integer at conversions.metal:{line}:"):
        lib.dispatch("to_int4", [torch.zeros(2, 4, dtype=torch.int32), x4], threads=2, threads_per_threadgroup=2)
    line = line_of("short s = x[i];", "conversions.metal")
    with pytest.raises(cpu_metal.KernelError, match=rf"16-bit signed integer at conversions.metal:{line}:"):
        lib.dispatch("half_to_short_implicit", [torch.zeros(1, dtype=torch.int16), torch.tensor([40000.0]).half()],
                     threads=1, threads_per_threadgroup=1)


def test_in_range_conversions_and_a_clamping_quantizer_run(kernels):
    lib = kernels("conversions")
    x = torch.tensor([1.5, -2.5, 2147483520.0, -2147483648.0])
    out = torch.zeros(4, dtype=torch.int32)
    lib.dispatch("to_int", [out, x], threads=4, threads_per_threadgroup=4)
    assert out.tolist() == [1, -2, 2147483520, -2147483648]
    x4 = torch.tensor([[1.9, -2.9, 0.0, 7.0]])
    out4 = torch.zeros(1, 4, dtype=torch.int32)
    lib.dispatch("to_int4", [out4, x4], threads=1, threads_per_threadgroup=1)
    assert out4.tolist() == [[1, -2, 0, 7]]
    q = torch.tensor([np.nan, 1000.0, -1000.0, 3.7, -3.7])
    qout = torch.zeros(5, dtype=torch.int8)
    lib.dispatch("to_char_clamped", [qout, q], threads=5, threads_per_threadgroup=5)
    assert qout.tolist() == [0, 127, -128, 3, -3]
