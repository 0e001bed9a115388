"""Compile-check mps_ext's host code against every supported torch release.

    python tools/torch_matrix.py [VERSION ...]

For each release in VERSIONS, every .cpp and .mm of csrc/ (and the generated
shaders.cpp) and every .cpp of executor/csrc/ is compiled, syntax only, as a Mac build of that release would
compile it: the real headers of the release's macOS arm64 wheel, the -std and
defines its torch.utils.cpp_extension.BuildExtension adds (read from the
wheel's own cpp_extension.py), and our flags and include directories from
tools/build_config.py. The .mm files are Objective-C++ against the Apple stub
headers of csrc/backend/apple_stubs (they declare exactly the Apple API used).

What cannot be reproduced on Linux, and how it is handled:
- There is no macOS SDK, so the target stays Linux (libstdc++, glibc).
  Defining __APPLE__ for everything would switch torch's headers to their
  macOS code, which needs the SDK (and int64_t == long long), so instead
  our own files are copied with their `__APPLE__` conditions set to true:
  our macOS code is compiled, torch's headers keep their Linux side.
- Clang enables blocks and Apple's Objective-C runtime on Darwin by default;
  here -fblocks and -fobjc-runtime=macosx-14.0 say so.

Headers are downloaded once per release (pip download of the wheel, only
torch/include and cpp_extension.py kept) into $MPS_EXT_HEADER_CACHE or
~/.cache/mps_ext/torch-headers/<version>/. A failed download is an error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import build_config  # noqa: E402
import embed_shaders  # noqa: E402

ROOT = build_config.ROOT
# Every release the README promises: the oldest supported, then the newest
# patch of each minor release.
VERSIONS = ("2.9.0", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
# pip takes wheels for this macOS or older: torch <= 2.11 is tagged
# macosx_11_0_arm64, 2.12 and later macosx_14_0_arm64.
WHEEL_PLATFORM = "macosx_15_0_arm64"
PYTHON_VERSION = "3.11"
# What a release's wheel contributes to the check.
_KEEP = re.compile(r"^torch/(include/.*|utils/cpp_extension\.py|version\.py)$")
_DONE = "COMPLETE"


class MatrixError(Exception):
    """The matrix could not run (download, extraction, unknown torch flags)."""


def cache_root() -> Path:
    d = os.environ.get("MPS_EXT_HEADER_CACHE")
    return Path(d) if d else Path.home() / ".cache" / "mps_ext" / "torch-headers"


def download_wheel(requirement: str, platform: str, dest: Path, extra: list[str] = (),
                   error: type[Exception] = MatrixError) -> Path:
    """The one wheel of `requirement` ("torch==2.15.0") for `platform`,
    downloaded into `dest`; `error` if pip fails or finds no single wheel."""
    # A machine-wide pip configuration may cap torch's version with a
    # constraints file (this project's development machines have one): the
    # matrix needs every release, so pip runs without configuration files or
    # constraints (other PIP_* settings, such as a certificate bundle, still
    # apply).
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [sys.executable, "-m", "pip", "download", requirement, "--no-deps", "--only-binary=:all:",
           "--platform", platform, *extra, "-d", str(dest), "-q", "--disable-pip-version-check"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wheels = list(dest.glob("*.whl"))
    if r.returncode != 0 or len(wheels) != 1:
        raise error(f"downloading {requirement.replace('==', ' ')} for {platform} failed:\n{r.stderr.strip()}")
    return wheels[0]


def cached_download(dest: Path, make: Callable[[Path], str]) -> Path:
    """`dest`, made on first use by `make(tree)`, which fills the new
    directory `tree` and returns what to record (the wheel's name). The tree
    is made beside `dest` and moved into place when complete, one process at
    a time: parallel test workers share the cache, and a second download
    would replace the tree a reader of the first is using."""
    if (dest / _DONE).exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / _DONE).exists():
            return dest
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}-") as tmp:
            tree = Path(tmp) / "tree"
            tree.mkdir()
            (tree / _DONE).write_text(make(tree) + "\n")
            if dest.exists():  # an interrupted earlier attempt
                shutil.rmtree(dest)
            os.replace(tree, dest)
    return dest


def fetch(version: str, root: Path | None = None) -> Path:
    """The release's extracted headers, downloaded on first use."""

    def make(tree: Path) -> str:
        wheel = download_wheel(f"torch=={version}", WHEEL_PLATFORM, tree.parent,
                               ["--python-version", PYTHON_VERSION])
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tree, [n for n in z.namelist() if _KEEP.match(n)])
        got = re.search(r"__version__\s*=\s*'([^']+)'", (tree / "torch" / "version.py").read_text())
        if not got or got.group(1).split("+")[0] != version:
            raise MatrixError(f"the wheel downloaded for torch {version} is {got and got.group(1)}")
        return wheel.name

    return cached_download((root or cache_root()) / version, make)


