"""Format the repository, or check that it is formatted (--check), with the
ruff and clang-format the test extra pins (pyproject.toml).

- C++, Objective-C++ and Metal (CLANG_FILES): clang-format, configured by
  .clang-format (and kernels_metal/.clang-format).
- Python: `ruff check` (pyproject.toml, [tool.ruff]). The code is not run
  through `ruff format` as a whole (docs/dev/contributing.md, "Formatting"):
  to meet the line length, each statement ruff reports as too long is
  formatted on its own (`ruff format --range`); a line no formatter can
  split (a long string or comment) gets `# noqa: E501` and stays for a
  person to shorten.

scripts/format.sh runs this; tests/test_lint.py and the pre-commit hooks run
`--check`.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLANG_PATTERNS = (
    "csrc/*.h",
    "csrc/*.cpp",
    "csrc/*.mm",
    "executor/csrc/*.h",
    "executor/csrc/*.cpp",
    "kernels_metal/*.h",
    "kernels_metal/*.metal",
)


def clang_files(root: Path = ROOT) -> list[str]:
    """The tracked C++, Objective-C++ and Metal files (git's pathspecs: `*`
    crosses directories), so a generated file (csrc/generated) is left out."""
    out = subprocess.run(["git", "ls-files", "--", *CLANG_PATTERNS], cwd=root, check=True, capture_output=True,
                         text=True).stdout
    return out.split()


def pinned(tool: str) -> str:
    """The version of `tool` the test extra pins."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    return next(r.split("==")[1] for r in extra if r.startswith(f"{tool}=="))


def clang_format() -> str:
    """The pinned clang-format: the one installed beside this Python (the
    `clang-format` wheel), not a system one, whose output can differ."""
    exe = Path(sys.executable).parent / "clang-format"
    exe = str(exe) if exe.exists() else shutil.which("clang-format")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout if exe else ""
    if f"version {pinned('clang-format')}" not in version:
        raise SystemExit(f"clang-format {pinned('clang-format')} is needed (pip install -e '.[test]'); "
                         f"found {version.strip() or 'none'}")
    return exe


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True)


def check() -> list[str]:
    """What is not formatted: one line per finding (none: an empty list)."""
    problems = []
    r = subprocess.run([clang_format(), "--dry-run", "-Werror", *clang_files()], cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode:
        places = [line.split(":")[0] for line in r.stderr.splitlines() if ": code should be clang-formatted" in line]
        problems += [f"{f}: not as clang-format writes it ({places.count(f)} places)" for f in sorted(set(places))]
        problems += [] if places else [r.stderr.strip()]
    r = ruff("check", "--output-format", "concise", "--no-cache", ".")
    if r.returncode:
        problems += [line for line in r.stdout.splitlines() if re.match(r"\S+:\d+:\d+: ", line)] or [r.stdout]
    return problems


def long_lines() -> dict[str, list[int]]:
    r = ruff("check", "--select", "E501", "--output-format", "json", "--no-cache", ".")
    found: dict[str, list[int]] = {}
    for v in json.loads(r.stdout):
        found.setdefault(v["filename"], []).append(v["location"]["row"])
    return found


def fix() -> None:
    subprocess.run([clang_format(), "-i", *clang_files()], cwd=ROOT, check=True)
    for path, rows in long_lines().items():
        for row in sorted(rows, reverse=True):  # from the bottom: earlier rows keep their numbers
            ruff("format", "--range", f"{row}:1-{row + 1}:1", path)
    if long_lines():
        ruff("check", "--select", "E501", "--add-noqa", ".")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; list what is not formatted")
    args = ap.parse_args(argv)
    if not args.check:
        fix()
    problems = check()
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
