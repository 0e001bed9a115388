"""python -m mps_ext_executor check FILES...
python -m mps_ext_executor self-check

check: check Metal shaders for mistakes C++ would accept: address spaces
mixed up (compiled with Metal's address spaces as distinct clang address
spaces), double, recursion, standard-library includes, pointer parameters
without an address space, kernel parameters without an attribute. Prints
file:line messages and exits non-zero on any finding.

self-check: `python -m mps_ext --self-check` with the executor installed as
mps_ext's backend of CPU tensors, so that every family's kernels also run on
CPU tensors (on a Mac, beside the GPU; elsewhere alone).
"""

import argparse
import sys

from ._compiler import CompileError, check_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mps_ext_executor")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check Metal shader files")
    check.add_argument("files", nargs="+")
    check.add_argument("-I", dest="include_dirs", action="append", default=[], help="extra include directory")
    sub.add_parser("self-check", help="mps_ext's self-check, its kernels on CPU tensors through the executor too")
    args = parser.parse_args(argv)
    if args.command == "self-check":
        return self_check()

    total = 0
    for f in args.files:
        try:
            findings = check_file(f, args.include_dirs)
        except (OSError, CompileError) as e:
            findings = [f"{f}: {e}"]
        for line in findings:
            print(line)
        total += len(findings)
    if total:
        print(f"{total} finding(s) in {len(args.files)} file(s)", file=sys.stderr)
        return 1
    print(f"{len(args.files)} file(s) checked, no findings")
    return 0


def self_check() -> int:
    import mps_ext
    from mps_ext.__main__ import main as mps_ext_main

    from . import install
    if mps_ext._C is not None:  # else mps_ext's main says why it did not load
        install()
    return mps_ext_main(["--self-check"])


if __name__ == "__main__":
    sys.exit(main())
