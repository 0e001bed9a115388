"""The Mac-only host code compiles: every csrc/**/*.mm is checked with clang as
Objective-C++ (syntax only) against the installed torch's own headers (the
Linux wheel ships ATen/mps) and the stub Apple headers in
csrc/backend/apple_stubs, which declare the selectors we call. Under ARC an
unknown selector is an error, so a typo in a Metal call fails here."""

import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths

from mps_ext.cpu_metal._compiler import find_clang

ROOT = Path(__file__).resolve().parent.parent
MM_FILES = sorted((ROOT / "csrc").rglob("*.mm"))

pytestmark = pytest.mark.skipif(sys.platform == "darwin",
                                reason="on macOS setup.py compiles the .mm files against the real SDK")


def syntax_check(path: Path) -> subprocess.CompletedProcess:
    cmd = [find_clang(), "-fsyntax-only", "-x", "objective-c++", "-std=c++17", "-fobjc-arc", "-fblocks",
           "-fobjc-runtime=macosx-14.0", "-w", "-isystem", str(ROOT / "csrc/backend/apple_stubs"),
           "-I", str(ROOT / "csrc"), "-I", str(ROOT / "kernels_metal")]
    for p in include_paths():
        cmd += ["-I", p]
    return subprocess.run(cmd + [str(path)], capture_output=True, text=True)


def test_there_is_host_code_to_check():
    assert [p.name for p in MM_FILES] == ["metal.mm"]


@pytest.mark.parametrize("path", MM_FILES, ids=lambda p: p.name)
def test_objective_cpp_compiles(path):
    r = syntax_check(path)
    assert r.returncode == 0, r.stderr


def test_a_wrong_selector_fails(tmp_path):
    broken = tmp_path / "broken.mm"
    broken.write_text((ROOT / "csrc/backend/metal.mm").read_text().replace("setBuffer:buffer", "setBufer:buffer"))
    r = syntax_check(broken)
    assert r.returncode != 0 and "setBufer" in r.stderr
