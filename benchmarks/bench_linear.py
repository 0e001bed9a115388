"""Decode-time linear layers: from the CPU Metal executor's counters, bytes
read from the weight against its size, 16-byte loads, dispatches,
threadgroups, and the time the weight traffic takes at the bandwidth of Apple
chips; on a Mac also the median time of stock torch against mps_ext, with
weights rotated so that the system-level cache cannot hold them. Both weight
layouts: F.linear's [N, K] (gemv_rows) and x @ W with W stored [K, N]
(gemv_cols).

    python benchmarks/bench_linear.py [--quick] [--layout nk|kn]
"""

import argparse

import torch

import mps_ext  # noqa: F401
from common import BANDWIDTH_GBPS, mac_times, table
from mps_ext import cpu_metal

SHAPES = [  # (K -> N, model)
    (4096, 4096, "Llama-3-8B q/o proj"),
    (4096, 14336, "Llama-3-8B up/gate"),
    (14336, 4096, "Llama-3-8B down"),
    (4096, 128256, "Llama-3-8B lm_head"),
    (2048, 768, "Qwen3-30B-A3B expert up"),
    (768, 2048, "Qwen3-30B-A3B expert down"),
    (2048, 151936, "Qwen3 lm_head"),
]
ROWS = [1, 2, 4, 8]
DTYPES = [torch.float16, torch.bfloat16]
ROTATE_BYTES = 512 * 2**20  # more than any system-level cache


def measure(k, n, rows, dtype, layout):
    x = torch.randn(rows, k).to(dtype)
    if layout == "nk":
        w = torch.randn(n, k).to(dtype)
        op = lambda: torch.ops.mps_ext.linear(x, w, None)  # noqa: E731
    else:
        w = torch.randn(k, n).to(dtype)
        op = lambda: torch.ops.mps_ext.mm(x, w)  # noqa: E731
    with cpu_metal.record() as rec:
        op()
    d = rec.dispatches[0]  # the weight's dispatch; gemv_cols_finish adds split-K sums
    wide = d.read_widths[2].get(16, 0) * 16
    row = {
        "weight read/size": f"{d.bytes_read[2] / w.nbytes:.3f}",
        "x reads": f"{d.bytes_read[1] / x.nbytes:.0f}",
        "16B loads": f"{wide / d.bytes_read[2]:.0%}",
        "dispatches": len(rec.dispatches),
        "threadgroups": sum(r.total_threadgroups for r in rec.dispatches),
        "kernel": d.kernel,
    }
    for chip in ("M3 Max", "M3 Ultra"):
        row[chip] = f"{d.bytes_read[2] / (BANDWIDTH_GBPS[chip] * 1e9) * 1e6:.1f}"
    row["stock us"] = row["mps_ext us"] = row["speedup"] = "-"
    if torch.backends.mps.is_available():
        copies = max(1, ROTATE_BYTES // w.nbytes)
        ws = [w.to("mps") for _ in range(copies)]
        xm = x.to("mps")
        i = [0]

        def step():
            i[0] = (i[0] + 1) % copies
            if layout == "nk":
                torch.nn.functional.linear(xm, ws[i[0]])
            else:
                xm @ ws[i[0]]

        stock, ours = mac_times(step, step)
        row.update({"stock us": f"{stock * 1e6:.1f}", "mps_ext us": f"{ours * 1e6:.1f}",
                    "speedup": f"{stock / ours:.2f}x"})
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the vocabulary-sized shapes")
    parser.add_argument("--layout", choices=["nk", "kn"], action="append",
                        help="weight layout: nk (F.linear, [N, K]) or kn (x @ W, [K, N]); both by default")
    args = parser.parse_args()
    rows_out = []
    for layout in args.layout or ["nk", "kn"]:
        for k, n, model in SHAPES:
            if args.quick and n > 100000:
                continue
            for dtype in DTYPES:
                for rows in ROWS:
                    r = {"layout": "W[N,K]" if layout == "nk" else "W[K,N]", "shape": f"{k}->{n}", "model": model,
                         "dtype": str(dtype)[6:], "rows": rows}
                    r.update(measure(k, n, rows, dtype, layout))
                    rows_out.append(r)
                    print(f"  {r['layout']} {r['shape']} {r['dtype']} rows={rows}: {r['weight read/size']}", flush=True)
    print(table(rows_out, [("layout", "weight"), ("shape", "K->N"), ("model", "layer"), ("dtype", "dtype"),
                           ("rows", "rows"), ("weight read/size", "weight read / size"),
                           ("16B loads", "16-byte loads"), ("x reads", "activation reads"),
                           ("dispatches", "dispatches"), ("threadgroups", "threadgroups"), ("M3 Max", "us @400GB/s"),
                           ("M3 Ultra", "us @819GB/s"), ("stock us", "stock (us)"),
                           ("mps_ext us", "mps_ext (us)"), ("speedup", "speedup")]))
    print("weight read / size: bytes the kernel read from the weight buffer over its size (executor counters). "
          "us @N GB/s: the time that weight traffic takes at the chip's bandwidth (the decode limit). "
          "activation reads: the activation's bytes read, over its size, counted per lane (threadgroups "
          "read it from cache on a GPU; each reads it once into threadgroup memory). "
          "W[K,N] with few column blocks splits K: a second dispatch adds the partial sums. "
          "Times only on a Mac.")


if __name__ == "__main__":
    main()
