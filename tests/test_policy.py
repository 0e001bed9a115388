"""The policy: which aten ops mps_ext leaves to each torch release on MPS,
and that the self-check and the tests accept torch's kernel there (and for a
family turned off), but nowhere else."""

import os
import subprocess
import sys

import pytest
import torch

import mps_ext
from mps_ext import _C, _policy
from mps_ext._selfcheck import judge

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASES = ["2.9.0", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]


def test_every_family_has_its_history_per_release():
    assert set(_policy.HISTORY) == set(mps_ext.families())
    for fam, entries in _policy.HISTORY.items():
        for releases, what, evidence in entries:
            assert what and evidence, fam
        # The entries cover 2.9 to 2.15 once each.
        covered = []
        for releases, _, _ in entries:
            first, _, last = releases.partition("-")
            lo, hi = _policy.torch_version(first + ".0"), _policy.torch_version((last or first) + ".0")
            covered += [r for r in RELEASES if lo <= _policy.torch_version(r) <= hi]
        assert sorted(covered, key=_policy.torch_version) == RELEASES, fam


def test_what_each_release_leaves_to_torch():
    ops = {f: _C.family_aten_ops(f) for f in mps_ext.families()}
    for version in RELEASES[:5]:  # 2.9 to 2.13
        assert all(_policy.left_to_torch(f, version) == {} for f in ops), version
        assert _policy.mm_min_rows(version) == 1
    for version in ["2.14.1", "2.15.0", "2.16.0+cpu"]:
        assert _policy.mm_min_rows(version) == 2  # torch's one-row GEMV for mm and addmm
        assert "aten::linear" not in _policy.left_to_torch("linear", version)  # aten::linear does not use it
    assert _policy.left_to_torch("softmax", "2.14.1") == {}
    assert set(_policy.left_to_torch("softmax", "2.15.0")) == {"aten::_softmax", "aten::_log_softmax"}
    assert _policy.steps_aside("softmax", ops["softmax"], "2.15.0") is None  # its backward stays
    assert "Metal constant_pad_nd" in _policy.steps_aside("pad", ops["pad"], "2.15.0")
    assert _policy.steps_aside("pad", ops["pad"], "2.14.1") is None
    for fam, natives in _policy.NATIVE.items():
        for native in natives:
            assert set(native.ops) <= set(ops[fam]), fam
    for fam, partly in _policy.PARTLY_NATIVE.items():
        for native, _ in partly:
            assert set(native.ops) <= set(ops[fam]), fam


def test_what_each_release_does_with_float8():
    ops = {f: _C.family_aten_ops(f) for f in ("fp8", "scaled_mm")}
    # One switch (set_fp8_e4m3fn_native) serves both families: the same release.
    assert _policy.FP8_E4M3FN.since == _policy.SCALED_MM_E4M3FN.since
    for version in RELEASES[:6]:  # 2.9 to 2.14: no float8 kernel of torch's on MPS
        assert not _policy.fp8_e4m3fn_native(version)
        assert _policy.partly_left_to_torch("fp8", version) == []
    for version in ["2.15.0", "2.16.0+cpu"]:
        assert _policy.fp8_e4m3fn_native(version)
        assert _policy.partly_left_to_torch("fp8", version) == ["float8_e4m3fn left to torch"]
        # float8_e5m2, block-wise recipes and _scaled_mm (v1) stay: both families install.
        for fam in ops:
            assert _policy.left_to_torch(fam, version) == {}
            assert _policy.steps_aside(fam, ops[fam], version) is None


@pytest.fixture
def cpu_policy():
    """Applies policy decisions to the CPU key (in production they apply to
    MPS only), and removes them afterwards."""
    mps_ext.reset_stats()
    yield
    _C.leave_to_torch("softmax", "aten::_softmax", "CPU", "")
    _C.set_mm_min_rows("CPU", 1)
    mps_ext.reset_stats()


def test_an_op_left_to_torch_goes_to_the_stock_kernel(cpu_policy):
    _C.leave_to_torch("softmax", "aten::_softmax", "CPU", "policy: torch's own (test)")
    x = torch.randn(3, 50)
    assert torch.equal(torch.ops.mps_ext._softmax(x, 1, False), torch._softmax(x, 1, False))
    torch.ops.mps_ext._log_softmax(x, 1, False)  # not left to torch
    assert mps_ext.stats()["softmax"]["fallbacks"] == {"policy: torch's own (test)": 1}
    assert mps_ext.stats()["softmax"]["ran"] == 1


def test_one_row_mm_goes_to_torch_gemv_but_linear_keeps_it(cpu_policy):
    _C.set_mm_min_rows("CPU", 2)
    x, w, b = torch.randn(1, 64), torch.randn(32, 64), torch.randn(32)
    torch.ops.mps_ext.mm(x, w.t())
    torch.ops.mps_ext.addmm(b, x, w.t())
    torch.ops.mps_ext.mm(w, x.t())  # one column: the same GEMV in torch
    torch.ops.mps_ext.linear(x, w, b)
    torch.ops.mps_ext.mm(torch.randn(2, 64), w.t())
    s = mps_ext.stats()["linear"]
    assert s["fallbacks"] == {"policy: one row (torch's own GEMV)": 3} and s["ran"] == 2


def stats(ran, **fallbacks):
    return {"ran": ran, "fallbacks": {k.replace("_", " "): v for k, v in fallbacks.items()}, "unavailable": {}}


def test_judge_accepts_decisions_only():
    before = stats(3, turned_off=1)
    assert judge("pad", "executor", before, stats(4, turned_off=1)) == (True, "")
    assert judge("pad", "executor", before, stats(3, turned_off=2)) == (False, "")
    policy = {"ran": 3, "fallbacks": {"turned off": 1, "policy: torch 2.15's own": 1}, "unavailable": {}}
    assert judge("pad", "executor", before, policy) == (False, "")
    ours, problem = judge("pad", "executor", before, stats(3, turned_off=1, kernels_unavailable_on_this_device=1))
    assert not ours and "kernels unavailable on this device" in problem
    ours, problem = judge("pad", "executor", before, before)
    assert not ours and "not counted" in problem
    # On MPS a family that is not installed runs torch's kernel and counts nothing.
    assert "left-out" not in mps_ext.installed_overrides()
    assert judge("left-out", "mps", before, before) == (False, "")


@pytest.mark.parametrize("disable", ["all", "softmax"])
def test_self_check_passes_with_families_turned_off(disable):
    r = subprocess.run([sys.executable, "-m", "mps_ext", "--self-check"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "MPS_EXT_DISABLE": disable})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "self-check passed" in r.stdout
    assert "softmax    48/48 passed (48 on torch's own kernel by policy or switch)" in r.stdout
    if disable == "softmax":
        assert "pad        4/4 passed\n" in r.stdout
