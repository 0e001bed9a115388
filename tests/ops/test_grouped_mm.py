"""_grouped_mm (F.grouped_mm) against torch's own CPU _grouped_mm, over the four
layouts, both weight layouts of the MoE forward, the decode and tiled
kernels, empty groups and rows past offs[-1] (which torch leaves unwritten:
ignored). Plus: each chosen expert's weights are read once at decode, the
launch depends on shapes only, and nothing reads offs on the host."""

import math

import pytest
import torch

import mps_ext
import mps_ext_executor as cpu_metal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
gen = torch.Generator().manual_seed(0)
TORCH_VERSION = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def tol(dtype, k):
    # torch's CPU kernel and ours both accumulate in float and round once;
    # only the order of the additions differs.
    eps = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    return dict(rtol=eps * 2, atol=eps * math.sqrt(max(k, 1)))


def offsets(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)


def experts(e, n, k, dtype, layout):
    """[E, K, N] weights: F.grouped_mm's MoE layout W[E, N, K].transpose(-2, -1)
    ('nk'), or W[E, K, N] stored as is ('kn')."""
    if layout == "nk":
        return randn(e, n, k, dtype=dtype, scale=k ** -0.5).transpose(-2, -1)
    return randn(e, k, n, dtype=dtype, scale=k ** -0.5)


def covered_rows(offs, m):
    return min(int(offs[-1]), m) if len(offs) else 0


def check_rows(got, exp, offs, dtype, k):
    """2D x 3D: rows past offs[-1] are unspecified."""
    end = covered_rows(offs, got.shape[0])
    assert got.shape == exp.shape and got.stride() == exp.stride() and got.dtype == exp.dtype
    torch.testing.assert_close(got[:end], exp[:end], **tol(dtype, k))


# ------------------------------------------------------------- layouts --
TYPE_NAMES = dict(zip(DTYPES, ["f32", "f16", "bf16"]))


def run_2d_3d(run, counts, extra_rows, k, n, dtype, layout):
    """The MoE forward, rows of `a` sorted by expert (plus rows past
    offs[-1]), checked against torch's CPU kernel; the dispatches."""
    a = randn(sum(counts) + extra_rows, k, dtype=dtype)
    b = experts(len(counts), n, k, dtype, layout)
    offs = offsets(counts)
    with cpu_metal.record() as rec:
        got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, dtype, k)
    return rec.dispatches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("counts", [[3, 0, 2, 1], [0, 0, 5, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 2, 0, 3, 0]],
                         ids=["mixed", "one-expert", "one-row-each", "empty-at-both-ends"])
def test_2d_3d_decode(run, device, dtype, layout, counts):
    dispatches = run_2d_3d(run, counts, 2, 72, 40, dtype, layout)  # two rows past offs[-1]
    if device == "executor":
        (d,) = dispatches
        assert d.kernel == f"gmm_decode_{'rows' if layout == 'nk' else 'cols'}_{TYPE_NAMES[dtype]}_vec"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_2d_3d_decode_many_groups_and_a_k_tail(run, device, dtype, layout):
    # 70 groups (the search for a row's group crosses rounds of 32 offsets),
    # groups of 1 to 9 rows (every row-count specialisation, and a group
    # taken in two chunks of 8), K = 75, which 16-byte pieces leave a tail
    # of, and N = 23, whose last 4-byte word of 16-bit weights is half a
    # column ([E, K, N] rows padded to 24, [E, N, K] ones to 80: still
    # aligned for vector loads).
    counts = [0] * 70
    for g, c in {0: 1, 31: 2, 32: 1, 33: 3, 34: 5, 63: 8, 64: 7, 69: 9}.items():
        counts[g] = c
    k, n = 75, 23
    a = randn(sum(counts) + 2, 80, dtype=dtype)[:, :k]
    if layout == "nk":
        b = randn(70, n, 80, dtype=dtype, scale=k ** -0.5)[..., :k].transpose(-2, -1)
    else:
        b = randn(70, k, 24, dtype=dtype, scale=k ** -0.5)[..., :n]
    offs = offsets(counts)
    with cpu_metal.record() as rec:
        got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, dtype, k)
    if device == "executor":
        (d,) = rec.dispatches
        assert d.kernel == f"gmm_decode_{'rows' if layout == 'nk' else 'cols'}_{TYPE_NAMES[dtype]}_vec"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_2d_3d_prefill_tiles(run, device, dtype, layout):
    # Groups that start and end inside 64-row tiles, empty ones, one longer
    # than a tile, rows past offs[-1], a K tail (40 = 32 + 8) and an N tail
    # (72 = 64 + 8).
    dispatches = run_2d_3d(run, [0, 37, 5, 0, 70, 1, 0], 9, 40, 72, dtype, layout)
    if device == "executor":
        assert [d.kernel for d in dispatches] == [f"gmm_tiled_{TYPE_NAMES[dtype]}"]


