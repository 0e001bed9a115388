"""Check that a built wheel of mps_ext holds what the package needs and
nothing a user should not get:

- the compiled extension mps_ext._C, once;
- every Python module of the product (the checkout's mps_ext/**/*.py
  outside the executor's directories);
- every shader of the checkout (kernels_metal/*.metal) embedded in _C, not
  shipped as loose .metal files: tools/embed_shaders.py starts each library's
  text with `#line 1 "kernels_metal/<name>.metal"`, which the compiler keeps
  verbatim in the binary's string data;
- the licence in the .dist-info directory;
- torch required with an upper bound (the extension is compiled against
  torch's C++ API, which changes between minor releases); with --torch X.Y.Z,
  the wheel is the one built for that release: `torch>=X.Y,<X.Y+1` and the
  local version label +torchX.Y (setup.py, MPS_EXT_PIN_TORCH);
- no executor (the CPU Metal executor and its headers, the C++ sources, the
  test hooks in _C), when that check is on: see FORBID_EXECUTOR.

    python tools/check_wheel.py dist/mps_ext-0.1.0+torch2.13-cp311-cp311-macosx_11_0_arm64.whl --torch 2.13.0

Exit status 1 and one line per problem when something is wrong.
"""

from __future__ import annotations

import argparse
import email.parser
import re
import sys
import zipfile
from pathlib import Path, PurePosixPath

from packaging.requirements import Requirement
from packaging.version import Version

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_config  # noqa: E402

# The CPU Metal executor is its own distribution (executor/, mps-ext-executor):
# the product's wheel holds none of it. (--no-forbid-executor checks a wheel
# built before that move.)
FORBID_EXECUTOR = True
# Wheel paths (prefixes) of executor code: its Python package (today's
# name and the one it had inside the product) with the headers it compiles
# shaders against, and any C++ source or header.
EXECUTOR_PATHS = ("mps_ext_executor/", "mps_ext/cpu_metal/", "executor/", "csrc/")
# Names of test hooks that must not be registered in _C: the executor's (its
# own package has them now) and the op layer's, which only a build with
# MPS_EXT_TEST_HOOKS=1 has (csrc/python/ops_bindings.cpp, bind_test_hooks).
EXECUTOR_STRINGS = ("_register_shader_source", "_simulate_metal_backend", "_set_executor_requested",
                    "_family_table_problem", "_define_family_again", "_set_index_limit", "_clear_unavailable",
                    "_boxed_fallbacks", "_warn_without_override_warning", "_variant_source")


def shader_marker(library: str) -> bytes:
    """What tools/embed_shaders.py puts at the start of `library`'s embedded text."""
    return f'#line 1 "kernels_metal/{library}.metal"'.encode()


def product_modules(root: Path, executor_paths: tuple[str, ...]) -> list[str]:
    """The checkout's Python files of the package, as wheel paths, outside
    `executor_paths`."""
    found = (p.relative_to(root).as_posix() for p in sorted((root / "mps_ext").rglob("*.py")))
    return [p for p in found if not p.startswith(executor_paths)]


def _torch_requirement(metadata: str) -> Requirement | None:
    msg = email.parser.Parser().parsestr(metadata)
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.name == "torch" and req.marker is None:
            return req
    return None


def check(wheel: Path, root: Path = build_config.ROOT, torch: str | None = None,
          executor_paths: tuple[str, ...] = (), executor_strings: tuple[str, ...] = ()) -> list[str]:
    """The problems of `wheel` against the checkout at `root` (none: an empty
    list). `torch`: the release the wheel must be for; `executor_paths` and
    `executor_strings`: what must not be in it (empty: not checked)."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        ext = [n for n in names if re.fullmatch(r"mps_ext/_C(\.[^/]*)?\.(so|pyd)", n)]
        if len(ext) != 1:
            problems.append(f"mps_ext/_C: {len(ext)} compiled extensions in the wheel, not 1 {sorted(ext)}")
        binary = z.read(ext[0]) if len(ext) == 1 else b""

        for module in product_modules(root, executor_paths):
            if module not in names:
                problems.append(f"{module}: missing")

        libraries = sorted(p.stem for p in (root / "kernels_metal").glob("*.metal"))
        if binary:
            for lib in libraries:
                if shader_marker(lib) not in binary:
                    problems.append(f"kernels_metal/{lib}.metal: not embedded in {ext[0]}")
        loose = sorted(n for n in names if n.endswith(".metal"))
        if loose:
            problems.append(f"loose shader files (they belong in _C): {loose}")

        dist_info = {PurePosixPath(n).parts[0] for n in names if PurePosixPath(n).parts[0].endswith(".dist-info")}
        if len(dist_info) != 1:
            problems.append(f"{len(dist_info)} .dist-info directories, not 1")
        else:
            info = dist_info.pop()
            if not any(PurePosixPath(n).name == "LICENSE" for n in names if n.startswith(info + "/")):
                problems.append(f"{info}: no LICENSE")
            meta = f"{info}/METADATA"
            problems += _check_metadata(z.read(meta).decode() if meta in names else "", torch)

        for path in executor_paths:
            shipped = sorted(n for n in names if n.startswith(path))
            if shipped:
                problems.append(f"executor code in the wheel: {len(shipped)} files under {path} ({shipped[0]}, ...)")
        for s in executor_strings:
            if binary and s.encode() in binary:
                problems.append(f"{ext[0]}: registers the test hook {s}")
    return problems


def _check_metadata(metadata: str, torch: str | None) -> list[str]:
    if not metadata:
        return ["no METADATA"]
    req = _torch_requirement(metadata)
    if req is None:
        return ["METADATA: torch is not required"]
    if not any(s.operator in ("<", "==", "~=") for s in req.specifier):
        return [f"METADATA: torch is not bounded above ({req})"]
    if torch is None:
        return []
    problems = []
    want = Requirement(build_config.torch_requirement(torch))
    if req.specifier != want.specifier:
        problems.append(f"METADATA: requires {req}, the wheel built against torch {torch} needs {want}")
    version = email.parser.Parser().parsestr(metadata)["Version"] or ""
    label = build_config.local_version(torch)[1:]
    if Version(version).local != label:
        problems.append(f"METADATA: version {version} does not carry +{label}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", nargs="+", type=Path)
    ap.add_argument("--torch", help="the torch release the wheel was built against (X.Y.Z)")
    ap.add_argument("--forbid-executor", action=argparse.BooleanOptionalAction, default=FORBID_EXECUTOR,
                    help=f"fail on executor code in the wheel (default: {FORBID_EXECUTOR}, FORBID_EXECUTOR)")
    args = ap.parse_args(argv)
    failed = False
    for wheel in args.wheels:
        forbid = (EXECUTOR_PATHS, EXECUTOR_STRINGS) if args.forbid_executor else ((), ())
        problems = check(wheel, torch=args.torch, executor_paths=forbid[0], executor_strings=forbid[1])
        for p in problems:
            print(f"{wheel.name}: {p}")
        if not problems:
            print(f"{wheel.name}: holds what mps_ext needs" + ("" if args.forbid_executor else
                                                               " (executor check off: FORBID_EXECUTOR)"))
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
