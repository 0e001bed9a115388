"""How mps_ext._C, and the CPU Metal executor's mps_ext_executor._C
(executor/, a package of its own), are compiled: sources, flags and include
directories per platform. setup.py and executor/setup.py build with this,
and the torch version matrix (tools/torch_matrix.py) compile-checks both
with it, so they cannot drift.

No -std flag: torch's BuildExtension adds the standard its own headers need
(C++17 up to torch 2.11, C++20 from 2.12) when the extension passes none, so
our code must compile as both.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = Path("csrc") / "generated" / "shaders.cpp"  # tools/embed_shaders.py writes it
# The torch minor releases the kernels are built and tested against (README,
# "Compatibility"), oldest and newest; pyproject.toml's build requirement
# says the same (tests/test_release.py).
TORCH_OLDEST, TORCH_NEWEST = (2, 9), (2, 15)
# Set by the release workflow: the wheel is for the torch it was built
# against and says so (docs/dev/release.md).
PIN_TORCH_ENV = "MPS_EXT_PIN_TORCH"


def sources(root: Path, platform: str) -> list[Path]:
    """Every translation unit of the product's extension under `root`, on
    `platform` (sys.platform's spelling). The generated shaders.cpp must
    exist."""
    found = sorted((root / "csrc").rglob("*.cpp"))
    if platform == "darwin":  # the Metal backend, Objective-C++
        found += sorted((root / "csrc").rglob("*.mm"))
    return found


def include_dirs(root: Path) -> list[Path]:
    return [root / "csrc", root / "kernels_metal"]


# The executor's extension: its engine, its CPU backend and bindings, built
# against the product's launch interface (csrc/backend/launch.h), which it
# reaches at run time through mps_ext._C._backend_slot(), not by linking.
EXECUTOR = Path("executor")


def executor_sources(root: Path) -> list[Path]:
    return sorted((root / EXECUTOR / "csrc").glob("*.cpp"))


def executor_include_dirs(root: Path) -> list[Path]:
    return [root / EXECUTOR / "csrc", root / "csrc", root / EXECUTOR / "mps_ext_executor" / "include"]


def include_dirs_of(root: Path, source: Path) -> list[Path]:
    """The include directories `source` (a file under `root`) is compiled with."""
    return executor_include_dirs(root) if (root / EXECUTOR) in source.parents else include_dirs(root)


# The environment variable that builds the op layer's test hooks into
# mps_ext._C (csrc/python/ops_bindings.cpp, bind_test_hooks): scripts/setup.sh
# sets it for the tests; a user's build and the release wheels have none.
TEST_HOOKS_ENV = "MPS_EXT_TEST_HOOKS"


# The environment variable that keeps debug information in the build (gdb, lldb): without it the
# extension is compiled with -g0, over the -g of Python's own CFLAGS, which BuildExtension passes
# first. Debug information doubled the compile time of a torch-heavy source (csrc/ops/pad.cpp: 46 s
# of CPU with -g, 24 s without, gcc 12) and made the Linux _C 52 MB, of which 1.8 MB is code.
DEBUG_INFO_ENV = "MPS_EXT_DEBUG_INFO"


def compile_args(platform: str, test_hooks: bool | None = None) -> list[str]:
    """The extension's compiler flags; test_hooks None: as TEST_HOOKS_ENV says."""
    args = ["-O2", "-fvisibility=hidden"]
    if os.environ.get(DEBUG_INFO_ENV) != "1":
        args += ["-g0"]
    if platform == "darwin":
        args += ["-fobjc-arc"]
    if test_hooks if test_hooks is not None else os.environ.get(TEST_HOOKS_ENV) == "1":
        args += ["-DMPS_EXT_TEST_HOOKS"]
    return args


def link_args(platform: str) -> list[str]:
    return ["-framework", "Metal", "-framework", "Foundation"] if platform == "darwin" else []


def torch_minor(version: str) -> tuple[int, int]:
    """(2, 13) from "2.13.0", "2.13.0+cpu" or "2.13"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def torch_requirement(pinned_to: str | None = None) -> str:
    """The distribution's torch requirement: every supported release, or,
    for a wheel built against torch `pinned_to`, that minor release only (the
    compiled extension links against that release's C++ ABI)."""
    if pinned_to is None:
        return f"torch>={TORCH_OLDEST[0]}.{TORCH_OLDEST[1]},<{TORCH_NEWEST[0]}.{TORCH_NEWEST[1] + 1}"
    major, minor = torch_minor(pinned_to)
    if not TORCH_OLDEST <= (major, minor) <= TORCH_NEWEST:
        raise ValueError(f"torch {pinned_to} is not a supported release "
                         f"({TORCH_OLDEST[0]}.{TORCH_OLDEST[1]} to {TORCH_NEWEST[0]}.{TORCH_NEWEST[1]})")
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


def local_version(pinned_to: str) -> str:
    """The local version label of a wheel built against torch `pinned_to`
    ("+torch2.13"): wheels for different torch releases get different file
    names, and `pip list` shows which one is installed."""
    major, minor = torch_minor(pinned_to)
    return f"+torch{major}.{minor}"
