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


def history() -> dict[str, list[tuple[str, str, str]]]:
    """docs/dev/policy.md's tables: per family (its '## name' section), the rows
    (releases, what torch has on MPS, evidence)."""
    out, family = {}, None
    with open(os.path.join(ROOT, "docs", "dev", "policy.md")) as f:
        for line in f:
            if line.startswith("## "):
                family = line[3:].strip()
                out[family] = []
            elif family and line.startswith("| 2."):
                releases, what, evidence = [cell.strip() for cell in line.strip().strip("|").split("|")]
                out[family].append((releases, what, evidence))
    return out


def test_every_family_has_its_history_per_release():
    entries_of = history()
    assert set(entries_of) == set(mps_ext.families())
    for fam, entries in entries_of.items():
        for releases, what, evidence in entries:
            assert what and evidence, fam
        # The entries cover 2.9 to 2.15 once each.
        covered = []
        for releases, _, _ in entries:
            first, _, last = releases.partition("-")
            lo, hi = _policy.torch_version(first + ".0"), _policy.torch_version((last or first) + ".0")
            covered += [r for r in RELEASES if lo <= _policy.torch_version(r) <= hi]
        assert sorted(covered, key=_policy.torch_version) == RELEASES, fam


def test_conditions_are_the_op_layers():
    """A rule's calls are a named condition the C++ op layer knows by the
    same name (csrc/dispatch/registry.h), and it refuses any other."""
    assert {c.value for c in _policy.Condition} == set(_C.policy_conditions())
    for natives in _policy.NATIVE.values():
        for native in natives:
            assert native.calls is None or isinstance(native.calls, _policy.Condition)
    with pytest.raises(RuntimeError, match="no policy condition named 'one row'; the conditions are one_row"):
        _C.leave_to_torch("linear", "aten::mm", "CPU", "policy: test", [], [], "one row")


def test_unknown_families_and_ops_are_errors(cpu_policy):
    """A family is one entry of one table (csrc/dispatch/families.h): a name not
    in it is an error, never a new family that nothing installs; a rule for
    an op its family does not have is an error, never a rule that nothing
    reads."""
    assert mps_ext.families() == sorted(mps_ext.families())
    with pytest.raises(
        RuntimeError, match="no op family named 'softmx'; the families are attention_gate, fp8, grouped_mm, kv_cache"
    ):
        _C.set_enabled("softmx", False)
    with pytest.raises(RuntimeError, match="no op family named 'lineaer'"):
        _C.leave_to_torch("lineaer", "aten::mm", "CPU", "policy: test")
    with pytest.raises(RuntimeError, match="the linear family has no op aten::_softmax"):
        _C.leave_to_torch("linear", "aten::_softmax", "CPU", "policy: test")
    assert "softmx" not in mps_ext.stats()
    # The policy's families are the op layer's, and mps_ext's import checks it.
    assert set(_policy.NATIVE) <= set(mps_ext.families())
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("mps_ext._policy", {os.path.join(ROOT, "mps_ext", "_policy.py")!r})
policy = importlib.util.module_from_spec(spec)
sys.modules["mps_ext._policy"] = policy
spec.loader.exec_module(policy)
policy.NATIVE["softmx"] = policy.NATIVE["softmax"]
import mps_ext
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "mps_ext/_policy.py has rules for unknown op families ['softmx']" in r.stderr, r.stderr


