"""FP8: scaled_mm at the GEMV benchmark's shapes (decode: 1, 2, 4, 8 rows)
and prefill (128, 512, 2048 rows), and conversions, from the CPU Metal
executor's counters: dispatches, threadgroups, weight bytes read over the
fp8 weight's size, 16-byte loads, activation bytes read over the weight's
size, all bytes moved over the minimum the product needs, and the time its
memory traffic takes at Apple chip bandwidths. On a Mac, also stock torch
(bf16 F.linear) against mps_ext (fp8 weights).

Prefill on the executor would take hours at these shapes, so it is measured
on a block of 2 x 4 tiles (64 rows, 256 columns, the full K) and scaled by
the number of tiles: every 32 x 64 tile of fp8_mm_tile does the same work
(it reads 32 activation rows and 64 weight rows over all of K, and the
scales of those, and writes its outputs), and every shape here is a whole
number of tiles. --check measures one prefill shape in full and compares.

    python benchmarks/bench_fp8.py [--quick] [--check]
"""

from __future__ import annotations

import argparse

import torch

import mps_ext
from bench_linear import SHAPES
from common import BANDWIDTH_GBPS, mac_times, table
from mps_ext import cpu_metal

E4 = torch.float8_e4m3fn
DECODE_ROWS = [1, 2, 4, 8]
PREFILL_ROWS = [128, 512, 2048]
TILE_M, TILE_N = 32, 64  # fp8_params.h: FP8_TILE_M, FP8_TILE_N
SAMPLE_M, SAMPLE_N = 2 * TILE_M, 4 * TILE_N  # the block prefill is measured on
CHIPS = ("M3 Max", "M3 Ultra")


