"""Every op's benchmark, one markdown table per op, a table per kernel and a
PNG plot.

    python -m benchmarks [OP ...] [--quick | --tiny] [--png PATH] [--chip CHIP]

OP: softmax, linear, pad, linalg, fp8, moe (default: all). --quick leaves out the
largest shapes (vocabulary-sized weights, 4096 x 4096 attention scores,
512 x 512 LU, ...), --tiny runs a few small cases (a smoke test). The
counters come from the CPU Metal executor, anywhere; on a Mac with MPS each
case is also timed, stock torch against mps_ext. The plot shows, per case,
the bandwidth limit (minimum bytes at the chip's bandwidth) against the time
mps_ext's traffic takes there, and the measured times on a Mac.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # python benchmarks/__main__.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, plot  # noqa: E402

OPS = ("softmax", "linear", "pad", "linalg", "fp8", "moe")


def op_cases(op: str, size: str) -> list[common.Case]:
    return importlib.import_module(f"benchmarks.bench_{op}").cases(size)


def op_notes(op: str) -> str:
    return getattr(importlib.import_module(f"benchmarks.bench_{op}"), "NOTES", "")


def legend(results: list[common.Result], chip: str) -> tuple[list[dict], str]:
    """The plot's bars (us by series) and its legend as markdown."""
    groups, rows = [], []
    for i, r in enumerate(results, 1):
        g = {"bandwidth limit": r.limit_us(chip), "mps_ext projected": r.projected_us(chip)}
        if r.times and not r.times[0].startswith("error"):
            g["stock measured"] = float(r.times[0])
        if r.times:
            g["mps_ext measured"] = float(r.times[1])
        groups.append(g)
        rows.append({"#": i, "case": f"{r.case.op} {r.case.id}",
                     **{name: f"{g[name]:.3g}" if name in g else "-" for name in plot.SERIES}})
    return groups, common.markdown(rows, ["#", "case", *plot.SERIES])


def main(argv: list[str] | None = None) -> list[common.Result]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"ops to run, of {', '.join(OPS)} (default: all)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="size", help="leave out the largest shapes")
    size.add_argument("--tiny", action="store_const", const="tiny", dest="size", help="a few small cases")
    parser.add_argument("--png", default="benchmarks.png", help="where to write the plot (default: %(default)s)")
    parser.add_argument("--chip", default="M3 Ultra", choices=list(common.BANDWIDTH_GBPS),
                        help="the chip of the plot's bandwidth (default: %(default)s)")
    parser.add_argument("--no-mac", action="store_true", help="do not time on a Mac's GPU")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"no benchmark for {', '.join(unknown)}; the ops are {', '.join(OPS)}")
    ops = args.ops or list(OPS)
    chips = list(common.BANDWIDTH_GBPS)
    start = time.perf_counter()
    results: list[common.Result] = []
    for op in ops:
        done = []
        for case in op_cases(op, args.size or "full"):
            print(f"  {op} {case.id} ...", end="", file=sys.stderr, flush=True)
            done.append(common.measure(case, mac=not args.no_mac))
            print(f" {done[-1].seconds:.1f} s", file=sys.stderr, flush=True)
        print(f"## {op}\n\n{common.op_table(done, chips)}\n")
        if op_notes(op):
            print(op_notes(op) + "\n")
        results += done
    print(common.CASE_NOTES + "\n")
    print(f"## Kernels\n\n{common.kernel_table(results)}\n")
    groups, table = legend(results, args.chip)
    image, lowest = plot.bar_chart(groups)
    Path(args.png).write_bytes(plot.png(image))
    print(f"## Plot\n\n{args.png}: per case (numbered below its bars), on a log scale of time with a gridline at "
          f"every decade from {lowest:g} us, at the {args.chip}'s {common.BANDWIDTH_GBPS[args.chip]} GB/s: "
          + ", ".join(f"{name} ({'rgb(%d, %d, %d)' % colour})" for name, colour in plot.SERIES.items())
          + f" (us):\n\n{table}\n")
    print(f"executor run time: {time.perf_counter() - start:.0f} s")
    return results


if __name__ == "__main__":
    main()
