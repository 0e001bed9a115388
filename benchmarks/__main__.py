"""Every op's benchmark, one markdown table per op, a table per kernel, the
decode census and projection, and PNG plots (matplotlib: the `bench` extra).

    python -m benchmarks [OP ...] [--quick | --tiny] [--png PATH] [--decode-png PATH] [--prefill-png PATH]
    python -m benchmarks decode --optimize --write-docs [--decode-png docs/decode.png]
    python -m benchmarks prefill --optimize --write-docs [--prefill-png docs/prefill.png]

OP: softmax, linear, pad, linalg, fp8, moe, norm, routing, decode, prefill (default: all).
routing is the host time mps_ext's routing adds per call
(benchmarks/bench_routing.py), timed here on CPU tensors; decode is the
census of a decoded token of whole models (benchmarks/bench_decode.py),
prefill the census of a prompt's prefill and its time to first token
(benchmarks/bench_prefill.py); the others are kernels; --write-docs rewrites
the decode tables of README.md and docs/decode.md, or README's prefill table
(tests/test_docs.py checks them). --quick leaves out the
largest shapes (vocabulary-sized weights, 4096 x 4096 attention scores,
512 x 512 LU, ...), --tiny runs a few small cases (a smoke test). The
counters come from the CPU Metal executor, anywhere; on a Mac with MPS each
case is also timed, stock torch against mps_ext. The plot shows, per op
(summed over its cases), the bandwidth limit (minimum bytes at the chip's
bandwidth) against mps_ext's cost there (the traffic it moves at that
bandwidth plus the GPU cost of each dispatch, benchmarks/timeline.py's
DISPATCH), and the measured times on a Mac; stock torch only where measured.
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

# The kernel benchmarks (cases of common.Case), one per op family, named as the family.
OPS = ("softmax", "linear", "pad", "linalg", "fp8", "scaled_mm", "grouped_mm", "moe", "norm", "attention_gate",
       "kv_cache", "linear_attention", "short_conv")
HOST = ("routing",)  # host-time benchmarks: their own table, no kernel cases
DECODE = "decode"  # whole models: benchmarks/bench_decode.py
PREFILL = "prefill"  # whole models' prompts: benchmarks/bench_prefill.py
MODELS = (DECODE, PREFILL)


def op_cases(op: str, size: str) -> list[common.Case]:
    return importlib.import_module(f"benchmarks.bench_{op}").cases(size)


def op_notes(op: str) -> str:
    return getattr(importlib.import_module(f"benchmarks.bench_{op}"), "NOTES", "")


def legend(results: list[common.Result], chip: str) -> tuple[list[dict], str]:
    """The plot's bars and its legend as markdown: per op, the sum over its
    cases of each series (us); a measured series only where every case of
    the op has it."""
    groups, rows = [], []
    for op in dict.fromkeys(r.case.op for r in results):
        mine = [r for r in results if r.case.op == op]
        g = {"bandwidth limit": sum(r.limit_us(chip) for r in mine),
             "mps_ext: traffic + dispatches": sum(r.dispatched_us(chip) for r in mine)}
        measured = [r.times for r in mine]
        if all(t and not t[0].startswith("error") for t in measured):
            g["stock measured"] = sum(float(t[0]) for t in measured)
        if all(measured):
            g["mps_ext measured"] = sum(float(t[1]) for t in measured)
        groups.append(g)
        rows.append({"#": len(groups), "op": op, "cases": len(mine),
                     **{name: f"{g[name]:.4g}" if name in g else "-" for name in plot.SERIES}})
    return groups, common.markdown(rows, ["#", "op", "cases", *plot.SERIES])


def main(argv: list[str] | None = None) -> list[common.Result]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    parser.add_argument("ops", nargs="*", metavar="OP",
                        help=f"ops to run, of {', '.join(OPS + MODELS)} (default: all)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", const="quick", dest="size", help="leave out the largest shapes")
    size.add_argument("--tiny", action="store_const", const="tiny", dest="size", help="a few small cases")
    parser.add_argument("--png", default="benchmarks.png",
                        help="where to write the ops' plot ('' for none; default: %(default)s)")
    parser.add_argument("--decode-png", default="benchmarks-decode.png",
                        help="where to write the decode plot ('' for none; default: %(default)s)")
    parser.add_argument("--prefill-png", default="benchmarks-prefill.png",
                        help="where to write the prefill plot ('' for none; default: %(default)s)")
    parser.add_argument("--optimize", action="store_true",
                        help="decode, prefill: count each model after mps_ext.optimize(model) as well")
    parser.add_argument("--chip", default="M3 Ultra", choices=list(common.BANDWIDTH_GBPS),
                        help="the chip of the plot's bandwidth (default: %(default)s)")
    parser.add_argument("--no-mac", action="store_true", help="do not time on a Mac's GPU")
    parser.add_argument("--write-docs", action="store_true",
                        help="decode (or prefill) --optimize, full size: rewrite its tables in README.md (and "
                        "docs/decode.md)")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS + HOST + MODELS]
    if unknown:
        parser.error(f"no benchmark for {', '.join(unknown)}; the ops are {', '.join(OPS + HOST + MODELS)}")
    if args.write_docs and (len(args.ops) != 1 or args.ops[0] not in MODELS or not args.optimize or args.size):
        parser.error("--write-docs writes the docs' decode or prefill tables: run it as `decode --optimize` or "
                     "`prefill --optimize` at full size")
    for host in HOST:
        if host in args.ops or not args.ops:
            importlib.import_module(f"benchmarks.bench_{host}").main([f"--{args.size}"] if args.size else [])
    ops = [op for op in args.ops if op in OPS] if args.ops else list(OPS)
    decode = DECODE in args.ops or not args.ops
    transform = None
    if args.optimize:
        import mps_ext
        if not hasattr(mps_ext, "optimize"):
            parser.error("--optimize: this mps_ext has no optimize(model)")
        transform = mps_ext.optimize
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
    if results:
        print(common.CASE_NOTES + "\n")
        from benchmarks import efficiency
        compute = efficiency.table(results)
        if compute:
            print(f"## Compute efficiency\n\n{compute}\n\n{efficiency.NOTES}\n")
        print(f"## Kernels\n\n{common.kernel_table(results)}\n")
        groups, table = legend(results, args.chip)
        if args.png:
            plot.ops_chart(groups, [op for op in dict.fromkeys(r.case.op for r in results)], args.png, args.chip)
            print(f"## Plot\n\n{args.png}: per op, the sum over its cases, on a log scale of time, at the "
                  f"{args.chip}'s {common.BANDWIDTH_GBPS[args.chip]} GB/s (us):\n\n{table}\n")
    if decode:
        from benchmarks import bench_decode
        text, rows = bench_decode.report(args.size or "full", transform=transform,
                                         log=lambda m: print(m, file=sys.stderr, flush=True))
        print(text)
        if args.write_docs:
            blocks = bench_decode.doc_blocks(rows, bench_decode.stop_check_loops(bench_decode.models_for("full")[0]))
            changed = bench_decode.write_docs(blocks)
            print(f"decode tables rewritten in: {', '.join(changed) or 'none (they were current)'}\n")
        if args.decode_png:
            plot.decode_chart(bench_decode.chart_bars(rows), args.decode_png)
            print(
                f"{args.decode_png}: decode tokens/s per model, one sequence: stock torch and peers published, mps_ext simulated (with ranges), byte limits.\n"  # noqa: E501
            )
    if PREFILL in args.ops or not args.ops:
        prefill_report(args, transform)
    print(f"executor run time: {time.perf_counter() - start:.0f} s")
    return results


def prefill_report(args, transform) -> None:
    """The prefill census: its markdown, README's table (--write-docs) and
    its plot."""
    from benchmarks import bench_decode, bench_prefill
    text, rows = bench_prefill.report(args.size or "full", transform=transform,
                                      log=lambda m: print(m, file=sys.stderr, flush=True))
    print(text)
    if args.write_docs:
        docs = [r for r in rows if r.length == bench_prefill.DOC_LENGTH and r.release == "2.15"]
        changed = bench_decode.write_docs(bench_prefill.doc_blocks(docs), docs=bench_prefill.DOCS,
                                          command=bench_prefill.DOC_COMMAND)
        print(f"prefill table rewritten in: {', '.join(changed) or 'none (it was current)'}\n")
    if args.prefill_png:
        length = bench_prefill.DOC_LENGTH
        plot.prefill_chart(bench_prefill.chart_bars(rows, length), args.prefill_png, length)
        print(f"{args.prefill_png}: time to first token per model, a {length}-token prompt: torch 2.15 stock and "
              f"optimized (projected, with ranges), peers (published), the compute limit.\n")


if __name__ == "__main__":
    main()
