"""How mps_ext._C is compiled: sources, flags and include directories per
platform. setup.py builds with this, and the torch version matrix
(tools/torch_matrix.py) compile-checks with it, so the two cannot drift.

No -std flag: torch's BuildExtension adds the standard its own headers need
(C++17 up to torch 2.11, C++20 from 2.12) when the extension passes none, so
our code must compile as both.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATED = Path("csrc") / "generated" / "shaders.cpp"  # tools/embed_shaders.py writes it


def sources(root: Path, platform: str) -> list[Path]:
    """Every translation unit of the extension under `root`, on `platform`
    (sys.platform's spelling). The generated shaders.cpp must exist."""
    found = sorted((root / "csrc").rglob("*.cpp"))
    if platform == "darwin":  # the Metal backend, Objective-C++
        found += sorted((root / "csrc").rglob("*.mm"))
    return found


def include_dirs(root: Path) -> list[Path]:
    return [root / "csrc", root / "kernels_metal", root / "mps_ext" / "cpu_metal" / "include"]


def compile_args(platform: str) -> list[str]:
    args = ["-O2", "-fvisibility=hidden"]
    if platform == "darwin":
        args += ["-fobjc-arc"]
    return args


def link_args(platform: str) -> list[str]:
    return ["-framework", "Metal", "-framework", "Foundation"] if platform == "darwin" else []