@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_prefill_tiles_are_64_square_staged_in_float(layout):
    # 128 rows of one group x 128 columns: 2 x 2 tiles of 64 x 64, so each
    # threadgroup reads a 64-row strip of `a` and a 64-column strip of the
    # expert, and each byte of either is read by 2 threadgroups. Every dtype
    # is staged decoded to float, once per stage (the fragments load with
    # simdgroup_load): the same threadgroup memory for each, and each kernel
    # leaves a core room for 2 threadgroups or more.
    memory = {}
    for dtype in DTYPES:
        a = randn(128, 64, dtype=dtype)
        b = experts(2, 128, 64, dtype, layout)
        offs = offsets([128, 0])
        with cpu_metal.record(counters=True) as rec:
            got = torch.ops.mps_ext._grouped_mm(a, b, offs)
        check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, dtype, 64)
        (d,) = rec.dispatches
        assert d.kernel == f"gmm_tiled_{TYPE_NAMES[dtype]}"
        assert d.threadgroups == (2, 2, 1)
        for name in ("a", "w"):
            i = d.buffer(name)
            assert d.threadgroup_bytes_read_distinct[i] == 2 * d.unique_bytes_read[i], name
        assert d.threadgroups_per_core >= 2
        memory[dtype] = d.threadgroup_memory
    assert memory[torch.float16] == memory[torch.bfloat16] == memory[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [6, 100], ids=["decode", "tiles"])