def test_what_each_release_leaves_to_torch():
    ops = {f: _C.family_aten_ops(f) for f in mps_ext.families()}
    for version in RELEASES[:5]:  # 2.9 to 2.13
        assert all(_policy.left_to_torch(f, version) == {} for f in ops), version
    for version in ["2.14.1", "2.15.0", "2.16.0+cpu"]:
        # torch's one-row GEMV for mm and addmm; aten::linear does not use it
        left = _policy.left_to_torch("linear", version)
        assert set(left) == {"aten::mm", "aten::addmm", "aten::mm.out", "aten::addmm.out"}
        assert left["aten::mm"].scope() == "one row"
        assert _policy.steps_aside("linear", ops["linear"], version) is None
    assert _policy.left_to_torch("softmax", "2.14.1") == {}
    assert set(_policy.left_to_torch("softmax", "2.15.0")) == {"aten::_softmax", "aten::_log_softmax"}
    assert _policy.steps_aside("softmax", ops["softmax"], "2.15.0") is None  # its backward stays
    # pad on 2.15: torch's Metal kernels, except the float8 formats they lack
    assert _policy.left_to_torch("pad", "2.14.1") == {}
    pad = _policy.left_to_torch("pad", "2.15.0")["aten::constant_pad_nd"]
    assert set(pad.kept_dtypes) == {"float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"}
    assert _policy.steps_aside("pad", ops["pad"], "2.15.0") is None
    # linalg on 2.15: torch's Metal LU and solves, its float32 inverse; mps_ext
    # keeps LU without pivoting, complex64 inverses (torch refuses both) and
    # lu_unpack.
    assert _policy.left_to_torch("linalg", "2.14.1") == {}
    left = _policy.left_to_torch("linalg", "2.15.0")
    assert set(left) == set(ops["linalg"]) - {"aten::lu_unpack", "aten::linalg_lu_factor"}
    assert left["aten::linalg_inv_ex"].scope() == "not complex64"
    assert left["aten::linalg_lu_factor_ex"].scope() == left["aten::linalg_lu"].scope() == "not pivot=False"
    assert _policy.steps_aside("linalg", ops["linalg"], "2.15.0") is None
    # grouped_mm on 2.15: torch's Metal _grouped_mm but for the bfloat16
    # prefills the op picks (tests/ops/test_grouped_mm.py, policy);
    # _scaled_grouped_mm, which no release has on MPS, stays.
    assert _policy.left_to_torch("grouped_mm", "2.14.1") == {}
    assert set(_policy.left_to_torch("grouped_mm", "2.15.0")) == {"aten::_grouped_mm"}
    rule = _policy.left_to_torch("grouped_mm", "2.15.0")["aten::_grouped_mm"]
    assert rule.calls == _policy.Condition.TORCH_GROUPED_MM
    assert _policy.steps_aside("grouped_mm", ops["grouped_mm"], "2.15.0") is None
    for fam, natives in _policy.NATIVE.items():
        for native in natives:
            assert set(native.ops) <= set(ops[fam]), fam


def test_what_each_release_does_with_float8():
    ops = {f: _C.family_aten_ops(f) for f in ("fp8", "scaled_mm")}
    for version in RELEASES[:6]:  # 2.9 to 2.14: no float8 kernel of torch's on MPS
        assert all(_policy.left_to_torch(f, version) == {} for f in ops), version
    for version in ["2.15.0", "2.16.0+cpu"]:
        # float8_e4m3fn tensors left to torch, float8_e5m2 kept; tensor-wise
        # and row-wise e4m3fn _scaled_mm_v2 left to torch (the op picks the
        # calls), block-wise recipes and _scaled_mm (v1, no MPS kernel) kept:
        # both families install.
        # Of the value ops, those torch 2.15 has float8_e4m3fn kernels or
        # dispatch for; no float8 lt/le/gt/ge, and nothing shows its
        # indexing, index_put_, where, masked_fill_, repeat, flip take float8.
        fp8 = _policy.left_to_torch("fp8", version)
        assert set(ops["fp8"]) - set(fp8) == {
            "aten::lt.Tensor", "aten::lt.Scalar", "aten::le.Tensor", "aten::le.Scalar", "aten::gt.Tensor",
            "aten::gt.Scalar", "aten::ge.Tensor", "aten::ge.Scalar", "aten::index.Tensor", "aten::_index_put_impl_",
            "aten::where.self", "aten::masked_fill_.Scalar", "aten::masked_fill_.Tensor", "aten::repeat",
            "aten::flip"}
        assert {"aten::_local_scalar_dense", "aten::eq.Tensor", "aten::ne.Scalar", "aten::equal", "aten::gather"} < set(
            fp8
        )
        assert {r.scope() for r in fp8.values()} == {"not float8_e5m2"}
        scaled = _policy.left_to_torch("scaled_mm", version)
        assert set(scaled) == {"aten::_scaled_mm_v2"} and scaled["aten::_scaled_mm_v2"].calls
        for fam in ops:
            assert _policy.steps_aside(fam, ops[fam], version) is None


