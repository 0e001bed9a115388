"""The package surface: availability, registration with aten schemas, routing
to the stock kernel, switches, counters, the report."""

import os
import pathlib
import subprocess
import sys

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
    with pytest.raises(ValueError, match="no op family 'nope'; mps_ext has fp8, grouped_mm, linalg, linear, norm, pad, scaled_mm, softmax"):
        mps_ext.set_enabled("nope", False)


def test_environment_variable_turns_families_off():
    r = python("import mps_ext; print(mps_ext.enabled_ops(), mps_ext.family_status('pad'))",
               env={"MPS_EXT_DISABLE": "pad, bogus"})
    assert r.returncode == 0
    assert "['fp8', 'grouped_mm', 'linalg', 'linear', 'norm', 'scaled_mm', 'softmax'] off: listed in MPS_EXT_DISABLE" in r.stdout
    assert "unknown op families ['bogus']" in r.stderr
    r = python("import mps_ext; print(mps_ext.enabled_ops())", env={"MPS_EXT_DISABLE": "all"})
    assert "[]" in r.stdout




def test_report_and_self_check():
    r = subprocess.run([sys.executable, "-m", "mps_ext_executor", "self-check"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Metal kernels active:" in r.stdout
    assert "self-check passed" in r.stdout
    for fam in mps_ext.families():
        assert fam in r.stdout


def test_the_family_table_check_names_each_missing_or_repeated_definition():
    """_C refuses to load when ops/families.h and the families' files disagree
    (ops_bindings.cpp raises family_table_problem()); what it says:"""
    from mps_ext import _C
    assert _C._family_table_problem([(f, 1) for f in mps_ext.families()]) == ""
    problem = _C._family_table_problem([("pad", 0), ("linear", 1), ("softmax", 2)])
    assert problem == ("the family 'pad' is in ops/families.h but no file defines it with MPS_EXT_FAMILY; "
                       "the family 'softmax' is defined 2 times (MPS_EXT_FAMILY)")


def test_a_family_defined_twice_is_counted_in_the_real_table():
    r = python("from mps_ext import _C; print(repr(_C._define_family_again('pad')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "\"the family 'pad' is defined 2 times (MPS_EXT_FAMILY)\""


def _compile_reasons(tmp_path, body):
    """Compiles `body` in a function after ops/reasons.h (syntax only, the
    installed torch's headers, the standard BuildExtension uses here)."""
    import shutil
    from torch.utils import cpp_extension
    src = tmp_path / "reasons_use.cpp"
    src.write_text('#include "ops/reasons.h"\nusing namespace mps_ext;\nvoid use() {\n' + body + "\n}\n")
    cxx = shutil.which("clang++-19") or shutil.which("clang++") or shutil.which("g++")
    std = "c++20" if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 15) else "c++17"
    cmd = [cxx, f"-std={std}", "-fsyntax-only", "-w", "-I", os.path.join(ROOT, "csrc"),
           *[f"-I{p}" for p in cpp_extension.include_paths()], str(src)]
    return subprocess.run(cmd, capture_output=True, text=True)


def test_fallback_reasons_are_the_tables_and_nothing_else(tmp_path):
    """A fallback reason is an entry of ops/reasons.h's table, named by
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