def test_3d_2d(run, dtype, cols):
    # out[:, s:e] = A[g] @ B[:, s:e]: the jagged dimension is B's columns.
    g, m, k = 3, 24, 32
    counts = [cols // 2, 0, cols - cols // 2 - 1]  # one column past offs[-1]
    a = randn(g, m, k, dtype=dtype)
    b = randn(cols, k, dtype=dtype).t()  # [K, cols], column-major
    offs = offsets(counts)
    got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    exp = torch._grouped_mm(a, b, offs=offs)
    end = int(offs[-1])
    assert got.shape == exp.shape and got.stride() == exp.stride()
    torch.testing.assert_close(got[:, :end], exp[:, :end], **tol(dtype, k))


@pytest.mark.parametrize("dtype", DTYPES)
def test_2d_2d_k_split(run, dtype):
    # out[g] = A[:, s:e] @ B[s:e, :]; an empty K range gives zeros.
    m, n = 20, 36
    counts = [0, 17, 40, 0, 3]
    ktot = sum(counts) + 5  # K past offs[-1] is not used
    a = randn(m, 72, dtype=dtype)[:, :ktot]
    b = randn(n, 72, dtype=dtype)[:, :ktot].t()  # [K, N] column-major
    offs = offsets(counts)
    got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    exp = torch._grouped_mm(a, b, offs=offs)
    assert got.shape == exp.shape == (5, m, n) and got.stride() == exp.stride()
    torch.testing.assert_close(got, exp, **tol(dtype, 40))
    assert torch.count_nonzero(got[0]) == 0 and torch.count_nonzero(got[3]) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b_layout", ["row", "col"])
def test_3d_3d_batched(run, dtype, b_layout):
    g, m, k, n = 3, 33, 24, 40
    a = randn(g, m, k, dtype=dtype)
    b = randn(g, k, n, dtype=dtype) if b_layout == "row" else randn(g, n, k, dtype=dtype).transpose(-2, -1)
    got = run("_grouped_mm", a, b, None, family="grouped_mm")
    exp = torch._grouped_mm(a, b)
    assert got.stride() == exp.stride()
    torch.testing.assert_close(got, exp, **tol(dtype, k))


def test_padded_output_strides_and_odd_n(run):
    # N = 5 halves: torch pads the output's row stride to 8 (16 bytes).
    a = randn(6, 16, dtype=torch.float16)
    b = experts(2, 5, 16, torch.float16, "nk")
    offs = offsets([2, 4])
    got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    exp = torch._grouped_mm(a, b, offs=offs)
    assert got.stride() == exp.stride() == (8, 1)
    torch.testing.assert_close(got, exp, **tol(torch.float16, 16))


@pytest.mark.parametrize("k", [0, 1, 8, 9, 23])
def test_any_k_with_scalar_tails(run, device, k):
    # K not a multiple of 8 halves: the leading stride is padded to 16 bytes
    # (torch requires it) and the last elements take the scalar path.
    kp = max(8, (k + 7) // 8 * 8)
    a = randn(5, kp, dtype=torch.float16)[:, :k]
    b = randn(3, 24, kp, dtype=torch.float16)[:, :, :k].transpose(-2, -1)
    offs = offsets([2, 0, 3])
    got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    exp = torch._grouped_mm(a, b, offs=offs) if k > 0 else torch.zeros(5, 24, dtype=torch.float16)
    check_rows(got, exp, offs, torch.float16, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["nk", "kn"])
def test_unaligned_operands_take_element_loads(run, device, dtype, layout):
    # A weight whose storage offset breaks 16-byte alignment (torch accepts
    # it on the CPU): no 16-byte loads.
    e, k, n = 3, 64, 24
    w = experts(e, n, k, dtype, layout)
    store = torch.empty(w.numel() + 1, dtype=dtype)
    b = store[1:].as_strided(w.shape, w.stride()).copy_(w)
    a = randn(5, k, dtype=dtype)
    offs = offsets([1, 0, 4])
    with cpu_metal.record() as rec:
        got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, dtype, k)
    if device == "executor":
        kind = "rows" if layout == "nk" else "cols"
        assert rec.dispatches[0].kernel == f"gmm_decode_{kind}_{TYPE_NAMES[dtype]}_scalar"


def test_strided_views_of_offs_and_operands(run):
    a = randn(12, 48, dtype=torch.bfloat16)[::2]  # row stride 96
    b = experts(3, 24, 48, torch.bfloat16, "nk")
    offs = torch.tensor([1, 0, 3, 0, 6, 0], dtype=torch.int32)[::2]  # [1, 3, 6], stride 2
    if TORCH_VERSION >= (2, 14):  # torch 2.14 started to refuse strided offsets
        with pytest.raises(RuntimeError, match=r"Offsets must have stride \(1,\)"):
            run("_grouped_mm", a, b, offs, family="grouped_mm")
        offs = offs.contiguous()
    got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    check_rows(got, torch._grouped_mm(a, b, offs=offs.contiguous()), offs, torch.bfloat16, 48)


def test_offsets_past_the_rows_are_clamped(run):
    # torch slices rows [s, e) of A, which clamps e to A's rows.
    a = randn(6, 16)
    b = experts(3, 8, 16, torch.float32, "nk")
    offs = torch.tensor([2, 6, 9], dtype=torch.int32)
    got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    torch.testing.assert_close(got, torch._grouped_mm(a, b, offs=offs), **tol(torch.float32, 16))


# ------------------------------------------------------------- errors --
ERRORS = {
    "int dtype": (lambda: (torch.ones(4, 16, dtype=torch.int32), randn(2, 16, 8), offsets([2, 2])),
                  "Expected mat_a to be Float32, BFloat16 or Float16 matrix"),
    "1-D": (lambda: (randn(16), randn(2, 16, 8), offsets([2, 2])), "mat_a has to be 2 or 3d"),
    "K mismatch": (lambda: (randn(4, 16), randn(2, 12, 8), offsets([2, 2])),
                   "contraction dimension of mat_a and mat_b must match"),
    "bad stride": (lambda: (randn(4, 6), randn(2, 6, 8), offsets([2, 2])), "strides should be multiple of 16 bytes"),
    "no offs": (lambda: (randn(4, 16), randn(2, 16, 8), None), "Have to provide offsets if there is a 2d matrix"),
    "offs for 3d": (lambda: (randn(2, 4, 16), randn(2, 16, 8), offsets([2, 2])), "no offset if both matrices are 3d"),
    "int64 offs": (lambda: (randn(4, 16), randn(2, 16, 8), torch.tensor([2, 4])), "Offsets have to be int32"),
    "2-D offs": (lambda: (randn(4, 16), randn(2, 16, 8), offsets([2, 2]).view(1, 2)), "offs has to be 1D"),
    "groups": (lambda: (randn(4, 16), randn(3, 16, 8), offsets([2, 2])), "matrix batch sizes have to match"),
    "batch": (lambda: (randn(2, 4, 16), randn(3, 16, 8), None), "batched dimension has to match"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_torchs_checks_and_messages(case):
    make, message = ERRORS[case]
    a, b, offs = make()
    with pytest.raises(RuntimeError, match=message):
        torch._grouped_mm(a, b, offs=offs)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.mps_ext._grouped_mm(a, b, offs)


def test_bias_and_out_dtype_are_refused_as_torch_does():
    a, b, offs = randn(4, 16, dtype=torch.bfloat16), randn(2, 16, 8, dtype=torch.bfloat16), offsets([2, 2])
    for kwargs, message in [({"bias": randn(8, dtype=torch.bfloat16)}, "Bias not supported yet"),
                            ({"out_dtype": torch.float32}, "output dtype must match")]:
        with pytest.raises(RuntimeError, match=message):
            torch._grouped_mm(a, b, offs=offs, **kwargs)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.mps_ext._grouped_mm(a, b, offs, **kwargs)
    got = torch.ops.mps_ext._grouped_mm(a, b, offs, out_dtype=torch.bfloat16)
    torch.testing.assert_close(got, torch._grouped_mm(a, b, offs=offs), **tol(torch.bfloat16, 16))


def test_mixed_dtypes_go_to_torch():
    a, b, offs = randn(4, 16, dtype=torch.bfloat16), randn(2, 16, 8), offsets([2, 2])
    mps_ext.reset_stats()
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, offs=offs)
    with pytest.raises(RuntimeError):
        torch.ops.mps_ext._grouped_mm(a, b, offs)
    assert mps_ext.stats()["grouped_mm"]["fallbacks"] == {"operands of different dtypes": 1}


def test_empty_shapes(run):
    a, b = randn(0, 16), randn(3, 16, 8)
    assert run("_grouped_mm", a, b, offsets([0, 0, 0]), family="grouped_mm").shape == (0, 8)
    got = run("_grouped_mm", randn(4, 16), randn(0, 16, 8), torch.zeros(0, dtype=torch.int32), family="grouped_mm")
    assert got.shape == (4, 8)


# ------------------------------------------------- decode-time traffic --
def route(tokens, top_k, n_experts, pattern):
    """Expert ids [tokens, top_k] for a routing pattern, distinct per token."""
    if pattern == "same":  # every token picks the same top_k experts
        return torch.arange(top_k).repeat(tokens, 1) + 3
    if pattern == "spread":  # no two tokens share an expert
        return torch.arange(tokens * top_k).view(tokens, top_k) + 1
    return torch.stack([torch.randperm(n_experts - 2, generator=gen)[:top_k] + 1 for _ in range(tokens)])


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (2, 4), (4, 8), (8, 8), (8, 1)])
@pytest.mark.parametrize("pattern", ["same", "spread", "random"])
def test_decode_reads_each_chosen_expert_once(run, device, tokens, top_k, pattern):
    n_experts, k, n = 72, 256, 96  # experts 0 and 71 are never chosen
    ids = route(tokens, top_k, n_experts, pattern)
    counts = torch.bincount(ids.flatten(), minlength=n_experts)
    order = torch.argsort(ids.flatten(), stable=True)
    x = randn(tokens, k, dtype=torch.bfloat16)
    a = x[order // top_k]  # rows sorted by expert
    b = experts(n_experts, n, k, torch.bfloat16, "nk")
    offs = offsets(counts.tolist())
    with cpu_metal.record() as rec:
        got = run("_grouped_mm", a, b, offs, family="grouped_mm")
    check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, torch.bfloat16, k)
    if device == "executor":
        (d,) = rec.dispatches
        chosen = int((counts > 0).sum())
        w, a_buf = d.buffer("w"), d.buffer("a")
        assert d.bytes_read[w] == chosen * n * k * 2  # each chosen expert once, the others never
        assert d.read_widths[w] == {16: chosen * n * k * 2 // 16}
        # A threadgroup stages its rows' activations once for all its
        # simdgroups: each row read once per threadgroup along N.
        assert d.bytes_read[a_buf] == d.threadgroups[0] * a.nbytes
        assert d.total_threadgroups == d.threadgroups[0] * tokens * top_k


def test_decode_threadgroups_for_model_shapes():
    # 1 token, gate+up of the benchmark models: at least 4 threadgroups per
    # core of an 80-core GPU (the weights are not needed: shapes decide).
    for n_experts, top_k, ffn in [(128, 8, 768), (256, 8, 512), (32, 4, 1792)]:
        a = randn(top_k, 64, dtype=torch.bfloat16)
        b = torch.zeros(n_experts, 2 * ffn, 64, dtype=torch.bfloat16).transpose(-2, -1)
        offs = offsets([1] * top_k + [0] * (n_experts - top_k))
        with cpu_metal.record() as rec:
            torch.ops.mps_ext._grouped_mm(a, b, offs)
        assert rec.dispatches[0].total_threadgroups >= 320


# ------------------------------------------------------------ no sync --
class _GuardedOffsets(torch.Tensor):
    """offs as a tensor subclass: every aten op that touches it other than
    the grouped op itself (item, _local_scalar_dense, a copy to the CPU,
    select, max, ...) is recorded. The grouped op is redispatched straight to
    mps_ext's kernel with offs still wrapped, so an op the C++ code ran on it
    would land here."""

    touched: list = []

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.mps_ext._grouped_mm.default, torch.ops.mps_ext._scaled_grouped_mm.default,
                    torch.ops.aten._grouped_mm.default, torch.ops.mps_ext.moe_experts.default):
            key = torch._C.DispatchKey.MPS if args[0].device.type == "mps" else torch._C.DispatchKey.CPU
            return func.redispatch(torch._C.DispatchKeySet(key), *args, **kwargs)
        cls.touched.append(str(func))
        unwrap = lambda t: t.plain if isinstance(t, cls) else t  # noqa: E731
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in kwargs.items()})