def test_an_op_left_to_torch_goes_to_the_stock_kernel(cpu_policy):
    _C.leave_to_torch("softmax", "aten::_softmax", "CPU", "policy: torch's own (test)")
    x = torch.randn(3, 50)
    assert torch.equal(torch.ops.mps_ext._softmax(x, 1, False), torch._softmax(x, 1, False))
    torch.ops.mps_ext._log_softmax(x, 1, False)  # not left to torch
    assert mps_ext.stats()["softmax"]["fallbacks"] == {"policy: torch's own (test)": 1}
    assert mps_ext.stats()["softmax"]["ran"] == 1


def test_one_row_mm_goes_to_torch_gemv_but_linear_keeps_it(cpu_policy):
    # A rule whose calls the op's own code picks (one row).
    mps_ext._leave_to_torch("linear", _policy.left_to_torch("linear", "2.14.1"), "CPU")
    x, w, b = torch.randn(1, 64), torch.randn(32, 64), torch.randn(32)
    torch.ops.mps_ext.mm(x, w.t())
    torch.ops.mps_ext.addmm(b, x, w.t())
    torch.ops.mps_ext.mm(w, x.t())  # one column: the same GEMV in torch
    torch.ops.mps_ext.mm(x, w.t(), out=torch.empty(1, 32))  # the out= forms (torch.compile's inductor)
    torch.ops.mps_ext.addmm(b, x, w.t(), out=torch.empty(1, 32))
    torch.ops.mps_ext.linear(x, w, b)
    torch.ops.mps_ext.mm(torch.randn(2, 64), w.t())
    torch.ops.mps_ext.mm(torch.randn(2, 64), w.t(), out=torch.empty(2, 32))
    s = mps_ext.stats()["linear"]
    assert s["fallbacks"] == {"policy: torch 2.14 has its own one-row GEMV for mm and addmm": 5} and s["ran"] == 3


def test_a_rule_can_keep_some_dtypes_and_some_argument_values(cpu_policy):
    why = "policy: torch's own (test)"
    _C.leave_to_torch("linalg", "aten::linalg_inv_ex", "CPU", why, [torch.complex64])
    _C.leave_to_torch("linalg", "aten::linalg_lu_factor_ex", "CPU", why, [], [("pivot", False)])
    a = torch.randn(3, 3) + 3 * torch.eye(3)
    for dtype, ours in [(torch.float32, False), (torch.complex64, True)]:
        mps_ext.reset_stats()
        inv, _ = torch.ops.mps_ext.linalg_inv_ex(a.to(dtype))
        torch.testing.assert_close(inv, torch.linalg.inv(a.to(dtype)))
        assert mps_ext.stats()["linalg"]["ran"] == int(ours)
    for pivot, ours in [(True, False), (False, True)]:
        mps_ext.reset_stats()
        torch.ops.mps_ext.linalg_lu_factor_ex(a, pivot=pivot)
        assert mps_ext.stats()["linalg"]["ran"] == int(ours)
        assert mps_ext.stats()["linalg"]["fallbacks"] == ({} if ours else {why: 1})
    with pytest.raises(RuntimeError, match="has no bool argument named 'pivoting'"):
        _C.leave_to_torch("linalg", "aten::linalg_lu", "CPU", why, [], [("pivoting", False)])


def test_pad_on_torch_2_15_keeps_the_dtypes_its_kernel_lacks(cpu_policy):
    # torch 2.15's constant_pad_nd kernels are instantiated for 15 dtypes, no
    # float8 format but e4m3fn (the names in its libtorch_cpu.dylib):
    # mps_ext keeps the other float8 formats it pads.
    mps_ext._leave_to_torch("pad", _policy.left_to_torch("pad", "2.15.0"), "CPU")
    x = torch.randn(2, 3)
    for dtype, ours in [(torch.float32, False), (torch.float8_e4m3fn, False), (torch.int16, False),
                        (torch.float8_e5m2, True), (torch.float8_e4m3fnuz, True), (torch.float8_e5m2fnuz, True)]:
        mps_ext.reset_stats()
        got = torch.ops.mps_ext.constant_pad_nd(x.to(dtype), [1, 1])
        want = torch.constant_pad_nd(x.to(dtype), [1, 1])
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if dtype.is_floating_point else \
            torch.equal(got, want)
        assert mps_ext.stats()["pad"]["ran"] == int(ours), dtype


