"""A kernel the machine cannot run never becomes the user's exception.

On a Mac, a Metal library or pipeline can fail to build, or a pipeline can
allow fewer threads per threadgroup than a launch needs at least. The Metal
backend only reports that (BackendUnavailable); launch.cpp and route()
decide: one warning naming the cause, the call and every later one that
needs that kernel (or any kernel of a library that failed) go to torch's own
kernel, stats() and the report say so, and the family's other kernels keep
running. Here the executor backend fails the same way through a test hook
(cpu_metal._C._simulate_failure, the `simulate` fixture of conftest.py), so
that exactly that decision code runs. Launches that adapt to a pipeline's
limit: tests/test_pipeline_limits.py."""

import os
import re
import subprocess
import sys

import pytest
import torch

import mps_ext
from mps_ext import _C
import mps_ext_executor as cpu_metal
from mps_ext.__main__ import report
from decode_steps import linear_attention, linear_attention_inputs, short_conv, short_conv_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REASON = "kernels unavailable on this device"


def overriding_warnings(text):
    return [line for line in text.splitlines() if "cannot run on CPU here" in line]


def test_a_library_that_does_not_build(simulate, capfd):
    simulate("softmax", kind="library")
    x = torch.randn(4, 300)
    want = torch._softmax(x, 1, False)
    with cpu_metal.record() as rec:
        first = torch.ops.mps_ext._softmax(x, 1, False)
        later = [torch.ops.mps_ext._log_softmax(x, 0, False), torch.ops.mps_ext._softmax(x, 1, False)]
    assert torch.equal(first, want) and torch.equal(later[1], want)
    assert torch.equal(later[0], torch._log_softmax(x, 0, False))
    assert rec.dispatches == []  # nothing of softmax ran, and nothing was retried
    assert cpu_metal._C._simulated_failure_hits() == 1
    warned = overriding_warnings(capfd.readouterr().err)
    assert len(warned) == 1, warned
    assert ("the kernels of softmax.metal cannot run on CPU here (softmax.metal failed to compile (simulated)); "
            "the softmax calls on CPU that need them go to PyTorch's own kernel") in warned[0]
    s = mps_ext.stats()["softmax"]
    assert s == {
        "ran": 0,
        "fallbacks": {REASON: 3},
        "unavailable": {"CPU": "softmax.metal failed to compile (simulated)"},
    }
    # Other families are not affected.
    torch.ops.mps_ext.constant_pad_nd(x, [1, 1], 0)
    assert mps_ext.stats()["pad"]["ran"] == 1


def test_the_report_shows_it(simulate, capsys):
    simulate("pad", kind="library")
    torch.ops.mps_ext.constant_pad_nd(torch.ones(3), [1, 1], 0)
    report()
    out = capsys.readouterr().out
    assert re.search(f"^pad +ran 0, fell back: 1 x {re.escape(REASON)}$", out, re.M), out
    assert "kernels unavailable on CPU: pad.metal failed to compile (simulated)" in out


def test_a_failure_of_the_second_kernel_of_an_op(simulate, capfd):
    """An op of two dispatches asks for the second one's pipeline before it
    encodes the first: a failure of the second dispatches nothing."""
    # A row this long is split: a partial dispatch, then a finishing one.
    x = torch.randn(2, 20000)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext._softmax(x, 1, False)
    kernels = [d.kernel for d in rec.dispatches]
    assert kernels == ["softmax_partial_f32_i32_vec", "softmax_finish_f32_f32_i32_vec"]
    mps_ext.reset_stats()
    simulate("softmax", "softmax_finish_f32_f32_i32_vec", kind="pipeline")
    with cpu_metal.record() as rec:
        got = torch.ops.mps_ext._softmax(x, 1, False)
        again = torch.ops.mps_ext._softmax(x, 1, False)
    assert rec.dispatches == []
    want = torch._softmax(x, 1, False)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert cpu_metal._C._simulated_failure_hits() == 1
    assert len(overriding_warnings(capfd.readouterr().err)) == 1
    assert mps_ext.stats()["softmax"]["unavailable"] == {
        "CPU": "cannot build the pipeline of softmax_finish_f32_f32_i32_vec (simulated)"}


