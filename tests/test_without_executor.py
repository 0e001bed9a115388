"""The product without the CPU Metal executor: what `pip install .` builds
and ships holds nothing of executor/, its _C exports none of the executor's
test hooks, and a process that cannot import the executor imports mps_ext,
reports, and routes CPU calls to torch (Linux: no backend of CPU tensors).
The executor registers through the op layer's registration point
(mps_ext._C._backend_slot()), which these tests also check."""

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

import mps_ext
import mps_ext_executor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build_config  # noqa: E402

# Makes mps_ext_executor unimportable, as in a user's environment, whatever
# sys.path and PYTHONPATH hold.
NO_EXECUTOR = """
import sys, importlib.abc
class NoExecutor(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "mps_ext_executor":
            raise ImportError("simulated: mps-ext-executor is not installed")
sys.meta_path.insert(0, NoExecutor())
"""

# The hooks the product's _C held for the executor and its tests before the
# executor became a package of its own (mps_ext_executor._C has them now).
EXECUTOR_HOOKS = ["_simulate_metal_backend", "_metal_backend_present", "_register_shader_source",
                  "_simulate_executor_failure", "_simulated_failure_hits", "_forget_executor_libraries",
                  "_set_executor_requested", "_executor_requested", "_set_executor_profile", "_launch",
                  "_routing_probe", "ExecutorLibrary", "ExecutorRecorder", "KernelError", "executor_worker_count"]


def run(code, *args):
    return subprocess.run([sys.executable, *args, "-c", NO_EXECUTOR + code], capture_output=True, text=True,
                          cwd=ROOT)


def test_the_products_build_and_packages_hold_no_executor_file():
    executor = ROOT / build_config.EXECUTOR
    for platform in ("linux", "darwin"):
        product = build_config.sources(ROOT, platform)
        assert product and not [p for p in product if executor in p.parents], platform
    assert not [d for d in build_config.include_dirs(ROOT) if executor in d.parents or d == executor]
    # setup.py's packages: found under mps_ext only, which holds no executor code.
    assert not (ROOT / "mps_ext" / "cpu_metal").exists()
    assert "package_data" not in (ROOT / "setup.py").read_text()
    names = {p.name for p in build_config.executor_sources(ROOT)}
    assert {"engine.cpp", "backend.cpp", "bindings.cpp", "routing_probe.cpp"} <= names
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".cpp", ".h", ".mm"):
            text = path.read_text()
            assert '#include "engine.h"' not in text and "cpu_metal::" not in text, path


def test_the_product_never_imports_the_executor():
    for path in (ROOT / "mps_ext").rglob("*.py"):
        for line in path.read_text().splitlines():
            assert not line.lstrip().startswith(("import mps_ext_executor", "from mps_ext_executor")), (path, line)


def test_the_products_extension_exports_no_executor_hook():
    assert [h for h in EXECUTOR_HOOKS if hasattr(mps_ext._C, h)] == []
    assert [h for h in ("_simulate_metal_backend", "_register_shader_source", "_simulate_failure", "_launch",
                        "_routing_probe", "ExecutorLibrary") if not hasattr(mps_ext_executor._C, h)] == []


@pytest.mark.skipif(sys.platform == "darwin", reason="on a Mac the backend is Metal")
def test_without_the_executor_mps_ext_imports_reports_and_routes_cpu_calls_to_torch():
    r = run("""
import torch, mps_ext
from mps_ext import _cpu_backend
assert mps_ext._C is not None, mps_ext._load_error
print(_cpu_backend.installed(), _cpu_backend.requested())
s = mps_ext.stats()
print(sorted(s) == mps_ext.families(), all(v == {"ran": 0, "fallbacks": {}, "unavailable": {}} for v in s.values()))
x = torch.randn(2, 8)
print(torch.equal(torch.ops.mps_ext._softmax(x, 1, False), torch._softmax(x, 1, False)))
print(mps_ext.stats()["softmax"])
try:
    torch.ops.mps_ext.moe_route(torch.randn(3, 8), 2)
except RuntimeError as e:
    print(str(e).splitlines()[0])
""")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "False False"
    assert lines[1] == "True True"
    assert lines[2] == "True"
    assert lines[3] == "{'ran': 0, 'fallbacks': {'no backend runs kernels on CPU tensors here': 1}, 'unavailable': {}}"
    assert lines[4].startswith("mps_ext: mps_ext::moe_route cannot run on CPU here (no backend runs kernels on CPU "
                               "tensors here) and torch has no kernel of its own"), lines[4]


@pytest.mark.skipif(sys.platform == "darwin", reason="on a Mac the self-check runs the GPU")
def test_without_the_executor_the_report_and_self_check_run_and_check_nothing():
    r = run("import sys; from mps_ext.__main__ import main; sys.exit(main(['--self-check']))")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Metal kernels active:" in r.stdout
    assert "self-check: nothing to check here (no Apple GPU, and no backend of CPU tensors installed)" in r.stdout


def test_the_backend_slot_is_a_capsule_the_executor_checks():
    slot = mps_ext._C._backend_slot()
    assert type(slot).__name__ == "PyCapsule"
    mps_ext_executor.install()  # again: the suite installed it (conftest.py); idempotent
    assert mps_ext_executor.gpu() == mps_ext_executor.GPU(*mps_ext._C._device_profile("cpu"))
    # A capsule of another name (another extension's) is refused before it is read.
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = ctypes.c_char_p(b"other.capsule")  # kept alive while the capsule lives
    other = new(ctypes.addressof(ctypes.c_int(0)), name, None)
    with pytest.raises(TypeError, match="install takes mps_ext._C._backend_slot"):
        mps_ext_executor._C._install(other)


def test_the_executor_requires_mps_ext_to_have_loaded():
    code = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "mps_ext._C":
            raise ImportError("simulated: libtorch mismatch")
sys.meta_path.insert(0, Block())
import mps_ext_executor
try:
    mps_ext_executor.install()
except RuntimeError as e:
    print(e)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("mps_ext_executor: mps_ext's native extension did not load: "
                                "ImportError: simulated: libtorch mismatch")