def guarded(offs):
    g = torch.Tensor._make_subclass(_GuardedOffsets, offs)
    g.plain = offs
    return g


def test_guard_catches_host_reads():
    # The guard itself: what a syncing implementation does is seen.
    _GuardedOffsets.touched.clear()
    guarded(offsets([1, 2, 3]))[1]
    guarded(offsets([1, 2, 3])).max()
    guarded(offsets([3])).item()
    assert _GuardedOffsets.touched == ["aten.select.int", "aten.max.default", "aten._local_scalar_dense.default"]


@pytest.mark.parametrize("m", [8, 100], ids=["decode", "tiles"])
def test_offsets_are_never_read_on_the_host(device, m):
    a = randn(m, 32, dtype=torch.bfloat16)
    b = experts(4, 16, 32, torch.bfloat16, "nk")
    counts = [m // 4, 0, m // 2, m - m // 4 - m // 2]
    offs = offsets(counts)
    on = "cpu" if device == "executor" else device
    op = torch.ops.mps_ext._grouped_mm if device == "executor" else torch.ops.aten._grouped_mm
    _GuardedOffsets.touched.clear()
    got = op(a.to(on), b.to(on), guarded(offs.to(on))).cpu()
    assert _GuardedOffsets.touched == []
    check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, torch.bfloat16, 32)
    if device == "executor":
        # torch's own CPU kernel copies them to the CPU: the guard sees it.
        torch._grouped_mm(a, b, offs=guarded(offs))
        assert _GuardedOffsets.touched == ["aten.to.dtype_layout"]