def test_a_pipeline_with_fewer_threads_than_a_fixed_launch_needs(simulate, capfd):
    """A launch of fixed size (gemv_cols: 256 threads, its least) on a
    pipeline that allows fewer: the kernel cannot run here; remembered, so
    that the next call does not ask the backend again."""
    x, w = torch.randn(3, 512), torch.randn(512, 700)  # x @ W with W stored [K, N]: the cols kernel
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.mm(x, w)
    d = rec.dispatches[0]  # then gemv_cols_finish, which adds the partial sums of K's splits
    needs = d.threads_per_threadgroup[0]
    assert d.kernel.startswith("gemv_cols_") and needs == 256
    mps_ext.reset_stats()
    simulate("linear", d.kernel, kind="max_threads", max_threads=128)
    got = [torch.ops.mps_ext.mm(x, w) for _ in range(2)]
    for g in got:
        torch.testing.assert_close(g, x @ w, rtol=1e-5, atol=1e-4)
    assert cpu_metal._C._simulated_failure_hits() == 1
    (warned,) = overriding_warnings(capfd.readouterr().err)
    cause = f"the pipeline of kernel {d.kernel} runs at most 128 threads per threadgroup on this GPU; it needs {needs}"
    assert f"kernel {d.kernel} cannot run on CPU here ({cause})" in warned
    assert mps_ext.stats()["linear"] == {"ran": 0, "fallbacks": {REASON: 2}, "unavailable": {"CPU": cause}}
    # The family's other kernels run: the same product with W stored [N, K] (gemv_rows).
    torch.ops.mps_ext.mm(x, w.t().contiguous().t())
    assert mps_ext.stats()["linear"]["ran"] == 1


def test_a_pipeline_with_enough_threads_runs(simulate):
    x, w = torch.randn(3, 512), torch.randn(512, 700)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext.mm(x, w)
    d = rec.dispatches[0]
    simulate("linear", d.kernel, kind="max_threads", max_threads=d.threads_per_threadgroup[0])
    torch.ops.mps_ext.mm(x, w)
    assert mps_ext.stats()["linear"]["ran"] == 2 and mps_ext.stats()["linear"]["unavailable"] == {}


def decode_calls():
    """A call of each decode kernel that was the linear family's until the
    families were split (issue 33), on fresh inputs each time (the steps
    update their state in place): F.linear of one row (gemv_rows), a Gated
    DeltaNet step at Qwen3.5/3.6's head sizes (linear_attention_decode) and
    an LFM2 convolution step (short_conv_decode); by library, which is also
    the family's name."""
    x, w = torch.randn(1, 256), torch.randn(512, 256)
    return {
        "linear": lambda: torch.ops.mps_ext.linear(x, w, None),
        "linear_attention": lambda: linear_attention(linear_attention_inputs(1, 1, 2, 128, 128, 4, torch.float32), 1),
        "short_conv": lambda: short_conv(short_conv_inputs(1, 64, 3, torch.float32)),
    }


def run_each(calls):
    """{library: (result, the kernels it dispatched)}; an op that raised has
    its error as its result."""
    out = {}
    for library, call in calls.items():
        with cpu_metal.record() as rec:
            try:
                got = call()
            except RuntimeError as e:
                got = e
        out[library] = (got, [d.kernel for d in rec.dispatches])
    return out


@pytest.mark.parametrize("failing", ["linear", "linear_attention", "short_conv"])
@pytest.mark.parametrize("kind", ["pipeline", "library"])
def test_one_kernel_failing_leaves_the_familys_other_kernels_running(simulate, capfd, failing, kind):
    """Issue 29: a linear_attention_decode pipeline that could not run took
    the whole linear family down, decode GEMV and short convolution
    included. Now only the calls that need the failing kernel (or, when its
    library failed, any of that library's) go to torch, or raise for
    mps_ext's own ops, which torch has no kernel for; the others run theirs,
    now and later. (They are three families now, so each counts apart.)"""
    calls = decode_calls()
    want = run_each(calls)
    kernel = want[failing][1][0]
    mps_ext.reset_stats()
    simulate(failing, kernel, kind=kind)
    for _ in range(2):
        got = run_each(calls)
        for library, (result, kernels) in got.items():
            if library != failing:
                assert kernels == want[library][1] and torch.equal(result, want[library][0]), library
            elif library == "linear":  # torch's F.linear
                assert kernels == [] and isinstance(result, torch.Tensor)
                torch.testing.assert_close(result, want[library][0], rtol=1e-5, atol=1e-5)
            else:
                assert kernels == [] and f"mps_ext::{kernel[:-4]} cannot run on CPU here ({REASON})" in str(result)
    assert cpu_metal._C._simulated_failure_hits() == 1
    cause = (f"{failing}.metal failed to compile (simulated)" if kind == "library"
             else f"cannot build the pipeline of {kernel} (simulated)")
    stats = mps_ext.stats()
    assert stats[failing] == {"ran": 0, "fallbacks": {REASON: 2}, "unavailable": {"CPU": cause}}
    assert all(stats[other] == {"ran": 2, "fallbacks": {}, "unavailable": {}} for other in calls if other != failing)
    (warned,) = overriding_warnings(capfd.readouterr().err)
    assert f"cannot run on CPU here ({cause}); the {failing} calls on CPU that need" in warned


