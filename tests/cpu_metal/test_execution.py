"""The executor runs Metal's execution model: kernels written for the purpose,
checked against numpy / torch computed independently."""

import numpy as np
import pytest
import torch

import mps_ext_executor as cpu_metal

rng = np.random.default_rng(1234)


def u32(x):
    return np.uint32(x)


# ------------------------------------------------------------- reductions --
def test_block_sum_with_barriers_and_simd_sum(kernels):
    lib = kernels("reduce")
    n, size = 1000, 256
    x = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    groups = (n + size - 1) // size
    out = torch.zeros(groups)
    stats = lib.dispatch("block_sum", [out, x, u32(n)], threadgroups=groups, threads_per_threadgroup=size,
                         threadgroup_memory=[size * 4])
    expected = np.add.reduceat(x.numpy().astype(np.float64), np.arange(0, n, size))
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert stats.barriers == groups  # one threadgroup barrier per threadgroup
    assert stats.simd_operations == groups * (size // 32 + 1)  # every simdgroup, then simdgroup 0 again
    assert stats.threads == groups * size


def test_tree_max(kernels):
    x = torch.from_numpy(rng.standard_normal(3 * 256).astype(np.float32))
    out = torch.zeros(3)
    stats = kernels("reduce").dispatch("tree_max", [out, x], threadgroups=3, threads_per_threadgroup=256)
    assert torch.equal(out, x.view(3, 256).max(1).values)
    assert stats.barriers == 3 * 9


def test_every_simd_reduction_on_a_partial_simdgroup(kernels):
    n = 80  # 64 + 16: the last threadgroup holds one simdgroup of 16 lanes
    v = rng.integers(-1000, 1000, n).astype(np.int32)
    out = torch.full((3 * 7,), -1, dtype=torch.int32)
    kernels("reduce").dispatch("simd_reductions", [out, torch.from_numpy(v)], threads=n, threads_per_threadgroup=64)
    got = out.numpy().reshape(3, 7)
    for g, chunk in enumerate([v[0:32], v[32:64], v[64:80]]):
        sign = np.where(chunk & 1, -1, 1)
        expected = [chunk.sum(), np.prod(sign), chunk.min(), chunk.max(),
                    np.bitwise_and.reduce(chunk), np.bitwise_or.reduce(chunk), np.bitwise_xor.reduce(chunk)]
        assert got[g].tolist() == [int(e) for e in expected], f"simdgroup {g}"


# ------------------------------------------------------------------ scans --
def test_simd_prefix_scans(kernels):
    v = rng.choice(np.array([1.0, 2.0, 0.5, -1.0, 3.0], dtype=np.float32), 64)
    out = torch.zeros(64 * 4)
    kernels("scan").dispatch("simd_scans", [out, torch.from_numpy(v)], threadgroups=1, threads_per_threadgroup=64)
    got = out.numpy().reshape(64, 4)
    for base in (0, 32):
        c = v[base:base + 32].astype(np.float64)
        np.testing.assert_array_equal(got[base:base + 32, 0], np.cumsum(c))
        np.testing.assert_array_equal(got[base:base + 32, 1], np.concatenate([[0], np.cumsum(c)[:-1]]))
        np.testing.assert_array_equal(got[base:base + 32, 2], np.cumprod(c))
        np.testing.assert_array_equal(got[base:base + 32, 3], np.concatenate([[1], np.cumprod(c)[:-1]]))


@pytest.mark.parametrize("size", [96, 1024, 50])
def test_threadgroup_prefix_scan(kernels, size):
    groups = 2
    v = rng.integers(0, 1000, groups * size).astype(np.uint32)
    out = torch.zeros(groups * size, dtype=torch.int32)
    kernels("scan").dispatch("block_scan", [out, torch.from_numpy(v.view(np.int32))], threadgroups=groups,
                             threads_per_threadgroup=size)
    expected = np.cumsum(v.reshape(groups, size).astype(np.int64), axis=1).reshape(-1)
    np.testing.assert_array_equal(out.numpy().astype(np.int64), expected)


# --------------------------------------------------------------- shuffles --
def test_every_shuffle(kernels):
    n = 64
    v = rng.integers(-500, 500, n).astype(np.int32)
    index, delta, mask, modulo = 5, 3, 6, 8
    args = np.array((index, delta, mask, modulo), dtype=[("i", "<u2"), ("d", "<u2"), ("m", "<u2"), ("mod", "<u2")])[()]
    out = torch.zeros(n * 12, dtype=torch.int32)
    kernels("shuffle").dispatch("shuffles", [out, torch.from_numpy(v), args], threadgroups=1,
                                threads_per_threadgroup=n)
    got = out.numpy().reshape(n, 12)
    for tid in range(n):
        base, l = tid - tid % 32, tid % 32
        d, f = v[base:base + 32], -v[base:base + 32]
        k, seg = l % modulo, l - l % modulo
        expected = [
            d[(tid * 7 + index) % 32],
            d[index],
            d[l - delta] if l >= delta else d[l],
            d[l + delta] if l + delta < 32 else d[l],
            d[l ^ mask],
            d[(l - delta) % 32],
            d[(l + delta) % 32],
            d[l - delta] if l >= delta else f[l - delta + 32],
            d[l + delta] if l + delta < 32 else f[l + delta - 32],
            d[seg + k - delta] if k >= delta else f[seg + k - delta + modulo],
            d[seg + k + delta] if k + delta < modulo else f[seg + k + delta - modulo],
            d[0],
        ]
        assert got[tid].tolist() == [int(e) for e in expected], f"thread {tid}"


def test_votes_count_only_active_lanes(kernels):
    n = 64
    v = rng.integers(-20, 100, n).astype(np.int32)
    out = torch.zeros(n * 8, dtype=torch.int64)
    out32 = out.view(torch.int32)[: n * 8]
    kernels("shuffle").dispatch("votes", [out32, torch.from_numpy(v)], threadgroups=1, threads_per_threadgroup=n)
    got = out32.numpy().view(np.uint32).reshape(n, 8)
    for tid in range(n):
        base, l = tid - tid % 32, tid % 32
        d = v[base:base + 32]
        ballot = sum(1 << i for i in range(32) if d[i] > 0)
        active = [i for i in range(32) if i % 3 == 0]
        row = [ballot, int(all(d > -100)), int(any(d > 50))]
        if l % 3 == 0:
            row += [sum(1 << i for i in active), sum(1 << i for i in active if d[i] > 0),
                    int(all(d[i] > 0 for i in active)), len(active), 0]
        else:
            row += [0xDEAD] * 5
        assert got[tid].tolist() == row, f"thread {tid}"


def test_reconvergence_after_a_divergent_loop(kernels):
    out = torch.zeros(32, dtype=torch.int32)
    kernels("shuffle").dispatch("divergent_loop", [out], threadgroups=1, threads_per_threadgroup=32)
    expected = [sum(32 - 8 * k for k in range(l // 8 + 1)) + 3200 for l in range(32)]
    assert out.tolist() == expected


# ---------------------------------------------------------------- atomics --
def test_histogram_with_threadgroup_and_device_atomics(kernels):
    n, bins = 1000, 37
    v = rng.integers(0, 1 << 20, n).astype(np.uint32)
    out = torch.zeros(bins, dtype=torch.int32)
    kernels("atomics").dispatch("histogram", [out, torch.from_numpy(v.view(np.int32)), u32(bins)],
                                threads=n, threads_per_threadgroup=128)
    np.testing.assert_array_equal(out.numpy(), np.bincount(v % bins, minlength=bins))


def test_min_max_or_cas_and_float_add(kernels):
    n = 2000
    v = rng.integers(-10**6, 10**6, n).astype(np.int32)
    result = torch.tensor([2**31 - 1, -2**31, 0, 0], dtype=torch.int32)
    fsum = torch.zeros(1)
    kernels("atomics").dispatch("min_max_sum", [result, fsum, torch.from_numpy(v)], threads=n,
                                threads_per_threadgroup=256)
    bits = np.bitwise_or.reduce(np.left_shift(1, v & 15))
    assert result.tolist() == [v.min(), v.max(), int(bits), 1000]
    assert fsum.item() == 0.5 * n


# ---------------------------------------------------------------- vectors --
def test_vector_constructors_swizzles_conversions(kernels):
    n = 8
    a = rng.uniform(-4, 4, (n, 4)).astype(np.float32)
    p = rng.uniform(-2, 2, (n, 3)).astype(np.float32)
    h = rng.uniform(-2, 2, (n, 4)).astype(np.float16)
    out = torch.zeros(n * 24)
    kernels("vectors").dispatch("vector_ops", [out, torch.from_numpy(a), torch.from_numpy(p),
                                               torch.from_numpy(h)], threads=n, threads_per_threadgroup=n)
    got = out.numpy().reshape(n, 24)
    for i in range(n):
        x, y, z, w = a[i]
        hf = h[i].astype(np.float32) + np.float32(0.5)
        with np.errstate(over="ignore"):
            flipped = (a[i:i + 1].view(np.uint32) ^ np.uint32(0x80000000)).view(np.float32)[0, 0]
        expected = [
            w, z, 1.0, x,
            p[i, 0] + p[i, 1] * p[i, 2],
            x * 2 + z, y * 2 + w,
            y, x,
            float(int(x) + int(w)),
            x + 2 * y + 3 * z + 4 * w,
            np.sqrt(x * x + y * y + z * z),
            hf[0] + hf[3],
            flipped,
            sum(max(c, 0) for c in a[i]),
            min(max(x, -1), 1),
            y if z > 0 else x,
            1.0,
            0.0,
            9.0,
            x * y + z,
            x + w,
            z - y,
            1216.0,
        ]
        np.testing.assert_allclose(got[i], np.array(expected, dtype=np.float32), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------- rounding --
SPECIALS = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 1e-40, np.inf, -np.inf,
                     1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 3.3895e38, 3.4e38],
                    dtype=np.float32)


def test_float_to_half_and_bfloat_round_to_nearest_even(kernels):
    x = np.concatenate([SPECIALS, rng.standard_normal(500).astype(np.float32) * 10.0 ** rng.integers(-8, 8, 500)])
    x = np.concatenate([x, [np.nan]]).astype(np.float32)
    n = len(x)
    h = torch.zeros(n, dtype=torch.float16)
    b = torch.zeros(n, dtype=torch.bfloat16)
    kernels("rounding").dispatch("to_half_and_bfloat", [h, b, torch.from_numpy(x)], threads=n,
                                 threads_per_threadgroup=64)
    xt = torch.from_numpy(x)
    assert torch.equal(h.view(torch.int16)[:-1], xt.half().view(torch.int16)[:-1])
    # a float denormal (1e-40) converts to a bfloat zero of its sign on Apple GPUs
    flushed = torch.where(xt.abs() < torch.finfo(torch.float32).tiny, torch.copysign(torch.zeros_like(xt), xt), xt)
    assert torch.equal(b.view(torch.int16)[:-1], flushed.bfloat16().view(torch.int16)[:-1])
    assert torch.isnan(h[-1]) and torch.isnan(b[-1])
    # numpy's float16 is an independent oracle for half
    with np.errstate(over="ignore"):  # 65520 and above become inf, as they should
        np_half = x[:-1].astype(np.float16)
    np.testing.assert_array_equal(h.numpy()[:-1].view(np.uint16), np_half.view(np.uint16))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_arithmetic_rounds_after_every_operation(kernels, dtype):
    n = 4096
    a, b, c = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) for _ in range(3))
    out = torch.zeros(n, dtype=dtype)
    name = "mul_add_half" if dtype == torch.float16 else "mul_add_bfloat"
    kernels("rounding").dispatch(name, [out, a, b, c], threads=n, threads_per_threadgroup=256)
    expected = a * b + c  # torch's CPU kernels round each op to the dtype
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    # and it differs from rounding only once, so the test can tell
    once = (a.float() * b.float() + c.float()).to(dtype)
    assert not torch.equal(out.view(torch.int16), once.view(torch.int16))


def test_vector_conversions_round_like_scalars(kernels):
    x = rng.standard_normal((256, 4)).astype(np.float32) * 100
    h = torch.zeros(256, 4, dtype=torch.float16)
    b = torch.zeros(256, 4, dtype=torch.bfloat16)
    kernels("rounding").dispatch("vector_rounding", [h, b, torch.from_numpy(x)], threads=256,
                                 threads_per_threadgroup=64)
    assert torch.equal(h, torch.from_numpy(x).half())
    assert torch.equal(b, torch.from_numpy(x).bfloat16())


# ------------------------------------------------------- simdgroup_matrix --
@pytest.mark.parametrize("dtype,name", [(torch.float32, "matmul_float"), (torch.float16, "matmul_half"),
                                        (torch.bfloat16, "matmul_bfloat")])
def test_simdgroup_matrix_multiply_against_numpy(kernels, dtype, name):
    M, N, K = 16, 24, 32
    A = rng.integers(-4, 5, (M, K)).astype(np.float32)
    B = rng.integers(-4, 5, (K, N)).astype(np.float32)
    C0 = rng.integers(-4, 5, (M, N)).astype(np.float32)
    C = torch.from_numpy(C0.copy())
    mnk = np.array([M, N, K, 0], dtype=np.uint32).tobytes()  # uint3 is 16 bytes
    stats = kernels("matrix").dispatch(name, [C, torch.from_numpy(A).to(dtype), torch.from_numpy(B).to(dtype), mnk],
                                       threadgroups=(N // 8, M // 8), threads_per_threadgroup=32)
    np.testing.assert_array_equal(C.numpy(), A @ B + C0)
    # each lane loads only its own two elements: A and B are read exactly
    # once per tile row / column
    itemsize = torch.tensor([], dtype=dtype).element_size()
    assert stats.bytes_read[1] == M * K * itemsize * (N // 8)
    assert stats.bytes_read[2] == K * N * itemsize * (M // 8)


def test_simdgroup_matrix_transposed_load_and_identity(kernels):
    A = rng.standard_normal((8, 8)).astype(np.float32)
    out = torch.zeros(64)
    kernels("matrix").dispatch("transpose_load", [out, torch.from_numpy(A.T.copy().reshape(-1))],
                               threadgroups=1, threads_per_threadgroup=32)
    np.testing.assert_allclose(out.numpy().reshape(8, 8), A, rtol=1e-6)


# ------------------------------------------------------------------ grids --
def _expected_positions(grid, tpt, uniform):
    rows = {}
    groups = [(g + t - 1) // t for g, t in zip(grid, tpt)]
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                pos = (x, y, z)
                group = tuple(p // t for p, t in zip(pos, tpt))
                local = tuple(p % t for p, t in zip(pos, tpt))
                actual = tuple(t if uniform else min(t, g - gi * t) for t, g, gi in zip(tpt, grid, group))
                index = local[0] + local[1] * actual[0] + local[2] * actual[0] * actual[1]
                count = actual[0] * actual[1] * actual[2]
                rows[(z * grid[1] + y) * grid[0] + x] = [
                    *pos,
                    *local,
                    *group,
                    *actual,
                    *tpt,
                    *groups,
                    groups[0] * groups[1] * groups[2] * tpt[0] * tpt[1] * tpt[2]
                    if uniform
                    else grid[0] * grid[1] * grid[2],
                    index,
                    index % 32,
                    index // 32,
                    (count + 31) // 32,
                    33,
                ]
    return rows


@pytest.mark.parametrize("grid,tpt", [((10, 7, 3), (4, 4, 2)), ((33, 1, 1), (32, 1, 1)), ((5, 5, 5), (8, 8, 8)),
                                      ((70, 3, 1), (64, 2, 1))])
def test_non_uniform_grid_builtins(kernels, grid, tpt):
    n = grid[0] * grid[1] * grid[2]
    out = torch.full((n * 24,), -1, dtype=torch.int32)
    stats = kernels("grid").dispatch("positions", [out, np.array(grid + (0,), dtype=np.uint32).tobytes()],
                                     threads=grid, threads_per_threadgroup=tpt)
    got = out.numpy().reshape(n, 24)
    for linear, row in _expected_positions(grid, tpt, uniform=False).items():
        assert got[linear].tolist() == row, f"thread {linear}"
    assert stats.threads == n  # no thread outside the grid ran


def test_uniform_grid_builtins(kernels):
    groups, tpt = (3, 2, 2), (4, 2, 3)
    grid = tuple(g * t for g, t in zip(groups, tpt))
    n = grid[0] * grid[1] * grid[2]
    out = torch.full((n * 24,), -1, dtype=torch.int32)
    kernels("grid").dispatch("positions", [out, np.array(grid + (0,), dtype=np.uint32).tobytes()],
                             threadgroups=groups, threads_per_threadgroup=tpt)
    got = out.numpy().reshape(n, 24)
    for linear, row in _expected_positions(grid, tpt, uniform=True).items():
        assert got[linear].tolist() == row


# -------------------------------------------------- thread order and stats --
ORDER_SOURCE = """
#include <metal_stdlib>
using namespace metal;
kernel void arrival_order(device uint* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup atomic_uint next;
  if (lid == 0) atomic_store_explicit(&next, 0u, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint slot = atomic_fetch_add_explicit(&next, 1u, memory_order_relaxed);
  out[slot] = lid;
}
"""


def test_seed_sets_the_order_threads_run_in():
    lib = cpu_metal.compile_library(ORDER_SOURCE, filename="order.metal")

    def order(seed):
        out = torch.zeros(64, dtype=torch.int32)
        lib.dispatch("arrival_order", [out], threadgroups=1, threads_per_threadgroup=64, seed=seed)
        return out.tolist()

    a, b = order(1), order(2)
    assert sorted(a) == list(range(64))
    assert a == order(1)  # reproducible
    assert a != b  # and different for another seed
    assert a != list(range(64))  # not simply in index order


def test_record_collects_every_dispatch(kernels):
    lib = kernels("reduce")
    x = torch.randn(512)
    out = torch.zeros(2)
    with cpu_metal.record() as rec:
        lib.dispatch("tree_max", [out, x], threadgroups=2, threads_per_threadgroup=256)
        lib.dispatch("tree_max", [out, x], threadgroups=1, threads_per_threadgroup=256)
    assert [d.kernel for d in rec.dispatches] == ["tree_max", "tree_max"]
    assert [d.total_threadgroups for d in rec.dispatches] == [2, 1]
    first = rec.dispatches[0]
    assert first.bytes_read == {1: 512 * 4}  # each input element read once
    assert first.bytes_written == {0: 2 * 4}
    assert first.read_widths == {1: {4: 512}}
    assert first.bytes_moved == 512 * 4 + 8
    # outside the block nothing is collected
    lib.dispatch("tree_max", [out, x], threadgroups=1, threads_per_threadgroup=256)
    assert len(rec.dispatches) == 2


def test_offset_views_bind_from_their_storage_offset(kernels):
    # The kernel sees the view's first element at index 0 and may read up to
    # the end of the storage, as a Metal buffer bound with an offset.
    base = torch.arange(300, dtype=torch.float32)
    view = base[44:]
    out = torch.zeros(1)
    kernels("reduce").dispatch("tree_max", [out, view], threadgroups=1, threads_per_threadgroup=256)
    assert out.item() == 44 + 255


# --------------------------------- mps_ext's own launch path (test hooks) --
def test_a_test_kernel_through_mps_ext_launch_path_matches_the_executor(kernels):
    """test_against_metal.py runs its kernels on a Mac through this path, so
    that they are built with the options mps_ext's own kernels are built
    with; here the same path runs them on the executor."""
    from tests.cpu_metal.conftest import run_through_mps_ext

    A = torch.randn(8, 8)
    args = [torch.zeros(64), A.t().contiguous().view(-1)]
    (out, _) = run_through_mps_ext("matrix", "transpose_load", args, 32, 32)
    expected = [a.clone() for a in args]
    kernels("matrix").dispatch("transpose_load", expected, threads=32, threads_per_threadgroup=32)
    assert torch.equal(out, expected[0]) and torch.equal(out.view(8, 8), A)


def test_registered_shader_sources_keep_their_name():
    with pytest.raises(RuntimeError, match="'softmax' is a built-in shader library"):
        cpu_metal._C._register_shader_source("softmax", "kernel void k() {}")
    cpu_metal._C._register_shader_source("test_registered_once", "kernel void k(device float* x [[buffer(0)]]) {}")
    with pytest.raises(RuntimeError, match="registered already with other source"):
        cpu_metal._C._register_shader_source("test_registered_once", "kernel void k2(device float* x [[buffer(0)]]) {}")
    with pytest.raises(RuntimeError, match="no shader library named 'test_never_registered'"):
        cpu_metal._C._launch("test_never_registered", "k", [torch.zeros(1)], [1, 1, 1], [1, 1, 1])