@pytest.mark.parametrize("m", [8, 64, 100])
def test_launch_geometry_depends_on_shapes_only(m):
    # The same shapes with different routings launch exactly the same.
    a = randn(m, 32)
    b = experts(6, 24, 32, torch.float32, "nk")
    launches = set()
    for counts in ([m, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, m], [1] * 5 + [m - 5], [0] * 6):
        offs = offsets(counts)
        with cpu_metal.record() as rec:
            got = torch.ops.mps_ext._grouped_mm(a, b, offs)
        check_rows(got, torch._grouped_mm(a, b, offs=offs), offs, torch.float32, 32)
        launches.add(tuple((d.kernel, d.threadgroups, d.threads_per_threadgroup) for d in rec.dispatches))
    assert len(launches) == 1, launches


def test_source_has_no_host_read_of_offsets():
    # A belt to the braces above: the op's file never takes a host view of
    # offs's data (which on a CPU tensor no dispatcher could see).
    from pathlib import Path
    src = (Path(__file__).resolve().parents[2] / "csrc/ops/grouped_mm.cpp").read_text()
    for pattern in ["offs->item", "offs->cpu", "offs->data_ptr", "offs->const_data_ptr", "offs->accessor",
                    "offs.item", "offs.cpu", "offs.data_ptr", "offs.const_data_ptr", "offs.accessor", "_local_scalar"]:
        assert pattern not in src, pattern


