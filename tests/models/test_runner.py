"""mps_ext_executor.run_model: the calls a Mac would send to mps_ext run its
kernels on the executor, those the chosen release's policy leaves to torch
and those the ops do not handle run aten's CPU kernels, and the report says
which and why."""

import pytest
import torch
import torch.nn.functional as F

import mps_ext
from mps_ext import _policy
import mps_ext_executor
from mps_ext_executor import run_model


def test_a_call_mps_ext_takes_runs_its_kernel_and_is_counted_with_its_bytes():
    x = torch.randn(1, 2, 4, 4)
    with run_model("2.13") as report:
        y = F.pad(x, (1, 1, 2, 0), value=0.5)
    torch.testing.assert_close(y, torch.ops.aten.constant_pad_nd(x, (1, 1, 2, 0), 0.5), rtol=0, atol=0)
    pad = report.families["pad"]
    assert (pad.ran, dict(pad.left_to_torch), pad.dispatches) == (1, {}, 1)
    assert pad.ops["aten::constant_pad_nd"].ran == 1
    # One kernel reads the input once and writes the output once (README: 1.000 of the minimum).
    assert pad.bytes == (x.numel() + y.numel()) * 4
    assert report.ran_kernels() == {"pad"}


def test_f_linear_is_one_aten_linear_call_as_on_a_mac():
    """On CPU aten::linear is a composite (t, then mm/addmm); on a Mac it has
    an MPS kernel, mps_ext's override, whose one-row policy differs from mm's
    (torch 2.14+ leaves mm's single row to torch, not linear's)."""
    x, w, b = torch.randn(1, 32), torch.randn(16, 32), torch.randn(16)
    with run_model("2.15") as report:
        y = F.linear(x, w, b)
        z = x @ w.t()
    torch.testing.assert_close(y, x @ w.t() + b)
    torch.testing.assert_close(z, x @ w.t())
    ops = report.families["linear"].ops
    assert ops["aten::linear"].ran == 1
    assert dict(ops["aten::mm"].left_to_torch) == {
        _policy_reason("linear", "aten::mm", "2.15"): 1}


def _policy_reason(family, op, release):
    return mps_ext.POLICY_PREFIX + _policy.left_to_torch(family, release)[op].what


def test_the_policy_of_the_chosen_release_leaves_calls_to_torch():
    x = torch.randn(2, 3, 40)
    with run_model("2.15") as report:
        y = torch.softmax(x, -1)
        p = F.pad(x, (1, 1))
    torch.testing.assert_close(y, torch.ops.aten._softmax(x, -1, False))
    torch.testing.assert_close(p, torch.ops.aten.constant_pad_nd(x, (1, 1), 0.0))
    assert report.ran_kernels() == set()
    assert report.left_to_torch("softmax") == {_policy_reason("softmax", "aten::_softmax", "2.15"): 1}
    assert report.left_to_torch("pad") == {_policy_reason("pad", "aten::constant_pad_nd", "2.15"): 1}
    # The same calls under 2.14's policy run the kernels, and the 2.15 rules are gone after the block.
    with run_model("2.14") as report:
        torch.softmax(x, -1)
        F.pad(x, (1, 1))
    assert report.ran_kernels() == {"softmax", "pad"}
    before = mps_ext.stats()["pad"]["ran"]
    torch.ops.mps_ext.constant_pad_nd(x, (1, 1))
    assert mps_ext.stats()["pad"]["ran"] == before + 1


def test_a_dtype_the_kernels_do_not_take_falls_back_with_its_reason():
    x = torch.randn(3, 50, dtype=torch.float64)
    with run_model("2.13") as report:
        y = torch.log_softmax(x, -1)
    torch.testing.assert_close(y, torch.ops.aten._log_softmax(x, -1, False), rtol=0, atol=0)
    (reason, n), = report.left_to_torch("softmax").items()
    assert n == 1 and reason.startswith("dtype Double"), reason
    assert report.families["softmax"].ran == 0 and report.families["softmax"].dispatches == 0


def test_the_executor_is_requested_inside_and_only_inside():
    assert not mps_ext_executor.requested()
    with run_model():
        assert mps_ext_executor.requested()
    assert not mps_ext_executor.requested()


def test_bad_releases_and_nesting_are_refused():
    with pytest.raises(ValueError, match="older than 2.9"):
        with run_model("2.8"):
            pass
    with pytest.raises(ValueError, match="such as '2.13'"):
        with run_model("latest"):
            pass
    with run_model("2.13"):
        with pytest.raises(RuntimeError, match="already active"):
            with run_model("2.13"):
                pass


def test_the_fp8_modules_run_their_kernels_inside_and_are_reported():
    """mps_ext's own ops, which its fp8 modules call (not an aten op a
    family overrides), are reported under their family too."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 64)).bfloat16()
    mps_ext.quantize_fp8(model)
    x = torch.randn(2, 256).bfloat16()
    with torch.no_grad(), run_model("2.13") as report:
        model(x)
    assert report.ran_kernels() == {"scaled_mm"}
    assert report.families["scaled_mm"].ops["mps_ext::fp8_linear"].ran == 1
    assert report.families["scaled_mm"].dispatches == 1


def test_f_linear_that_needs_its_derivative_decomposes_and_still_trains():
    """torch.ops.mps_ext.linear has no derivative: where autograd needs one,
    F.linear decomposes as on CPU, and its addmm (and the backward's mm,
    whose rows are too many for the GEMV) are routed."""
    x, w, b = torch.randn(2, 32), torch.randn(16, 32, requires_grad=True), torch.randn(16, requires_grad=True)
    with run_model("2.13") as report:
        F.linear(x, w, b).square().sum().backward()
    torch.testing.assert_close(w.grad, 2 * (x @ w.detach().t() + b.detach()).t() @ x)
    ops = report.families["linear"].ops
    assert "aten::linear" not in ops and ops["aten::addmm"].ran == 1
    assert sum(ops["aten::mm"].left_to_torch.values()) == 1  # grad of w: [16, 2] @ [2, 32], 16 rows


def test_rules_set_on_the_cpu_key_before_the_run_do_not_leak_into_it(cpu_policy):
    mps_ext._C.leave_to_torch("pad", "aten::constant_pad_nd", "CPU", mps_ext.POLICY_PREFIX + "a stale rule")
    with run_model("2.13") as report:
        F.pad(torch.randn(2, 5), (1, 1))
    assert report.ran_kernels() == {"pad"}
