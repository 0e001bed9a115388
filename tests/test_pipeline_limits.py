"""Launches sized from the pipeline's own limit (issue 29, point 6).

A Metal pipeline's maxTotalThreadsPerThreadgroup depends on the kernel's
registers and threadgroup memory, so on a real GPU it can be below the
kernel's [[max_total_threads_per_threadgroup]] even where the executor's
register estimate fits it. The op layer asks for the limit before it
chooses a launch's geometry (dispatch/kernel_choice.h, thread_budget) and sizes
every launch that can adapt from it: the op still runs its kernel, and
gives the same result (bit for bit where the geometry changes no sum).
Here the executor pretends a kernel's pipeline allows fewer threads
(cpu_metal._C._simulate_failure(..., "max_threads", n): the `simulate`
fixture of conftest.py). What cannot adapt: a shape longer than the
pipeline's threads hold goes to torch for that call only; a pipeline below
a launch's least makes its kernel unavailable (and test_fallback.py: one
kernel's failure leaves the family's others running)."""

import dataclasses
from typing import Callable

import pytest
import torch

import mps_ext
import mps_ext_executor as cpu_metal
from decode_steps import linear_attention, linear_attention_inputs

F32 = torch.float32
REASON = "kernels unavailable on this device"


def rand(*shape, seed=0, dtype=F32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def threads(d):
    t = d.threads_per_threadgroup
    return t[0] * t[1] * t[2]


def outputs(x):
    """The tensors of an op's result (a tensor, or a tuple or list of them)."""
    return [x] if isinstance(x, torch.Tensor) else [t for v in x for t in outputs(v)]


# ------------------------------------------------------------ the cases --
def qwen35_linear_attention(dtype):
    """A Gated DeltaNet step at Qwen3.5/3.6's head sizes (dk = dv = 128, two
    value heads per key head: 1024 threads unlimited); returns the output
    and the states it updates in place."""
    def run():
        d = linear_attention_inputs(2, 2, 4, 128, 128, 4, dtype, seed=5)
        return linear_attention(d, 2), d["conv_state"], d["recurrent_state"]
    return run


def kv_append():
    k_cache, v_cache = torch.zeros(1, 2, 8, 256), torch.zeros(1, 2, 8, 256)
    torch.ops.mps_ext.kv_append(k_cache, v_cache, rand(1, 2, 1, 256, seed=1), rand(1, 2, 1, 256, seed=2), 3)
    return k_cache, v_cache


def qk_norm_rope_append():
    k_cache, v_cache = torch.zeros(1, 4, 8, 128), torch.zeros(1, 4, 8, 128)
    q_out = torch.ops.mps_ext.qk_norm_rope_append(rand(1, 1, 16, 128, seed=1), rand(1, 1, 4, 128, seed=2),
                                                  rand(1, 1, 4, 128, seed=7), rand(1, 1, 128, seed=3),
                                                  rand(1, 1, 128, seed=4), rand(128, seed=5), rand(128, seed=6), 1e-6,
                                                  "weight", k_cache, v_cache, 3)
    return q_out, k_cache, v_cache


def moe_layer():
    hidden, inter, experts = 2048, 32, 4
    return torch.ops.mps_ext.moe_layer(rand(2, hidden, seed=1), rand(experts, hidden, seed=2, scale=0.3),
                                       rand(experts, 2 * inter, hidden, seed=3, scale=hidden ** -0.5), None,
                                       rand(experts, hidden, inter, seed=4, scale=inter ** -0.5), None, 2)


def scaled_mm_decode():
    a = rand(2, 512, seed=1).to(torch.float8_e4m3fn)
    b = rand(2048, 512, seed=2).to(torch.float8_e4m3fn).t()
    s = torch.tensor(0.02)
    return torch.ops.mps_ext._scaled_mm_v2(a, b, [s], [0], [], [s], [0], [], None, F32, [], False)


def lu_unpack():
    lu, piv = torch.linalg.lu_factor(rand(2, 64, 64, seed=1))
    return torch.ops.mps_ext.lu_unpack(lu, piv)


@dataclasses.dataclass
class Case:
    id: str
    family: str
    library: str
    kernel: str  # the kernel limited: the first dispatched whose name starts so
    run: Callable
    limit: int
    exact: bool = True  # the same bits as the unlimited run (else within float32 rounding of it)


CASES = [
    *[Case(f"linear_attention_{t}_{limit}", "linear_attention", "linear_attention", "linear_attention_decode_",
           qwen35_linear_attention(dtype), limit)
      for t, dtype in (("f32", F32), ("bf16", torch.bfloat16)) for limit in (512, 256, 32)],
    Case("gemv_rows", "linear", "linear", "gemv_rows_",
         lambda: torch.ops.mps_ext.linear(rand(3, 512, seed=1), rand(2048, 512, seed=2), None), 32),
    Case("fp8_gemv", "scaled_mm", "scaled_mm", "fp8_gemv_", scaled_mm_decode, 32),
    Case("gmm_decode_rows", "grouped_mm", "grouped_mm", "gmm_decode_rows_",
         lambda: torch.ops.mps_ext._grouped_mm(rand(2, 256, seed=1), rand(2, 2048, 256, seed=2).transpose(-2, -1),
                                               torch.tensor([1, 2], dtype=torch.int32)), 32),
    Case("moe_down_combine", "moe", "grouped_mm", "moe_down_combine_", moe_layer, 32),
    Case("rms_norm", "norm", "norm", "rms_norm_",
         lambda: torch.ops.mps_ext.rms_norm(rand(64, 256, seed=1), rand(256, seed=2), 1e-6), 64),
    Case("qk_norm_rope", "norm", "norm", "qk_norm_rope_",
         lambda: torch.ops.mps_ext.qk_norm_rope(rand(1, 1, 16, 128, seed=1), rand(1, 1, 4, 128, seed=2),
                                                rand(1, 1, 128, seed=3), rand(1, 1, 128, seed=4),
                                                rand(128, seed=5), rand(128, seed=6), 1e-6), 64),
    Case("qk_norm_rope_append", "norm", "norm", "qk_norm_rope_append_", qk_norm_rope_append, 64),
    Case("sigmoid_gate", "attention_gate", "attention_gate", "sigmoid_gate_",
         lambda: torch.ops.mps_ext.sigmoid_gate(rand(4, 2048, seed=1), rand(4, 2048, seed=2)), 64),
    Case("kv_append", "kv_cache", "kv_cache", "kv_append_", kv_append, 64),
    # gqa 4 at 256 threads (2 streams); at 128 one stream: the streams' partial softmaxes merged in another grouping
    Case("kv_decode_attention", "kv_cache", "kv_cache", "kv_decode_attention_",
         lambda: torch.ops.mps_ext.kv_decode_attention(rand(1, 8, 1, 128, seed=1), rand(1, 2, 300, 128, seed=2),
                                                       rand(1, 2, 300, 128, seed=3), 128 ** -0.5), 128, exact=False),
    # A row the block shape now holds in fewer threads than it needs goes to the split shape: other sums.
    Case("softmax_block", "softmax", "softmax", "softmax_block_",
         lambda: torch.ops.mps_ext._softmax(rand(4, 4096, seed=1), 1, False), 128, exact=False),
    # Fewer rows a threadgroup: a row's elements fall to other lanes, other sums.
    Case("softmax_strided", "softmax", "softmax", "softmax_strided_",
         lambda: torch.ops.mps_ext._softmax(rand(2, 1024, 16, seed=1), 1, False), 128, exact=False),
    Case("lu_panel", "linalg", "linalg_lu", "lu_panel_",
         lambda: torch.ops.mps_ext.linalg_lu_factor_ex(rand(2, 128, 128, seed=1)), 64, exact=False),
    Case("lu_unpack", "linalg", "linalg_lu", "lu_unpack_", lu_unpack, 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_launch_fits_a_pipeline_that_allows_fewer_threads(simulate, case):
    """The op still runs its kernel (no fallback), within the pipeline's
    limit, with the unlimited run's result."""
    with cpu_metal.record() as rec:
        want = case.run()
    (d,) = [d for d in rec.dispatches if d.kernel.startswith(case.kernel)][:1]
    assert threads(d) > case.limit, "the case does not limit the launch"
    before = mps_ext.stats()[case.family]
    simulate(case.library, d.kernel, kind="max_threads", max_threads=case.limit)
    with cpu_metal.record() as rec:
        got = case.run()
    assert cpu_metal._C._simulated_failure_hits() >= 1  # the op asked for the limited pipeline
    assert all(threads(e) <= case.limit for e in rec.dispatches if e.kernel == d.kernel)
    after = mps_ext.stats()[case.family]
    assert after["ran"] == 2 * before["ran"] and after["fallbacks"] == {} and after["unavailable"] == {}
    for g, w in zip(outputs(got), outputs(want), strict=True):
        if case.exact:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_linear_attention_takes_fewer_columns_at_once():
    """The geometry behind the bit-for-bit claim: the same row parts (16
    threads of 8 rows for dk = 128) over fewer columns at once."""
    runs = {}
    for limit in (None, 512, 32):
        if limit:
            cpu_metal._C._simulate_failure("linear_attention", "linear_attention_decode_f32", "max_threads", limit)
        try:
            with cpu_metal.record() as rec:
                qwen35_linear_attention(F32)()
        finally:
            cpu_metal._C._simulate_failure("")
        (d,) = rec.dispatches
        runs[limit] = threads(d)
    assert runs == {None: 1024, 512: 512, 32: 32}


# --------------------------------------------- shapes a limit cannot take --
def test_a_row_longer_than_the_pipeline_holds_is_this_calls_fallback(simulate):
    """rms_norm keeps 8 elements of a row per thread: under a 512-thread
    pipeline a row of 8192 cannot run (mps_ext's own op: it says why),
    while one of 4096 still does; nothing is remembered as unavailable."""
    w8, w4 = rand(8192, seed=2), rand(4096, seed=3)
    simulate("norm", "rms_norm_f32", kind="max_threads", max_threads=512)
    why = "row elements past 4096, the most the kernel's pipeline takes on this GPU"
    with pytest.raises(RuntimeError, match=f"mps_ext::rms_norm cannot run on CPU here \\({why}\\)"):
        torch.ops.mps_ext.rms_norm(rand(2, 8192, seed=1), w8, 1e-6)
    x = rand(2, 4096, seed=1)
    with cpu_metal.record() as rec:
        got = torch.ops.mps_ext.rms_norm(x, w4, 1e-6)
    assert [threads(d) for d in rec.dispatches] == [512]
    want = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)).float() * w4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert mps_ext.stats()["norm"] == {"ran": 1, "fallbacks": {why: 1}, "unavailable": {}}


def test_a_matrix_taller_than_the_solve_pipeline_goes_to_torch(simulate):
    """lu_solve gives each row a thread: under a 64-thread pipeline a
    100-row system goes to torch (exactly torch's result), before any
    factorisation is dispatched for it; a 40-row one runs the kernels."""
    simulate("linalg_solve", "lu_solve_f32_1", kind="max_threads", max_threads=64)
    a, b = rand(100, 100, seed=1) + 100 * torch.eye(100), rand(100, 1, seed=2)
    with cpu_metal.record() as rec:
        got = torch.ops.mps_ext._linalg_solve_ex(a, b, left=True, check_errors=False)
    assert rec.dispatches == []
    for g, w in zip(got, torch.ops.aten._linalg_solve_ex(a, b, left=True, check_errors=False), strict=True):
        assert torch.equal(g, w)
    a40, b40 = a[:40, :40].contiguous(), b[:40].contiguous()
    with cpu_metal.record() as rec:
        x40 = torch.ops.mps_ext._linalg_solve_ex(a40, b40, left=True, check_errors=False)[0]
    assert [d.kernel for d in rec.dispatches] == ["lu_panel_f32", "lu_solve_f32_1"]
    torch.testing.assert_close(x40.double(), torch.linalg.solve(a40.double(), b40.double()), rtol=1e-5, atol=1e-6)
    why = "matrix rows past 64, the most the kernel's pipeline takes on this GPU"
    assert mps_ext.stats()["linalg"] == {"ran": 1, "fallbacks": {why: 1}, "unavailable": {}}


def test_a_pipeline_below_a_launchs_least_makes_the_kernel_unavailable(simulate, capfd):
    """linear_attention_decode needs a simdgroup at least: a pipeline of 16
    threads cannot run it; remembered, so the next call does not ask the
    backend again."""
    simulate("linear_attention", "linear_attention_decode_f32", kind="max_threads", max_threads=16)
    for _ in range(2):
        with pytest.raises(RuntimeError, match=f"cannot run on CPU here \\({REASON}\\)"):
            qwen35_linear_attention(F32)()
    assert cpu_metal._C._simulated_failure_hits() == 1
    cause = ("the pipeline of kernel linear_attention_decode_f32 runs at most 16 threads per threadgroup on this "
             "GPU; it needs at least 32")
    assert mps_ext.stats()["linear_attention"] == {"ran": 0, "fallbacks": {REASON: 2}, "unavailable": {"CPU": cause}}
    assert cause in capfd.readouterr().err
