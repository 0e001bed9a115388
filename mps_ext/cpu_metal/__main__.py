"""python -m mps_ext.cpu_metal check FILES...

Check Metal shaders for mistakes C++ would accept: address spaces mixed up
(compiled with Metal's address spaces as distinct clang address spaces),
double, recursion, standard-library includes, pointer parameters without an
address space, kernel parameters without an attribute. Prints file:line
messages and exits non-zero on any finding.
"""

import argparse
import sys

from ._compiler import CompileError, check_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mps_ext.cpu_metal")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="check Metal shader files")
    check.add_argument("files", nargs="+")
    check.add_argument("-I", dest="include_dirs", action="append", default=[], help="extra include directory")
    args = parser.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