@pytest.mark.parametrize("m", [8, 100], ids=["decode", "tiles"])
@pytest.mark.parametrize("offs", [[5, 2, 7, 3], [-4, 90, 1, 2**31 - 1], [2**31 - 1] * 4, [-1] * 4])
def test_offsets_out_of_order_or_range_stay_in_bounds(m, offs):
    # torch requires non-decreasing offsets; others give unspecified rows,
    # but the kernels never leave their buffers (the executor checks every access).
    a = randn(m, 32)
    b = experts(4, 16, 32, torch.float32, "nk")
    out = torch.ops.mps_ext._grouped_mm(a, b, torch.tensor(offs, dtype=torch.int32))
    assert out.shape == (m, 16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    torch.ops.mps_ext._scaled_grouped_mm(
        a8, b8, torch.ones(m), torch.ones(4, 16), torch.tensor(offs, dtype=torch.int32)
    )


# --------------------------------------------------------------- meta --
def _meta(t):
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


LAYOUTS = {  # (a, b, offs) of each layout, N odd so the output's row stride is padded
    "2d x 3d": lambda dt: (randn(10, 32, dtype=dt), experts(3, 13, 32, dt, "nk"), offsets([4, 0, 5])),
    "3d x 2d": lambda dt: (randn(3, 6, 32, dtype=dt), randn(13, 32, dtype=dt).t(), offsets([4, 0, 9])),
    "2d x 2d": lambda dt: (randn(6, 40, dtype=dt)[:, :32], randn(13, 40, dtype=dt)[:, :32].t(), offsets([16, 16, 32])),
    "3d x 3d": lambda dt: (randn(3, 6, 32, dtype=dt), experts(3, 13, 32, dt, "nk"), None),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_meta_kernel_gives_the_kernels_sizes_and_strides(layout, dtype):
    # torch.compile traces torch.ops.mps_ext._grouped_mm through mps_ext's
    # Meta kernel (mps_ext/_meta.py): the sizes, padded strides and dtype the
    # op gives, which are aten's CPU kernel's. (torch's own Meta kernel takes
    # bfloat16 only before torch 2.14 and leaves the stride unpadded off CUDA
    # before 2.15.)
    a, b, offs = LAYOUTS[layout](dtype)
    want = torch._grouped_mm(a, b, offs=offs)
    got = torch.ops.mps_ext._grouped_mm(a, b, offs)
    meta = torch.ops.mps_ext._grouped_mm(_meta(a), _meta(b), _meta(offs))
    assert meta.device.type == "meta"
    for t in (got, meta):
        assert (t.shape, t.stride(), t.dtype) == (want.shape, want.stride(), want.dtype)


# ------------------------------------------------------- policy (2.15) --
def _policy_calls():
    """(what, a, b, counts, mps_ext's kernel runs) under torch 2.15's rule
    (mps_ext/_policy.py, torch_grouped_mm): mps_ext takes back only the
    bfloat16 jagged-row products of more than 64 rows with K contiguous in
    both operands (torch's simdgroup tile against gmm_tiled, counted in
    docs/dev/policy.md); the rest stays with torch."""
    bf16, k, n = torch.bfloat16, 32, 16
    x = lambda m: randn(m, k, dtype=bf16)  # noqa: E731
    return [
        # torch's few-rows kernel (GroupedMM.mm: rows <= min(32, groups), K contiguous in both): decode
        ("few rows", x(8), experts(16, n, k, bf16, "nk"), [1] * 8 + [0] * 8, False),
        # torch's simdgroup tile, but mps_ext's decode kernel (not counted against it)
        ("40 rows", x(40), experts(16, n, k, bf16, "nk"), [3] * 8 + [2] * 8, False),
        ("64 rows", x(64), experts(4, n, k, bf16, "nk"), [16] * 4, False),
        # a prefill: torch's simdgroup tile, mps_ext's gmm_tiled
        ("65 rows", x(65), experts(4, n, k, bf16, "nk"), [16, 16, 16, 17], True),
        ("3D x 2D, 100 columns", randn(4, n, k, dtype=bf16), x(100).t(), [25] * 4, True),
        # not counted: another dtype, N contiguous weights, a's K strided, 2D x 2D, 3D x 3D (torch's bmm)
        ("float32", randn(100, k), experts(4, n, k, torch.float32, "nk"), [25] * 4, False),
        ("weights [E, K, N]", x(100), experts(4, n, k, bf16, "kn"), [25] * 4, False),
        ("a's K strided", randn(k, 128, dtype=bf16).t(), experts(4, n, k, bf16, "nk"), [32] * 4, False),
        ("2D x 2D", x(128).t().contiguous(), randn(128, n, dtype=bf16), [32] * 4, False),
        ("3D x 3D", randn(4, 100, k, dtype=bf16), experts(4, n, k, bf16, "nk"), None, False),
    ]


def test_torch_2_15_takes_decode_and_mps_ext_bf16_prefill_by_shape_alone(cpu_policy):
    """The 2.15 rule installed on the CPU key: each call goes where the rule
    says, for two routings of the same shapes (the decision is the shapes'),
    and nothing but torch's own CPU kernel (which copies offs to the CPU)
    touches offs: the policy never reads it."""
    from mps_ext import _policy
    mps_ext._leave_to_torch("grouped_mm", _policy.left_to_torch("grouped_mm", "2.15.0"), "CPU")
    for what, a, b, counts, ours in _policy_calls():
        routings = [None] if counts is None else [counts, [sum(counts)] + [0] * (len(counts) - 1)]
        for routing in routings:
            offs = None if routing is None else offsets(routing)
            mps_ext.reset_stats()
            _GuardedOffsets.touched.clear()
            got = torch.ops.mps_ext._grouped_mm(a, b, None if offs is None else guarded(offs))
            s = mps_ext.stats()["grouped_mm"]
            assert s["ran"] == int(ours), what
            assert list(s["fallbacks"]) == ([] if ours else [mps_ext.POLICY_PREFIX + _policy.NATIVE["grouped_mm"][0]
                                                              .what]), what
            # torch's CPU fallback copies offs to the CPU (aten.to); mps_ext's decision reads nothing of it
            assert _GuardedOffsets.touched == ([] if ours or offs is None else ["aten.to.dtype_layout"]), what
            want = torch._grouped_mm(a, b, offs=offs)
            if a.dim() == 2 and b.dim() == 3:
                check_rows(got, want, offs, a.dtype, a.shape[-1])
            else:
                torch.testing.assert_close(got, want, **tol(a.dtype, a.shape[-1]))
