"""The package surface: availability, registration with aten schemas, routing
to the stock kernel, switches, counters, the report."""

import os
import pathlib
import subprocess
import sys
import warnings

import pytest
import torch

import mps_ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python(code, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_unavailable_reason_is_one_sentence_naming_the_cause():
    reason = mps_ext.unavailable_reason()
    if sys.platform != "darwin":
        assert reason == "mps_ext's Metal kernels run on macOS with an Apple GPU; this is Linux."
        assert not mps_ext.is_available()
    else:
        assert (reason is None) == mps_ext.is_available()


def test_import_never_raises_even_when_the_extension_is_broken():
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mps_ext._C":
            raise ImportError("simulated: libtorch mismatch")
sys.meta_path.insert(0, Block())
import mps_ext
print(mps_ext.is_available(), mps_ext.families(), mps_ext.stats(), repr(mps_ext._load_error))
"""
    r = python(code)
    assert r.returncode == 0, r.stderr
    assert "False [] {} 'ImportError: simulated: libtorch mismatch'" in r.stdout


def test_ops_have_the_aten_schemas():
    for fam in mps_ext.families():
        for op in mps_ext._C.family_aten_ops(fam):
            name, _, overload = op.split("::")[1].partition(".")
            ours = getattr(getattr(torch.ops.mps_ext, name), overload or "default")._schema
            aten = getattr(getattr(torch.ops.aten, name), overload or "default")._schema
            assert [(a.name, str(a.type)) for a in ours.arguments] == [(a.name, str(a.type)) for a in aten.arguments]
            assert [str(r.type) for r in ours.returns] == [str(r.type) for r in aten.returns]


def test_unsupported_inputs_go_to_the_stock_kernel_and_are_counted():
    mps_ext.reset_stats()
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(torch.ops.mps_ext._softmax(x, 1, False), torch._softmax(x, 1, False))
    y = torch.zeros(2, dtype=torch.complex128)
    assert torch.equal(torch.ops.mps_ext.constant_pad_nd(y, [1, 1], 0), torch.constant_pad_nd(y, [1, 1]))
    s = mps_ext.stats()
    assert s["softmax"] == {"ran": 0, "fallbacks": {"dtype Double (float32, float16 and bfloat16 are handled)": 1},
                            "unavailable": {}}
    assert s["pad"]["fallbacks"] == {"dtype ComplexDouble (elements of 1, 2, 4 or 8 bytes are handled)": 1}


def test_disabled_sends_calls_to_the_stock_kernel():
    mps_ext.reset_stats()
    x = torch.randn(2, 5)
    with mps_ext.disabled("softmax"):
        assert "softmax" not in mps_ext.enabled_ops() and "pad" in mps_ext.enabled_ops()
        torch.ops.mps_ext._softmax(x, 1, False)
        torch.ops.mps_ext.constant_pad_nd(x, [1, 1], 0)
    torch.ops.mps_ext._softmax(x, 1, False)
    s = mps_ext.stats()
    assert s["softmax"] == {"ran": 1, "fallbacks": {"turned off": 1}, "unavailable": {}}
    assert s["pad"] == {"ran": 1, "fallbacks": {}, "unavailable": {}}
    assert "softmax" in mps_ext.enabled_ops()


def test_disabled_restores_after_an_error():
    with pytest.raises(ZeroDivisionError):
        with mps_ext.disabled():
            assert mps_ext.enabled_ops() == []
            1 / 0
    assert set(mps_ext.enabled_ops()) == set(mps_ext.families())


def test_set_enabled_rejects_unknown_families():
    with pytest.raises(
        ValueError,
        match="no op family 'nope'; mps_ext has attention_gate, fp8, grouped_mm, kv_cache, "
        "linalg, linear, linear_attention, moe, norm, pad, scaled_mm, short_conv, softmax",
    ):
        mps_ext.set_enabled("nope", False)


def test_environment_variable_turns_families_off():
    r = python("import mps_ext; print(mps_ext.enabled_ops(), mps_ext.family_status('pad'))",
               env={"MPS_EXT_DISABLE": "pad, bogus"})
    assert r.returncode == 0
    assert ("['attention_gate', 'fp8', 'grouped_mm', 'kv_cache', 'linalg', 'linear', 'linear_attention', 'moe', "
            "'norm', 'scaled_mm', 'short_conv', 'softmax'] off: listed in MPS_EXT_DISABLE") in r.stdout
    assert "unknown op families ['bogus']" in r.stderr
    r = python("import mps_ext; print(mps_ext.enabled_ops())", env={"MPS_EXT_DISABLE": "all"})
    assert "[]" in r.stdout




# The families split off each old name (issue 33): what the old name used to
# switch besides itself, from which op files routed through it before.
SPLIT = {"norm": {"kv_cache", "attention_gate"}, "linear": {"linear_attention", "short_conv"},
         "grouped_mm": {"moe"}}


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each old name warns once a process: forget which did, and restore the
    switches after the test."""
    monkeypatch.setattr(mps_ext, "_warned_split", set())
    yield
    for fam in mps_ext.families():
        mps_ext._C.set_enabled(fam, True)


@pytest.mark.parametrize("old", sorted(SPLIT))
def test_an_old_name_alone_keeps_its_old_set_and_warns_once(fresh_warnings, old):
    with pytest.warns(DeprecationWarning, match=f"'{old}' no longer includes ") as caught:
        mps_ext.set_enabled(old, False)
    assert all(new in str(caught[0].message) for new in SPLIT[old])
    assert {f for f in mps_ext.families() if not mps_ext._C.is_enabled(f)} == {old} | SPLIT[old]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        mps_ext.set_enabled(old, True)
        assert set(mps_ext.enabled_ops()) == set(mps_ext.families())
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        with mps_ext.disabled(old):
            assert {f for f in mps_ext.families() if not mps_ext._C.is_enabled(f)} == {old} | SPLIT[old]
    assert not [w for w in again if issubclass(w.category, DeprecationWarning)]
    assert set(mps_ext.enabled_ops()) == set(mps_ext.families())


def test_an_old_name_beside_a_new_family_means_the_new_ones(fresh_warnings):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mps_ext.disabled("linear", "short_conv", "kv_cache"):
            off = {f for f in mps_ext.families() if not mps_ext._C.is_enabled(f)}
        assert off == {"linear", "short_conv", "kv_cache"}  # linear_attention stays on
        mps_ext.set_enabled("moe", False)
        assert mps_ext._C.is_enabled("grouped_mm")


def test_an_old_name_in_the_environment_keeps_its_old_set():
    r = subprocess.run(
        [
            sys.executable,
            "-W",
            "always::DeprecationWarning",
            "-c",
            "import mps_ext; print(mps_ext.enabled_ops()); print(mps_ext.family_status('moe'))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "MPS_EXT_DISABLE": "grouped_mm,pad"},
    )
    assert r.returncode == 0, r.stderr
    on, moe = r.stdout.splitlines()[-2:]
    assert "'grouped_mm'" not in on and "'moe'" not in on and "'pad'" not in on and "'linear'" in on
    assert moe == "off: MPS_EXT_DISABLE lists grouped_mm, which included it"
    assert "DeprecationWarning: mps_ext: the op family 'grouped_mm' no longer includes moe" in r.stderr


def test_each_own_op_is_listed_by_the_family_whose_switch_it_obeys():
    """_C.family_own_ops (the registration's list, which `python -m mps_ext`
    prints) names each of torch.ops.mps_ext's own ops once, under the family
    whose switch it obeys (its RoutedOp's FamilyId); commit obeys none."""
    from test_docs import family_of, own_ops
    from mps_ext import _C
    listed = [(op.removeprefix("mps_ext::"), fam) for fam in mps_ext.families() for op in _C.family_own_ops(fam)]
    assert len(dict(listed)) == len(listed)
    assert dict(listed) == {op: family_of(op) for op in own_ops() if op != "commit"}
    assert {"kv_append", "sigmoid_gate", "moe_layer", "linear_attention_decode", "short_conv_decode"} <= dict(
        listed
    ).keys()


def test_report_and_self_check():
    r = subprocess.run(
        [sys.executable, "-m", "mps_ext_executor", "self-check"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Metal kernels active:" in r.stdout
    assert "self-check passed" in r.stdout
    for fam in mps_ext.families():
        assert fam in r.stdout


def test_the_family_table_check_names_each_missing_or_repeated_definition():
    """_C refuses to load when dispatch/families.h and the families' files disagree
    (ops_bindings.cpp raises family_table_problem()); what it says:"""
    from mps_ext import _C
    assert _C._family_table_problem([(f, 1) for f in mps_ext.families()]) == ""
    problem = _C._family_table_problem([("pad", 0), ("linear", 1), ("softmax", 2)])
    assert problem == ("the family 'pad' is in dispatch/families.h but no file defines it with MPS_EXT_FAMILY; "
                       "the family 'softmax' is defined 2 times (MPS_EXT_FAMILY)")


def test_a_family_defined_twice_is_counted_in_the_real_table():
    r = python("from mps_ext import _C; print(repr(_C._define_family_again('pad')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "\"the family 'pad' is defined 2 times (MPS_EXT_FAMILY)\""


def _compile_reasons(tmp_path, body):
    """Compiles `body` in a function after dispatch/reasons.h (syntax only, the
    installed torch's headers, the standard BuildExtension uses here)."""
    import shutil
    from torch.utils import cpp_extension
    src = tmp_path / "reasons_use.cpp"
    src.write_text('#include "dispatch/reasons.h"\nusing namespace mps_ext;\nvoid use() {\n' + body + "\n}\n")
    cxx = shutil.which("clang++-19") or shutil.which("clang++") or shutil.which("g++")
    std = "c++20" if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 15) else "c++17"
    cmd = [cxx, f"-std={std}", "-fsyntax-only", "-w", "-I", os.path.join(ROOT, "csrc"),
           *[f"-I{p}" for p in cpp_extension.include_paths()], str(src)]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_fallback_reasons_are_the_tables_and_nothing_else(tmp_path):
    """A fallback reason is an entry of dispatch/reasons.h's table, named by
    because::<name>; its arguments fit the text's placeholders. A name not in
    the table, a string, or arguments of the wrong kind or number do not
    compile."""
    ok = _compile_reasons(tmp_path, """
  Reason a = because::not_strided;
  Reason b = because::dtype_not_float(c10::ScalarType::Half);
  Reason c = because::gradient_dtype(c10::ScalarType::Float, c10::ScalarType::Half);
  Reason d = because::foreign_device(c10::DeviceType::CPU, c10::DeviceType::MPS);
  Reason e = because::rows_past(512) || because::policy(std::string("policy: x"));
  (void)a; (void)b; (void)c; (void)d; (void)e;""")
    assert ok.returncode == 0, ok.stderr[-3000:]
    wrong = [
        "Reason r1 = because::no_such_reason;",
        'Reason r2 = "layout is not strided";',
        "Reason r3 = because::dtype_not_float(c10::DeviceType::CPU);",
        "Reason r4 = because::gradient_dtype(c10::ScalarType::Float);",
        'Reason r5 = because::policy("policy: a literal, not interned text");',
        "Reason r6 = because::dtype_not_float;",
    ]
    # One compile: each line must be named by an error (or by the
    # instantiation that fails a static_assert) at its own line number.
    r = _compile_reasons(tmp_path, "\n".join("  " + line for line in wrong))
    assert r.returncode != 0
    first = 4  # the body starts at line 4 of reasons_use.cpp
    for n, line in enumerate(wrong, first):
        assert f"reasons_use.cpp:{n}:" in r.stderr, (line, r.stderr[-3000:])


def test_the_version_is_written_once():
    """pyproject.toml reads the version from mps_ext/__init__.py: the
    installed distribution's metadata and the module agree."""
    import importlib.metadata
    assert importlib.metadata.version("mps_ext") == mps_ext.__version__
    import tomllib
    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert "version" in project["dynamic"] and "version" not in project
