"""FP8: scaled_mm at the GEMV benchmark's shapes (decode: 1, 2, 4, 8 rows)
and prefill (128, 512, 2048 rows), and conversions, from the CPU Metal
executor's counters: weight bytes read over the fp8 weight's size,
16-byte loads, threadgroups, activation bytes over the weight's size, and
the time the weight traffic takes at Apple chip bandwidths. On a Mac, also
stock torch (bf16 F.linear) against mps_ext (fp8 weights).

    python benchmarks/bench_fp8.py [--quick]
"""

import argparse

import torch

import mps_ext  # noqa: F401
from bench_linear import SHAPES
from common import BANDWIDTH_GBPS, mac_times, table
from mps_ext import cpu_metal

E4 = torch.float8_e4m3fn


def measure(k, n, rows, recipe):
    a = torch.randn(rows, k).to(E4)
    w = torch.randn(n, k).to(E4)
    if recipe == "row":
        scales = ([torch.ones(rows, 1)], [1], [], [torch.ones(1, n)], [1], [])
    else:
        scales = ([torch.ones(rows, -(-k // 128))], [4], [], [torch.ones(-(-k // 128), -(-n // 128))], [5], [])
    with cpu_metal.record() as rec:
        torch.ops.mps_ext._scaled_mm_v2(a, w.t(), *scales, None, torch.bfloat16, [], False)
    (d,) = rec.dispatches
    wi, xi = d.buffer("w"), d.buffer("x")
    wide = d.read_widths[wi].get(16, 0) * 16
    row = {
        "weight read/size": f"{d.bytes_read[wi] / w.nbytes:.3f}",
        "bound": f"{max(rows / 32, 1.02) if rows > 8 else 1.02:.2f}",
        "16B loads": f"{wide / d.bytes_read[wi]:.0%}",
        "x read/w size": f"{d.bytes_read.get(xi, 0) / w.nbytes:.3f}",
        "threadgroups": d.total_threadgroups,
        "kernel": d.kernel,
    }
    for chip in ("M3 Max", "M3 Ultra"):
        row[chip] = f"{d.bytes_read[wi] / (BANDWIDTH_GBPS[chip] * 1e9) * 1e6:.1f}"
    row["stock us"] = row["mps_ext us"] = "-"
    if torch.backends.mps.is_available():
        wb = torch.randn(n, k, dtype=torch.bfloat16, device="mps")
        xb = torch.randn(rows, k, dtype=torch.bfloat16, device="mps")
        q = mps_ext.FP8Linear.from_linear(torch.nn.Linear(k, n, bias=False, device="mps", dtype=torch.bfloat16),
                                          recipe)
        stock, ours = mac_times(lambda: torch.nn.functional.linear(xb, wb), lambda: q(xb))
        row.update({"stock us": f"{stock * 1e6:.1f}", "mps_ext us": f"{ours * 1e6:.1f}"})
    return row


def conversions():
    out = []
    for src, dst in [(torch.bfloat16, E4), (torch.float32, E4), (E4, torch.bfloat16), (E4, torch.float16)]:
        x = torch.randn(4096, 4096).to(src)
        y = torch.empty(4096, 4096, dtype=dst)
        with cpu_metal.record() as rec:
            torch.ops.mps_ext.copy_(y, x)
        moved = sum(d.memory_bytes_moved for d in rec.dispatches)
        out.append({"conversion": f"{str(src)[6:]} -> {str(dst)[6:]}", "shape": "4096x4096",
                    "dispatches": len(rec.dispatches), "bytes/minimum": f"{moved / (x.nbytes + y.nbytes):.3f}",
                    "threadgroups": sum(d.total_threadgroups for d in rec.dispatches)})
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the vocabulary-sized and 2048-row shapes")
    args = parser.parse_args()
    rows_out = []
    for k, n, model in SHAPES:
        if args.quick and n > 100000:
            continue
        for rows in [1, 2, 4, 8, 128, 512, 2048]:
            if rows > 8 and (n > 100000 or (args.quick and rows > 128)):
                continue  # prefill at vocabulary width takes the executor too long
            for recipe in ("row", "block"):
                r = {"shape": f"{k}->{n}", "model": model, "rows": rows, "recipe": recipe}
                r.update(measure(k, n, rows, recipe))
                rows_out.append(r)
                print(f"  {r['shape']} rows={rows} {recipe}: {r['weight read/size']}", flush=True)
    print(table(rows_out, [("shape", "K->N"), ("model", "layer"), ("rows", "rows"), ("recipe", "scales"),
                           ("weight read/size", "weight read / size"), ("bound", "bound"),
                           ("16B loads", "16-byte loads"), ("x read/w size", "act. read / w size"),
                           ("threadgroups", "threadgroups"), ("M3 Max", "us @400GB/s"),
                           ("M3 Ultra", "us @819GB/s"), ("stock us", "bf16 stock (us)"),
                           ("mps_ext us", "fp8 mps_ext (us)")]))
    print("weight read / size: bytes read from the fp8 weight buffer over its size (executor counters); bound: "
          "1.02 for decode, rows / 32 for prefill. act. read / w size: activation bytes read over the weight's "
          "size (decode: each simdgroup reads the activation rows once per step, so it grows with rows and with "
          "the number of simdgroups, N / outputs per simdgroup; prefill: each 32 x 64 tile reads its activation "
          "rows, N / 64 times in all). Times only on a Mac.")
    print()
    conv = conversions()
    print(table(conv, [("conversion", "conversion"), ("shape", "shape"), ("dispatches", "dispatches"),
                       ("bytes/minimum", "bytes / minimum"), ("threadgroups", "threadgroups")]))


if __name__ == "__main__":
    main()
