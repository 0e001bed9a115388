"""tools/check_wheel.py on small wheels made here (zip files, no build): a
wheel with what the package needs passes; each defect is named."""

import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import check_wheel  # noqa: E402

LIBRARIES = sorted(p.stem for p in (ROOT / "kernels_metal").glob("*.metal"))
EXT = "mps_ext/_C.cpython-311-darwin.so"
INFO = "mps_ext-0.1.0+torch2.13.dist-info"
METADATA = "Metadata-Version: 2.4\nName: mps_ext\nVersion: 0.1.0+torch2.13\nRequires-Dist: torch<2.14,>=2.13\n" \
           "Requires-Dist: numpy\nRequires-Dist: pytest; extra == \"test\"\n"


def binary(libraries=LIBRARIES, extra=b""):
    """Bytes standing in for _C: machine code around the embedded shader texts."""
    texts = b"".join(b"\x00" + check_wheel.shader_marker(lib) + b"\n#include <metal_stdlib>\n..." for lib in libraries)
    return b"\x7fELF\x00\x01" + texts + extra + b"\x00"


# What a wheel built before the executor moved out held of it (one file
# each of its Python package, now mps_ext_executor, and its headers).
OLD_EXECUTOR = ("mps_ext/cpu_metal/__init__.py", "mps_ext/cpu_metal/include/mx_metal.h")


def contents(executor=False):
    """Wheel path -> bytes of a wheel with what the package needs (and the
    executor's files, as the product shipped them before the executor
    became its own package, when `executor`)."""
    files = {m: b"" for m in check_wheel.product_modules(ROOT, check_wheel.EXECUTOR_PATHS)}
    files.update({p: b"" for p in OLD_EXECUTOR} if executor else {})
    files[EXT] = binary()
    files[f"{INFO}/METADATA"] = METADATA.encode()
    files[f"{INFO}/licenses/LICENSE"] = b"MIT License\n"
    files[f"{INFO}/WHEEL"] = b"Wheel-Version: 1.0\n"
    return files


def wheel(tmp_path, files, name="mps_ext-0.1.0+torch2.13-cp311-cp311-macosx_11_0_arm64.whl"):
    path = tmp_path / name
    with zipfile.ZipFile(path, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)
    return path


FORBID = dict(executor_paths=check_wheel.EXECUTOR_PATHS, executor_strings=check_wheel.EXECUTOR_STRINGS)


def test_a_wheel_with_what_the_package_needs_passes(tmp_path):
    assert check_wheel.check(wheel(tmp_path, contents()), torch="2.13.0", **FORBID) == []
    # A wheel of the product from before the executor moved out passes with the executor check off.
    assert check_wheel.check(wheel(tmp_path, contents(executor=True)), torch="2.13.0") == []
    assert check_wheel.main([str(wheel(tmp_path, contents())), "--torch", "2.13.0", "--forbid-executor"]) == 0


def drop(name):
    def f(files):
        del files[name]
    return f


def put(name, data=b""):
    def f(files):
        files[name] = data
    return f


def metadata(old, new):
    def f(files):
        files[f"{INFO}/METADATA"] = METADATA.replace(old, new).encode()
    return f


DEFECTS = {
    "no _C": (drop(EXT), "mps_ext/_C: 0 compiled extensions"),
    "two _C": (put("mps_ext/_C.abi3.so", binary()), "mps_ext/_C: 2 compiled extensions"),
    "a module missing": (drop("mps_ext/passes/__init__.py"), "mps_ext/passes/__init__.py: missing"),
    "a shader not embedded": (put(EXT, binary(LIBRARIES[1:])), f"kernels_metal/{LIBRARIES[0]}.metal: not embedded"),
    "a loose shader": (put("mps_ext/kernels_metal/softmax.metal"), "loose shader files"),
    "no licence": (drop(f"{INFO}/licenses/LICENSE"), "no LICENSE"),
    "no metadata": (drop(f"{INFO}/METADATA"), "no METADATA"),
    "torch not required": (metadata("Requires-Dist: torch<2.14,>=2.13\n", ""), "torch is not required"),
    "torch unbounded": (metadata("torch<2.14,>=2.13", "torch>=2.9"), "torch is not bounded above"),
    "another torch's pin": (metadata("torch<2.14,>=2.13", "torch<2.15,>=2.14"), "needs torch<2.14,>=2.13"),
    "no local label": (metadata("Version: 0.1.0+torch2.13", "Version: 0.1.0"), "does not carry +torch2.13"),
    "executor package": (put("mps_ext/cpu_metal/__init__.py"), "executor code in the wheel: 1 files under mps_ext/"),
    "executor headers": (put("mps_ext/cpu_metal/include/metal_stdlib"), "under mps_ext/cpu_metal/"),
    "C++ sources": (put("csrc/ops/softmax.cpp"), "under csrc/"),
    "test hooks in _C": (put(EXT, binary(extra=b"_simulate_metal_backend\x00")), "registers the test hook"),
    "op-layer test hooks in _C": (put(EXT, binary(extra=b"_set_index_limit\x00")), "test hook _set_index_limit"),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_defect_is_named(tmp_path, defect):
    change, message = DEFECTS[defect]
    files = contents()
    change(files)
    problems = check_wheel.check(wheel(tmp_path, files), torch="2.13.0", **FORBID)
    assert len(problems) == 1 and message in problems[0], problems
    assert check_wheel.main([str(wheel(tmp_path, files)), "--torch", "2.13.0", "--forbid-executor"]) == 1


def test_the_executor_check_is_on_and_a_switch(tmp_path):
    """On by default (the executor is its own distribution): a wheel with
    the executor's files fails; --no-forbid-executor lets one through."""
    assert check_wheel.FORBID_EXECUTOR
    path = wheel(tmp_path, contents(executor=True))
    assert check_wheel.main([str(path)]) == 1
    assert check_wheel.main([str(path), "--forbid-executor"]) == 1
    assert check_wheel.main([str(path), "--no-forbid-executor"]) == 0
    assert check_wheel.main([str(wheel(tmp_path, contents()))]) == 0