def test_a_library_failing_takes_down_each_of_its_kernels(simulate):
    """linear_attention.metal failing: its kernels of every dtype, without
    asking the backend again; other libraries run (linear.metal's, once the
    same family's)."""
    simulate("linear_attention", kind="library")
    for dtype in (torch.float32, torch.bfloat16, torch.float32):
        with pytest.raises(RuntimeError, match=f"linear_attention_decode cannot run on CPU here \\({REASON}\\)"):
            linear_attention(linear_attention_inputs(1, 1, 2, 64, 64, 4, dtype), 1)
    assert cpu_metal._C._simulated_failure_hits() == 1
    torch.ops.mps_ext.linear(torch.randn(1, 64), torch.randn(32, 64), None)
    assert mps_ext.stats()["linear"]["ran"] == 1


def test_a_grouped_mm_kernel_failing_leaves_the_rest_of_grouped_mm(simulate):
    """The prefill tiles' pipeline failing: prefill _grouped_mm goes to
    torch; the decode product (another kernel of the same library) and
    moe_route (another library, the moe family's) run theirs."""
    experts = torch.randn(2, 96, 64).transpose(-2, -1)  # the MoE form: W[E, N, K].transpose(-2, -1)
    prefill, decode = torch.randn(128, 64), torch.randn(2, 64)
    offs_prefill, offs_decode = torch.tensor([64, 128], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    logits = torch.randn(3, 8)
    calls = {
        "prefill": lambda: torch.ops.mps_ext._grouped_mm(prefill, experts, offs_prefill),
        "decode": lambda: torch.ops.mps_ext._grouped_mm(decode, experts, offs_decode),
        "route": lambda: torch.ops.mps_ext.moe_route(logits, 2),
    }
    want = run_each(calls)
    (tiles,) = want["prefill"][1]
    assert tiles == "gmm_tiled_f32"
    mps_ext.reset_stats()
    simulate("grouped_mm", tiles, kind="pipeline")
    got = run_each(calls)
    assert got["prefill"][1] == [] and torch.equal(got["prefill"][0],
                                                   torch._grouped_mm(prefill, experts, offs=offs_prefill))
    for name in ("decode", "route"):
        assert got[name][1] == want[name][1]
        for g, w in zip(outputs(got[name][0]), outputs(want[name][0]), strict=True):
            assert torch.equal(g, w), name
    assert mps_ext.stats()["grouped_mm"] == {
        "ran": 1, "fallbacks": {REASON: 1}, "unavailable": {"CPU": f"cannot build the pipeline of {tiles} (simulated)"}}
    assert mps_ext.stats()["moe"] == {"ran": 1, "fallbacks": {}, "unavailable": {}}


def outputs(x):
    return [x] if isinstance(x, torch.Tensor) else list(x)


def test_through_an_aten_override_it_is_a_python_warning():
    """What a Mac user sees: the override of an aten op (installed here on
    the CPU key, in a process of its own) warns through Python's warnings."""
    code = """
import warnings, torch, mps_ext
mps_ext._C.install_overrides(["softmax"], "CPU")
import mps_ext_executor
mps_ext_executor.install()  # mps_ext runs kernels on CPU tensors through it
mps_ext_executor._C._set_requested(True)  # on a Mac CPU tensors reach the executor only when asked
mps_ext_executor._C._simulate_failure("softmax", "", "library", 0)
x = torch.randn(3, 5)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ys = [torch.softmax(x, 1) for _ in range(4)]
print(len(w), str(w[0].message) if w else "")
print(mps_ext.stats()["softmax"])
print(all(torch.allclose(y, x.exp() / x.exp().sum(1, keepdim=True)) for y in ys))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("1 mps_ext: the kernels of softmax.metal cannot run on CPU here"), r.stdout
    assert f"'fallbacks': {{'{REASON}': 4}}" in lines[1]
    assert lines[2] == "True"


NOT_ASKED = "the CPU backend was not asked for"


@pytest.fixture
def mac():
    """As on a Mac: a Metal GPU backend is present (simulated), and the CPU
    Metal executor is not asked for (the suite asks for it: conftest.py)."""
    cpu_metal._C._simulate_metal_backend(1)
    cpu_metal._C._set_requested(False)
    mps_ext.reset_stats()
    try:
        yield
    finally:
        cpu_metal._C._set_requested(True)
        cpu_metal._C._simulate_metal_backend(-1)
        mps_ext.reset_stats()


def test_on_a_mac_cpu_tensors_reach_the_executor_only_when_asked(mac):
    """The executor is the contributor's instrument: on a Mac, a
    torch.ops.mps_ext op on CPU tensors runs torch's CPU kernel unless the
    executor was asked for; mps_ext's own ops, which torch has no kernel
    for, say so."""

    assert cpu_metal._C._metal_backend_present() and not cpu_metal._C._requested()
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with cpu_metal.record() as rec:
        y = torch.ops.mps_ext._softmax(x, 1, False)
        z = torch.ops.mps_ext.linear(x, w, None)
        p = torch.ops.mps_ext.constant_pad_nd(x, [1, 1])
    assert rec.dispatches == []
    assert torch.equal(y, torch._softmax(x, 1, False)) and torch.equal(p, torch.constant_pad_nd(x, [1, 1]))
    torch.testing.assert_close(z, x @ w.t())
    for fam in ("softmax", "linear", "pad"):
        assert mps_ext.stats()[fam] == {"ran": 0, "fallbacks": {NOT_ASKED: 1}, "unavailable": {}}, fam
    logits = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="mps_ext::moe_route cannot run on CPU here \\(the CPU backend was "
                                           "not asked for"):
        torch.ops.mps_ext.moe_route(logits, 2)
    with cpu_metal.request(), cpu_metal.record() as rec:
        assert cpu_metal._C._requested()
        torch.testing.assert_close(torch.ops.mps_ext._softmax(x, 1, False), torch._softmax(x, 1, False))
        torch.ops.mps_ext.moe_route(logits, 2)
    assert not cpu_metal._C._requested()
    assert len(rec.dispatches) >= 2
    assert mps_ext.stats()["softmax"]["ran"] == 1 and mps_ext.stats()["moe"]["ran"] == 1


def test_each_fallback_gives_torchs_result_counts_its_reason_and_calls_torch_unboxed():
    """Every decision route makes sends the call to torch's kernel with the
    op's own signature (no IValue stack: _C._boxed_fallbacks counts the
    fallbacks that were boxed), and stats() reports each reason's text,
    arguments (a dtype, a count, a rule's text) filled in."""
    mps_ext.reset_stats()
    boxed = _C._boxed_fallbacks()
    a9, b = torch.randn(9, 16), torch.randn(16, 12)  # 9 rows and 12 columns: no GEMV either way
    torch.testing.assert_close(torch.ops.mps_ext.mm(a9, b), torch.mm(a9, b), rtol=0, atol=0)
    ai, bi = torch.arange(6).reshape(2, 3), torch.arange(12).reshape(3, 4)
    assert torch.equal(torch.ops.mps_ext.mm(ai, bi), torch.mm(ai, bi))
    a2 = torch.randn(2, 16)
    errors = []
    for mm_out in (torch.ops.mps_ext.mm.out, torch.ops.aten.mm.out):  # an out tensor of another dtype
        with pytest.raises(RuntimeError) as e:
            mm_out(a2, b, out=torch.empty(2, 12, dtype=torch.float64))
        errors.append(str(e.value).splitlines()[0])
    assert errors[0] == errors[1]
    lu = torch.randn(513, 4)
    for x, y in zip(torch.ops.mps_ext.linalg_lu_factor_ex(lu), torch.linalg.lu_factor_ex(lu)):
        assert torch.equal(x, y)
    x = torch.randn(3, 5)
    _C.leave_to_torch("linear", "aten::linear", "CPU", "policy: a test rule")
    try:
        w = torch.randn(4, 5)
        assert torch.equal(torch.ops.mps_ext.linear(x, w, None), torch.nn.functional.linear(x, w))
    finally:
        _C.leave_to_torch("linear", "aten::linear", "CPU", "")
    mps_ext.set_enabled("pad", False)
    try:
        assert torch.equal(torch.ops.mps_ext.constant_pad_nd(x, [1, 2], 0.5), torch.constant_pad_nd(x, [1, 2], 0.5))
    finally:
        mps_ext.set_enabled("pad", True)
    s = mps_ext.stats()
    assert [s[f]["ran"] for f in ("linear", "linalg", "pad")] == [0, 0, 0]
    assert s["linear"]["fallbacks"] == {"float32 with more than 8 rows (a general matmul)": 1,
                                        "dtype Long (float32, float16 and bfloat16 are handled)": 1,
                                        "an out tensor of another dtype": 1, "policy: a test rule": 1}
    assert s["linalg"]["fallbacks"] == {"matrices of more than 512 rows": 1}
    assert s["pad"]["fallbacks"] == {"turned off": 1}
    assert _C._boxed_fallbacks() == boxed
    mps_ext.reset_stats()
