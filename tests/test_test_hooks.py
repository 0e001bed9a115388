"""The product's _C exports no test hooks: the op layer's are compiled only
with MPS_EXT_TEST_HOOKS=1 (scripts/setup.sh builds the tests' _C so;
tools/build_config.py), the executor's are in its own package
(tests/test_without_executor.py). A user's build and the release wheels
have none (tools/check_wheel.py looks for their names in _C)."""

import re
import struct
import sys
from pathlib import Path

import pytest

from tools import build_config

ROOT = Path(__file__).resolve().parents[1]
# What the product's _C registers under a leading underscore without the
# flag: the registration point of a CPU backend, and the GPU profile the ops'
# launch geometry assumes (the executor mirrors it).
NOT_TEST_HOOKS = {"_backend_slot", "_device_profile"}


def underscore_defs_outside_the_hooks(text: str) -> set[str]:
    """The `m.def("_name"` of C++ source text outside #ifdef MPS_EXT_TEST_HOOKS ... #endif."""
    outside = re.sub(r"#ifdef MPS_EXT_TEST_HOOKS\b.*?#endif", "", text, flags=re.S)
    return set(re.findall(r'm\.def\(\s*"(_\w+)"', outside))


def test_every_underscore_binding_of_the_product_is_behind_the_flag():
    found = set()
    for path in sorted((ROOT / "csrc").rglob("*.cpp")):
        found |= underscore_defs_outside_the_hooks(path.read_text())
    assert found <= NOT_TEST_HOOKS, f"test hooks compiled into every build: {sorted(found - NOT_TEST_HOOKS)}"


def test_the_check_sees_a_hook_outside_the_flag():
    text = ('#ifdef MPS_EXT_TEST_HOOKS\n  m.def("_set_index_limit", f);\n#endif\n'
            '  m.def("_clear_unavailable", g);\n  m.def("stats", h);\n')
    assert underscore_defs_outside_the_hooks(text) == {"_clear_unavailable"}


def test_the_flag_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(build_config.TEST_HOOKS_ENV, raising=False)
    assert "-DMPS_EXT_TEST_HOOKS" not in build_config.compile_args("linux")
    assert "-DMPS_EXT_TEST_HOOKS" in build_config.compile_args("linux", test_hooks=True)
    monkeypatch.setenv(build_config.TEST_HOOKS_ENV, "1")
    assert "-DMPS_EXT_TEST_HOOKS" in build_config.compile_args("linux")


def test_scripts_setup_builds_the_tests_product_with_the_hooks():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(rf'{build_config.TEST_HOOKS_ENV}=1 python -m pip install [^\n]*-e "\.\[test\]"', setup)


def test_the_build_leaves_out_debug_information(monkeypatch):
    monkeypatch.delenv(build_config.DEBUG_INFO_ENV, raising=False)
    assert "-g0" in build_config.compile_args("linux") and "-g0" in build_config.compile_args("darwin")
    monkeypatch.setenv(build_config.DEBUG_INFO_ENV, "1")
    assert "-g0" not in build_config.compile_args("darwin")


@pytest.mark.skipif(sys.platform != "linux", reason="reads the ELF section table of the Linux build")
def test_the_built_extensions_have_no_debug_information():
    # -g0 comes after Python's own -g on BuildExtension's command line (post_cflags): this shows it won.
    import mps_ext
    import mps_ext_executor
    for module in (mps_ext._C, mps_ext_executor._C):
        sections = elf_section_names(Path(module.__file__))
        assert ".text" in sections and ".debug_info" not in sections, (module.__file__, sorted(sections))


def elf_section_names(path: Path) -> set[str]:
    """The section names of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not a 64-bit little-endian ELF"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]  # sh_offset of the section-name string table
    return {data[names_at + h[0]:data.index(b"\0", names_at + h[0])].decode() for h in headers}