@dataclasses.dataclass
class TorchFlags:
    std: str  # e.g. "c++17"
    defines: list[str]
    include_dirs: list[Path]


def torch_flags(headers: Path) -> TorchFlags:
    """What this release's BuildExtension and CppExtension add on macOS,
    read from its cpp_extension.py; an error if the code changed shape."""
    text = (headers / "torch" / "utils" / "cpp_extension.py").read_text()

    def need(pattern: str, what: str) -> re.Match:
        m = re.search(pattern, text, re.S)
        if not m:
            raise MatrixError(f"{headers.name}: cpp_extension.py no longer shows {what}; update tools/torch_matrix.py")
        return m

    # The standard it appends when the extension passes no -std.
    std = need(r"def append_std\w*_if_no_std_present\(.*?cpp_flag = cpp_flag_prefix \+ '(c\+\+\d+)'",
               "the -std BuildExtension adds").group(1)
    need(r"_add_compile_flag\(extension, '-DTORCH_API_INCLUDE_EXTENSION_H'\)", "-DTORCH_API_INCLUDE_EXTENSION_H")
    need(r"define = f'-DTORCH_EXTENSION_NAME=\{name\}'", "-DTORCH_EXTENSION_NAME")
    need(r"lib_include,\s*#[^\n]*\n\s*os\.path\.join\(lib_include, 'torch', 'csrc', 'api', 'include'\)",
         "include_paths()")
    include = headers / "torch" / "include"
    return TorchFlags(std, ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"],
                      [include, include / "torch" / "csrc" / "api" / "include"])


_APPLE_CONDITIONS = [
    (re.compile(r"^(\s*#\s*)ifdef\s+__APPLE__\b", re.M), r"\1if 1 /* __APPLE__ */"),
    (re.compile(r"^(\s*#\s*)ifndef\s+__APPLE__\b", re.M), r"\1if 0 /* !__APPLE__ */"),
    (re.compile(r"defined\s*\(\s*__APPLE__\s*\)|defined\s+__APPLE__\b"), "1 /* __APPLE__ */"),
]


def as_on_mac(text: str, name: str) -> str:
    """`text` with its __APPLE__ conditions true, on the same lines."""
    for pattern, repl in _APPLE_CONDITIONS:
        text = pattern.sub(repl, text)
    leftover = re.search(r"\b__APPLE__\b(?! \*/)", text)
    if leftover:
        line = text.count("\n", 0, leftover.start()) + 1
        raise MatrixError(f"{name}:{line}: use __APPLE__ only as #ifdef, #ifndef or defined()")
    return text


def mac_tree(dest: Path) -> Path:
    """A copy of the sources the build reads, with our own __APPLE__
    conditions true, and the generated shaders.cpp. Line numbers are kept."""
    for d in build_config.include_dirs(ROOT) + build_config.executor_include_dirs(ROOT) + [ROOT / "csrc"]:
        rel = d.relative_to(ROOT)
        if (dest / rel).exists():
            continue
        shutil.copytree(d, dest / rel, ignore=shutil.ignore_patterns("generated", "__pycache__", "*.so"))
    for path in dest.rglob("*"):
        if path.suffix in (".cpp", ".mm", ".h"):
            text = path.read_text()
            mac = as_on_mac(text, str(path.relative_to(dest)))
            if mac != text:
                path.write_text(mac)
    embed_shaders.generate(dest / build_config.GENERATED)
    return dest


def find_clang() -> str:
    for c in (os.environ.get("MPS_EXT_CLANG"), "clang++-19", "clang++"):
        if c and shutil.which(c):
            return shutil.which(c)
    raise MatrixError("no clang++ (Debian: apt-get install clang-19), or set MPS_EXT_CLANG")


def compile_command(clang: str, source: Path, tree: Path, flags: TorchFlags, pch: Path | None = None) -> list[str]:
    """The syntax check of `source`; with `pch`, torch's headers are read
    from that precompiled header (made by pch_command) instead of parsed."""
    cmd = [clang, "-fsyntax-only", "-fno-color-diagnostics", "-Wno-unused-command-line-argument",
           f"-std={flags.std}", *flags.defines, *build_config.compile_args("darwin", test_hooks=True)]
    if source.suffix == ".mm":
        cmd += ["-x", "objective-c++", "-fblocks", "-fobjc-runtime=macosx-14.0",
                "-isystem", str(tree / "csrc" / "backend" / "apple_stubs")]
    for d in build_config.include_dirs_of(tree, source):
        cmd += ["-I", str(d)]
    for d in flags.include_dirs:
        cmd += ["-I", str(d)]
    cmd += ["-I", sysconfig.get_paths()["include"]]
    if pch is not None:
        cmd += ["-include-pch", str(pch)]
    return cmd + [str(source)]