def test_linalg_on_torch_2_15_op_by_op(cpu_policy):
    """The 2.15 table as it is installed (here on the CPU key): which calls
    go to torch's kernel."""
    rules = _policy.left_to_torch("linalg", "2.15.0")
    mps_ext._leave_to_torch("linalg", rules, "CPU")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 5, 5, generator=g) + 4 * torch.eye(5)
    b = torch.randn(2, 5, 3, generator=g)
    lu, piv = torch.linalg.lu_factor(a)
    calls = [  # (call, mps_ext's kernel runs)
        (lambda: torch.ops.mps_ext.linalg_lu_factor_ex(a), False),
        (lambda: torch.ops.mps_ext.linalg_lu_factor_ex(a, pivot=False), True),
        (lambda: torch.ops.mps_ext.linalg_lu(a.to(torch.complex64)), False),
        (lambda: torch.ops.mps_ext.linalg_lu(a, pivot=False), True),
        (lambda: torch.ops.mps_ext.lu_unpack(lu, piv), True),
        (lambda: torch.ops.mps_ext.linalg_solve_triangular(a.triu(), b, upper=True), False),
        (lambda: torch.ops.mps_ext.triangular_solve(b, a.triu()), False),
        (lambda: torch.ops.mps_ext.linalg_lu_solve(lu, piv, b), False),
        (lambda: torch.ops.mps_ext._linalg_solve_ex(a, b), False),
        (lambda: torch.ops.mps_ext._linalg_det(a), False),
        (lambda: torch.ops.mps_ext._linalg_slogdet(a.to(torch.complex64)), False),
        (lambda: torch.ops.mps_ext.linalg_inv_ex(a), False),
        (lambda: torch.ops.mps_ext.linalg_inv_ex(a.to(torch.complex64)), True),
    ]
    for i, (fn, ours) in enumerate(calls):
        mps_ext.reset_stats()
        fn()
        s = mps_ext.stats()["linalg"]
        assert s["ran"] == int(ours), i
        assert all(why.startswith(mps_ext.POLICY_PREFIX) for why in s["fallbacks"]), i


def test_grouped_mm_on_torch_2_15(cpu_policy):
    """The 2.15 table installed on the CPU key: _grouped_mm goes to torch's
    kernel; _scaled_grouped_mm and mps_ext's own MoE ops run mps_ext's."""
    rules = _policy.left_to_torch("grouped_mm", "2.15.0")
    mps_ext._leave_to_torch("grouped_mm", rules, "CPU")
    try:
        a, w = torch.randn(4, 32).bfloat16(), torch.randn(3, 16, 32).bfloat16()
        offs = torch.tensor([1, 1, 4], dtype=torch.int32)
        a8, w8 = a.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).transpose(-2, -1)
        calls = [  # (call, its family, mps_ext's kernel runs)
            (lambda: torch.ops.mps_ext._grouped_mm(a, w.transpose(-2, -1), offs), "grouped_mm", False),
            (lambda: torch.ops.mps_ext._scaled_grouped_mm(a8, w8, torch.ones(4), torch.ones(3, 16), offs), "grouped_mm",
             True),
            (lambda: torch.ops.mps_ext.moe_experts(a, w, None, offs), "moe", True),
        ]
        for i, (fn, fam, ours) in enumerate(calls):
            mps_ext.reset_stats()
            fn()
            s = mps_ext.stats()[fam]
            assert s["ran"] == int(ours), i
            assert all(why.startswith(mps_ext.POLICY_PREFIX) for why in s["fallbacks"]) and bool(s["fallbacks"]) != ours
    finally:
        for op in rules:
            _C.leave_to_torch("grouped_mm", op, "CPU", "")


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
    r = subprocess.run(
        [sys.executable, "-m", "mps_ext_executor", "self-check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MPS_EXT_DISABLE": disable},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "self-check passed" in r.stdout
    assert "softmax    48/48 passed (48 on torch's own kernel by policy or switch)" in r.stdout
    if disable == "softmax":
        assert "pad        4/4 passed\n" in r.stdout