def operands(rows, k, n, recipe):
    """Activation, weight and _scaled_mm_v2's scale arguments of one product."""
    a, w = torch.randn(rows, k).to(E4), torch.randn(n, k).to(E4)
    if recipe == "row":
        scales = ([torch.ones(rows, 1)], [1], [], [torch.ones(1, n)], [1], [])
    else:  # 1x128 activation blocks, 128x128 weight blocks
        scales = ([torch.ones(rows, -(-k // 128))], [4], [], [torch.ones(-(-k // 128), -(-n // 128))], [5], [])
    return a, w, scales


def minimum_bytes(rows, k, n, recipe):
    """What the product must move at least: each operand and scale read once,
    the bf16 output written once."""
    kb, nb = -(-k // 128), -(-n // 128)
    scales = (rows + n) * 4 if recipe == "row" else (rows * kb + kb * nb) * 4
    return rows * k + n * k + scales + rows * n * 2


def count(rows, k, n, recipe):
    """Executor counters of one _scaled_mm_v2 call."""
    a, w, scales = operands(rows, k, n, recipe)
    with cpu_metal.record() as rec:
        torch.ops.mps_ext._scaled_mm_v2(a, w.t(), *scales, None, torch.bfloat16, [], False)
    (d,) = rec.dispatches
    wi, xi = d.buffer("w"), d.buffer("x")
    return {"kernel": d.kernel, "dispatches": len(rec.dispatches), "threadgroups": d.total_threadgroups,
            "w": d.bytes_read[wi], "w16": d.read_widths[wi].get(16, 0) * 16, "x": d.bytes_read.get(xi, 0),
            "all": d.memory_bytes_moved}


def prefill_count(rows, k, n, recipe):
    """count() of a prefill product, from the per-tile counts of a sample block."""
    sample = count(SAMPLE_M, k, min(SAMPLE_N, n), recipe)
    tiles = -(-rows // TILE_M) * -(-n // TILE_N)
    per_tile = tiles / sample["threadgroups"]
    return {**sample, "threadgroups": tiles,
            **{key: round(sample[key] * per_tile) for key in ("w", "w16", "x", "all")}}


def row_of(rows, k, n, recipe, c):
    weight = n * k
    minimum = minimum_bytes(rows, k, n, recipe)
    # DRAM traffic: the weight bytes as counted (prefill re-reads them once
    # per 32 rows), the rest once: the activation, scales and output are
    # small next to the weight and are re-read from the GPU's caches.
    dram = c["w"] + minimum - weight
    r = {"rows": rows, "recipe": recipe, "kernel": c["kernel"], "dispatches": c["dispatches"],
         "threadgroups": c["threadgroups"], "w/size": f"{c['w'] / weight:.3f}",
         "bound": f"{rows / 32:.0f}" if rows > 8 else "1.02", "16B": f"{c['w16'] / c['w']:.0%}",
         "x/w": f"{c['x'] / weight:.3f}", "all/min": f"{c['all'] / minimum:.2f}"}
    for chip in CHIPS:
        r[chip] = f"{dram / (BANDWIDTH_GBPS[chip] * 1e9) * 1e6:.1f}"
    r["stock us"] = r["mps_ext us"] = "-"
    times = mac_times(*mac_calls(rows, k, n, recipe)) if mps_ext.is_available() else None
    if times:
        r.update({"stock us": f"{times[0] * 1e6:.1f}", "mps_ext us": f"{times[1] * 1e6:.1f}"})
    return r


def mac_calls(rows, k, n, recipe):
    """bf16 F.linear (stock torch) and the FP8Linear of the same layer, on MPS."""
    layer = torch.nn.Linear(k, n, bias=False, device="mps", dtype=torch.bfloat16)
    q = mps_ext.FP8Linear.from_linear(layer, recipe)
    x = torch.randn(rows, k, dtype=torch.bfloat16, device="mps")
    return (lambda: layer(x)), (lambda: q(x))


def conversions():
    out = []
    for src, dst in [(torch.bfloat16, E4), (torch.float32, E4), (E4, torch.bfloat16), (E4, torch.float16)]:
        x = torch.randn(4096, 4096).to(src)
        y = torch.empty(4096, 4096, dtype=dst)
        with cpu_metal.record() as rec:
            torch.ops.mps_ext.copy_(y, x)
        moved = sum(d.memory_bytes_moved for d in rec.dispatches)
        minimum = x.nbytes + y.nbytes
        r = {"conversion": f"{str(src)[6:]} -> {str(dst)[6:]}", "shape": "4096x4096",
             "dispatches": len(rec.dispatches), "all/min": f"{moved / minimum:.3f}",
             "threadgroups": sum(d.total_threadgroups for d in rec.dispatches)}
        for chip in CHIPS:
            r[chip] = f"{moved / (BANDWIDTH_GBPS[chip] * 1e9) * 1e6:.1f}"
        out.append(r)
    return out


COLUMNS = [("shape", "K->N"), ("model", "layer"), ("rows", "rows"), ("recipe", "scales"), ("kernel", "kernel"),
           ("dispatches", "disp."), ("threadgroups", "threadgroups"), ("w/size", "w read/size"),
           ("bound", "bound"), ("16B", "16B loads"), ("x/w", "act read/w size"), ("all/min", "bytes/min"),
           ("M3 Max", "us @400GB/s"), ("M3 Ultra", "us @819GB/s"), ("stock us", "bf16 stock us"),
           ("mps_ext us", "fp8 mps_ext us")]

NOTES = """\
w read/size: bytes read from the fp8 weight buffer over its size (executor counters); bound: what the issue asks
  (decode <= 1.02, prefill <= rows / 32: each 32-row tile reads the weight once).
16B loads: share of the weight bytes read with 16-byte loads.
act read/w size: activation bytes read over the weight's size. Decode: every simdgroup reads the activation rows once
  (its outputs share them), so it grows with the rows and with N / outputs per simdgroup; these re-reads of a few KB
  hit the GPU's caches. Prefill: every 32 x 64 tile reads its 32 activation rows, N / 64 times in all.
bytes/min: all bytes the kernel moves (every read counted, re-reads included) over the least the product needs (each
  operand and scale once, the bf16 output once).
us @N GB/s: the kernel's DRAM traffic (the weight bytes as counted, the rest once) at the chip's bandwidth
  (anchors.md): the decode limit; prefill at these sizes is bound by arithmetic instead.
Prefill rows (rows > 8) are scaled from a 64 x 256 sample block (2 x 4 tiles, full K) by the tile count.
Times (stock bf16 F.linear vs FP8Linear) only on a Mac."""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the vocabulary-sized shapes")
    parser.add_argument("--check", action="store_true",
                        help="also measure one prefill shape in full and compare with its per-tile scaling")
    args = parser.parse_args()
    out = []
    for k, n, model in SHAPES:
        if args.quick and n > 100000:
            continue
        for rows in DECODE_ROWS + PREFILL_ROWS:
            for recipe in ("row", "block"):
                c = count(rows, k, n, recipe) if rows <= 8 else prefill_count(rows, k, n, recipe)
                r = {"shape": f"{k}->{n}", "model": model, **row_of(rows, k, n, recipe, c)}
                out.append(r)
                print(f"  {r['shape']} rows={rows} {recipe}: {r['w/size']}", flush=True)
    print(table(out, COLUMNS))
    print(NOTES)
    if args.check:
        k, n, rows = 768, 2048, 128
        for recipe in ("row", "block"):
            full, scaled = count(rows, k, n, recipe), prefill_count(rows, k, n, recipe)
            print(f"check {k}->{n} rows={rows} {recipe}: measured {full}, scaled from tiles {scaled}")
    print()
    print(table(conversions(), [("conversion", "conversion"), ("shape", "shape"), ("dispatches", "dispatches"),
                                ("threadgroups", "threadgroups"), ("all/min", "bytes/min"),
                                ("M3 Max", "us @400GB/s"), ("M3 Ultra", "us @819GB/s")]))


if __name__ == "__main__":
    main()
