"""The host code compiles against every supported torch release, as a Mac
build of that release compiles it (tools/torch_matrix.py: the release's
macOS arm64 headers and BuildExtension flags, the .mm files as Objective-C++
against the Apple stub headers). The first run downloads each release's
headers; a failed download fails the test."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import torch_matrix  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform == "darwin",
                                reason="on macOS setup.py compiles the sources against the real SDK")


@pytest.mark.parametrize("version", torch_matrix.VERSIONS)
def test_host_code_compiles(version):
    results = torch_matrix.check([version], log=lambda *_: None)
    # The product's sources and the executor's (executor/csrc, against the product's headers).
    assert {r.source for r in results} >= {"csrc/backend/metal.mm", "csrc/dispatch/registration.cpp",
                                           "csrc/generated/shaders.cpp", "executor/csrc/backend.cpp",
                                           "executor/csrc/engine.cpp"}
    assert all(r.ok for r in results), torch_matrix.report(results)


def test_the_standard_is_the_one_buildextension_adds():
    stds = {v: torch_matrix.torch_flags(torch_matrix.fetch(v)).std for v in ("2.9.0", "2.15.0")}
    assert stds == {"2.9.0": "c++17", "2.15.0": "c++20"}


def test_our_macos_code_is_compiled():
    text = "#ifdef __APPLE__\nA\n#endif\n#if defined(__APPLE__) && X\nB\n#endif\n#ifndef __APPLE__\nC\n#endif\n"
    mac = torch_matrix.as_on_mac(text, "x.cpp")
    assert mac.splitlines()[0] == "#if 1 /* __APPLE__ */" and mac.count("\n") == text.count("\n")
    assert mac.splitlines()[3].startswith("#if 1 /* __APPLE__ */ && X")
    assert mac.splitlines()[6] == "#if 0 /* !__APPLE__ */"
    with pytest.raises(torch_matrix.MatrixError, match="x.cpp:2"):
        torch_matrix.as_on_mac("\nint apple = __APPLE__;\n", "x.cpp")


def test_a_wrong_selector_fails(tmp_path):
    """The stubs declare Apple's selectors; under ARC an unknown one is an error."""
    tree = torch_matrix.mac_tree(tmp_path)
    mm = tree / "csrc/backend/metal.mm"
    flags = torch_matrix.torch_flags(torch_matrix.fetch("2.13.0"))
    cmd = torch_matrix.compile_command(torch_matrix.find_clang(), mm, tree, flags)
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    mm.write_text(mm.read_text().replace("setBuffer:buffer", "setBufer:buffer"))
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "setBufer" in r.stderr


def test_a_failed_download_is_an_error_not_a_skip(tmp_path):
    with pytest.raises(torch_matrix.MatrixError, match=r"downloading torch 2\.9\.999 .* failed"):
        torch_matrix.fetch("2.9.999", tmp_path)
    assert not (tmp_path / "2.9.999").exists()


def test_concurrent_fetches_download_once(tmp_path):
    """Parallel test workers share the header cache: one makes it, the
    others wait and read the finished tree."""
    import threading
    import time

    made = []

    def make(tree):
        made.append(1)
        time.sleep(0.3)
        (tree / "header.h").write_text("x")
        return "the.whl"

    got = []
    threads = [threading.Thread(target=lambda: got.append(torch_matrix.cached_download(tmp_path / "v", make)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and got == [tmp_path / "v"] * 3
    assert (tmp_path / "v" / "header.h").read_text() == "x"


def _metal_mm_command(tmp_path, sdk: int):
    """metal.mm's check against the stubs of one macOS SDK, deprecations as errors."""
    tree = torch_matrix.mac_tree(tmp_path)
    flags = torch_matrix.torch_flags(torch_matrix.fetch("2.13.0"))
    cmd = torch_matrix.compile_command(torch_matrix.find_clang(), tree / "csrc/backend/metal.mm", tree, flags)
    return tree / "csrc/backend/metal.mm", cmd[:1] + [f"-D__MAC_OS_X_VERSION_MAX_ALLOWED={sdk}",
                                                       "-Werror=deprecated-declarations"] + cmd[1:]


@pytest.mark.parametrize("sdk", [140000, 150000])
def test_the_math_mode_compiles_with_the_sdks_of_macos_14_and_15(tmp_path, sdk):
    """macOS 15's SDK deprecates fastMathEnabled for mathMode, which macOS 14's
    lacks: metal.mm names each only where the SDK has it undeprecated, and
    the stubs hold both SDKs' declarations."""
    mm, cmd = _metal_mm_command(tmp_path, sdk)
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    # Unguarded, each API fails on the SDK that lacks or deprecates it.
    text = mm.read_text()
    start, end = text.index("void set_safe_math("), text.index("\n}\n", text.index("void set_safe_math("))
    if sdk == 140000:
        mm.write_text(text[:start] + "void set_safe_math(MTLCompileOptions* options) {\n"
                      "  options.mathMode = MTLMathModeSafe;" + text[end:])
        wrong = "mathMode"
    else:
        mm.write_text(text[:start] + "void set_safe_math(MTLCompileOptions* options) {\n"
                      "  options.fastMathEnabled = NO;" + text[end:])
        wrong = "fastMathEnabled"
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and wrong in r.stderr, r.stderr[-3000:]