# Parsing torch's headers is most of each compile (about two thirds of
# linear.cpp's), so the .cpp files of a release share one precompiled copy
# of the heavy ones. That prepends them to every file: a file missing one of
# these includes still passes here, but not in setup.py's build, which
# compiles each file on its own.
# The templates those headers instantiate for themselves are instantiated in
# the precompiled header (-fpch-instantiate-templates), once a release, not
# again at the end of every file that reads it: that was most of what a
# file cost with the header (module.cpp: 2.9 s, 0.4 s with it; a release's
# files 92 s of CPU, 31 s). Instantiations our code asks for still happen,
# and fail, in its own file.
_PRECOMPILED = ("ATen/ATen.h", "torch/library.h", "pybind11/pybind11.h")


def pch_command(clang: str, tree: Path, flags: TorchFlags, version: str) -> tuple[list[str], Path]:
    """The command that precompiles _PRECOMPILED for `version` (with the
    flags its .cpp files are checked with), and the file it writes."""
    header = tree / f"torch-{version}.h"
    header.write_text("".join(f"#include <{h}>\n" for h in _PRECOMPILED))
    cmd = compile_command(clang, header, tree, flags)
    cmd = [c for c in cmd[:-1] if c != "-fsyntax-only"]
    return cmd + ["-fpch-instantiate-templates", "-x", "c++-header", str(header), "-o", f"{header}.pch"], \
        Path(f"{header}.pch")


@dataclasses.dataclass
class Result:
    version: str
    std: str
    source: str  # path relative to the repository
    ok: bool
    stderr: str
    seconds: float


def check(versions=VERSIONS, jobs: int | None = None, sources: list[str] | None = None,
          log=print) -> list[Result]:
    """Compile every source against every release; raises MatrixError if
    the matrix itself cannot run. `sources` (repository-relative paths)
    limits the files."""
    clang = find_clang()
    jobs = jobs or os.cpu_count() or 2
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(min(len(versions), 4)) as pool:
        headers = dict(zip(versions, pool.map(fetch, versions)))
    log(f"headers of {len(versions)} torch release(s) ready in {time.monotonic() - t0:.1f} s ({cache_root()})")
    flags = {v: torch_flags(h) for v, h in headers.items()}
    with tempfile.TemporaryDirectory(prefix="mps_ext-matrix-") as work:
        tree = mac_tree(Path(work))
        files = build_config.sources(tree, "darwin") + build_config.executor_sources(tree)
        if sources is not None:
            files = [f for f in files if str(f.relative_to(tree)) in sources]
            if len(files) != len(sources):
                raise MatrixError(
                    f"not sources of the build: {sorted(set(sources) - {str(f.relative_to(tree)) for f in files})}"
                )

        def precompile(version: str) -> Path:
            cmd, pch = pch_command(clang, tree, flags[version], version)
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise MatrixError(f"torch {version}: precompiling {', '.join(_PRECOMPILED)} failed:\n{r.stderr[:2000]}")
            return pch

        t1 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            pchs = dict(zip(versions, pool.map(precompile, versions)))

        def one(version: str, source: Path) -> Result:
            start = time.monotonic()
            # A precompiled header is C++; the Objective-C++ files parse their own.
            pch = pchs[version] if source.suffix == ".cpp" else None
            r = subprocess.run(compile_command(clang, source, tree, flags[version], pch), capture_output=True,
                               text=True)
            # Messages name the repository's files, not the copy's.
            err = r.stderr.replace(str(tree) + "/", "")
            return Result(version, flags[version].std, str(source.relative_to(tree)), r.returncode == 0, err,
                          time.monotonic() - start)

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(lambda vs: one(*vs), [(v, f) for v in versions for f in files]))
    log(f"{len(results)} compiles in {time.monotonic() - t1:.1f} s on {jobs} job(s)")
    return results


def report(results: list[Result]) -> str:
    lines = []
    by_version: dict[str, list[Result]] = {}
    for r in results:
        by_version.setdefault(r.version, []).append(r)
    for v, rs in by_version.items():
        bad = [r for r in rs if not r.ok]
        lines.append(f"torch {v:7} -std={rs[0].std}: {len(rs) - len(bad)}/{len(rs)} files compile"
                     + (f"; FAILED: {', '.join(r.source for r in bad)}" if bad else ""))
    for r in results:
        if not r.ok:
            errors = [ln for ln in r.stderr.splitlines() if ": error:" in ln or ": fatal error:" in ln]
            lines.append(f"\n--- torch {r.version}, {r.source}:")
            lines += errors[:10] or r.stderr.splitlines()[:10]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), help=f"default: {' '.join(VERSIONS)}")
    parser.add_argument("-j", "--jobs", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        results = check(args.versions, args.jobs)
    except MatrixError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
